"""`python -m predmask.rl.train [hydra overrides]`: one GRPO training run of the CPU engine, resumable, e.g.

    python -m predmask.rl.train method=predmask_kl_agg model=cpu_s precision=bf16 delta=0.15 \\
        trainer.steps=200 seed=0 run_dir=runs/x

composes ``conf/train.yaml`` and writes the run directory (its files: README.md; their writer and parser:
:mod:`predmask.rundir`). The trainer holds the run directory's writer lock for its whole life. Started again
with the same config after any kind of death (SIGKILL included), a run resumes from its last checkpoint and
first truncates ``metrics.jsonl`` to the checkpoint's step, so the file ends with each step once. A run's
``seed`` draws its own stream of training prompts and seeds its sampling per step; the base model
(``base.seed``) and the evaluation splits (``task.seed``) are shared by every seed. So the same seed and
config give the same metrics on the same machine (all but the wall-clock metrics,
``predmask.metrics.wall_clock``).
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from predmask import metrics as M
from predmask.checkpoints import Checkpoint, checkpoint_files, latest_valid_checkpoint, save_checkpoint
from predmask.config import store_schemas
from predmask.console import error
from predmask.progress import progress as show_progress
from predmask.progress import report_phases
from predmask.rl.base import load_training_state, training_state
from predmask.rl.engine import Engine, prepare_config
from predmask.rl.task import STANDIN_LABEL, iter_train_prompts
from predmask.rl.trackers import Trackers, require_installed
from predmask.rundir import (
    CONFIG_FILE,
    LOG_FILE,
    METRICS_FILE,
    PHASE_FILE,
    STATUS_FILE,
    MetricsWriter,
    RunDirBusyError,
    cut_metrics,
    hold_run_lock,
    last_step,
    read_config,
    read_metrics,
    storage_problem,
    write_config,
    write_status,
)

#: config keys that may change between a run and its resumption (``trainer.steps`` only upwards: ``_check_steps``)
_RESUMABLE_KEYS = ({"trainer", "steps"}, {"trainer", "progress"}, {"trainer", "log_every"}, {"trainer", "logger"})
#: config keys that say where a run is, not what it is: a run directory moved with its runs root
#: (``mv runs runs2``, rerun with ``PREDMASK_RUNS=runs2``) resumes, and its config.yaml then names the new place
_LOCATION_KEYS = (("run_dir",),)

log = logging.getLogger("predmask.rl.train")


# ----------------------------------------------------------------------------------------------- config
def _diff_keys(a: Any, b: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[tuple[str, ...]] = []
        for k in sorted(set(a) | set(b)):
            out += _diff_keys(a.get(k), b.get(k), (*prefix, str(k)))
        return out
    return [] if a == b else [prefix]


def _check_identity(run_dir: Path, c: dict[str, Any]) -> None:
    """Refuse (ValueError, one line) when ``run_dir`` holds a run whose config differs from ``c`` in anything but
    the keys a resume may change (``_RESUMABLE_KEYS``) and where the run is (``_LOCATION_KEYS``)."""
    path = run_dir / CONFIG_FILE
    if not path.exists():
        return
    old = read_config(path)
    diffs = [d for d in _diff_keys(old, c) if set(d) not in _RESUMABLE_KEYS and d not in _LOCATION_KEYS]
    if diffs:
        names = ", ".join(".".join(d) for d in diffs[:6])
        raise ValueError(f"run_dir {run_dir} holds a run with a different config ({names}); use another run_dir")


def _check_steps(run_dir: Path, ckpt: Checkpoint | None, total: int) -> None:
    """A resume continues a run, it never shortens one: ``trainer.steps`` below the step its newest checkpoint
    reached would leave config.yaml saying fewer steps than status.json and metrics.jsonl hold (ValueError)."""
    if ckpt is not None and ckpt.step > total:
        raise ValueError(
            f"run_dir {run_dir} has reached step {ckpt.step} ({ckpt.path.name}) and trainer.steps={total} would "
            f"shorten it; a resume only continues a run: pass trainer.steps={ckpt.step} or more, or use another "
            f"run_dir for a {total}-step run (nothing was changed)"
        )


# ----------------------------------------------------------------------------------------------- logging
class _RunLogHandler(logging.FileHandler):
    """``train.log``: a line that cannot be written (a full disk) costs that line and one warning on stderr, never a
    traceback; the write that fails next in the run directory stops the run with its own line."""

    warned = False

    def handleError(self, record: logging.LogRecord) -> None:
        if not self.warned:
            self.warned = True
            exc = sys.exc_info()[1]
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            print(f"warning: cannot write {self.baseFilename}: {why}; its lines are lost until it can be written",
                  file=sys.stderr, flush=True)


@contextmanager
def run_logging(run_dir: Path, logger: logging.Logger | None = None) -> Iterator[None]:
    """In the block, ``train.log`` gets every line of ``logger`` (default: the trainer's); the console
    (stdout) the same minus the quiet lines (logged with ``extra={"console": False}``)."""
    target = log if logger is None else logger
    file_handler = _RunLogHandler(run_dir / LOG_FILE, mode="a")
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    console = logging.StreamHandler(sys.stdout)
    console.setFormatter(logging.Formatter("[predmask.rl] %(message)s"))
    console.addFilter(lambda record: bool(getattr(record, "console", True)))
    target.setLevel(logging.INFO)
    target.propagate = False
    for h in (file_handler, console):
        target.addHandler(h)
    try:
        yield
    finally:
        for h in (file_handler, console):
            target.removeHandler(h)
            h.close()


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
def run(cfg: DictConfig | Mapping[str, Any]) -> dict[str, Any]:
    """Train one run to ``trainer.steps`` (resuming if its run_dir has a checkpoint); returns a summary dict."""
    c = prepare_config(cfg)
    require_installed(c["trainer"].get("logger", ()))  # a tracker the run asks for is importable here
    run_dir = Path(c["run_dir"])
    with hold_run_lock(run_dir):  # before anything is written: a second trainer on run_dir refuses, touching nothing
        return _run_locked(c, run_dir)


def _run_locked(c: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    _check_identity(run_dir, c)  # before anything is written: a different run here is refused, untouched
    total = int(c["trainer"]["steps"])
    with run_logging(run_dir):
        ckpt = latest_valid_checkpoint(run_dir, log)  # unreadable newer ones moved aside, with a warning line
        _check_steps(run_dir, ckpt, total)
        write_config(run_dir, c)
        try:
            return _start(c, run_dir, ckpt, total)
        except BaseException as exc:
            record_failure(run_dir, total, exc)
            raise


def _start(c: dict[str, Any], run_dir: Path, ckpt: Checkpoint | None, total: int) -> dict[str, Any]:
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
    with report_phases(run_dir / PHASE_FILE):  # a sweep shows the base model's pretraining, not step 0
        engine = Engine(c, progress=progress)
    log.info("policy: %d parameters, vocabulary %d; base model %s (train acc %.3f, %s)",
             engine.n_parameters, engine.tokenizer.vocab_size, engine.base_info.get("cache_path"),
             engine.base_info.get("train_acc", float("nan")),
             "built now" if engine.base_info.get("built") else "from cache")
    summary = _train(engine, c, run_dir, ckpt, progress)
    write_status(run_dir, "completed", summary["step"], total)
    log.info("completed at step %d", summary["step"])
    return summary


def _failure_text(run_dir: Path, exc: BaseException) -> str:
    """One line for a run's end by ``exc``: the Ctrl-C line, a storage problem with its remedy, or the error."""
    if isinstance(exc, KeyboardInterrupt):
        files = checkpoint_files(run_dir)
        since = f" (newest checkpoint: {files[-1].name})" if files else " (no checkpoint yet: it restarts from step 0)"
        return (f"interrupted: run_dir {run_dir} stopped at step {last_step(run_dir)}{since}; rerun the same command "
                "to resume it")
    if isinstance(exc, OSError) and (line := storage_problem(exc, run_dir)):
        return line
    return f"{type(exc).__name__}: {exc}"


@contextmanager
def _sigint_ignored(ignore: bool) -> Iterator[None]:
    """SIGINT ignored in the block (when ``ignore``, and in the main thread, where handlers live); restored after."""
    if not ignore or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def record_failure(run_dir: Path, total: int, exc: BaseException, logger: logging.Logger = log) -> None:
    """status.json says "failed" and why, and train.log gets the line (a traceback only for an unexpected error):
    the trainer's and every variational stage's end by ``exc``. When status.json cannot be written the reason is
    added to ``exc``'s notes, which :func:`failure_exit` prints."""
    text = _failure_text(run_dir, exc)
    step = last_step(run_dir)
    with _sigint_ignored(isinstance(exc, KeyboardInterrupt)):  # a second Ctrl-C does not cut the record short
        try:
            write_status(run_dir, "failed", step, total, error=text)
        except OSError as status_exc:
            exc.add_note(f"{STATUS_FILE} could not record it: {storage_problem(status_exc, run_dir) or status_exc}")
    expected = isinstance(exc, (ValueError, KeyboardInterrupt)) or (
        isinstance(exc, OSError) and storage_problem(exc, run_dir) is not None)
    if expected:
        logger.error("failed at step %d: %s", step, text, extra={"console": False})
    else:
        logger.exception("failed at step %d", step)


def due(step: int, every: int, last: int) -> bool:
    """Whether a step-interval event (validation, checkpoint; ``every`` 0: only at the end) falls on ``step``."""
    return bool(every and step % every == 0) or step == last


def _resume(engine: Engine, run_dir: Path, ckpt: Checkpoint | None) -> tuple[int, int]:
    """Load ``ckpt`` into the engine (none: a fresh start) and cut ``metrics.jsonl`` to its step: (the step, the
    data position) to continue from."""
    start_step, data_pos = 0, 0
    if ckpt is not None:
        load_training_state(ckpt.blob, engine.model, engine.optimizer)
        engine.sync_rollout()
        start_step, data_pos = ckpt.step, int(ckpt.blob["data_position"])
        log.info("resumed from %s (step %d)", ckpt.path.name, start_step)
    cut_metrics(run_dir, None if ckpt is None else start_step, log)
    return start_step, data_pos


def _train(engine: Engine, c: dict[str, Any], run_dir: Path, ckpt: Checkpoint | None,
           progress: bool) -> dict[str, Any]:
    t = engine.trainer_cfg
    seed = int(c["seed"])
    metrics_path = run_dir / METRICS_FILE
    start_step, data_pos = _resume(engine, run_dir, ckpt)
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
            val = engine.validate_base(seed * 7_919)  # the other methods of this setting and seed share it
            val[M.TIMING_TESTING] = time.perf_counter() - t0
            record({**val, M.GLOBAL_STEP: 0}, step=0)
            last_val = val
            log.info(_step_summary(0, val), extra={"console": console})
        stream = iter_train_prompts(engine.task, start=data_pos, replicate=seed)  # each seed its own stream

        title = f"GRPO {engine.method_name} {engine.model_cfg['name']} {engine.precision.name}"
        with show_progress(title, total=t.steps, completed=start_step, unit="steps", bar=progress) as bar:
            data: dict[str, Any] = {}
            for step in range(start_step + 1, t.steps + 1):
                t0 = time.perf_counter()
                problems = [next(stream) for _ in range(t.train_batch_size)]
                data_pos += t.train_batch_size
                gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
                data = engine.train_step(problems, gen)
                if due(step, t.val_every, t.steps):
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
                if due(step, t.save_every, t.steps):
                    blob = {"data_position": data_pos, **training_state(engine.model, engine.optimizer)}
                    save_checkpoint(run_dir, step, blob, t.keep_checkpoints)
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
        except BaseException as exc:
            code = failure_exit(exc, Path(str(cfg.get("run_dir"))))
            if code is None:
                raise
            sys.exit(code)

    _app()


def failure_exit(exc: BaseException, run_dir: Path) -> int | None:
    """How a run's command (the trainer, a variational stage) ends on ``exc``, after printing its one line on stderr
    with ``exc``'s notes: bad input or a live writer on run_dir ``error: ...``, 2; Ctrl-C the line saying how to
    resume, 130; a full disk or a read-only file system ``error: ...`` naming the file and the remedy, 1. None for
    any other error: its traceback is the report."""
    if isinstance(exc, (ValueError, RunDirBusyError)):
        line, code = str(exc), 2
    elif isinstance(exc, KeyboardInterrupt):
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # the process is ending: a second Ctrl-C changes nothing
        line, code = _failure_text(run_dir, exc), 130
    elif isinstance(exc, OSError) and (problem := storage_problem(exc, run_dir)) is not None:
        line, code = problem, 1
    else:
        return None
    line += "".join(f"; {n}" for n in getattr(exc, "__notes__", ()))
    if code == 130:
        print(line, file=sys.stderr, flush=True)
    else:
        error(line)
    return code


if __name__ == "__main__":
    main()
