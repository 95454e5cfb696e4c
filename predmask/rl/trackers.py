"""Experiment trackers of a training run (verl's ``trainer.logger``): the names, where each writes in a run directory,
the W&B run id a resumed run keeps, and the CPU engine's TensorBoard and W&B writers (their use: README.md).

``metrics.jsonl`` is the record and the trackers mirror it: each attempt first hands a tracker the lines the
file already holds that the tracker lacks, then every new step after its line is synced. So a tracker turned
on at a resumption, or one whose files a kill cut short (W&B's service process drops what it has not written
when its parent is killed), still shows every step once. A tracker that fails is reported once and dropped for
the rest of the attempt; no tracker can cost a line of ``metrics.jsonl``.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import secrets
import string
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

from predmask.io import atomic_write_text

#: the optional trackers and the module each needs
_EXTRA_MODULES: dict[str, str] = {"tensorboard": "tensorboard", "wandb": "wandb"}
EXTRA_HINT = "pip install -e '.[trackers]'"
#: TensorBoard's event directory inside a run directory, and verl's variable that replaces it
TENSORBOARD_SUBDIR = "tensorboard"
TENSORBOARD_ENV = "TENSORBOARD_DIR"
#: the file holding a run's W&B id, and W&B's own variable for the directory its files go under
WANDB_ID_FILE = "wandb_id"
WANDB_DIR_ENV = "WANDB_DIR"
#: the W&B project of a CPU run (``$WANDB_PROJECT`` instead when set)
WANDB_PROJECT = "predmask"
_ID_ALPHABET = string.ascii_lowercase + string.digits

log = logging.getLogger("predmask.rl.train")


def require_installed(loggers: Iterable[str]) -> None:
    """One ValueError line naming the extra when a requested optional tracker cannot be imported."""
    for name in loggers:
        module = _EXTRA_MODULES.get(name)
        if module is None:
            continue
        try:
            importlib.import_module(module)
        except ImportError:
            raise ValueError(
                f"trainer.logger asks for {name}, which is not installed: it is the optional extra 'trackers' "
                f"({EXTRA_HINT})"
            ) from None


def tensorboard_dir(run_dir: Path, environ: Mapping[str, str] = os.environ) -> Path:
    """Where a run's TensorBoard event files go: ``$TENSORBOARD_DIR`` when set (verl's rule), else
    ``<run_dir>/tensorboard``."""
    return Path(environ.get(TENSORBOARD_ENV) or run_dir / TENSORBOARD_SUBDIR)


def wandb_dir(run_dir: Path, environ: Mapping[str, str] = os.environ) -> Path:
    """The directory W&B writes its ``wandb/`` folder under: ``$WANDB_DIR`` when set, else the run directory."""
    return Path(environ.get(WANDB_DIR_ENV) or run_dir)


def wandb_run_id(run_dir: Path) -> str:
    """The run's W&B id: read from ``<run_dir>/wandb_id``, or made (8 lowercase letters and digits, as W&B's own)
    and written atomically on first use. The caller holds the run directory's writer lock."""
    path = run_dir / WANDB_ID_FILE
    if path.is_file():
        run_id = path.read_text().strip()
        if run_id and all(ch.isalnum() or ch in "-_" for ch in run_id):
            return run_id
        raise ValueError(f"{path} holds {run_id!r}, not a W&B run id (letters, digits, '-', '_'); fix or delete it")
    run_id = "".join(secrets.choice(_ID_ALPHABET) for _ in range(8))
    atomic_write_text(path, run_id + "\n")
    return run_id


class _Tracker(Protocol):
    next_step: int  # the first step this tracker lacks (the replay starts there)

    def log(self, data: Mapping[str, float], step: int) -> None: ...

    def close(self, failed: bool) -> None: ...


class _TensorBoard:
    """verl's TensorBoard adapter (``add_scalar`` per metric at the step), flushed every step; opened with
    ``purge_step=0``, which hides every earlier attempt's events from TensorBoard (the history is replayed)."""

    def __init__(self, directory: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        directory.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(str(directory), purge_step=0)
        self.next_step = 0

    def log(self, data: Mapping[str, float], step: int) -> None:
        for key, value in data.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self, failed: bool) -> None:
        self.writer.close()


class _WandB:
    """One W&B run per run directory: the id of ``wandb_id``, resumed when it exists (``resume="allow"``)."""

    def __init__(self, run_dir: Path, config: Mapping[str, Any]) -> None:
        import wandb

        directory = wandb_dir(run_dir)
        directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or WANDB_PROJECT, name=run_dir.name,
                              id=wandb_run_id(run_dir), resume="allow", dir=str(directory), config=dict(config))
        self.next_step = int(self.run.step)  # W&B's step of the next log: what the run already has ends before it

    def log(self, data: Mapping[str, float], step: int) -> None:
        self.run.log(dict(data), step=step)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


def _numeric(data: Mapping[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in data.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}


class Trackers:
    """The optional trackers of one training attempt; ``log`` after the step's ``metrics.jsonl`` line is synced."""

    def __init__(self, trackers: Mapping[str, _Tracker]) -> None:
        self._trackers = dict(trackers)

    @classmethod
    def open(cls, loggers: Iterable[str], run_dir: Path, config: Mapping[str, Any],
             history: Iterable[Mapping[str, Any]] = ()) -> Trackers:
        """Open the optional trackers named in ``loggers`` and replay to each the ``history`` records (the
        ``{"step", "data"}`` lines of ``metrics.jsonl`` so far) it lacks."""
        openers = {
            "tensorboard": lambda: _TensorBoard(tensorboard_dir(run_dir)),
            "wandb": lambda: _WandB(run_dir, config),
        }
        opened: dict[str, _Tracker] = {}
        for name in loggers:
            if name in openers:
                try:
                    opened[name] = openers[name]()
                except Exception as exc:  # noqa: BLE001 - a tracker never stops training
                    log.warning("%s disabled for this attempt (metrics.jsonl is unaffected): %s: %s",
                                name, type(exc).__name__, exc)
        trackers = cls(opened)
        for record in sorted(history, key=lambda r: r["step"]):
            trackers.log(record["data"], record["step"], replay=True)
        return trackers

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._trackers)

    def log(self, data: Mapping[str, Any], step: int, replay: bool = False) -> None:
        """Hand the step's finite numeric metrics to every open tracker (``replay``: only to those that lack the
        step); one that raises is reported and dropped."""
        values = _numeric(data)
        for name, tracker in list(self._trackers.items()):
            if replay and step < tracker.next_step:
                continue
            try:
                tracker.log(values, step)
            except Exception as exc:  # noqa: BLE001 - a tracker never stops training
                log.warning("%s failed at step %d and is dropped for this attempt (metrics.jsonl is unaffected): "
                            "%s: %s", name, step, type(exc).__name__, exc)
                self._close(name, failed=True)

    def close(self, failed: bool = False) -> None:
        for name in list(self._trackers):
            self._close(name, failed)

    def _close(self, name: str, failed: bool) -> None:
        tracker = self._trackers.pop(name)
        try:
            tracker.close(failed)
        except Exception as exc:  # noqa: BLE001 - a tracker never stops training
            log.warning("%s did not close cleanly: %s: %s", name, type(exc).__name__, exc)
