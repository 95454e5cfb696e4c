"""`python -m predmask.rl.train [hydra overrides]`: one GRPO training run of the CPU engine, resumable.

Composes ``conf/train.yaml`` (defaults: method, model, precision, cluster) with Hydra overrides, e.g.

    python -m predmask.rl.train method=predmask_kl_agg model=cpu_s precision=bf16 delta=0.15 \\
        trainer.steps=200 seed=0 run_dir=runs/x

and writes the run directory (the contract of every CPU or VeRL run; its files, writer and parser:
:mod:`predmask.rundir`):

- ``config.yaml``  the resolved config, written before training starts (the CPU model actually trained, every
                   parameter of the method, what the precision emulates, and the stand-in labels included);
- ``metrics.jsonl`` one verl file-logger line ``{"step": N, "data": {...}}`` per step (step 0: validation before
                   training), verl metric names plus the mask and mismatch metrics;
- ``status.json``  ``{"status", "step", "total_steps", "updated", "error"}``, replaced atomically;
- ``checkpoints/step_XXXXXX.pt`` model, optimiser, RNG states and data position every ``trainer.save_every``
                   steps and at the end (the last ``trainer.keep_checkpoints`` are kept);
- ``train.log``    the human log (appended across restarts);
- ``tensorboard/``, ``wandb/``, ``wandb_id`` only with ``trainer.logger`` naming ``tensorboard`` / ``wandb``
                   (verl's tracker names; :mod:`predmask.rl.trackers`: where they write, the W&B id a resumed run
                   keeps). ``console`` in the list prints the step lines; ``file`` (``metrics.jsonl``) is required.

The trainer holds the run directory's writer lock (``.run.lock``, ``predmask.rundir.hold_run_lock``) for its whole
life: a second trainer on the same ``run_dir`` exits with one line naming the first one's pid and writes nothing, and
a ``status.json`` that says "running" while the lock is free belongs to a killed trainer (``predmask.rundir.run_status``).
Started again with the same config after any kind of death (SIGKILL included), a run resumes from its last
checkpoint and first truncates ``metrics.jsonl`` to the checkpoint's step, so the file ends with each step once;
a line found then that is not a record (``predmask.rundir``'s one parser and step rule, shared with ingest) is moved
to ``metrics.corrupt.jsonl`` (with a warning), never dropped, and the valid lines after it are kept.
Sampling is seeded per step from ``seed``, so the same seed and config give the same metrics on the same machine
(all but the wall-clock metrics, ``predmask.metrics.wall_clock``). A completed run started again does nothing.
Hydra does not change the working directory and writes no ``outputs/`` or ``.hydra/`` directories.
"""

from __future__ import annotations

import logging
import random
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from predmask import metrics as M
from predmask.config import store_schemas
from predmask.io import atomic_write
from predmask.progress import progress as show_progress
from predmask.rl.engine import Engine, prepare_config
from predmask.rl.task import STANDIN_LABEL, Problem, iter_train_prompts
from predmask.rl.trackers import Trackers, require_installed
from predmask.rundir import (
    CHECKPOINT_DIR,
    CONFIG_FILE,
    CORRUPT_METRICS_FILE,
    LOG_FILE,
    METRICS_FILE,
    MetricsWriter,
    RunDirBusyError,
    hold_run_lock,
    last_step,
    read_config,
    read_metrics,
    truncate_metrics,
    write_config,
    write_status,
)
from predmask.schemas.task_schema import TaskConfig

__all__ = ["latest_checkpoint", "main", "run", "setup_logging"]

#: config keys that may change between a run and its resumption
_RESUMABLE_KEYS = ({"trainer", "steps"}, {"trainer", "progress"}, {"trainer", "log_every"}, {"trainer", "logger"})

log = logging.getLogger("predmask.rl.train")


# ----------------------------------------------------------------------------------------------- checkpoints
def _ckpt_path(run_dir: Path, step: int) -> Path:
    return run_dir / CHECKPOINT_DIR / f"step_{step:06d}.pt"


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run directory, or None."""
    d = run_dir / CHECKPOINT_DIR
    if not d.is_dir():
        return None
    found = sorted(p for p in d.glob("step_*.pt") if p.name[5:11].isdigit())
    return found[-1] if found else None


def _save_checkpoint(run_dir: Path, step: int, engine: Engine, data_position: int, keep: int) -> Path:
    path = _ckpt_path(run_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    blob = {
        "step": step,
        "data_position": data_position,
        "model": engine.model.state_dict(),
        "optimizer": engine.optimizer.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
    }
    atomic_write(path, lambda tmp: torch.save(blob, tmp))
    for old in sorted(path.parent.glob("step_*.pt"))[:-keep]:
        old.unlink(missing_ok=True)
    return path


def _load_checkpoint(path: Path, engine: Engine) -> tuple[int, int]:
    blob = torch.load(path, map_location="cpu", weights_only=False)
    engine.model.load_state_dict(blob["model"])
    engine.optimizer.load_state_dict(blob["optimizer"])
    torch.set_rng_state(blob["rng"]["torch"])
    random.setstate(blob["rng"]["python"])
    engine.sync_rollout()
    return int(blob["step"]), int(blob["data_position"])


# ----------------------------------------------------------------------------------------------- config
def _diff_keys(a: Any, b: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[tuple[str, ...]] = []
        for k in sorted(set(a) | set(b)):
            out += _diff_keys(a.get(k), b.get(k), (*prefix, str(k)))
        return out
    return [] if a == b else [prefix]


def _check_or_write_config(run_dir: Path, c: dict[str, Any]) -> None:
    path = run_dir / CONFIG_FILE
    if path.exists():
        old = read_config(path)
        diffs = [d for d in _diff_keys(old, c) if set(d) not in _RESUMABLE_KEYS]
        if diffs:
            names = ", ".join(".".join(d) for d in diffs[:6])
            raise ValueError(f"run_dir {run_dir} holds a run with a different config ({names}); use another run_dir")
    write_config(run_dir, c)


# ----------------------------------------------------------------------------------------------- logging
class _ConsoleFilter(logging.Filter):
    """Lets through every record except those logged with ``extra={"console": False}``."""

    def filter(self, record: logging.LogRecord) -> bool:
        return bool(getattr(record, "console", True))


def setup_logging(run_dir: Path, logger: logging.Logger | None = None) -> list[logging.Handler]:
    """``train.log`` gets every line of ``logger`` (default: the trainer's); the console (stdout) the same minus the
    quiet step lines. The caller removes and closes the returned handlers."""
    target = log if logger is None else logger
    file_handler = logging.FileHandler(run_dir / LOG_FILE, mode="a")
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    console = logging.StreamHandler(sys.stdout)
    console.setFormatter(logging.Formatter("[predmask.rl] %(message)s"))
    console.addFilter(_ConsoleFilter())
    target.setLevel(logging.INFO)
    target.propagate = False
    for h in (file_handler, console):
        target.addHandler(h)
    return [file_handler, console]


def _use_progress(setting: str | bool) -> bool:
    """Whether to show a progress bar (else the console gets the step lines and plain progress lines)."""
    if isinstance(setting, bool):
        return setting
    if setting == "auto":
        return sys.stderr.isatty()
    return str(setting).lower() in ("true", "1", "yes")


def _step_summary(step: int, data: Mapping[str, Any]) -> str:
    parts = [f"step {step}"]
    for key, short in ((M.SCORE_MEAN, "score"), (M.RESPONSE_LENGTH_MEAN, "len"), (M.CLIPFRAC, "clipfrac"),
                       (M.MASK_OUTSIDE_FRAC, "outside"), (M.MISMATCH_TOPK_KL, "mismatch_topk_kl")):
        if key in data:
            parts.append(f"{short}={data[key]:.4g}")
    for key, value in data.items():
        if M.VAL_ACC_RE.match(key):
            parts.append(f"{key.split('/')[1]}={value:.3f}")
    return " ".join(parts)


# ----------------------------------------------------------------------------------------------- the run
def _problem_stream(task: TaskConfig, start: int) -> Iterator[Problem]:
    return iter_train_prompts(task, split="train", start=start)


def run(cfg: DictConfig | Mapping[str, Any]) -> dict[str, Any]:
    """Train one run to ``trainer.steps`` (resuming if its run_dir has a checkpoint); returns a summary dict."""
    c = prepare_config(cfg)
    require_installed(c["trainer"].get("logger", ()))  # a tracker the run asks for is importable here
    run_dir = Path(c["run_dir"])
    with hold_run_lock(run_dir):  # before anything is written: a second trainer on run_dir refuses, touching nothing
        return _run_locked(c, run_dir)


def _run_locked(c: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    _check_or_write_config(run_dir, c)
    handlers = setup_logging(run_dir)
    total = int(c["trainer"]["steps"])
    step = 0
    try:
        torch.set_num_threads(int(c["trainer"].get("threads", 1)))
        write_status(run_dir, "running", 0, total)
        log.info("start: run_dir=%s method=%s delta=%s seed=%s", run_dir, c["method"]["name"], c["delta"], c["seed"])
        log.info("model: %s%s", c["model"].get("label", c["model"]["name"]),
                 f" (resolved from {c['model']['resolved_from']})" if c["model"].get("resolved_from") else "")
        log.info("precision: %s (CPU emulation: %s)", c["precision"].get("label", c["precision"]["name"]),
                 c["precision"]["emulates"])
        log.info("eval splits: %s", STANDIN_LABEL)
        progress = _use_progress(c["trainer"].get("progress", "auto"))
        log.info("loading the base model from %s (pretrained on first use, about a minute)", c["cache_dir"])
        engine = Engine(c, progress=progress)
        log.info("policy: %d parameters, vocabulary %d; base model %s (train acc %.3f, %s)",
                 engine.n_parameters, engine.tokenizer.vocab_size, engine.base_info.get("cache_path"),
                 engine.base_info.get("train_acc", float("nan")),
                 "built now" if engine.base_info.get("built") else "from cache")
        summary = _train(engine, c, run_dir, progress)
        write_status(run_dir, "completed", summary["step"], total)
        log.info("completed at step %d", summary["step"])
        return summary
    except BaseException as exc:
        step = last_step(run_dir)
        write_status(run_dir, "failed", step, total, error=f"{type(exc).__name__}: {exc}")
        log.exception("failed at step %d", step, extra={"console": not isinstance(exc, ValueError)})
        raise
    finally:
        for h in handlers:
            log.removeHandler(h)
            h.close()


def _train(engine: Engine, c: dict[str, Any], run_dir: Path, progress: bool) -> dict[str, Any]:
    t = engine.trainer_cfg
    seed = int(c["seed"])
    metrics_path = run_dir / METRICS_FILE
    ckpt = latest_checkpoint(run_dir)
    start_step, data_pos = 0, 0
    if ckpt is not None:
        start_step, data_pos = _load_checkpoint(ckpt, engine)
        cut = truncate_metrics(metrics_path, start_step)
        log.info("resumed from %s (step %d); dropped %d metrics lines past it", ckpt.name, start_step, cut.dropped)
    else:
        cut = truncate_metrics(metrics_path, -1)
        if cut.dropped:
            log.info("no checkpoint: restarting from step 0, dropped %d metrics lines", cut.dropped)
    if cut.quarantined:
        log.warning("%d unparseable line(s) of %s moved to %s; every valid line before the checkpoint is kept",
                    cut.quarantined, METRICS_FILE, CORRUPT_METRICS_FILE)
    if start_step >= t.steps:
        log.info("already at step %d of %d: nothing to do", start_step, t.steps)
        return {"step": start_step, "resumed": ckpt is not None}
    console = "console" in t.logger
    writer = MetricsWriter(metrics_path)
    trackers = Trackers.open(t.logger, run_dir, c, history=read_metrics(metrics_path))  # replays what they lack
    if trackers.names:
        log.info("trackers: %s", ", ".join(trackers.names))

    def record(data: dict[str, Any], step: int) -> None:
        writer.log(data, step=step)  # synced first: no tracker can cost a metrics.jsonl line
        trackers.log(data, step=step)

    last_val: dict[str, float] = {}
    failed = True
    try:
        if start_step == 0 and t.val_before_train:
            t0 = time.perf_counter()
            val = engine.validate(seed * 7_919)
            val[M.TIMING_TESTING] = time.perf_counter() - t0
            record({**val, M.GLOBAL_STEP: 0}, step=0)
            last_val = val
            log.info(_step_summary(0, val), extra={"console": console})
        stream = _problem_stream(engine.task, data_pos)

        title = f"GRPO {engine.method_name} {engine.model_cfg['name']} {engine.precision.name}"
        with show_progress(title, total=t.steps, completed=start_step, unit="steps", bar=progress) as bar:
            data: dict[str, Any] = {}
            for step in range(start_step + 1, t.steps + 1):
                t0 = time.perf_counter()
                problems = [next(stream) for _ in range(t.train_batch_size)]
                data_pos += t.train_batch_size
                gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
                data = engine.train_step(problems, gen)
                if (t.val_every and step % t.val_every == 0) or step == t.steps:
                    tv = time.perf_counter()
                    last_val = engine.validate(seed * 7_919 + step)
                    data.update(last_val)
                    data[M.TIMING_TESTING] = time.perf_counter() - tv
                data[M.TIMING_STEP] = time.perf_counter() - t0
                data[M.PERF_THROUGHPUT] = data[M.PERF_TOTAL_NUM_TOKENS] / max(data[M.TIMING_STEP], 1e-9)
                data[M.GLOBAL_STEP] = step
                record(data, step=step)
                loud = step % max(1, t.log_every) == 0 or any(k.startswith(M.VAL_CORE_PREFIX) for k in data)
                log.info(_step_summary(step, data), extra={"console": console and loud and not progress})
                if (t.save_every and step % t.save_every == 0) or step == t.steps:
                    _save_checkpoint(run_dir, step, engine, data_pos, t.keep_checkpoints)
                write_status(run_dir, "running", step, t.steps)
                val_txt = " ".join(f"{v:.2f}" for k, v in last_val.items() if M.VAL_ACC_RE.match(k)) or "-"
                bar.advance(status=f"score {data.get(M.SCORE_MEAN, float('nan')):.3f} val {val_txt}")
        failed = False
        return {"step": t.steps, "resumed": ckpt is not None, **last_val}
    finally:
        writer.close()
        trackers.close(failed=failed)


def main() -> None:
    """Hydra entry point (``python -m predmask.rl.train``)."""
    import hydra

    store_schemas()

    @hydra.main(config_path="pkg://conf", config_name="train", version_base=None)
    def _app(cfg: DictConfig) -> None:
        try:
            run(cfg)
        except (ValueError, RunDirBusyError) as exc:  # bad input, or a live trainer on run_dir: one line, exit 2
            print(f"error: {exc}", file=sys.stderr)
            sys.exit(2)

    _app()


if __name__ == "__main__":
    main()
