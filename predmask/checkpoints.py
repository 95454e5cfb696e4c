"""A run directory's checkpoints (``checkpoints/step_XXXXXX.pt``): written atomically, read as data only, the
newest readable one found on resume with an unreadable newer one moved aside, never deleted. Every trainer
that checkpoints and every reader of a saved model file goes through here."""

from __future__ import annotations

import errno
import io
import logging
import os
import pickle
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from predmask.io import atomic_write, write_synced
from predmask.rundir import CHECKPOINT_DIR, DamagedFileError, first_line

#: the suffix an unreadable checkpoint is renamed with (``step_000008.pt`` -> ``step_000008.pt.damaged``)
DAMAGED_SUFFIX = ".damaged"

#: errors of the file system, not of the file's bytes: a checkpoint that meets one is not moved aside
_ACCESS_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.ENOENT, errno.EISDIR})

#: what torch's data-only unpickler says when a file asks it to build a Python object (a GLOBAL: a function or class
#: by name, the way a pickle runs code); any other failure of it means bytes it cannot parse
_NAMES_AN_OBJECT = ("GLOBAL", "Can only create new object", "Can only build")


class CheckpointRefusedError(ValueError):
    """A file holding a Python object other than tensors and plain containers: it is not loaded (one line)."""


@dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint: its file, its step and its contents as saved."""

    path: Path
    step: int
    blob: dict[str, Any]


def checkpoint_path(run_dir: Path, step: int) -> Path:
    """``run_dir/checkpoints/step_XXXXXX.pt``: the checkpoint of ``step``."""
    return run_dir / CHECKPOINT_DIR / f"step_{step:06d}.pt"


def checkpoint_files(run_dir: Path) -> list[Path]:
    """The checkpoints of a run directory, oldest first (damaged ones, renamed, are not listed)."""
    d = run_dir / CHECKPOINT_DIR
    if not d.is_dir():
        return []
    steps = {p: int(m.group(1)) for p in d.glob("step_*.pt") if (m := re.fullmatch(r"step_(\d+)\.pt", p.name))}
    return sorted(steps, key=steps.__getitem__)


def save_checkpoint(run_dir: Path, step: int, blob: Mapping[str, Any], keep: int) -> Path:
    """Write ``blob`` (its ``step`` set to ``step``) as the checkpoint of ``step`` (a temporary file renamed over
    it: whole or absent), then delete all but the newest ``keep`` checkpoints. Returns the path."""
    path = checkpoint_path(run_dir, step)
    buffer = io.BytesIO()  # serialised first: a failed write is then an OSError naming the file (torch's own zip
    torch.save({**blob, "step": step}, buffer)  # writer reports a full disk as a RuntimeError without a name)
    try:
        atomic_write(path, lambda tmp: write_synced(tmp, buffer.getbuffer()))
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from None
    for old in checkpoint_files(run_dir)[:-max(1, keep)]:
        old.unlink(missing_ok=True)
    return path


def _refusal_detail(exc: pickle.UnpicklingError) -> str:
    """The line of torch's weights-only error that names what was refused (e.g. ``unsupported GLOBAL posix.system``)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    named = [ln for ln in lines if any(mark in ln for mark in _NAMES_AN_OBJECT)]
    return (named or lines[-1:])[0].split(". Please")[0].rstrip(".")


def load_data(path: Path) -> Any:
    """The contents of a torch file, loaded as data only (``weights_only=True``: tensors, numbers, strings and
    their containers). CheckpointRefusedError (one line naming the file) when it names any other Python
    object: nothing is run. DamagedFileError when its bytes are not a whole torch file; OSError when it cannot
    be opened."""
    try:
        with warnings.catch_warnings():  # torch warns about a foreign pickle protocol before refusing it
            warnings.simplefilter("ignore", UserWarning)
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if not any(mark in str(exc) for mark in _NAMES_AN_OBJECT):  # bytes it cannot parse: damaged, not hostile
            raise DamagedFileError(path, f"unreadable ({first_line(exc)})") from None
        raise CheckpointRefusedError(
            f"refused: {path} holds Python objects beyond tensors and plain containers ({_refusal_detail(exc)}); "
            "files are loaded as data only, so it was not loaded and nothing in it ran; delete it, or move it "
            "out of the run directory if you trust it and must inspect it"
        ) from None
    except OSError as exc:
        if exc.errno in _ACCESS_ERRNOS:
            raise
        raise DamagedFileError(path, f"unreadable ({first_line(exc)})") from None
    except (RuntimeError, EOFError, KeyError, ValueError, IndexError, AttributeError, TypeError) as exc:
        raise DamagedFileError(path, f"unreadable ({first_line(exc)})") from None


def _quarantine(path: Path) -> Path:
    """Rename ``path`` to ``<name>.damaged`` (``.damaged-2``, ... when taken); returns the new path."""
    target, n = path.with_name(path.name + DAMAGED_SUFFIX), 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}{DAMAGED_SUFFIX}-{n}")
    os.replace(path, target)
    return target


def latest_valid_checkpoint(run_dir: Path, log: logging.Logger) -> Checkpoint | None:
    """The newest checkpoint of ``run_dir`` that reads whole, or None when there is none.

    Each newer one that does not read is renamed to ``<name>.damaged`` (kept, never deleted) with one warning line on
    ``log``; a refused one (``CheckpointRefusedError``) stops the search: it is the caller's to report.
    """
    for path in reversed(checkpoint_files(run_dir)):
        try:
            blob = load_data(path)
            step = blob.get("step") if isinstance(blob, dict) else None
            if isinstance(step, bool) or not isinstance(step, int):
                raise DamagedFileError(path, "not a checkpoint (no integer 'step')")
            return Checkpoint(path, step, blob)
        except DamagedFileError as exc:
            moved = _quarantine(path)
            log.warning("%s: moved aside to %s (kept, not deleted); trying the next older checkpoint", exc, moved.name)
    return None
