"""The project's one benchmark entry: ``python scripts/benchmark.py <loss|engine|study|reports|parse> [options]``.

The measuring code lives beside what it measures (each sub-command's module, named in SUBCOMMANDS; its ``--help``
shows that module's account); this file parses the options, prints the tables and PASS/FAIL lines, and writes the
JSON records. Exit status: 0, 1 when
a target the sub-command enforces is missed (loss) or the paper fails (reports), 2 on bad options.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a plain copy of the repository, without installing it

import torch
from rich.console import Console
from rich.table import Table

from predmask import bench as loss
from predmask import hidden_gather_bench as hidden
from predmask.io import atomic_write_text


def positive_ints(text: str) -> list[int]:
    """An option's comma-separated positive integers."""
    try:
        values = [int(t) for t in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"takes positive integers separated by commas, got {text!r}")
    return values


def positive_int(text: str) -> int:
    """An option's one positive integer."""
    values = positive_ints(text) if "," not in text else []
    if not values:
        raise argparse.ArgumentTypeError(f"takes one positive integer, got {text!r}")
    return values[0]


def names(text: str) -> list[str]:
    return [n for n in text.split(",") if n]


def target_line(row: dict[str, Any]) -> str:
    """The printed line of a PASS/FAIL row (``predmask.bench.target``)."""
    return f"{'PASS' if row['pass'] else 'FAIL'} {row['target']}: {row['value']:.3f} (limit {row['limit']})"


def verdict(r: dict[str, Any], complete: bool, what: str) -> int:
    """Print the target's line; 1 when the measured command failed or left work undone (one FAIL line) or the
    target was missed."""
    print(target_line(r["target"]))
    if r["returncode"] or not complete:
        print(f"FAIL {what} exited {r['returncode']} {r['stderr']}")
        return 1
    return 0 if r["target"]["pass"] else 1


def write_json(path: Path, doc: dict[str, Any]) -> None:
    atomic_write_text(path, json.dumps(doc, indent=2) + "\n")


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """A right-aligned rich table on stdout (200 columns wide when stdout is not a terminal)."""
    table = Table(title=title, title_justify="left")
    for col in columns:
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(*row)
    Console(highlight=False, width=None if sys.stdout.isatty() else 200).print(table)


def loss_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    p.add_argument("--dtype", default="float32", choices=sorted(loss.DTYPES), help="logits dtype (default float32)")
    p.add_argument("--tokens", type=positive_ints, default=[4096], help="token counts, comma-separated (default 4096)")
    p.add_argument("--vocab", type=positive_int, default=32000)
    p.add_argument("--topk", type=positive_int, default=20)
    p.add_argument("--repeats", type=positive_int, default=7)
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    p.add_argument("--hidden-size", type=positive_int, default=hidden.DEFAULT_HIDDEN_SIZE,
                   help=f"hidden size D of the hidden-states path's comparison (default {hidden.DEFAULT_HIDDEN_SIZE})")
    p.add_argument("--no-hidden", action="store_true",
                   help="skip the hidden-states path (predmask/hidden_gather_bench.py; CPU only)")
    p.add_argument("--out", type=Path, help="also write the report (bench.txt) and the record (bench.json) here")


def loss_report(env: dict[str, Any], dtype: str, records: Sequence[dict[str, Any]], repeats: int) -> list[str]:
    """Per size the step times, ratios, peak memory, closed-form errors and targets; last the verdict."""
    where = env.get("gpu", f"CPU, {env['cpu_threads']} threads")
    lines = [f"bench loss: {where}, torch {env['torch']}, {dtype} logits, delta {loss.DELTA}, median of {repeats}"]
    for r in records:
        lines.append(f"{r['tokens']} tokens x vocab {r['vocab']}, K={r['topk']} "
                     f"(logits {r['logits_bytes'] / 2**30:.3f} GiB)")
        for n, t in r["median_s"].items():
            line = f"  {n:22s} fwd+bwd {t * 1e3:9.2f} ms"
            if n in r["time_ratio"]:
                line += f"   x{r['time_ratio'][n]:.3f} of {loss.BASELINE}"
            if n in r["peak_extra"]:
                line += f"   peak extra memory {r['peak_extra'][n]:5.2f} x logits"
            lines.append(line)
        lines.append(f"  closed forms from {dtype} logits vs float64 (same logits and rollout log-probs):")
        for name, e in r["closed_forms"].items():
            lines.append(f"    {name:16s} max abs {e['max_abs']:.3e}  max rel {e['max_rel']:.3e}  "
                         f"decision flips {int(e['decision_flips'])} of {r['tokens']}")
        if "hidden" in r:
            lines += hidden_lines(r["hidden"])
        lines += [f"  {target_line(t)}" for t in r["targets"]]
    failed = sum(not t["pass"] for r in records for t in r["targets"])
    total = sum(len(r["targets"]) for r in records)
    lines.append(f"{'PASS' if failed == 0 else 'FAIL'}: {total - failed} of {total} targets met")
    return lines


def hidden_lines(h: dict[str, Any]) -> list[str]:
    """The hidden-states path's step times, time ratio and peak memory at one size (its targets are the record's)."""
    head = f"D={h['hidden_size']}, {h['method']}, float32, {h['threads']} thread; every step includes the lm_head"
    lines = [f"  from hidden states ({head}):"]
    for n, t in h["median_s"].items():
        lines.append(f"    {n:26s} fwd+bwd {t * 1e3:9.2f} ms")
    lines.append(f"    time from hidden states / from logits: x{h['time_ratio']:.3f}")
    if h["peak_extra"]:
        p, grads = h["peak_extra"], h["grad_bytes"] / h["unit_bytes"]
        lines.append(f"    peak extra memory (torch.profiler) in [tokens, vocab] float32 tensors: from logits "
                     f"{p['logits']:.3f} x, from hidden states {p['hidden']:.3f} x = the h and W gradients "
                     f"{grads:.3f} x + {p['hidden'] - grads:.3f} x")
    return lines


def run_loss(args: argparse.Namespace) -> int:
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        args.parser.error(f"--device {args.device}: no CUDA device is visible (allowed: cpu, or cuda on a GPU machine)")
    if not args.device.startswith(("cpu", "cuda")):
        args.parser.error(f"--device {args.device!r}: allowed cpu or cuda[:N]")
    if args.topk + 1 >= args.vocab:
        args.parser.error(f"--topk {args.topk} must be below --vocab - 1 ({args.vocab - 1})")
    env = loss.environment(args.device)
    records = []
    for tokens in args.tokens:
        records.append(loss.bench_size(tokens, vocab=args.vocab, topk=args.topk, device=args.device,
                                       dtype=loss.DTYPES[args.dtype], repeats=args.repeats,
                                       memory=not args.no_memory))
        if not args.no_hidden and args.device == "cpu":
            h = hidden.bench_hidden(tokens, vocab=args.vocab, dim=args.hidden_size, topk=args.topk,
                                    repeats=args.repeats, memory=not args.no_memory)
            records[-1].update(hidden=h, targets=records[-1]["targets"] + h["targets"])
        print(f"bench loss: {tokens} tokens measured", file=sys.stderr, flush=True)
    text = "\n".join(loss_report(env, args.dtype, records, args.repeats)) + "\n"
    print(text, end="")
    if args.out is not None:
        write_json(args.out / "bench.json", {
            "environment": env, "dtype": args.dtype, "delta": loss.DELTA, "repeats": args.repeats,
            "time_ratio_max": loss.TIME_RATIO_MAX, "peak_extra_max": loss.PEAK_EXTRA_MAX,
            "hidden_time_ratio_max": hidden.HIDDEN_TIME_RATIO_MAX,
            "hidden_peak_extra_max": hidden.HIDDEN_PEAK_EXTRA_MAX, "sizes": records})
        atomic_write_text(args.out / "bench.txt", text)
    return 0 if all(t["pass"] for r in records for t in r["targets"]) else 1


def engine_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", type=names, default="cpu_s,cpu_m,cpu_moe", help="comma-separated conf/model names")
    p.add_argument("--steps", type=positive_int, default=10, help="timed GRPO steps per model (after 2 warm-up)")
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads")
    p.add_argument("--mismatch", action="store_true",
                   help="measure the rollout-vs-training mismatch of each precision and the top-K tail mass")
    p.add_argument("--sequences", type=positive_int, default=512, help="sampled sequences per precision (--mismatch)")
    p.add_argument("--previous", action="store_true",
                   help="time the engine against its previous path: rollouts per precision, short runs per setting")
    p.add_argument("--precisions", type=names, default="fp32,bf16,fp8_rollout",
                   help="rollout precisions compared (--previous)")
    p.add_argument("--settings", type=names, default=None,
                   help="conf/setting names of the short runs (default: the main comparison's; --previous)")
    p.add_argument("--run-steps", type=positive_int, default=15,
                   help="GRPO steps of a short run, then one validation (default 15, a run's val_every; --previous)")
    p.add_argument("--repeats", type=positive_int, default=3, help="interleaved repetitions of each rollout and run (--previous)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides applied to every model")


def run_engine(args: argparse.Namespace) -> int:
    from predmask.rl.bench import bench_model, measure_mismatch

    torch.set_num_threads(args.threads)
    if args.mismatch:
        cols = ("model", "precision", "tokens", "topk_kl_mean", "topk_kl_max", "sampled_kl", "frac_outside",
                "tail_mean", "tail_median", "tail_p90", "tail_frac_gt_1e-3")
        rows = [[v if isinstance(v, str) else (f"{int(v)}" if c == "tokens" else f"{v:.3g}")
                 for c, v in ((c, row[c]) for c in cols)]
                for model in args.models for row in measure_mismatch(model, args.overrides, args.sequences)]
        print_table("rollout vs training mismatch on the base policy (CPU emulation of the precisions)", cols, rows)
        return 0
    if args.previous:
        return run_engine_previous(args)
    rows = []
    for model in args.models:
        r = bench_model(model, args.overrides, args.steps)
        rows.append([model, f"{int(r['params']):,}", f"{r['s_per_step']:.3f}", f"{r['steps_per_s']:.2f}",
                     f"{r['gen_tokens_per_s']:,.0f}", f"{r['train_tokens_per_s']:,.0f}", f"{r['val_s']:.2f}",
                     f"{r['run_s']:.0f} ({int(r['run_steps'])} steps)"])
    print_table(f"predmask.rl CPU engine benchmark ({args.threads} thread(s); {' '.join(args.overrides)})",
                ("model", "params", "s/step", "steps/s", "gen tok/s", "train tok/s", "val s", "run s (projected)"),
                rows)
    return 0


def main_comparison_shape() -> dict[str, Any]:
    """The main comparison on the local cluster, read from its configs: its settings, and methods, seeds, slots,
    steps and validations per run (step 0's included)."""
    from predmask.config import compose, group_entry, sweep_params
    from predmask.rl.bench import validations_per_run

    params, cluster = sweep_params("main_comparison"), group_entry("cluster", "local")
    trainer = compose("train", []).trainer
    return {"settings": params["+setting"].split(","), "methods": len(params["method"].split(",")),
            "seeds": int(cluster["seeds"]), "slots": int(cluster["max_parallel"]), "steps": int(trainer.steps),
            "validations": validations_per_run(trainer)}


def run_engine_previous(args: argparse.Namespace) -> int:
    """The engine against its previous path (``predmask.rl.bench.compare_rollouts`` / ``compare_runs``), and the
    main comparison projected from one short run per setting (``project_sweep``) with the warm worker's start-up
    (``launch.warm_worker.time_start_up``)."""
    from launch.warm_worker import time_start_up
    from predmask.rl.bench import compare_rollouts, compare_runs, project_sweep
    from sweeps.submit import WORKER_PRELOAD

    print(f"load average at start: {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
    rows = [[r["model"], r["precision"], r["rollout"], f"{r['old_s']:.3f}", f"{r['new_s']:.3f}",
             f"{r['ratio']:.2f}", "yes" if r["same_tokens"] else "no", f"{r['max_dlogmu']:.2g}"]
            for model in args.models for r in compare_rollouts(model, args.precisions, args.overrides, args.repeats)]
    print_table(f"rollout, previous path / this one (median CPU s of {args.repeats}, {args.threads} thread(s))",
                ("model", "precision", "rollout", "old s", "new s", "old/new", "same tokens", "max |Δ log μ|"), rows)
    shape = main_comparison_shape()
    settings = shape.pop("settings")
    runs = compare_runs(args.settings or settings, args.overrides, args.run_steps, args.repeats)
    print_table(f"short run: {args.run_steps} GRPO steps + 1 validation from the base model, previous path / this "
                f"one (median CPU s of {args.repeats})",
                ("setting", "model", "precision", "method", "old s", "new s", "old/new", "old val s", "new val s",
                 "old wall s", "new wall s", "old val acc", "new val acc"),
                [[r["setting"], r["model"], r["precision"], r["method"], f"{r['old_cpu_s']:.2f}",
                  f"{r['new_cpu_s']:.2f}", f"{r['ratio']:.2f}", f"{r['old_val_cpu_s']:.2f}", f"{r['new_val_cpu_s']:.2f}",
                  f"{r['old_wall_s']:.2f}", f"{r['new_wall_s']:.2f}", f"{r['old_val']:.3f}", f"{r['new_val']:.3f}"]
                 for r in runs])
    total_old, total_new = sum(r["old_cpu_s"] for r in runs), sum(r["new_cpu_s"] for r in runs)
    print(f"short runs together: {total_old:.1f} s -> {total_new:.1f} s CPU, x{total_old / total_new:.2f}")
    start = time_start_up([sys.executable, "-m", "predmask.rl.train", "--help"], WORKER_PRELOAD, args.repeats)
    print(f"a run's start-up (python -m predmask.rl.train --help, median CPU s of {args.repeats}): "
          f"{start['process_s']:.2f} s as its own process, {start['worker_s']:.2f} s as a warm worker's child")
    stages = project_sweep(runs, start_up_s=start["process_s"], worker_start_s=start["worker_s"], **shape)
    print_table(f"main comparison PROJECTED from the short runs ({shape['methods']} methods x {len(runs)} settings x "
                f"{shape['seeds']} seeds, {shape['steps']} steps, {shape['validations']} validations per run; CPU "
                f"seconds summed, over {shape['slots']} single-thread slots; base models and install not included)",
                ("path", "CPU min", "projected wall min", "previous / this"),
                [[r["stage"], f"{r['cpu_min']:.1f}", f"{r['wall_min']:.1f}", f"{r['ratio']:.2f}"] for r in stages])
    print(f"base models (pretrained once per model, their recorded time): {stages[0]['base_models_min']:.1f} min")
    return 0


def study_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seeds", type=positive_int, default=2, help="seeds measured per batch size (default 2)")
    p.add_argument("--sequences", type=positive_ints, default=[256, 512, 1024],
                   help="comma-separated batch sizes (default 256,512,1024)")
    p.add_argument("--workers", type=positive_int, default=os.cpu_count() or 1, help="cores of the extrapolated run")
    p.add_argument("--target-seeds", type=positive_int, default=61, help="seeds of the extrapolated run (default 61)")
    p.add_argument("--target-sequences", type=positive_int, default=1024,
                   help="sequences per seed of the extrapolated run")
    p.add_argument("--json", type=Path, default=Path("results/token_level/bench.json"),
                   help="where to write the numbers")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="study config overrides")


def run_study(args: argparse.Namespace) -> int:
    from analysis.token_level import bench as study
    from analysis.token_level.compute.study_config import StudyInputError

    try:
        result = study.bench(args.overrides, args.sequences, args.seeds)
    except StudyInputError as err:
        args.parser.error(str(err))
    study.extrapolate(result, args.target_seeds, args.target_sequences, args.workers)
    cols = ("sequences", "seed", "wall s", "cpu s", "rollout s", "stale s", "masks s", "truth s", "tokens",
            "outside", "disagree")
    print_table(f"token-level study, per seed, 1 thread: {result['label']}", cols, [
        [str(r["sequences"]), str(r["seed"]), *(f"{r.get(k, 0.0):.2f}" for k in (
            "wall", "cpu", "seconds_rollout", "seconds_stale", "seconds_masks", "seconds_ground_truth")),
         str(r["n_tokens"]), str(r["n_outside"]), str(r["n_disagree"])] for r in result["seeds"]])
    row = study.ground_truth_target(result["seeds"])
    print(target_line(row) if row else "ground truths: not computed (ground_truth=false or an FP8 training forward)")
    fit, x = result["fit"]["cpu"], result["extrapolation"]
    print(f"CPU time per seed ≈ {fit['a']:.2f} s + {1000 * fit['b_per_sequence']:.2f} ms × sequences; "
          f"{x['seeds']} seeds × {x['sequences']} sequences on {x['workers']} single-threaded workers ≈ "
          f"{x['seeds_per_worker']} × {x['cpu_per_seed']:.1f} s + start-up {result['startup_wall']:.1f} s + model "
          f"load {result['backend_load']['wall']:.1f} s ≈ {x['wall_estimate'] / 60:.1f} min (if each worker gets a "
          "whole core)")
    write_json(args.json, result)
    print(f"wrote {args.json}")
    return 0


@contextlib.contextmanager
def scratch_dir(keep: Path | None) -> Iterator[Path]:
    """The folder a benchmark builds in: ``keep`` (made if missing, kept afterwards) or a temporary one, removed."""
    with tempfile.TemporaryDirectory(prefix="predmask-bench-") as tmp:
        root = keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        yield root


def reports_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=positive_int, default=500, help="steps per run (default 500)")
    p.add_argument("--keep", type=Path, default=None, help="build in this folder and keep it (default: a temp dir)")


def run_reports(args: argparse.Namespace) -> int:
    from reports.bench import bench

    with scratch_dir(args.keep) as root:
        r = bench(root, args.steps)
    print(f"synthetic database: {r['runs']} runs x {r['steps']} steps x {r['metrics']} metrics + 61-seed study")
    print(f"ingest: {r['ingest_s']:.2f} s")
    print(f"{target_line(r['target'])}; {r['paper_s']['cpu']:.2f} s CPU (wall time grows when other processes "
          "share the cores)")
    if r["failures"]:
        print(f"failures: {r['failures']}")
    return 1 if r["failures"] else 0


def parse_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=positive_int, default=2048, help="generated tokens of the sequence (default 2048)")
    p.add_argument("--vocab", type=positive_int, default=32000)
    p.add_argument("--topk", type=positive_int, default=20)
    p.add_argument("--repeats", type=positive_int, default=7)


def run_parse(args: argparse.Namespace) -> int:
    from predmask.verl import records_bench

    r = records_bench.measure(args.tokens, args.vocab, args.topk, args.repeats)
    us = r["us_per_token"]
    print_table(f"top-K record parse, {r['tokens']} tokens, K={r['k']}, V={r['vocab']} "
                f"(least CPU time of {r['repeats']})",
                ("form", "parser", "us/token", "x cheaper", "equal to before"),
                [["dict", "per entry (before)", f"{us['before_dict']:.2f}", "1.0", "-"],
                 ["dict", "vectorised (after)", f"{us['after_dict']:.2f}", f"{r['speedup_dict']:.1f}",
                  str(r["equal"]["dict"])],
                 ["flat", "vectorised (after)", f"{us['after_flat']:.2f}", f"{r['speedup_flat']:.1f}",
                  str(r["equal"]["flat"])]])
    for row in r["targets"]:
        print(target_line(row))
    if not all(r["equal"].values()):
        print(f"FAIL the parsers disagree on the same objects: {r['equal']}")
        return 1
    return 0 if all(t["pass"] for t in r["targets"]) else 1


def ingest_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lines", type=positive_int, default=500_000, help="lines of the metrics file (default 500000)")
    p.add_argument("--metrics", type=positive_int, default=32, help="values per line (default 32, about 1.3 kB)")
    p.add_argument("--keep", type=Path, default=None, help="write in this folder and keep it (default: a temp dir)")


def run_ingest(args: argparse.Namespace) -> int:
    from analysis.store import ingest_bench

    with scratch_dir(args.keep) as root:
        r = ingest_bench.measure(root, args.lines, args.metrics)
    print(f"metrics.jsonl: {r['lines']:,} lines x {r['metrics']} values, {r['file_bytes'] / 1e6:.0f} MB")
    print(f"ingest: {r['wall_s']:.1f} s wall, peak memory {r['peak_bytes'] / (1 << 20):.0f} MiB, "
          f"{r['rows_stored']:,} of {r['rows_expected']:,} rows stored")
    return verdict(r, r["rows_stored"] == r["rows_expected"], "the ingest")


def status_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runs", type=positive_int, default=10_000, help="run directories of the sweep (default 10000)")
    p.add_argument("--keep", type=Path, default=None, help="write the runs root here and keep it (default: a temp dir)")


def run_status(args: argparse.Namespace) -> int:
    from sweeps import status_bench

    with scratch_dir(args.keep) as root:
        r = status_bench.measure(root, args.runs)
    print(f"python -m sweeps status: {r['runs']:,} runs in {r['wall_s']:.1f} s wall ({r['ms_per_run']:.2f} ms a run), "
          f"{r['cpu_s']:.1f} s CPU, {r['rows']:,} rows shown; load average {r['load']:.1f} on {r['cores']} cores")
    return verdict(r, r["rows"] == r["runs"], "status")


#: sub-command: (one line of help, the module that measures, its options, its run)
SUBCOMMANDS: dict[str, tuple[str, str, Callable[[argparse.ArgumentParser], None],
                             Callable[[argparse.Namespace], int]]] = {
    "loss": ("the whole loss of the predictive masks against DPPO-TopK-KL: time, peak memory, float64 error",
             "predmask/bench.py", loss_options, run_loss),
    "engine": (("the CPU engine's steps/s and tokens/s per model, each precision's mismatch (--mismatch), or its "
                "speed against the previous path (--previous)"),
               "predmask/rl/bench.py", engine_options, run_engine),
    "study": ("the token-level study's per-seed cost, its 61-seed extrapolation and the ground truths' cost",
              "analysis/token_level/bench.py", study_options, run_study),
    "reports": ("all figures, tables and the page on a synthetic database of the paper's size",
                "reports/bench.py", reports_options, run_reports),
    "ingest": ("one long run's metrics.jsonl into the results database: wall time and peak memory",
               "analysis/store/ingest_bench.py", ingest_options, run_ingest),
    "status": ("python -m sweeps status over many synthetic run directories: wall time against the target",
               "sweeps/status_bench.py", status_options, run_status),
    "parse": ("the rollout hook's top-K parse per generated token, per entry (before) and vectorised (after)",
              "predmask/verl/records_bench.py", parse_options, run_parse),
}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python scripts/benchmark.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    subs = ap.add_subparsers(title="sub-commands", dest="command", required=True, metavar="SUB")
    for name, (summary, module, options, run) in SUBCOMMANDS.items():
        doc = ast.get_docstring(ast.parse((ROOT / module).read_text()))
        p = subs.add_parser(name, help=summary, description=f"{summary}.\n\n{module}: {doc}",
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        options(p)
        p.set_defaults(run=run, parser=p)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
