"""Atomic file writes, and the run directory's writer lock: every file a job leaves behind is whole or absent, and
one process at a time writes a run directory."""

from __future__ import annotations

import fcntl
import os
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = [
    "DEAD",
    "RUN_LOCK_FILE",
    "RunDirBusyError",
    "atomic_write",
    "atomic_write_text",
    "hold_run_lock",
    "run_status",
    "run_writer_alive",
]

#: the lock file of a run directory; the process writing the run directory holds an exclusive flock on it
RUN_LOCK_FILE = ".run.lock"
#: the status of a run whose status.json still says "running" while no process holds its lock (killed)
DEAD = "dead"


def atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """Call ``write(tmp)`` on a temporary file beside ``path``, then rename it over ``path`` in one step."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically, UTF-8 encoded."""
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


class RunDirBusyError(RuntimeError):
    """Another live process holds the run directory's writer lock (one line, naming its pid)."""


def _holder(fd: int) -> str:
    """``pid N`` (``pid N on HOST`` from another host) as the lock's holder wrote it, or ``pid unknown``."""
    words = os.pread(fd, 200, 0).decode(errors="replace").split()
    if len(words) >= 2 and words[0] == "pid":
        host = words[2] if len(words) >= 3 else None
        return f"pid {words[1]}" + (f" on {host}" if host and host != socket.gethostname() else "")
    return "pid unknown"


@contextmanager
def hold_run_lock(run_dir: Path) -> Iterator[None]:
    """Hold an exclusive flock on ``run_dir/.run.lock`` for the with-block (the run's writer, for its whole life).

    The lock file holds ``pid N HOST`` of the holder while it is held. Raises RunDirBusyError when another process
    holds it. The lock goes with the process: a SIGKILLed writer leaves it free (``run_writer_alive``).
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / RUN_LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirBusyError(
                f"run_dir {run_dir} is being written by another trainer ({_holder(fd)})"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} {socket.gethostname()}\n".encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)


def run_writer_alive(run_dir: Path) -> bool:
    """Whether some process holds ``run_dir``'s writer lock now (False when there is no lock file)."""
    try:
        fd = os.open(run_dir / RUN_LOCK_FILE, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def run_status(run_dir: Path, status: str) -> str:
    """The status a run directory's ``status.json`` gives, corrected for a dead writer: "running" with the writer
    lock free means the writer was killed, so the run is ``"dead"``; any other status is returned as it is."""
    if status == "running" and not run_writer_alive(run_dir):
        return DEAD
    return status
