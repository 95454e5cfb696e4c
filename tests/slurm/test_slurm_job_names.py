"""A sweep's job as a cluster user sees it: submitted through the sweep's own executor to the real emulated Slurm,
its name in squeue is ``predmask-<sweep>-<run_id>``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from launch.command_job import CommandJob
from sweeps.families import expand
from sweeps.submit import make_executor

pytestmark = pytest.mark.slurm

WAIT_FOR = "import pathlib, sys, time\nd = time.time() + 120\nwhile not pathlib.Path(sys.argv[1]).exists() and time.time() < d: time.sleep(0.2)"


def test_a_sweep_job_is_named_after_its_sweep_and_run(tmp_path: Path, jobs: Any) -> None:
    (spec,) = expand("smoke", ["method=dppo_topk_kl", "cluster=slurm_emulated"])
    release = tmp_path / "release"
    job = jobs.track(make_executor(spec, tmp_path / "submitit").submit(
        CommandJob(command=[sys.executable, "-c", WAIT_FOR, str(release)], run_dir=str(tmp_path / "run"))))
    try:  # the job waits for the release file, so it is still in the queue now
        shown = subprocess.run(["squeue", "-h", "-j", str(job.job_id), "-o", "%j"], capture_output=True,
                               text=True, check=True).stdout.strip()
    finally:
        release.touch()
    assert shown == f"predmask-smoke-{spec.run_id}"
    assert jobs.wait(job, timeout_s=180)["outcome"] == "completed"
