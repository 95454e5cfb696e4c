"""The command job: a submitit callable that runs one argv in one task, records its exit status, and is
requeued (the same callable again) on preemption or time-out, the command resuming from its own checkpoints."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import submitit

from launch.procs import terminate_group
from launch.shell import check_env_name, shell_join
from launch.slurm import restart_count
from launch.warm_worker import WORKER_ENV, WorkerRun, start_in_worker
from predmask.io import atomic_write_text
from predmask.rundir import EXIT_STATUS_FILE


class CommandFailedError(RuntimeError):
    """The command of a job exited with a non-zero status."""


class JobInterrupted(BaseException):
    """Slurm sent SIGTERM (requeue, preemption, scancel) or submitit is requeueing after a time-out.

    A BaseException on purpose: submitit writes no result for it, so an interrupted attempt is never taken
    for the end of the run (the requeued attempt writes the result)."""


@dataclass
class InterruptFlag:
    """Whether SIGTERM arrived while :func:`interruptible` was active."""

    raised: bool = False


@contextmanager
def interruptible() -> Iterator[InterruptFlag]:
    """Note SIGTERM instead of dying on it; turn whatever happens after it into :class:`JobInterrupted`."""
    flag = InterruptFlag()

    def on_sigterm(signum: int, frame: Any) -> None:
        flag.raised = True
        print("launch: SIGTERM received, the job is being interrupted", file=sys.stderr, flush=True)

    try:
        previous = signal.signal(signal.SIGTERM, on_sigterm)
    except ValueError:  # not the main thread: leave signals alone
        previous = None
    try:
        yield flag
    except Exception as exc:
        if flag.raised:
            raise JobInterrupted(f"interrupted by SIGTERM ({type(exc).__name__}: {exc})") from exc
        raise
    else:
        if flag.raised:
            raise JobInterrupted("interrupted by SIGTERM")
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    """A job's JSON record, written atomically."""
    atomic_write_text(path, json.dumps(data, indent=1, default=str) + "\n")


@dataclass
class CommandJob(submitit.helpers.Checkpointable):
    """A submitit callable that runs ``command`` (an argv, never interpreted by a shell) once, in one task.

    ``run_dir``: its working directory, where ``exit_status.json`` is written too; ``env``: added to its
    environment (a RayJob exports it before ``ray start``); ``log_file``: its stdout/stderr, appended (None:
    the task log); ``check``: raise :class:`CommandFailedError` on a non-zero exit, after writing the status;
    ``stop_timeout_s``: the grace between SIGTERM and SIGKILL. Returns the exit status record, outcome
    ``completed``, ``failed``, ``error`` (could not run) or ``interrupted`` (SIGTERM or requeue: the job
    raises :class:`JobInterrupted` and submitit records no result)."""

    command: Sequence[str]
    run_dir: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    log_file: str | None = None
    check: bool = True
    stop_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if isinstance(self.command, (str, bytes)) or not self.command:
            raise ValueError(f"command must be a non-empty argv list, got {self.command!r}")
        self.command = [str(a) for a in self.command]
        self.env = {check_env_name(k): str(v) for k, v in self.env.items()}

    def __call__(self) -> dict[str, Any]:
        job_env = submitit.JobEnvironment()
        if job_env.num_tasks != 1:
            raise ValueError(
                f"CommandJob runs one task, got {job_env.num_tasks}: use RayJob for multi-node runs"
            )
        with interruptible() as interrupted, \
                self._recorded(str(job_env.job_id), restart_count(), interrupted) as record:
            record["returncode"] = self._run_command(extra_env={})
        return self._checked(record)

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        """Requeue the same callable; the command resumes from its own checkpoints in ``run_dir``."""
        return submitit.helpers.DelayedSubmission(self, *args, **kwargs)

    @contextmanager
    def _recorded(self, job_id: str, restart: int, flag: InterruptFlag,
                  rendezvous: Path | None = None) -> Iterator[dict[str, Any]]:
        """The exit status record of the block, written to ``run_dir`` (and ``rendezvous``) however the block
        ends."""
        record: dict[str, Any] = {"job_id": job_id, "restart": restart, "command": list(self.command),
                                  "returncode": None, "outcome": None, "started": time.time(),
                                  "finished": None, "error": None}
        exc: BaseException | None = None
        try:
            yield record
        except BaseException as err:  # SystemExit from submitit's time-out handler included
            exc = err
            raise
        finally:
            record["finished"] = time.time()
            if flag.raised or isinstance(exc, (SystemExit, KeyboardInterrupt, JobInterrupted)):
                record["outcome"] = "interrupted"
            elif exc is not None or record["returncode"] is None:
                record["outcome"] = "error"
            else:
                record["outcome"] = "completed" if record["returncode"] == 0 else "failed"
            if exc is not None:
                record["error"] = f"{type(exc).__name__}: {exc}"
            for folder in (rendezvous, self.run_dir):
                if folder is not None:
                    write_json(Path(folder) / EXIT_STATUS_FILE, record)

    def _run_command(self, extra_env: Mapping[str, str]) -> int:
        """Run the command to completion (in the warm worker that ``PREDMASK_WORKER`` names, if any: a run the
        worker lost runs again as its own process); on any interruption, end its whole process group."""
        env = {**os.environ, **self.env, **extra_env}
        worker = env.pop(WORKER_ENV, None)  # the warm worker's socket, not the command's
        cwd = None
        if self.run_dir is not None:
            Path(self.run_dir).mkdir(parents=True, exist_ok=True)
            cwd = self.run_dir
        proc = self._start(env, cwd, worker)
        try:
            code = proc.wait()
            if isinstance(proc, WorkerRun) and proc.lost:
                proc = self._start(env, cwd, None, note=f"launch: the warm worker lost run pid {proc.pid} (killed); "
                                                        "it runs again as its own process\n")
                code = proc.wait()
            return code
        finally:
            if proc.poll() is None:
                terminate_group(proc, self.stop_timeout_s)

    def _start(self, env: Mapping[str, str], cwd: str | None, worker: str | None,
               note: str = "") -> subprocess.Popen[bytes] | WorkerRun:
        """The command started, its output appended to the log file (else the task's): in ``worker`` when it takes
        it, else as a process in a session of its own; ``note`` is written to the log first."""
        out: Any = None
        if self.log_file is not None:
            Path(self.log_file).parent.mkdir(parents=True, exist_ok=True)
            # appended, never through a link (a job.log linked out of the run directory is refused: OSError ELOOP)
            out = os.fdopen(os.open(self.log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644), "ab")
        try:
            if note:
                (out or sys.stderr.buffer).write(note.encode())
                (out or sys.stderr.buffer).flush()
            fds = [0, *([out.fileno()] * 2 if out is not None else [1, 2])]
            return (worker and start_in_worker(worker, self.command, env=env, cwd=cwd, fds=fds)) or subprocess.Popen(
                self.command,
                env=env,
                cwd=cwd,
                stdout=out,
                stderr=subprocess.STDOUT if out else None,
                start_new_session=True,
            )
        finally:
            if out is not None:
                out.close()

    def _checked(self, record: dict[str, Any]) -> dict[str, Any]:
        if self.check and record["returncode"] != 0:
            raise CommandFailedError(
                f"command exited with status {record['returncode']}: {shell_join(self.command)[:300]}"
            )
        return record
