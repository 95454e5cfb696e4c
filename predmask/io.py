"""Atomic file writes: every file a job leaves behind is whole or absent (the run directory's own files and its
writer lock: ``predmask.rundir``)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path


def atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """Call ``write(tmp)`` on a temporary file beside ``path``, then rename it over ``path`` in one step."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_dir(path: Path, write: Callable[[Path], object]) -> None:
    """Call ``write(tmp)`` to fill a new temporary folder beside ``path``, then rename it to ``path`` in one step. A
    folder already at ``path`` is replaced (moved aside just before the rename, deleted after); a failing ``write``
    leaves it as it was and no temporary folder behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    old = path.with_name(f".{path.name}.{os.getpid()}.old")
    for leftover in (tmp, old):
        shutil.rmtree(leftover, ignore_errors=True)
    try:
        tmp.mkdir()
        write(tmp)
        if path.exists():
            os.replace(path, old)
        try:
            os.replace(tmp, path)
        except OSError:
            if old.exists() and not path.exists():
                os.replace(old, path)
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically, UTF-8 encoded."""
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_synced(path: Path, data: bytes | memoryview, mode: str = "wb") -> None:
    """Write (``mode`` "ab": append) ``data`` to ``path`` and sync it to disk before returning."""
    with open(path, mode) as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
