"""`python -m analysis token_level`: the token-level study of the direction criteria (docs/math.md §5, paper §4.2).

Composes the config (``compute.study_config``), fans the pending seeds out to workers (``compute.fanout``:
local processes or a Slurm job array), then, the only database writer, summarises the finished seed files into
seed rows (``seed_row``), ingests them and prints the study's report (``summary.report``). A rerun skips the
seeds already stored for the same study (same config, whatever the seed count and launcher).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from analysis.token_level.compute.study_config import (
    StudyInputError,
    compose_study,
    study_config,
    study_id_of,
    validate,
)
from predmask.console import error, make_console

if TYPE_CHECKING:
    import polars as pl


ERR = make_console(stderr=True)
_log = logging.getLogger("analysis.token_level")
#: the study's progress lines, beside its seed files
PROGRESS_LOG = "study.log"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m analysis token_level",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "The token-level study of the direction criteria (docs/math.md §5): per seed, a fresh rollout, pi_pre moved "
            "off mu by emulated precision mismatch and staleness, one optimiser step per mask (ratio DPPO; "
            "predictive with aggregated, uniform and exact tails; unmasked reference), and the realised ΔD of every "
            "token outside the trust region, with its own update's ground truths (docs/math.md §5.1). Results go "
            "to the DuckDB tables token_level_{studies,seeds,tokens} and, judged per study, token_level_criteria, "
            "token_level_criteria_seeds and token_level_sign_agreement. The report at the end first judges both "
            "criteria on the same tokens, then sets this run beside the paper's numbers."
        ),
        epilog=(
            "overrides (key=value, composed on conf/token_level.yaml):\n"
            "  model=NAME        conf/model entry: cpu_* (CPU engine) or a Hugging Face model (GPU path)\n"
            "  checkpoint=PATH   start from a training run's saved weights instead of the base model\n"
            "  delta=X           trust-region threshold on the top-K KL (default 0.15)\n"
            "  top_k=K (or K=K)  width of the rollout's top-K support (default 20)\n"
            "  sequences=N       sequences per seed (a multiple of group_size; default 1024)\n"
            "  staleness=S       mini-batch updates before the studied step\n"
            "  lr=X              AdamW learning rate of the stale and studied steps\n"
            "  precision=NAME    conf/precision entry: bf16, fp8_rollout, fp8_e2e (emulated on CPU)\n"
            "  any other key of the config (group_size, minibatches, update_path, micro_batch, launcher.*, ...)\n\n"
            "examples:\n"
            "  python -m analysis token_level --seeds 61\n"
            "  python -m analysis token_level --seeds 8 sequences=256 delta=0.1\n"
            "  python -m analysis token_level --seeds 61 --cluster slurm_emulated precision=fp8_rollout"
        ),
    )
    p.add_argument(
        "--seeds",
        type=int,
        required=True,
        metavar="N",
        help="number of seeds: the study covers seeds START..START+N-1 (the paper uses 61)",
    )
    p.add_argument("--seed-start", type=int, default=0, metavar="START", help="first seed (default 0)")
    add_run_options(p, "print the resolved config and study id; run nothing")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides (see below)")
    return p


def add_run_options(p: argparse.ArgumentParser, dry_run: str) -> None:
    """The options of every command that runs the study's seeds (this one, the drift grid): where the workers run,
    the database, the seed files, the workers, inline, and ``--dry-run`` (``dry_run``: what it prints)."""
    from predmask.rundir import add_db_option

    p.add_argument(
        "--cluster",
        default=None,
        metavar="NAME",
        help="conf/cluster entry that runs the workers: local (default; local processes), slurm_emulated or "
        "h20_4x8 (a Slurm job array)",
    )
    add_db_option(p)
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder of the per-seed files, one sub-folder per study (default: results/token_level)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        metavar="W",
        help="worker processes / array tasks (default: the CPU count locally, capped by the seeds to run; "
        "launcher.array_tasks, else one per pending seed, on Slurm)",
    )
    p.add_argument(
        "--inline",
        action="store_true",
        help="run the seeds in this process, one after another (no submitit; for debugging)",
    )
    p.add_argument("--dry-run", action="store_true", help=dry_run)


def out_root(arg: Path | None) -> Path:
    return arg if arg is not None else Path.cwd() / "results" / "token_level"


def stored_in(db: Path, study_id: str) -> set[int]:
    from analysis.store import connect, stored_seeds, table_exists

    if not db.is_file():
        return set()
    with connect(db, read_only=True) as con:
        return stored_seeds(con, study_id) if table_exists(con, "token_level_seeds") else set()


def seed_row(written: Mapping[str, Any], tokens: pl.DataFrame) -> dict[str, Any]:
    """A seed's row of ``token_level_seeds``: what its worker wrote (seed, ``n_tokens``, batch facts, timings)
    with the counts and rates its token rows give (``seed_summary``), keys in sorted order."""
    from analysis.token_level.summary.study_stats import seed_summary

    return dict(sorted({**seed_summary(tokens, written["n_tokens"]), **written}.items()))


def ingest(db: Path, study_id: str, cfg: Mapping[str, Any], study_dir: Path, seeds: Sequence[int]) -> int:
    """Write the finished seed files of ``seeds`` into the database (the only writer); returns seeds written.

    In the same transaction, the study's criteria judged on all its stored tokens (docs/math.md §5.1) replace its
    rows of the study-level tables (``analysis.token_level.summary.study_tables.study_tables``)."""
    import polars as pl

    from analysis.store import connect, upsert_token_level
    from analysis.token_level.compute.fanout import SeedFiles
    from analysis.token_level.summary.study_tables import study_tables

    files = SeedFiles(study_dir)
    done = files.finished(seeds)
    with connect(db) as con:
        if not done:
            upsert_token_level(con, study_id, study_config(cfg), None, None)
            return 0
        seed_tokens = [files.read_tokens(s) for s in done]
        rows = pl.DataFrame(
            [seed_row(files.read_row(s), t) for s, t in zip(done, seed_tokens)], infer_schema_length=None
        )
        tokens = pl.concat(seed_tokens, how="diagonal_relaxed")
        upsert_token_level(con, study_id, study_config(cfg), rows, tokens, derive=study_tables)
    return len(done)


def worker_count(args: argparse.Namespace, cfg: Mapping[str, Any], n: int) -> int:
    """Worker jobs for ``n`` pending seeds: ``--workers``, else the Slurm array size, else the CPU count."""
    if args.workers is not None:
        return max(1, min(args.workers, n))
    if cfg["cluster"].get("backend") == "slurm":
        return max(1, min(cfg["launcher"]["array_tasks"] or n, n))
    return max(1, min(os.cpu_count() or 1, n))


def run_studies(
    studies: Sequence[tuple[dict[str, Any], Path, list[int]]], args: argparse.Namespace, title: str, jobs_dir: Path,
    log_file: Path, console: Console,
) -> tuple[list[str], bool]:
    """Run the pending seeds of one study or several (config, study directory, pending seeds; the drift grid's
    cells) on one pool of workers: each study prepared (``prepare_study``; each base model named once), the seeds
    dealt to the workers (``fanout.deal``) and run in this process (``--inline``) or as jobs through the launch
    layer, with a progress bar of finished seeds. Returns (the workers' failures, whether it was interrupted)."""
    from analysis.token_level.compute.fanout import SeedFiles, deal, run_worker, submit_shares
    from predmask.progress import progress

    shown: set[str] = set()
    for cfg, study_dir, _pending in studies:
        info = prepare_study(cfg, study_dir)
        if info is not None and info.get("cache_path") not in shown:
            shown.add(info.get("cache_path"))
            console.print(
                f"base model: {info.get('cache_path')} (train accuracy {info.get('train_acc', float('nan')):.3f})"
            )
    cfg = studies[0][0]
    n_pending = sum(len(pending) for *_, pending in studies)
    shares = deal(studies, 1 if args.inline else worker_count(args, cfg, n_pending))
    if not args.inline:
        where = cfg["cluster"].get("name", "local")
        console.print(f"{len(shares)} worker(s) on {where}; logs in {jobs_dir}", markup=False)
    console.print(f"progress: {log_file}", markup=False)
    todo = [(SeedFiles(study_dir), pending) for _cfg, study_dir, pending in studies]

    def finished() -> int:
        return sum(len(files.finished(pending)) for files, pending in todo)

    failures: list[str] = []
    with progress(title, n_pending, log=_log, unit="seeds", stream=sys.stdout, log_file=log_file) as bar:
        try:
            if not args.inline:
                return submit_shares(cfg, jobs_dir, shares, finished, bar.advance_to), False
            for spec in shares[0]:
                try:
                    run_worker(spec, on_seed=lambda seed: bar.advance_to(finished(), status=f"seed {seed} done"))
                except RuntimeError as exc:  # the worker's failed seeds (tracebacks printed above)
                    failures.append(f"inline worker: {Path(spec.study_dir).name}: {exc}")
        except KeyboardInterrupt:
            return failures, True
    return failures, False


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    console = make_console()
    try:
        if args.seeds < 1:
            raise StudyInputError(f"--seeds must be >= 1, got {args.seeds}")
        if args.seed_start < 0:
            raise StudyInputError(f"--seed-start must be >= 0, got {args.seed_start}")
        if args.workers is not None and args.workers < 1:
            raise StudyInputError(f"--workers must be >= 1, got {args.workers}")
        cfg = compose_study(args.overrides, args.cluster)
        validate(cfg)
        if cfg.get("checkpoint") is not None and cfg["model"].get("backend") == "cpu":
            from analysis.token_level.compute.backend import check_checkpoint

            check_checkpoint(cfg)
    except StudyInputError as err:
        error(str(err))
        return 2
    study_id = study_id_of(cfg)
    seeds = list(range(args.seed_start, args.seed_start + args.seeds))
    if args.dry_run:
        from omegaconf import OmegaConf

        console.print(OmegaConf.to_yaml(cfg))
        console.print(f"study {study_id}: seeds {seeds[0]}..{seeds[-1]}")
        return 0
    return _run(args, cfg, study_id, seeds, console)


def prepare_study(cfg: dict[str, Any], study_dir: Path) -> dict[str, Any] | None:
    """Before any worker starts: relative paths made absolute against this directory, the CPU base model
    built into its cache (its info; None when the study trains no CPU base model), and ``config.json`` beside
    the seed files."""
    from predmask.io import atomic_write_text

    paths = cfg["paths"] = dict(cfg.get("paths") or {})
    for key, value in paths.items():  # workers may start elsewhere (Slurm)
        if isinstance(value, str) and value and not Path(value).is_absolute():
            paths[key] = str(Path.cwd() / value)
    info = None
    if cfg["model"].get("backend") == "cpu" and not cfg.get("checkpoint"):
        from analysis.token_level.compute.backend import base_model

        _model, info = base_model(cfg, progress=True)
    study_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(study_dir / "config.json", json.dumps(study_config(cfg), indent=1, sort_keys=True))
    return info


def _run(
    args: argparse.Namespace, cfg: dict[str, Any], study_id: str, seeds: list[int], console: Console
) -> int:
    from analysis.store import StoreError, check_db_path, connect, paper_command
    from analysis.token_level.compute.fanout import SeedFiles
    from analysis.token_level.summary.report import load_study, print_report
    from predmask.rundir import db_or_default

    db = db_or_default(args.db)
    study_dir = out_root(args.out) / study_id
    try:
        check_db_path(db)  # before any seed runs: a bad path costs nothing
        stored = stored_in(db, study_id)
    except StoreError as err:
        error(str(err))
        return 2
    files = SeedFiles(study_dir)
    on_disk = set(files.finished(seeds)) - stored
    pending = [s for s in seeds if s not in stored and s not in on_disk]
    console.print(
        f"token-level study {study_id} ({cfg['label']}): {len(seeds)} seeds, {len(stored & set(seeds))} "
        f"stored, {len(on_disk)} finished on disk, {len(pending)} to run → {study_dir}"
    )
    failures: list[str] = []
    interrupted = False
    if pending:
        failures, interrupted = run_studies([(cfg, study_dir, pending)], args, f"token-level study {study_id}",
                                            study_dir / "jobs", study_dir / PROGRESS_LOG, console)
    try:
        n_new = ingest(db, study_id, cfg, study_dir, [s for s in seeds if s not in stored])
    except StoreError as err:
        error(str(err))
        return 1
    console.print(f"ingested {n_new} seed(s) into {db}")
    for msg in failures:
        error(msg)
    if interrupted:
        remaining = sum(1 for s in seeds if s not in stored and not files.done(s))
        ERR.print(
            f"interrupted: finished seeds are stored; rerun the same command to run the other {remaining} seed(s)"
        )
        return 130
    with connect(db, read_only=True) as con:
        data = load_study(con, study_id, seeds)
    print_report(data, console)
    missing = len(seeds) - data.seeds.height
    if missing:
        error(f"{missing} of {len(seeds)} seeds are not stored; rerun the same command to run them")
        return 1
    console.print(f"next: {paper_command(args.db, study_id)}", markup=False)
    return 0
