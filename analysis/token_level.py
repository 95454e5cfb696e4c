"""`python -m analysis token_level`: the token-level study of the direction criteria (math.md §5, paper §4.2).

Per seed: a fresh rollout (top-K support, rewards, GRPO advantages), the training policy moved off the rollout
distribution by emulated precision mismatch and policy staleness, and ONE optimiser step per mask (ratio DPPO,
predictive with the aggregated / uniform / exact tail, and the unmasked reference) from the same state; every
token outside the trust region is stored with its D_pre, r, A, Ddot per tail, keep decisions and ΔD per mask.

The config is conf/analysis/token_level.yaml composed with Hydra-style ``key=value`` overrides. Seeds fan out
through submitit (local processes, or a Slurm job array on a cluster config); each seed writes its own files;
this process alone ingests them into DuckDB and prints the study's table beside the paper's numbers. A rerun skips
the seeds already stored for the same study (same config, whatever the seed count and launcher).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

__all__ = ["LAUNCHER_KEYS", "STUDY_VERSION", "StudyInputError", "compose_study", "main", "study_id_of"]

#: bump when a code change alters what a study computes (it is part of the study id)
STUDY_VERSION = 1
#: keys that say where/how the study runs, not what it computes: excluded from the study id
LAUNCHER_KEYS: tuple[str, ...] = ("cluster", "launcher", "paths", "hydra")
#: config groups whose values are checked against conf/<group>/*.yaml with a one-line error
GROUPS: tuple[str, ...] = ("model", "precision", "cluster")
#: short override names accepted on the command line
ALIASES: dict[str, str] = {"K": "top_k"}
PRIMARY = "analysis/token_level"
POLL_SECONDS = 0.5

_err = Console(stderr=True, highlight=False, soft_wrap=True)


class StudyInputError(ValueError):
    """Bad input; the message is one line naming the bad value and what is allowed."""


# ------------------------------------------------------------------------------------------------ config


def _conf_dir() -> Path:
    from importlib import resources

    return Path(str(resources.files("conf")))


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (_conf_dir() / group).glob("*.yaml"))


def _normalise_overrides(overrides: Sequence[str], cluster: str | None) -> list[str]:
    out = []
    for ov in overrides:
        if ov.startswith("~"):  # Hydra's delete syntax
            out.append(ov)
            continue
        if "=" not in ov:
            raise StudyInputError(f"bad override {ov!r}: expected key=value (e.g. delta=0.1)")
        key, value = ov.split("=", 1)
        prefix = "+" if key.startswith("+") else ""
        key = prefix + ALIASES.get(key.lstrip("+"), key.lstrip("+"))
        if key in GROUPS and value not in _options(key):
            raise StudyInputError(f"unknown {key} {value!r}; valid: {', '.join(_options(key))}")
        out.append(f"{key}={value}")
    if cluster is not None:
        if cluster not in _options("cluster"):
            raise StudyInputError(f"unknown cluster {cluster!r}; valid: {', '.join(_options('cluster'))}")
        out.append(f"cluster={cluster}")
    return out


def compose_study(overrides: Sequence[str] = (), cluster: str | None = None) -> dict[str, Any]:
    """The resolved study config: conf/analysis/token_level.yaml with ``overrides`` (Hydra's compose API)."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    ovs = _normalise_overrides(overrides, cluster)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module="conf", version_base=None):
            cfg = compose(PRIMARY, overrides=ovs)
            resolved = OmegaConf.to_container(cfg, resolve=True)
    except (HydraException, OmegaConfBaseException) as err:
        raise StudyInputError(
            f"cannot compose the study config with {' '.join(ovs) or 'no overrides'}: "
            f"{str(err).splitlines()[0]}"
        ) from None
    finally:
        GlobalHydra.instance().clear()
    assert isinstance(resolved, dict)
    if resolved.get("checkpoint"):  # one study whatever the spelling of the path
        resolved["checkpoint"] = str(Path(str(resolved["checkpoint"])).resolve())
    resolved["label"] = _label(resolved)
    return resolved


def _label(cfg: Mapping[str, Any]) -> str:
    """How outputs name this run (a CPU stand-in and emulated precision are said to be so)."""
    from analysis.token_level_backend import model_label, precision_of

    m = cfg["model"]
    prec = cfg["precision"].get("label") or precision_of(cfg).label
    if m.get("backend") == "cpu":
        return f"{model_label(cfg)}; {prec}"
    return f"{m.get('name')} ({cfg.get('checkpoint') or m.get('path')}); precision {cfg['precision'].get('name')}"


def study_id_of(cfg: Mapping[str, Any]) -> str:
    """Stable hash of the study config without launcher keys (the seed count is not in the config)."""
    core = {k: v for k, v in cfg.items() if k not in LAUNCHER_KEYS}
    blob = json.dumps(
        {"study_version": STUDY_VERSION, **core}, sort_keys=True, separators=(",", ":"), default=str
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def study_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """What token_level_studies stores: the config without launcher keys, plus the study version."""
    return {"study_version": STUDY_VERSION, **{k: v for k, v in cfg.items() if k not in LAUNCHER_KEYS}}


def _number(cfg: Mapping[str, Any], key: str, kind: type, what: str, ok: Any) -> Any:
    value = cfg.get(key)
    try:
        if isinstance(value, bool) or value is None:
            raise TypeError
        v = kind(value)
        if kind is int and v != value:
            raise TypeError
    except (TypeError, ValueError):
        raise StudyInputError(f"{key} must be {what}, got {value!r}") from None
    if not ok(v):
        raise StudyInputError(f"{key} must be {what}, got {value!r}")
    return v


def validate(cfg: Mapping[str, Any]) -> None:
    """One-line errors for a config the study cannot run (checked before anything is written)."""
    from analysis.token_level_backend import settings_of

    _number(cfg, "delta", float, "a number > 0", lambda v: v > 0)
    _number(cfg, "top_k", int, "an integer >= 1", lambda v: v >= 1)
    group = _number(cfg, "group_size", int, "an integer >= 2", lambda v: v >= 2)
    seqs = _number(
        cfg,
        "sequences",
        int,
        f"a positive multiple of group_size={group}",
        lambda v: v >= group and v % group == 0,
    )
    mbs = _number(cfg, "minibatches", int, "an integer >= 1", lambda v: v >= 1)
    if mbs > seqs // group:
        raise StudyInputError(f"minibatches={mbs} exceeds the {seqs // group} prompt groups of a seed")
    _number(cfg, "staleness", int, "an integer >= 0", lambda v: v >= 0)
    _number(cfg, "lr", float, "a number > 0", lambda v: v > 0)
    _number(cfg, "max_new_tokens", int, "an integer >= 1", lambda v: v >= 1)
    _number(cfg, "temperature", float, "a number > 0", lambda v: v > 0)
    m = cfg["model"]
    if m.get("backend") not in ("cpu", "hf"):
        raise StudyInputError(f"model {m.get('name')!r} has backend {m.get('backend')!r}; allowed: cpu, hf")
    ckpt = cfg.get("checkpoint")
    if ckpt is not None and not Path(str(ckpt)).exists():
        raise StudyInputError(f"checkpoint {ckpt} does not exist")
    if m.get("backend") == "hf":
        path = ckpt or m.get("path")
        if not path or not Path(str(path)).exists():
            raise StudyInputError(
                f"model {m.get('name')!r}: checkpoint path {path} does not exist (set "
                "PREDMASK_MODEL_ROOT or checkpoint=...)"
            )
    else:
        from analysis.token_level_backend import task_of
        from predmask.rl.tokenizer import ArithmeticTokenizer

        try:
            vocab = ArithmeticTokenizer(task_of(cfg).max_number).vocab_size
        except ValueError as err:
            raise StudyInputError(str(err)) from None
        if cfg["top_k"] >= vocab - 1:
            raise StudyInputError(f"top_k must be < {vocab - 1} (vocabulary {vocab}), got {cfg['top_k']}")
        if ckpt is not None:
            _check_cpu_checkpoint(cfg, vocab)
    try:
        from predmask.methods import get_method

        get_method(str(cfg["stale_method"]))
        settings_of(cfg, vocab_size=1 << 20)
    except (ValueError, KeyError, TypeError) as err:
        raise StudyInputError(str(err).splitlines()[0]) from None


def _check_cpu_checkpoint(cfg: Mapping[str, Any], vocab: int) -> None:
    """Load a CPU-engine checkpoint into the configured architecture (cheap for CPU models)."""
    from analysis.token_level_backend import load_checkpoint_weights
    from predmask.rl.model import build_policy

    try:
        model = build_policy(cfg["model"], vocab, seed=0)
        load_checkpoint_weights(model, Path(str(cfg["checkpoint"])))
    except Exception as err:  # noqa: BLE001 - any load failure is bad input, reported in one line
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise StudyInputError(
            f"checkpoint {cfg['checkpoint']} cannot be loaded into model "
            f"{cfg['model'].get('name')!r}: {first}"
        ) from None


# ----------------------------------------------------------------------------------------------- the CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m analysis token_level",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "The token-level study of the direction criteria (math.md §5): per seed, a fresh rollout, pi_pre moved "
            "off mu by emulated precision mismatch and staleness, one optimiser step per mask (ratio DPPO; "
            "predictive with aggregated, uniform and exact tails; unmasked reference), and the realised ΔD of every "
            "token outside the trust region. Results go to the DuckDB tables token_level_{studies,seeds,tokens}; "
            "the table printed at the end sets this run beside the paper's numbers."
        ),
        epilog=(
            "overrides (key=value, composed on conf/analysis/token_level.yaml):\n"
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
    p.add_argument(
        "--cluster",
        default=None,
        metavar="NAME",
        help="conf/cluster entry that runs the workers: local (default; local processes), slurm_emulated or "
        "h20_4x8 (a Slurm job array)",
    )
    p.add_argument(
        "--db",
        type=Path,
        default=None,
        help="results database (default: $PREDMASK_DB or results/predmask.duckdb)",
    )
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
    p.add_argument(
        "--dry-run", action="store_true", help="print the resolved config and study id; run nothing"
    )
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides (see below)")
    return p


def _console() -> Console:
    import shutil

    return Console(
        highlight=False, soft_wrap=True, width=max(120, shutil.get_terminal_size((120, 24)).columns)
    )


def _db_path(arg: Path | None) -> Path:
    from analysis.store import default_db_path

    return arg if arg is not None else default_db_path()


def _out_root(arg: Path | None) -> Path:
    return arg if arg is not None else Path.cwd() / "results" / "token_level"


def _stored(db: Path, study_id: str) -> set[int]:
    from analysis.store import connect, stored_seeds

    if not db.is_file():
        return set()
    con = connect(db, read_only=True)
    try:
        tables = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
        return stored_seeds(con, study_id) if "token_level_seeds" in tables else set()
    finally:
        con.close()


def ingest(db: Path, study_id: str, cfg: Mapping[str, Any], study_dir: Path, seeds: Sequence[int]) -> int:
    """Write the finished seed files of ``seeds`` into the database (the only writer); returns seeds written."""
    import polars as pl

    from analysis.store import connect, upsert_token_level
    from analysis.token_level_exec import SeedFiles

    files = SeedFiles(study_dir)
    done = files.finished(seeds)
    con = connect(db)
    try:
        if not done:
            upsert_token_level(con, study_id, study_config(cfg), None, None)
            return 0
        rows = pl.DataFrame([files.read_row(s) for s in done], infer_schema_length=None)
        tokens = pl.concat([files.read_tokens(s) for s in done], how="diagonal_relaxed")
        upsert_token_level(con, study_id, study_config(cfg), rows, tokens)
    finally:
        con.close()
    return len(done)


def _workers(args: argparse.Namespace, cfg: Mapping[str, Any], n: int) -> int:
    if args.workers is not None:
        return max(1, min(args.workers, n))
    launcher = cfg.get("launcher") or {}
    if cfg["cluster"].get("backend") == "slurm":
        return max(1, min(int(launcher.get("array_tasks") or n), n))
    return max(1, min(os.cpu_count() or 1, n))


def _run_inline(cfg: dict[str, Any], study_dir: Path, pending: list[int], progress: Any, task: Any) -> None:
    from analysis.token_level_exec import WorkerSpec, run_worker

    spec = WorkerSpec(
        cfg, str(study_dir), tuple(pending), threads=int((cfg.get("launcher") or {}).get("threads", 1))
    )
    run_worker(spec, on_seed=lambda _s: progress.advance(task))


class _NoSacctNoise:
    """Drop submitit's repeated "Bypassing sacct error" warnings (clusters without accounting, e.g. the emulated
    one): completion is read from the seed files and the jobs' own state, not from sacct."""

    def filter(self, record: Any) -> bool:
        return "Bypassing sacct error" not in record.getMessage()


def _run_submitit(
    cfg: dict[str, Any], study_dir: Path, pending: list[int], workers: int, progress: Any, task: Any
) -> list[str]:
    """Submit the workers, follow the seed files until every job ends; returns one message per failed job."""
    import logging

    from analysis.token_level_exec import SeedFiles, WorkerSpec, make_seed_executor, run_worker, split_seeds

    logging.getLogger("submitit").addFilter(_NoSacctNoise())
    launcher = dict(cfg.get("launcher") or {})
    if launcher.get("gpus_per_node") is None:
        launcher["gpus_per_node"] = 1 if cfg["model"].get("backend") == "hf" else 0
    threads = int(launcher.get("threads", 1))
    shares = split_seeds(pending, workers)
    executor = make_seed_executor(study_dir / "jobs", cfg["cluster"], launcher, len(shares))
    specs = [WorkerSpec(cfg, str(study_dir), share, threads) for share in shares]
    if cfg["cluster"].get("backend") == "slurm":
        jobs = executor.map_array(run_worker, specs)
    else:
        jobs = [executor.submit(run_worker, spec) for spec in specs]
    files = SeedFiles(study_dir)
    try:
        while True:
            progress.update(task, completed=len(files.finished(pending)))
            if all(j.done() for j in jobs):
                break
            time.sleep(POLL_SECONDS)
    except KeyboardInterrupt:
        for j in jobs:
            with contextlib.suppress(Exception):  # best effort: a finished job cannot be cancelled
                j.cancel(check=False)
        raise
    progress.update(task, completed=len(files.finished(pending)))
    failures = []
    for j in jobs:
        try:
            j.result()
        except Exception as exc:  # noqa: BLE001 - report every failed worker, keep what finished
            last = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
            failures.append(
                f"worker {j.job_id} failed: {last[-1] if last else type(exc).__name__} "
                f"(log: {j.paths.stderr})"
            )
    return failures


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    console = _console()
    try:
        if args.seeds < 1:
            raise StudyInputError(f"--seeds must be >= 1, got {args.seeds}")
        if args.seed_start < 0:
            raise StudyInputError(f"--seed-start must be >= 0, got {args.seed_start}")
        if args.workers is not None and args.workers < 1:
            raise StudyInputError(f"--workers must be >= 1, got {args.workers}")
        cfg = compose_study(args.overrides, args.cluster)
        validate(cfg)
    except StudyInputError as err:
        _err.print(f"error: {err}")
        return 2
    study_id = study_id_of(cfg)
    seeds = list(range(args.seed_start, args.seed_start + args.seeds))
    if args.dry_run:
        from omegaconf import OmegaConf

        console.print(OmegaConf.to_yaml(cfg))
        console.print(f"study {study_id}: seeds {seeds[0]}..{seeds[-1]}")
        return 0
    return _run(args, cfg, study_id, seeds, console)


def _absolute_paths(cfg: dict[str, Any]) -> None:
    """Workers may start elsewhere (Slurm): make relative paths absolute against this process's directory."""
    paths = dict(cfg.get("paths") or {})
    for key, value in paths.items():
        if isinstance(value, str) and value and not Path(value).is_absolute():
            paths[key] = str(Path.cwd() / value)
    cfg["paths"] = paths


def _run(
    args: argparse.Namespace, cfg: dict[str, Any], study_id: str, seeds: list[int], console: Console
) -> int:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from analysis.store import StoreError, connect
    from analysis.token_level_exec import SeedFiles
    from analysis.token_level_report import load_study, print_report
    from predmask.io import atomic_write_text

    db = _db_path(args.db)
    study_dir = _out_root(args.out) / study_id
    try:
        stored = _stored(db, study_id)
    except StoreError as err:
        _err.print(f"error: {err}")
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
        _absolute_paths(cfg)
        if cfg["model"].get("backend") == "cpu" and not cfg.get("checkpoint"):
            from analysis.token_level_backend import base_model

            _model, info = base_model(
                cfg, progress=True
            )  # build the cached base once, before the workers start
            console.print(
                f"base model: {info.get('cache_path')} (train accuracy {info.get('train_acc', float('nan')):.3f})"
            )
        study_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(study_dir / "config.json", json.dumps(study_config(cfg), indent=1, sort_keys=True))
        workers = 1 if args.inline else _workers(args, cfg, len(pending))
        columns = (
            TextColumn("[bold]seeds"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("elapsed"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
        )
        with Progress(*columns, console=console, transient=False) as progress:
            task = progress.add_task("seeds", total=len(pending))
            try:
                if args.inline:
                    _run_inline(cfg, study_dir, pending, progress, task)
                else:
                    where = cfg["cluster"].get("name", "local")
                    progress.console.print(f"{workers} worker(s) on {where}; logs in {study_dir / 'jobs'}")
                    failures = _run_submitit(cfg, study_dir, pending, workers, progress, task)
            except KeyboardInterrupt:
                interrupted = True
            except RuntimeError as exc:  # the inline worker's failed seeds (tracebacks printed above)
                failures = [f"inline worker: {exc}"]
    try:
        n_new = ingest(db, study_id, cfg, study_dir, [s for s in seeds if s not in stored])
    except StoreError as err:
        _err.print(f"error: {err}")
        return 1
    console.print(f"ingested {n_new} seed(s) into {db}")
    for msg in failures:
        _err.print(f"error: {msg}")
    if interrupted:
        remaining = sum(1 for s in seeds if s not in stored and not files.done(s))
        _err.print(
            f"interrupted: finished seeds are stored; rerun the same command to run the other {remaining} seed(s)"
        )
        return 130
    con = connect(db, read_only=True)
    try:
        data = load_study(con, study_id, seeds, study_config(cfg))
    finally:
        con.close()
    print_report(data, console)
    missing = len(seeds) - data.seeds.height
    if missing:
        _err.print(
            f"error: {missing} of {len(seeds)} seeds are not stored; rerun the same command to run them"
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
