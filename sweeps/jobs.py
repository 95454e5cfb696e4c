"""The job a sweep submits for one CPU-engine run: the trainer as a subprocess, holding the run's lock."""

from __future__ import annotations

import fcntl
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sweeps.compose import RunSpec
from sweeps.launch.command_job import CommandJob


def trainer_argv(spec: RunSpec, run_dir: Path, python: str | None = None) -> list[str]:
    """The CPU trainer's command line for a run: the sweep's own overrides plus the run directory."""
    return [python or sys.executable, "-m", "predmask.rl.train", *spec.overrides, f"run_dir={run_dir.resolve()}"]


@dataclass
class TrainJob(CommandJob):
    """A single-task job running the CPU trainer, holding ``run_dir/.run.lock`` while it runs.

    The lock lets a later sweep invocation tell a live run from a dead one (``sweeps.runs.run_is_live``).
    Requeue on preemption or timeout is CommandJob's: the same job again, and the trainer resumes from its
    last checkpoint.
    """

    def __call__(self) -> dict[str, Any]:
        assert self.run_dir is not None
        path = Path(self.run_dir)
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path / ".run.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise RuntimeError(f"run {path} is already running in another process") from None
            return super().__call__()
        finally:
            os.close(fd)
