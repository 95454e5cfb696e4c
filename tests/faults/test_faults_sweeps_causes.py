"""A failed sweep run is reported with its cause, read from its run directory: the trainer's own error line (and its
exit status), or ``killed by signal 9 (SIGKILL)`` for a trainer killed for real; the sweep then names the command that
resumes it, and ``python -m sweeps status`` shows the killed run as dead."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sweeps.families import expand

REPO = Path(__file__).resolve().parents[2]
TINY = ["smoke", "method=dppo_topk_kl", "trainer.val_every=20", "trainer.save_every=2", "trainer.val_n=2",
        "base.steps=40", "base.eval_problems=16", "task.eval_size=8", "trainer.train_batch_size=4",
        "trainer.ppo_mini_batch_size=2", "rollout.n=4"]


def _env(tmp: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "PREDMASK_RUNS": str(tmp / "runs"),
            "PREDMASK_DB": str(tmp / "db.duckdb"), "PREDMASK_CACHE": str(tmp / "cache"), "OMP_NUM_THREADS": "1"}


def _sweep(tmp: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "sweeps", *args], cwd=tmp, env=_env(tmp), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_a_trainer_error_is_reported_with_its_own_line_and_exit_status(tmp_path: Path) -> None:
    """The run directory already holds another run's config: the trainer refuses it (one `error:` line, exit 2)
    before it builds anything."""
    args = [*TINY, "trainer.steps=2"]
    (spec,) = expand("smoke", args[1:])
    run_dir = tmp_path / "runs" / "smoke" / spec.run_id
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("seed: 99\n")
    proc = _sweep(tmp_path, *args)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 1, out
    failed = [ln for ln in out.splitlines() if ln.startswith(f"failed {spec.run_id}: ")]
    assert len(failed) == 1, out
    assert re.fullmatch(rf"failed {spec.run_id}: run_dir {re.escape(str(run_dir.resolve()))} holds a run with a "
                        rf"different config \([a-z_, .]+\); use another run_dir \(exit status 2\) "
                        rf"\(log: {re.escape(str(run_dir / 'job.log'))}\)", failed[0]), failed[0]
    assert "_log.out" not in out
    assert out.splitlines()[-1].startswith("next: fix the cause above, then rerun the same command")
    assert out.splitlines()[-1].endswith("python -m sweeps " + " ".join(args))


@pytest.mark.slow
def test_a_trainer_killed_with_sigkill_is_reported_as_killed_and_shown_dead(tmp_path: Path) -> None:
    args = [*TINY, "trainer.steps=40"]
    (spec,) = expand("smoke", args[1:])
    run_dir = tmp_path / "runs" / "smoke" / spec.run_id
    proc = _sweep(tmp_path, *args)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                step = json.loads((run_dir / "status.json").read_text()).get("step", 0)
            except (OSError, json.JSONDecodeError):
                step = 0
            if step >= 2:
                break
            time.sleep(0.5)
        holder = (run_dir / ".run.lock").read_text()  # "pid N HOST": the trainer holds its run's lock
        pid = int(re.match(r"pid (\d+)", holder).group(1))
        os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, out
    failed = [ln for ln in out.splitlines() if ln.startswith(f"failed {spec.run_id}: ")]
    assert len(failed) == 1, out
    assert re.fullmatch(rf"failed {spec.run_id}: killed by signal 9 \(SIGKILL\) at step \d+/40 "
                        rf"\(log: {re.escape(str(run_dir / 'job.log'))}\)", failed[0]), failed[0]

    status = subprocess.run([sys.executable, "-m", "sweeps", "status", "smoke"], cwd=tmp_path, env=_env(tmp_path),
                            capture_output=True, text=True, timeout=300, check=False)
    assert status.returncode == 0
    (row,) = [ln for ln in status.stdout.splitlines() if spec.run_id in ln]
    assert " dead " in row
    assert status.stdout.splitlines()[-1].startswith("smoke: 1 not completed (1 dead); next: rerun the sweep's own")
