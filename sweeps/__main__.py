"""`python -m sweeps`: run a named grid of experiments, or show the run registry."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from sweeps.compose import RunSpec, SweepError, describe, expand, sweep_names
from sweeps.runs import SweepLock, read_state, runs_root, sweep_dir

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

Overrides use Hydra's syntax; a comma list sweeps that key (it replaces the sweep's own axis).
Axes: method=<name>, +setting=<model-precision pair>, delta=<float>; also model=, precision=, top_k=,
cluster=local|slurm_emulated|h20_4x8.
Seeds: every cell of the grid runs at S seeds, each seed its own run (run config key seed; run id). seeds=N runs
seeds 0..N-1, seeds=[0,3,7] those seeds, seed=4 or seed=0,1 the seed axis as any other Hydra axis (give seed= or
seeds=, not both). Default: the sweep's own seed axis (smoke: seed 0), else the cluster's seeds: 3 on the CPU
engine (local, slurm_emulated), 1 on h20_4x8. The count is not part of any run: a cell's seed-0 run has the same
id whatever S, so a rerun with more seeds runs only the new ones. Runs go seed by seed (every cell at seed 0 first).
Resume: a rerun of the same command skips completed runs, joins live ones and resumes the others.
Outputs: run directories under runs/<sweep>/<run_id>/ ($PREDMASK_RUNS), the results database
results/predmask.duckdb ($PREDMASK_DB or --db). On the local cluster every run is a CPU stand-in: small
Qwen3-architecture models, a synthetic task, emulated bf16/FP8 precision.
"""


def _db_path(arg: str | None) -> Path:
    from analysis.store import default_db_path

    return Path(arg) if arg else default_db_path()


def _ingest(db: Path, spec: RunSpec, path: Path, backend: str) -> None:
    """Register and ingest one finished run (the sweep process is the database's only writer)."""
    from analysis.store import connect, ingest_run_dir, upsert_runs

    con = connect(db)
    try:
        ingest_run_dir(con, path)
        record = json.loads((path / "job.json").read_text()) if (path / "job.json").exists() else {}
        upsert_runs(con, [{
            "run_id": spec.run_id, "sweep": spec.sweep, "method": spec.method, "delta": spec.delta,
            "model": spec.model, "precision": spec.precision, "seed": spec.seed, "backend": backend,
            "status": read_state(path).status, "config": spec.config, "job_id": record.get("job_id"),
            "log_path": str((path / "job.log").resolve()), "run_dir": str(path.resolve()),
        }])
    finally:
        con.close()


def cmd_run(args: argparse.Namespace, console: Console) -> int:
    from sweeps.submit import backend_of, dry_run_records, job_command, run_sweep, write_dry_run

    specs = expand(args.sweep, args.overrides)
    root = Path(args.runs_root) if args.runs_root else runs_root()
    clusters = {spec.config["cluster"]["name"] for spec in specs}
    if len(clusters) > 1:
        raise SweepError(f"one cluster per sweep invocation, got {', '.join(sorted(clusters))}")
    if args.dry_run:
        records = dry_run_records(specs, root)
        out = write_dry_run(records, sweep_dir(args.sweep, root))
        if args.format == "json":
            print(json.dumps(records, indent=2))
        else:
            for rec in records:
                console.rule(f"{rec['run_id']}  {rec['method']}  delta={rec['delta']}  {rec['model']}/{rec['precision']}"
                             f"  seed={rec['seed']}")
                if rec["sbatch"]:
                    console.print(rec["sbatch"], markup=False, highlight=False)
                console.print(" ".join(rec["command"]), markup=False, highlight=False, soft_wrap=True)
            console.print(f"[dim]{describe(specs)}; scripts and commands written to {out}[/]")
        return 0

    for spec in specs:  # every run's command composes (model and data paths, names) before anything is written
        job_command(spec, root / spec.sweep / spec.run_id)
    db = _db_path(args.db)
    backend = backend_of(specs[0])
    max_parallel = args.max_parallel or int(specs[0].config["cluster"].get("max_parallel", 2))
    console.print(f"sweep [bold]{args.sweep}[/]: {describe(specs)} on {backend} "
                  f"({specs[0].config['cluster']['name']}), runs in {sweep_dir(args.sweep, root)}, database {db}")
    started = time.perf_counter()
    with SweepLock(sweep_dir(args.sweep, root)):
        outcome = run_sweep(specs, root=root, max_parallel=max_parallel, console=console,
                            on_finished=lambda spec, path: _ingest(db, spec, path, backend))
        # runs completed by an earlier invocation may have ended after its last ingest: ingest them again
        # (idempotent) so the database always matches the run directories.
        for spec in specs:
            if spec.run_id in outcome.skipped:
                _ingest(db, spec, root / spec.sweep / spec.run_id, backend)
    elapsed = time.perf_counter() - started
    console.print(f"{len(outcome.completed)} completed, {len(outcome.skipped)} already done, "
                  f"{len(outcome.failed)} failed in {elapsed / 60:.1f} min; database: {db}")
    if not outcome.failed:
        console.print(f"next: python -m reports paper{'' if args.db is None else f' --db {db}'}", highlight=False)
    for run_id, message in outcome.failed.items():
        console.print(f"[red]failed[/] {run_id}: {message}", highlight=False)
    return 1 if outcome.failed else 0


def cmd_status(args: argparse.Namespace, console: Console) -> int:
    root = Path(args.runs_root) if args.runs_root else runs_root()
    sweeps = [args.sweep] if args.sweep else sorted(p.name for p in root.iterdir() if p.is_dir()) \
        if root.exists() else []
    table = Table(title=f"runs under {root}")
    for col in ("sweep", "run_id", "method", "model", "precision", "delta", "seed", "status", "step"):
        table.add_column(col, no_wrap=True)
    import yaml

    for name in sweeps:
        for path in sorted(p for p in (root / name).iterdir() if p.is_dir() and not p.name.startswith(".")) \
                if (root / name).exists() else []:
            cfg_file = path / "planned_config.yaml"
            if not cfg_file.exists():
                continue
            cfg = yaml.safe_load(cfg_file.read_text())
            state = read_state(path)
            step = f"{state.step}/{state.total_steps}" if state.total_steps else str(state.step)
            table.add_row(name, path.name, cfg["method"]["name"], cfg["model"]["name"], cfg["precision"]["name"],
                          str(cfg.get("delta")), str(cfg.get("seed")), state.status, step)
    if not console.is_terminal:
        console.width = max(console.width, 140)
    console.print(table)
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m sweeps",
        description="Run a named grid of predmask experiments (Hydra sweep + submitit), or show the registry. "
        f"Sweeps: {', '.join(sweep_names())}; or 'status [sweep]'.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("sweep", help="a sweep name (conf/sweep/), or 'status'")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. method=dppo_topk_kl,predmask_kl_agg")
    ap.add_argument("--dry-run", action="store_true", help="submit nothing; print each run's id, sbatch script and "
                    "exact command, and write them under runs/<sweep>/dry-run/")
    ap.add_argument("--format", choices=("text", "json"), default="text", help="dry-run output format")
    ap.add_argument("--db", help="results database (default: $PREDMASK_DB or results/predmask.duckdb)")
    ap.add_argument("--runs-root", help="root of run directories (default: $PREDMASK_RUNS or runs/)")
    ap.add_argument("--max-parallel", type=int, help="runs at once (default: the cluster config's max_parallel)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_intermixed_args(argv)  # options may sit between overrides
    console = Console(stderr=args.format == "json")
    try:
        if args.sweep == "status":
            args.sweep = args.overrides[0] if args.overrides else None
            return cmd_status(args, console)
        return cmd_run(args, console)
    except (ValueError, RuntimeError) as err:  # SweepError is a ValueError
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
