"""`python -m sweeps`: run a named grid of experiments, or show the run registry."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from predmask.command_text import (
    ACCURACY_WEIGHTING,
    INGEST,
    PAPER,
    REPORT_VARIATIONAL,
    command,
    sweep_command,
    with_db,
)
from predmask.console import error, make_console
from predmask.progress import duration_text, process_seconds
from predmask.rundir import (
    PLANNED_CONFIG_FILE,
    RUNS_DIRNAME,
    RUNS_ENV,
    DamagedFileError,
    add_db_option,
    db_or_default,
    first_line,
    other_roots,
    read_config,
    runs_root,
    sweep_path,
)
from sweeps.compose import RunSpec, SweepError, sweep_family, sweep_names
from sweeps.families import describe, expand
from sweeps.run_dirs import (
    DAMAGED,
    RunState,
    check_inside_root,
    damaged_line,
    finished_elsewhere,
    read_state,
    run_dir,
    sweep_lock,
)

if TYPE_CHECKING:
    from sweeps.submit import Outcome

EPILOG = """\
examples:
  python -m sweeps main_comparison                       # 48 runs: 16 cells x 3 seeds on the CPU engine (local)
  python -m sweeps main_comparison seeds=5               # seeds 0..4: only the runs not yet completed run
  python -m sweeps main_comparison seeds=[0,3,7]         # these seeds
  python -m sweeps smoke                                 # 4 short runs (one seed), a few minutes
  python -m sweeps main_comparison method=dppo_topk_kl,predmask_kl_agg delta=0.05,0.15
  python -m sweeps main_comparison cluster=h20_4x8 --dry-run   # the 16 VeRL jobs (one seed), nothing submitted
  python -m sweeps main_comparison --dry-run --format json
  python -m sweeps status main_comparison
  python -m sweeps paper --dry-run                       # every step the paper's report needs, with time estimates
  python -m sweeps variational_reasoning                 # 37 runs: 1 prior + 3 seeds x (3 stages + 9 finals)
  python -m sweeps variational_reasoning_smoke           # the same chain, one seed, 128 questions (<= 3 min)
  python -m sweeps variational_reasoning method=sft,vr_acc method.data=best_mixed data.questions=256
  python -m sweeps variational_reasoning cluster=h20_4x8 model=qwen3_4b_base --dry-run   # verl SFT + vLLM jobs

Overrides use Hydra's syntax; a comma list sweeps that key (it replaces the sweep's own axis).
Axes: method=<name>, +setting=<model-precision pair>, delta=<float>; also model=, precision=, top_k=,
cluster=local|slurm_emulated|h20_4x8.
Seeds: every cell of the grid runs at S seeds, each seed its own run (run config key seed; run id). seeds=N runs
seeds 0..N-1, seeds=[0,3,7] those seeds, seed=4 or seed=0,1 the seed axis as any other Hydra axis (give seed= or
seeds=, not both). Default: the sweep's own seed axis (smoke: seed 0), else the cluster's seeds: 3 on the CPU
engine (local, slurm_emulated), 1 on h20_4x8. The count is not part of any run: a cell's seed-0 run has the same
id whatever S, so a rerun with more seeds runs only the new ones. Runs go seed by seed (every cell at seed 0 first).
Resume: a rerun of the same command skips completed runs, joins live ones and resumes the others.
Dry run: needs no Slurm (no srun/sbatch) and no GPU; nothing is submitted. It opens with a WARNINGS block on a
Slurm cluster (runs on an unverified engine, no environment on the nodes, placeholder values, run directories on a
filesystem the nodes may not share; --strict refuses to submit, exit 2, while one remains), then the plan: jobs,
nodes x GPUs (or CPU cores) per job, the most held at once, the wall-time limit, the worst-case GPU-hours, the
expected GPU-hours (an estimate: planned steps x sweeps.plan.ASSUMED_STEP_MINUTES), the partition,
every data and model path the jobs read with whether it exists here, and the command that submits (the same
without --dry-run). --format json prints {"summary": {...}, "runs": [...]}, also written to
runs/<sweep>/dry-run/plan.json beside each run's .cmd and .sbatch:
  summary: sweep, cluster, backend (local|slurm), trainer (cpu|verl), runs (e.g. "16 runs (16 cells x 1 seed)"),
    jobs, nodes_per_job, resource ("GPU" or "CPU core"), per_node, per_job, max_parallel,
    at_once (= min(max_parallel, jobs) x per_job), timeout_min, worst_case_hours (= jobs x per_job x
    timeout_min / 60), max_num_timeout, worst_case_hours_with_requeues (x (1 + max_num_timeout)),
    planned_steps, assumed_step_minutes, expected_hours (null: not estimated), partition (null: the site
    default), check_paths, paths: [{kind (data|model), path, prepare, exists, runs}], submit (the command line),
    attention: [{attention (flash_attention_2, sdpa, or megatron: Megatron's own), runs, needs (the module the nodes must
    import, null: none beyond torch)}] (verl: what the runs' models attend with),
    warnings: [{cause (unverified|environment|placeholder|shared dirs), text, runs}]
  runs: [{run_id, method, delta, model, precision, seed, command (argv), sbatch (script text, null if local)}]
Before anything is written, every run is checked as its trainer checks it (e.g. top_k within the vocabulary,
trainer.steps >= 1, the mini-batch dividing the batch, delta finite and > 0, rollout.n >= 2) and the database path
is checked; a bad one is one line naming the run's cell, exit 2. A failed run is reported with its cause (the
trainer's error line, or killed by signal 9) and the command that resumes it.
Before submitting, every data and model path the jobs read must exist, else one error line names the first
missing one and the command that prepares it (python -m sweeps.datasets prepare --out DIR for data; for a model,
download it there or set model.path=DIR); cluster.check_paths=false skips the check. Slurm jobs are named
predmask-<sweep>-<run_id> (squeue, sacct). A run whose ingest cannot reach the database (held by another process)
is deferred, the sweep goes on, and its end tries it again (else: python -m analysis ingest runs/<sweep>); so is
one the database cannot store now (a full disk, a read-only file), with one line naming the database.
A run-directory file that cannot be read shows as damaged (status: "damaged", then a line "damaged: <file>, <what>");
the sweep reports it and goes on with the other runs. Nothing is written or deleted through a symlink that leads out
of the runs root (one error line, exit 2). Ctrl-C: one line, exit 130; local runs stop, Slurm jobs go on (a rerun
joins them); rerun the same command to resume.
Variational family (a sweep file with family: variational; sweeps.vr_chain): per seed a posterior q_phi, its
traces, their weights and the finals sft, rft, vr_acc, vr_gml, vr_likelihood (each at method.data=best_mixed and
all_weighted) and grpo (an ordinary train run on the same questions); one prior pi_theta0 (the cached base model) for
all seeds. Axes: method=, method.data=, seeds, any key of conf/variational.yaml (data.questions=256; a comma list
sweeps it); model=, task.*, base.*, cluster= apply to every run, trainer.*/rollout.*/precision=/delta=/top_k= to grpo
only. Each stage run keeps only the sections that determine it and names the runs it reads (config key inputs), so a
changed final setting reruns only the finals, a changed posterior setting everything after it. Runs go in waves: a
run starts once every run it reads completed; one whose input failed is not started (its line names the failed run
and the resume command). The end prints the wall time beside the target (20 min; smoke 3 min, on 2 cores) and next:
python -m analysis accuracy_weighting, python -m reports variational. Dry-run records add stage, data, inputs.
Outputs: run directories under runs/<sweep>/<run_id>/ ($PREDMASK_RUNS), the results database
results/predmask.duckdb ($PREDMASK_DB or --db). On the local cluster every run is a CPU stand-in: small
Qwen3-architecture models, a synthetic task, emulated bf16/FP8 precision.
"""


def _ingest(db: Path, path: Path) -> str | None:
    """Ingest one finished run (the sweep process is the database's only writer); returns why the store
    refused the run directory, else None."""
    from analysis.store import connect, ingest_run_dir

    with connect(db) as con:
        result = ingest_run_dir(con, path)
    return result.refused if result.run_registered == "refused" else None


def storage_cause(err: BaseException) -> str:
    """One line for a storage error: a StoreError's own line, an OSError's strerror and file, else the error's
    type and first line (a DuckDB error on a full disk)."""
    from analysis.store import StoreError

    if isinstance(err, StoreError):
        return first_line(err)
    if isinstance(err, OSError) and err.strerror:
        return f"{err.strerror}: {err.filename}" if err.filename else err.strerror
    return first_line(err, typed=True)


class Ingester:
    """Ingests each finished run as it ends; a run whose ingest fails on storage (the database held by another
    process, a full disk, a read-only file) is deferred and :meth:`catch_up` tries it again; a run directory
    the store cannot read (a damaged file) is reported, not deferred."""

    def __init__(self, db: Path, catch_up_hint: str) -> None:
        self.db, self.hint = db, catch_up_hint
        self.deferred: dict[str, tuple[RunSpec, Path, str]] = {}  # run_id -> (spec, run dir, cause)

    def _try(self, spec: RunSpec, path: Path) -> bool:
        import duckdb

        from analysis.store import StoreError

        try:
            refused = _ingest(self.db, path)
        except DamagedFileError as err:  # the run directory's fault: retrying will not help
            self.deferred.pop(spec.run_id, None)
            print(f"warning: run {spec.run_id} not ingested: {err}", flush=True)
            return True
        except (StoreError, OSError, duckdb.Error) as err:  # held, full, read-only: the database's fault, for now
            self.deferred[spec.run_id] = (spec, path, storage_cause(err))
            return False
        self.deferred.pop(spec.run_id, None)
        if refused:
            print(f"warning: run {spec.run_id} not registered in the database: {refused}", flush=True)
        return True

    def __call__(self, spec: RunSpec, path: Path) -> None:
        if not self._try(spec, path):
            cause = self.deferred[spec.run_id][2]
            into = "" if str(self.db) in cause else f" into {self.db}"  # the line names the database once
            print(f"ingest of {spec.run_id}{into} deferred: {cause}; the end of this sweep, the next sweep or "
                  f"`{self.hint}` catches it up", flush=True)

    def catch_up(self) -> dict[str, str]:
        """Try every deferred run once more; returns the runs still deferred, with the cause."""
        for spec, path, _ in list(self.deferred.values()):
            if self._try(spec, path):
                print(f"ingest of {spec.run_id} caught up", flush=True)
        return {run_id: cause for run_id, (_, _, cause) in self.deferred.items()}


def _submit_command(args: argparse.Namespace) -> str:
    """The command that submits what a dry run shows: the same invocation without --dry-run and --format."""
    argv = [args.sweep, *args.overrides]
    for flag, value in (("--db", args.db), ("--runs-root", args.runs_root), ("--max-parallel", args.max_parallel)):
        if value is not None:
            argv += [flag, str(value)]
    if args.strict:
        argv.append("--strict")
    return sweep_command(shlex.join(argv))


def cmd_dry_run(args: argparse.Namespace, specs: list[RunSpec], root: Path) -> int:
    from sweeps.plan import max_parallel, plan_summary, refuse_warnings, summary_lines
    from sweeps.submit import dry_run_records, write_dry_run

    summary = plan_summary(specs, max_parallel(specs, args.max_parallel), _submit_command(args), root)
    payload = {"summary": summary, "runs": dry_run_records(specs, root)}
    out = write_dry_run(payload, sweep_path(args.sweep, root), root)
    if args.format == "json":
        print(json.dumps(payload, indent=2))
        print(f"scripts and commands written to {out}", file=sys.stderr)
        if args.strict:
            refuse_warnings(summary["warnings"])
        return 0
    lines = summary_lines(summary)
    for rec in payload["runs"]:
        title = f"{rec['run_id']}  {rec['method']}  delta={rec['delta']}  {rec['model']}/{rec['precision']}"
        if "stage" in rec:  # a variational stage run: its stage, recipe and the runs it reads
            reads = " ".join(f"{k}={v}" for k, v in rec["inputs"].items()) or "nothing"
            data = f" {rec['data']}" if rec["data"] else ""
            title = f"{rec['run_id']}  {rec['stage']}: {rec['method']}{data}  {rec['model']}  reads {reads}"
        lines += ["", f"=== {title}  seed={rec['seed']}"]
        if rec["sbatch"]:
            lines += [rec["sbatch"].rstrip("\n"),
                      "# (end of the sbatch script) the trainer command, run by rank 0 inside srun:"]
        lines.append(shlex.join(rec["command"]))
    lines += ["", f"{describe(specs)}; scripts and commands written to {out}", *summary_lines(summary)[-1:]]
    print("\n".join(lines))  # plain print: long lines stay whole when piped
    if args.strict:
        refuse_warnings(summary["warnings"])
    return 0


def elsewhere_line(args: argparse.Namespace, specs: list[RunSpec], root: Path) -> str | None:
    """A warning when runs this sweep would start over under a runs root it found (not named by --runs-root or
    $PREDMASK_RUNS) have finished under another root of the project: where, and the command that uses them."""
    found = None if args.runs_root or os.environ.get(RUNS_ENV) else finished_elsewhere(specs, root, other_roots())
    if found is None:
        return None
    other, n = found
    return (f"warning: {n} of these {len(specs)} runs would start over under {root.absolute()}, but runs with the "
            f"same ids finished under {other / RUNS_DIRNAME}; to use them: PREDMASK_ROOT={shlex.quote(str(other))} "
            f"{_submit_command(args)}")


def _note_skipped_methods(overrides: Sequence[str], cluster: str) -> None:
    """A variational sweep's note of the methods its cluster's trainer does not compose (none given by hand)."""
    from predmask.config import bare_key
    from sweeps.vr_chain import cluster_skipped

    skipped = cluster_skipped([o for o in overrides if bare_key(o) == "cluster"])
    if skipped and not any(o.startswith("method=") for o in overrides):
        print(f"note: {', '.join(skipped)} left out of the method axis: not composed for the "
              f"{cluster} trainer (predmask.verl.vr_cluster)", file=sys.stderr)


def cmd_run(args: argparse.Namespace, console: Console) -> int:
    from analysis.store import check_db_path
    from sweeps.plan import check_paths, max_parallel, plan_warnings, refuse_warnings, warning_lines
    from sweeps.submit import backend_of, run_sweep, run_waves, validate_runs

    specs = expand(args.sweep, args.overrides)
    root = Path(args.runs_root) if args.runs_root else runs_root()
    clusters = {spec.config["cluster"]["name"] for spec in specs}
    if len(clusters) > 1:
        raise SweepError(f"one cluster per sweep invocation, got {', '.join(sorted(clusters))}")
    if sweep_family(args.sweep) == "variational":
        _note_skipped_methods(args.overrides, clusters.pop())
    validate_runs(specs, root)  # every run as its trainer checks it, before anything is written (dry run included)
    sweep_dir = sweep_path(args.sweep, root)
    check_inside_root(root, [sweep_dir, sweep_dir / ("dry-run" if args.dry_run else ".submitit"),
                             *(run_dir(spec, root) for spec in specs)])  # nothing followed out of the runs root
    if line := elsewhere_line(args, specs, root):
        print(line, file=sys.stderr, flush=True)
    if args.dry_run:
        return cmd_dry_run(args, specs, root)

    warnings = plan_warnings(specs, root)
    if args.strict:
        refuse_warnings(warnings)  # before anything is submitted
    for line in warning_lines(warnings):
        console.print(line)
    check_paths(specs)
    db = db_or_default(args.db)
    check_db_path(db)  # before the first run starts, not when it ends
    backend = backend_of(specs[0])
    parallel = max_parallel(specs, args.max_parallel)
    console.print(f"sweep [bold]{args.sweep}[/]: {describe(specs)} on {backend} "
                  f"({specs[0].config['cluster']['name']}), runs in {sweep_dir}, database {db}")
    hint = with_db(command(f"{INGEST} {shlex.quote(str(sweep_dir))}"), args.db and db)
    ingest = Ingester(db, hint)
    chained = any(spec.inputs for spec in specs)  # a variational sweep: each stage after the runs it reads
    with sweep_lock(sweep_dir):
        if chained:
            outcome = run_waves(specs, root=root, max_parallel=parallel, console=console, on_finished=ingest,
                                resume=_submit_command(args))
        else:
            outcome = run_sweep(specs, root=root, max_parallel=parallel, console=console, on_finished=ingest)
        # runs completed by an earlier invocation may have ended after its last ingest: ingest them again
        # (idempotent) so the database always matches the run directories.
        for spec in specs:
            if spec.run_id in outcome.skipped:
                ingest(spec, root / spec.sweep / spec.run_id)
        deferred = ingest.catch_up()
    return _report(args, console, outcome, deferred, db, hint)


def _report(args: argparse.Namespace, console: Console, outcome: Outcome, deferred: dict[str, str], db: Path,
            hint: str) -> int:
    """The sweep's end: its counts and wall time, each run not completed or not ingested, and what to run next."""
    elapsed = time.monotonic() - args.started  # the command's wall time: start-up, planning and checks included
    blocked = f", {len(outcome.blocked)} not started" if outcome.blocked else ""
    console.print(f"{len(outcome.completed)} completed, {len(outcome.skipped)} already done, "
                  f"{len(outcome.failed)} failed{blocked} in {duration_text(elapsed)}{_target_text(args.sweep)}; "
                  f"database: {db}")
    for run_id, message in outcome.failed.items():
        console.print(f"[red]failed[/] {run_id}: {message}")
    for run_id, message in outcome.blocked.items():
        console.print(f"[yellow]not started[/] {run_id}: {message}")
    for run_id, cause in deferred.items():
        console.print(f"[yellow]not ingested[/] {run_id}: {cause}")
    if outcome.failed:
        console.print(f"next: fix the cause above, then rerun the same command (completed runs are skipped, the "
                      f"failed ones resume): {_submit_command(args)}")
    if deferred:
        console.print(f"catch up with: {hint}")
    elif not outcome.failed:
        for nxt in _next_commands(args.sweep):
            console.print(f"next: {with_db(nxt, args.db and db)}")
    return 1 if outcome.failed or outcome.blocked or deferred else 0


def _target_text(sweep: str) -> str:
    """`` (target <= N min on 2 cores)`` for a sweep file that sets ``target_minutes``."""
    from predmask.config import group_entry

    target = group_entry("sweep", sweep).get("target_minutes")
    return f" (target <= {target:g} min on 2 cores)" if isinstance(target, int | float) else ""


def _next_commands(sweep: str) -> list[str]:
    """What to run once a sweep has completed: its family's analysis and report."""
    if sweep_family(sweep) == "variational":
        return [command(ACCURACY_WEIGHTING), command(REPORT_VARIATIONAL)]
    return [command(PAPER)]


def cmd_status(args: argparse.Namespace, console: Console) -> int:
    root = Path(args.runs_root) if args.runs_root else runs_root()
    sweeps = [args.sweep] if args.sweep else sorted(p.name for p in root.iterdir() if p.is_dir()) \
        if root.exists() else []
    rows: list[tuple[str, ...]] = []
    counts: dict[str, Counter[str]] = {}
    damaged: list[str] = []  # one line per damaged run, in full (a table cell would be cut)
    for name in sweeps:
        for path in sorted(p for p in (root / name).iterdir() if p.is_dir() and not p.name.startswith(".")) \
                if (root / name).exists() else []:
            cfg_file = path / PLANNED_CONFIG_FILE
            if not cfg_file.exists():
                continue
            state = read_state(path)
            step = f"{state.step}/{state.total_steps}" if state.total_steps else str(state.step)
            try:
                cells = _run_cells(RunSpec(path.name, name, (), read_config(cfg_file)))
            except (ValueError, KeyError, TypeError, AttributeError) as err:  # a damaged or foreign config
                what = err.what if isinstance(err, DamagedFileError) else f"not a run config ({type(err).__name__})"
                cells, state = ("?",) * 5, RunState(DAMAGED, error=damaged_line(PLANNED_CONFIG_FILE, what))
            rows.append((name, path.name, *cells, state.status, step))
            counts.setdefault(name, Counter())[state.status] += 1
            if state.status == DAMAGED:
                damaged.append(f"{name} {path.name}: {state.error}")
    print("\n".join(table_lines(f"runs under {root}", STATUS_COLUMNS, rows)), flush=True)
    for line in [*damaged, *status_next(counts, root)]:
        console.print(line)
    return 0


#: the columns of ``python -m sweeps status``
STATUS_COLUMNS = ("sweep", "run_id", "method", "model", "precision", "delta", "seed", "status", "step")


def table_lines(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A plain text table (no markup, so 10,000 rows take milliseconds): the title, the header, a rule, a line
    per row."""
    widths = [max(map(len, column)) for column in zip(header, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        return "│ " + " │ ".join(cell.ljust(w) for cell, w in zip(cells, widths, strict=True)) + " │"

    return [title, line(header), "├" + "┼".join("─" * (w + 2) for w in widths) + "┤", *map(line, rows)]


def _run_cells(run: RunSpec) -> tuple[str, str, str, str, str]:
    """A run's method (a stage run's in parentheses, a final's with its data), model, precision, delta and seed."""
    method = run.method if run.stage in (None, "final") else f"({run.method})"  # a stage run, not a recipe
    data = run.config["method"].get("data") if run.stage == "final" else None
    return f"{method} {data}" if data else method, run.model, run.precision, str(run.delta), str(run.seed)


def status_next(counts: dict[str, Counter[str]], root: Path) -> list[str]:
    """What to run after ``status``, from the number of runs in each state per sweep."""
    if not any(counts.values()):
        return [f"no runs under {root} yet; next: {sweep_command('smoke')} (a few minutes), then {command(PAPER)}"]
    lines = []
    for name, by_status in sorted(counts.items()):
        unfinished = sum(n for status, n in by_status.items() if status not in ("completed", "running"))
        if by_status["running"]:
            lines.append(f"{name}: {by_status['running']} running; {sweep_command(f'status {name}')} shows their steps")
        if unfinished:
            which = ", ".join(f"{n} {status}" for status, n in sorted(by_status.items())
                              if status not in ("completed", "running"))
            lines.append(f"{name}: {unfinished} not completed ({which}); next: rerun the sweep's own command "
                         f"({sweep_command(name)} with the same overrides) to resume them; a failed run's cause "
                         "is in its job.log")
    if not lines:
        nexts = dict.fromkeys(c for name in counts if name in sweep_names() for c in _next_commands(name))
        lines.append(f"every run completed; next: {' and '.join(nexts) or command(PAPER)}")
    return lines


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m sweeps",
        description="Run a named grid of predmask experiments (Hydra sweep + submitit), or show the registry. "
        f"Sweeps: {', '.join(sweep_names())}; or 'status [sweep]'.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("sweep", help="a sweep name (conf/sweep/), or 'status'")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. method=dppo_topk_kl,predmask_kl_agg")
    ap.add_argument("--dry-run", action="store_true", help="submit nothing (no Slurm needed); print the plan, then "
                    "each run's id, sbatch script and exact command, and write them under runs/<sweep>/dry-run/")
    ap.add_argument("--format", choices=("text", "json"), default="text",
                    help="dry-run output format (json: {\"summary\": ..., \"runs\": [...]}, see below)")
    add_db_option(ap)
    ap.add_argument("--runs-root", help="root of run directories (default: $PREDMASK_RUNS or runs/)")
    ap.add_argument("--max-parallel", type=int, help="runs at once (default: the cluster config's max_parallel)")
    ap.add_argument("--strict", action="store_true", help="refuse to submit (exit 2) while the plan's WARNINGS block "
                    "names a risk (unverified engine, no environment, placeholder, unshared run directories)")
    return ap


def _hang_up(signum: int, frame: object) -> None:
    """The terminal closed (SIGHUP): stop as on Ctrl-C (the local jobs' controllers, in sessions of their own,
    never see the terminal's signals: the sweep cancels them)."""
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_intermixed_args(argv)  # options may sit between overrides
    # the wall clock the end line reports: from the process's start when run as a command (interpreter start-up
    # and imports included), else from this call
    args.started = time.monotonic() - (process_seconds() if argv is None else 0.0)
    with contextlib.suppress(ValueError):  # not the main thread (main() called from a test's thread): leave it
        signal.signal(signal.SIGHUP, _hang_up)
    console = make_console(stderr=args.format == "json")
    try:
        if args.sweep == "status":
            args.sweep = args.overrides[0] if args.overrides else None
            return cmd_status(args, console)
        if args.sweep == "paper":  # every command the paper's report needs, in order (sweeps.paper_plan)
            from sweeps.paper_plan import run_plan

            if args.overrides:
                raise SweepError(f"'paper' runs the embedded default and takes no overrides, got {args.overrides}")
            return run_plan(dry_run=args.dry_run)
        return cmd_run(args, console)
    except (ValueError, RuntimeError) as err:  # SweepError is a ValueError, StoreError a RuntimeError
        error(str(err))
        return 2
    except OSError as err:  # a runs root or database location that cannot be created or written
        error(f"{err.strerror or err}: {err.filename or ''} (choose another --runs-root or --db)".rstrip())
        return 2
    except KeyboardInterrupt as err:  # Ctrl-C: one line (the sweep's own once it follows runs), no traceback
        from sweeps.submit import SweepInterrupted

        if not isinstance(err, SweepInterrupted):
            print("interrupted: nothing was lost; rerun the same command to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
