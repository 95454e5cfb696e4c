"""The job a sweep submits for one CPU-engine run: the trainer as a subprocess, holding the run's lock."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import submitit

from sweeps.compose import RunSpec


def trainer_argv(spec: RunSpec, run_dir: Path, python: str | None = None) -> list[str]:
    """The CPU trainer's command line for a run: the sweep's own overrides plus the run directory."""
    return [python or sys.executable, "-m", "predmask.rl.train", *spec.overrides, f"run_dir={run_dir}"]


class TrainJob(submitit.helpers.Checkpointable):
    """Runs ``argv`` in ``run_dir`` as a child process; fails with the log's path when the trainer fails.

    Holds ``run_dir/.run.lock`` while the trainer runs, so a later sweep invocation can tell a live run from a
    dead one. On Slurm preemption or timeout submitit calls ``checkpoint`` and requeues this same job; the
    trainer resumes from its last checkpoint.
    """

    def __init__(self, argv: list[str], run_dir: str, threads: int = 1, env: dict[str, str] | None = None) -> None:
        self.argv = list(argv)
        self.run_dir = run_dir
        self.threads = threads
        self.env = dict(env or {})
        self._proc: subprocess.Popen[bytes] | None = None

    def __call__(self) -> int:
        path = Path(self.run_dir)
        path.mkdir(parents=True, exist_ok=True)
        lock_fd = os.open(path / ".run.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise RuntimeError(f"run {path} is already running in another process") from None
            env = {**os.environ, **self.env, "OMP_NUM_THREADS": str(self.threads),
                   "MKL_NUM_THREADS": str(self.threads), "PREDMASK_THREADS": str(self.threads)}
            log = path / "job.log"
            with open(log, "ab") as out:
                self._proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                              start_new_session=True)
                try:
                    rc = self._proc.wait()
                except BaseException:
                    self._stop_child()
                    raise
            if rc != 0:
                raise RuntimeError(f"trainer exited with status {rc}; log: {log}")
            return rc
        finally:
            os.close(lock_fd)

    def _stop_child(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        self._stop_child()
        return submitit.helpers.DelayedSubmission(TrainJob(self.argv, self.run_dir, self.threads, self.env))
