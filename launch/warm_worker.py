"""A warm worker for local runs: one process imports the CPU engine once and forks a child per run, so the
runs of a local sweep skip the seconds of imports that each ``python -m predmask.rl.train`` pays.

:func:`local_worker` starts ``python -m launch.warm_worker SOCKET ROOT MODULE...`` (its own session, the
socket in a private temporary folder) for the length of a sweep; a CommandJob whose environment names the
socket (``PREDMASK_WORKER``) hands it a command ``<this python> -m MODULE ARGS``. Per run the worker forks a
watcher, which forks the run's child and reports its pid, then its exit status. The child runs what
``python -m MODULE ARGS`` runs, in a session of its own, with the job's directory, environment and file
descriptors (passed over the socket): a killed child is a killed trainer, which resumes as any run does. The
worker itself never runs torch work (a fork after parallel work is unsafe). ROOT is in every child's command
line, so ``launch.procs.pids_using_dir(ROOT)`` finds them. The worker exits when its stdin closes; a run whose
watcher died without its exit status is stopped and marked ``lost``, and the job runs it again as its own
process."""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import resource
import runpy
import selectors
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from launch.procs import kill_group

#: the environment variable that holds a worker's socket path (set in a local run's job environment)
WORKER_ENV = "PREDMASK_WORKER"
_MAX_MESSAGE = 1 << 20


def worker_module(command: Sequence[str]) -> tuple[str, list[str]] | None:
    """``(MODULE, ARGS)`` of a command ``<this interpreter> -m MODULE ARGS`` (what a worker can run), else None."""
    if len(command) >= 3 and command[0] == sys.executable and command[1] == "-m":
        return command[2], list(command[3:])
    return None


class WorkerRun:
    """A run in the worker, used as a ``subprocess.Popen``: ``pid`` (its session), ``poll()``, ``wait(timeout)``;
    ``cpu_s``: the CPU seconds its process used, once it has ended. ``lost``: its watcher ended without the exit
    status (the worker's processes were killed); the run's session was then killed (``returncode`` -SIGKILL)."""

    def __init__(self, sock: socket.socket, pid: int) -> None:
        self.sock, self.pid, self.returncode, self.cpu_s, self.lost = sock, pid, None, float("nan"), False

    def poll(self) -> int | None:
        return self.wait(timeout=0) if self.returncode is None else self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.sock.settimeout(timeout)
            try:
                message = self.sock.recv(_MAX_MESSAGE)
            except (TimeoutError, BlockingIOError):
                if timeout == 0:
                    return None  # type: ignore[return-value]  # poll(): still running
                raise subprocess.TimeoutExpired(f"worker run {self.pid}", timeout or 0) from None
            if message:
                status = json.loads(message)
                self.returncode, self.cpu_s = int(status["returncode"]), float(status["cpu_s"])
            else:  # no watcher to report it: the run may still be going, unwatched; it ends here
                _kill_session(self.pid)
                self.returncode, self.lost = -signal.SIGKILL, True
            self.sock.close()
        return self.returncode


def _kill_session(sid: int, timeout_s: float = 30.0) -> None:
    """SIGKILL the session ``sid`` (a run's child leads its own), and wait until none of its processes runs."""
    kill_group(sid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while _running_in_session(sid):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the processes of run pid {sid} outlived SIGKILL for {timeout_s:.0f} s")
        time.sleep(0.05)


def _running_in_session(sid: int) -> bool:
    """Whether a process of session ``sid`` runs (a zombie, awaiting its parent's wait, does not)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid pgrp session
        except (OSError, IndexError):
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            return True
    return False


def start_in_worker(path: str, command: Sequence[str], *, env: Mapping[str, str], cwd: str | None,
                    fds: Sequence[int]) -> WorkerRun | None:
    """Start ``command`` in the worker at socket ``path`` with stdin, stdout, stderr ``fds``; None when the worker
    cannot take it (not a ``-m`` command of this interpreter, or no worker listening): the caller starts a process."""
    parsed = worker_module(command)
    if parsed is None:
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(path)
        request = {"module": parsed[0], "args": parsed[1], "env": dict(env), "cwd": cwd or os.getcwd()}
        socket.send_fds(sock, [json.dumps(request).encode()], list(fds))
        pid = int(json.loads(sock.recv(_MAX_MESSAGE))["pid"])
    except (OSError, ValueError, KeyError):
        sock.close()
        return None
    except BaseException:  # interrupted before the pid came: the watcher, unable to send it, stops the run
        sock.close()
        raise
    return WorkerRun(sock, pid)


@contextlib.contextmanager
def local_worker(root: Path, preload: Sequence[str], env: Mapping[str, str] | None = None) -> Iterator[str | None]:
    """A worker for the length of the block, importing ``preload`` (module names); yields its socket path (None
    when it did not start: the runs then start their own processes). ``env`` is added to its environment (the
    jobs' thread settings, read by the math libraries when the worker imports them)."""
    folder = Path(tempfile.mkdtemp(prefix="predmask-worker-"))  # private (0700): only this user can connect
    path = folder / "socket"
    proc = subprocess.Popen([sys.executable, "-m", __name__, str(path), str(root), *preload],
                            env={**os.environ, **(env or {})}, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60  # it listens before it imports: the socket comes at once, or never
        while not path.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        yield str(path) if path.exists() and proc.poll() is None else None
    finally:
        assert proc.stdin is not None
        proc.stdin.close()  # the worker's signal to exit; runs in flight go on in their own sessions
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(folder, ignore_errors=True)


def time_start_up(command: Sequence[str], preload: Sequence[str], repeats: int = 3) -> dict[str, float]:
    """Median CPU seconds of ``command`` (a ``-m`` command that exits at once, e.g. ``--help``) run ``repeats``
    times as its own process (``process_s``) and as a child of a warm worker importing ``preload`` (``worker_s``);
    the benchmark of ``python scripts/benchmark.py engine``."""
    def own() -> float:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime

    process = [own() for _ in range(repeats)]
    worker: list[float] = []
    with tempfile.TemporaryDirectory() as tmp, local_worker(Path(tmp), preload) as path, \
            open(os.devnull, "wb") as null:
        for _ in range(repeats):
            run = path and start_in_worker(path, command, env=os.environ, cwd=tmp, fds=[0, null.fileno(), null.fileno()])
            if not run or run.wait() != 0:
                raise RuntimeError(f"the warm worker did not run {' '.join(command)}")
            worker.append(run.cpu_s)
    return {"process_s": statistics.median(process), "worker_s": statistics.median(worker)}


# ------------------------------------------------------------------------------------------------- the worker
def _exit_code(code: Any) -> int:
    """The exit status ``sys.exit(code)`` gives a process."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF  # as the OS keeps it (sys.exit(-1): 255)
    print(code, file=sys.stderr)
    return 1


def _run_module(module: str, args: list[str]) -> int:
    """What ``python -m MODULE ARGS`` does, in this process; its exit status (-SIGINT: an uncaught Ctrl-C, which
    the interpreter ends by its own SIGINT)."""
    sys.argv = [module, *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        return _exit_code(exc.code)
    except BaseException as exc:  # noqa: BLE001 - uncaught: its traceback, then status 1, as the interpreter ends
        traceback.print_exc()
        return -signal.SIGINT if isinstance(exc, KeyboardInterrupt) else 1
    return 0


def _child(request: dict[str, Any], fds: list[int]) -> None:
    """The run's process (forked): its session, descriptors, directory, environment; the module; exit."""
    code = 1
    try:
        os.setsid()
        for target, fd in enumerate(fds[:3]):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.path[0] = request["cwd"]  # as ``python -m`` started in that directory
        sys.modules.pop(request["module"], None)  # run as ``__main__`` from its source, its imports already loaded
        code = _run_module(request["module"], request["args"])
    except BaseException:  # noqa: BLE001 - the run could not start here: its traceback in its log, status 1
        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        if code < 0:
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        os._exit(code)


def _watch(conn: socket.socket) -> None:
    """The watcher (forked per run): forks the run's child, reports its pid, then its exit status; exits."""
    try:
        request_bytes, fds, _flags, _addr = socket.recv_fds(conn, _MAX_MESSAGE, 3)
        pid = os.fork()
        if pid == 0:
            conn.close()
            _child(json.loads(request_bytes), fds)
        for fd in fds:
            os.close(fd)
        try:
            conn.send(json.dumps({"pid": pid}).encode())
        except OSError:  # the job went away before it learnt the pid: nobody else can stop the run
            os.killpg(pid, signal.SIGTERM)
        _pid, status, usage = os.wait4(pid, 0)
        with contextlib.suppress(OSError):  # the job may be gone (interrupted): nobody to tell
            conn.send(json.dumps({"returncode": os.waitstatus_to_exitcode(status),
                                  "cpu_s": usage.ru_utime + usage.ru_stime}).encode())
    finally:
        os._exit(0)


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: python -m launch.warm_worker SOCKET ROOT [MODULE ...]", file=sys.stderr)
        return 2
    path = argv[0]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)  # runs that arrive while the modules import wait here
    for module in argv[2:]:
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001 - a child imports it again and fails with its own error in its log
            traceback.print_exc()
    events = selectors.DefaultSelector()
    events.register(listener, selectors.EVENT_READ)
    events.register(sys.stdin, selectors.EVENT_READ)
    while True:
        for key, _ in events.select(timeout=1.0):
            if key.fileobj is sys.stdin:
                return 0  # the sweep closed our stdin (or died)
            conn, _addr = listener.accept()
            sys.stdout.flush()
            sys.stderr.flush()
            if os.fork() == 0:
                events.close()
                listener.close()
                _watch(conn)
            conn.close()
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
