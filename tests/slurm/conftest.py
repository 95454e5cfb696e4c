"""Fixtures of the Slurm integration tests: the emulated cluster (scripts/slurm-emulated.sh), its cluster
config, and per-test cleanup of submitted jobs and of the Ray processes they started.

When the cluster is not reachable through ``sinfo`` the ``slurm`` tests are skipped with the reason, except
under ``CI=true``, where they fail: CI must start the cluster before the tests.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
CLUSTER_YAML = REPO / "conf" / "cluster" / "slurm_emulated.yaml"
STANDIN = Path(__file__).resolve().parent / "ray_standin.py"
@pytest.fixture
def cluster_cfg(slurm_cluster: dict[str, Any]) -> dict[str, Any]:
    """conf/cluster/slurm_emulated.yaml as a plain dict (tests narrow it, e.g. to one node)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(CLUSTER_YAML), resolve=True)  # type: ignore[return-value]


@dataclass
class JobTracker:
    """Remembers submitted jobs; waits on them with a deadline; cancels and cleans them up at teardown."""

    jobs: list[Any] = field(default_factory=list)

    def track(self, job: Any) -> Any:
        self.jobs.append(job)
        return job

    def wait(self, job: Any, timeout_s: float) -> Any:
        """Rank 0's result, with a deadline (submitit cannot see a dead job without sacct: we bound the wait).
        Multi-task jobs need job.results() (job.result() refuses them): rank 0 is results()[0]."""
        deadline = time.monotonic() + timeout_s
        while not job.done():
            if time.monotonic() > deadline:
                state = squeue_state(job.job_id)
                pytest.fail(
                    f"job {job.job_id} not done after {timeout_s:.0f} s (squeue: {state!r})\n"
                    f"--- stdout tail ---\n{_tail(job.stdout())}\n--- stderr tail ---\n{_tail(job.stderr())}"
                )
            time.sleep(0.5)
        return job.results()[0]

    def state(self, job: Any) -> str:
        """The job's Slurm state from squeue ('' once it has left the queue)."""
        return squeue_state(job.job_id)

    def kill_ray(self, job: Any) -> None:
        """Remove what the job's Ray nodes left (an attempt killed by Slurm cannot clean up after itself)."""
        kill_ray_of_job(str(job.job_id).split("_")[0])

    def cleanup(self) -> None:
        for job in self.jobs:
            main_id = str(job.job_id).split("_")[0]
            if squeue_state(job.job_id):
                subprocess.run(["scancel", main_id], check=False, capture_output=True)
            kill_ray_of_job(main_id)


def squeue_state(job_id: str) -> str:
    out = subprocess.run(
        ["squeue", "-h", "-j", str(job_id), "-o", "%T"], capture_output=True, text=True, check=False
    )
    return out.stdout.strip()


def kill_ray_of_job(job_id: str) -> None:
    """Kill the Ray processes a job of ours left behind (their command lines name the job's temp dirs)."""
    needle = f"/tmp/ray-{job_id}-".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "cmdline").read_bytes():
                os.kill(int(entry.name), signal.SIGKILL)
        except OSError:
            continue
    for path in Path("/tmp").glob(f"ray-{job_id}-*"):
        shutil.rmtree(path, ignore_errors=True)


def _tail(text: str | None, n: int = 25) -> str:
    return "\n".join((text or "").splitlines()[-n:])


@pytest.fixture
def standin() -> Callable[..., list[str]]:
    """argv of the stand-in trainer (tests/slurm/ray_standin.py) in one of its modes."""

    def argv(mode: str, *args: str) -> list[str]:
        return [sys.executable, str(STANDIN), mode, *args]

    return argv


@pytest.fixture
def jobs(slurm_cluster: dict[str, Any]) -> Iterator[JobTracker]:
    tracker = JobTracker()
    yield tracker
    tracker.cleanup()
