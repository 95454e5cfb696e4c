"""Benchmark of the token-level study: per-seed cost single-threaded, its scaling, and the 61-seed extrapolation.

``python -m analysis.token_level.bench [--seeds 2] [--sequences 256,512,1024] [--workers 2] [overrides]`` runs
a few seeds of the study in this process with one torch thread for each batch size, measures wall and CPU time per
seed (split into rollout, stale updates and the masked steps), fits ``time = a + b * sequences``, and extrapolates
the full study (``--target-seeds`` seeds on ``--workers`` single-threaded workers, one per core, plus the measured
worker start-up). CPU time is the figure to trust on a shared machine: wall time there includes other load.
Writes the numbers to ``--json`` (default results/token_level/bench.json) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from predmask.io import atomic_write_text

__all__ = ["bench", "main"]


def _startup_seconds() -> float:
    """Wall time of a fresh interpreter importing the study's modules (what each worker pays before its seeds)."""
    t0 = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import analysis.token_level.compute.backend, analysis.token_level.compute.fanout, submitit",
        ],
        check=True,
        capture_output=True,
    )
    return time.perf_counter() - t0


def bench(overrides: list[str], sequences: list[int], seeds: int, threads: int = 1) -> dict[str, Any]:
    """Per-seed timings of the study for each batch size (seeds 1000.. so no stored study is touched)."""
    import torch

    from analysis.token_level.compute.backend import make_backend, run_seed
    from analysis.token_level.compute.config import compose_study, settings_of, validate
    from analysis.token_level.summary.stats import seed_summary

    torch.set_num_threads(threads)
    cfg = compose_study(overrides)
    validate(cfg)
    t0, c0 = time.perf_counter(), time.process_time()
    backend = make_backend(cfg)
    load = {"wall": time.perf_counter() - t0, "cpu": time.process_time() - c0}
    rows = []
    for n in sequences:
        cfg_n = dict(cfg, sequences=n)
        settings = settings_of(cfg_n, backend.vocab_size)
        for i in range(seeds):
            seed = 1000 + i
            t0, c0 = time.perf_counter(), time.process_time()
            res = run_seed(backend, cfg_n, settings, seed)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            summary = seed_summary(res.tokens, res.n_tokens)
            rows.append(
                {
                    "sequences": n,
                    "seed": seed,
                    "wall": wall,
                    "cpu": cpu,
                    **res.facts,
                    "n_tokens": summary["n_tokens"],
                    "n_outside": summary["n_outside"],
                    "n_disagree": summary["n_disagree"],
                }
            )
    return {
        "label": cfg["label"],
        "overrides": overrides,
        "threads": threads,
        "backend_load": load,
        "seeds": rows,
    }


def ground_truth_ratio(rows: list[dict[str, Any]]) -> float | None:
    """Seconds of the study with its per-token ground truths over the same seeds without them (measured in one run:
    each seed's wall time over that time less its ground-truth pass); None when no seed computed them."""
    with_gt = sum(r["wall"] for r in rows)
    gt = sum(r.get("seconds_ground_truth", 0.0) for r in rows)
    return with_gt / (with_gt - gt) if gt > 0 and with_gt > gt else None


def ground_truth_ratio_line(rows: list[dict[str, Any]]) -> str:
    """The ratio against the issue's target (the study with ground truths at most 1.5x the study without)."""
    ratio = ground_truth_ratio(rows)
    if ratio is None:
        return "ground truths: not computed (ground_truth=false or an FP8 training forward)"
    verdict = "PASS" if ratio <= 1.5 else "FAIL"
    return f"ground truths: the study takes {ratio:.2f}x its time without them (target <= 1.5x): {verdict}"


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares ``y = a + b x`` (b = 0 with a single x)."""
    if len(set(xs)) < 2:
        return sum(ys) / len(ys), 0.0
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m analysis.token_level.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--seeds", type=int, default=2, help="seeds measured per batch size (default 2)")
    p.add_argument(
        "--sequences", default="256,512,1024", help="comma-separated batch sizes (default 256,512,1024)"
    )
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="cores of the extrapolated run")
    p.add_argument("--target-seeds", type=int, default=61, help="seeds of the extrapolated run (default 61)")
    p.add_argument(
        "--target-sequences", type=int, default=1024, help="sequences per seed of the extrapolated run"
    )
    p.add_argument(
        "--json", type=Path, default=Path("results/token_level/bench.json"), help="where to write the numbers"
    )
    p.add_argument("overrides", nargs="*", metavar="key=value", help="study config overrides")
    args = p.parse_args(argv)
    console = Console(highlight=False, width=max(120, shutil.get_terminal_size((120, 24)).columns))
    try:
        sizes = [int(x) for x in args.sequences.split(",") if x]
    except ValueError:
        console.print(f"error: --sequences must be comma-separated integers, got {args.sequences!r}")
        return 2
    if args.seeds < 1 or not sizes or args.workers < 1:
        console.print("error: --seeds, --workers and every --sequences value must be >= 1")
        return 2
    from analysis.token_level.compute.config import StudyInputError

    try:
        result = bench(args.overrides, sizes, args.seeds)
    except StudyInputError as err:
        console.print(f"error: {err}")
        return 2
    result["startup_wall"] = _startup_seconds()
    rows = result["seeds"]
    a_cpu, b_cpu = _fit([r["sequences"] for r in rows], [r["cpu"] for r in rows])
    a_wall, b_wall = _fit([r["sequences"] for r in rows], [r["wall"] for r in rows])
    per_seed = a_cpu + b_cpu * args.target_sequences
    per_worker = math.ceil(args.target_seeds / args.workers)
    total = per_worker * per_seed + result["startup_wall"] + result["backend_load"]["wall"]
    result["fit"] = {
        "cpu": {"a": a_cpu, "b_per_sequence": b_cpu},
        "wall": {"a": a_wall, "b_per_sequence": b_wall},
    }
    result["extrapolation"] = {
        "seeds": args.target_seeds,
        "sequences": args.target_sequences,
        "workers": args.workers,
        "cpu_per_seed": per_seed,
        "seeds_per_worker": per_worker,
        "wall_estimate": total,
    }
    table = Table(title=f"token-level study, per seed, 1 thread: {result['label']}", title_justify="left")
    for col in (
        "sequences",
        "seed",
        "wall s",
        "cpu s",
        "rollout s",
        "stale s",
        "masks s",
        "truth s",
        "tokens",
        "outside",
        "disagree",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r["sequences"]),
            str(r["seed"]),
            f"{r['wall']:.2f}",
            f"{r['cpu']:.2f}",
            f"{r['seconds_rollout']:.2f}",
            f"{r['seconds_stale']:.2f}",
            f"{r['seconds_masks']:.2f}",
            f"{r.get('seconds_ground_truth', 0.0):.2f}",
            str(r["n_tokens"]),
            str(r["n_outside"]),
            str(r["n_disagree"]),
        )
    console.print(table)
    console.print(ground_truth_ratio_line(rows))
    console.print(
        f"CPU time per seed ≈ {a_cpu:.2f} s + {1000 * b_cpu:.2f} ms × sequences; "
        f"{args.target_seeds} seeds × {args.target_sequences} sequences on {args.workers} single-threaded "
        f"workers ≈ {per_worker} × {per_seed:.1f} s + start-up {result['startup_wall']:.1f} s + model load "
        f"{result['backend_load']['wall']:.1f} s ≈ {total / 60:.1f} min (if each worker gets a whole core)"
    )
    atomic_write_text(args.json, json.dumps(result, indent=1))
    console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
