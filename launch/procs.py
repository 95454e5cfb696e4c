"""Process, port and file-wait utilities of the jobs: process groups, pids by argument, free ports."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

POLL_S = 0.5


def free_port(ip: str) -> int:
    """A TCP port that is free on ``ip`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((ip, 0))
        return int(sock.getsockname()[1])


def wait_files(paths: Sequence[Path], timeout_s: float, give_up: Sequence[Path] = ()) -> bool:
    """True once every path exists; False after ``timeout_s`` or as soon as a ``give_up`` path exists."""
    deadline = time.monotonic() + timeout_s
    while True:
        if all(p.exists() for p in paths):
            return True
        if any(p.exists() for p in give_up) or time.monotonic() >= deadline:
            return all(p.exists() for p in paths)
        time.sleep(POLL_S)


def terminate_group(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM the process group of ``proc``; SIGKILL it after ``grace_s``."""
    kill_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        kill_group(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def kill_group(pgid: int, sig: int) -> None:
    """Send ``sig`` to a process group; nothing when it is gone or not ours."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def kill_pid(pid: int, sig: int) -> None:
    """Send ``sig`` to a process; nothing when it is gone or not ours."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def pids_using_dir(path: str) -> list[int]:
    """Pids of the processes with an argument that is ``path`` or lies under it (our job-and-rank-unique Ray
    temp dir: its session's raylet, GCS, agents and workers); ``/tmp/ray-1-r0-1`` never matches ``...-10``."""
    me, found = os.getpid(), []
    under, exact = (path.rstrip("/") + "/").encode(), (path.rstrip("/") + "\0").encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if under in cmdline or exact in cmdline:
            found.append(int(entry.name))
    return found
