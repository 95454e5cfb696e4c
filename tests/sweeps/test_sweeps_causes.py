"""sweeps.run_dirs.failure_cause on run directories written as the trainer and the command job write them: the cause of
the latest attempt only (job.log from the sweep's offset, records no older than the submission)."""

from __future__ import annotations

import json
from pathlib import Path

from sweeps.run_dirs import exit_text, failure_cause


def _run_dir(tmp_path: Path, *, old_log: str, new_log: str, returncode: int | None, status: dict | None) -> Path:
    path = tmp_path / "run"
    path.mkdir()
    (path / "job.log").write_text(old_log + new_log)
    (path / "job.json").write_text(json.dumps({"submitted": 100.0, "log_offset": len(old_log.encode())}))
    if returncode is not None:
        (path / "exit_status.json").write_text(json.dumps({"started": 101.0, "returncode": returncode}))
    if status is not None:
        (path / "status.json").write_text(json.dumps(status))
    return path


def test_the_trainers_error_line_of_this_attempt_with_its_exit_status(tmp_path: Path) -> None:
    path = _run_dir(tmp_path, old_log="error: an earlier attempt's problem\n",
                    new_log="[predmask.rl] start\nerror: top_k must lie in [1, 27], got 99\n", returncode=2,
                    status=None)
    assert failure_cause(path) == "top_k must lie in [1, 27], got 99 (exit status 2)"


def test_a_crash_is_its_status_error_else_the_tracebacks_last_line(tmp_path: Path) -> None:
    log = "Traceback (most recent call last):\n  File \"x.py\", line 1\nRuntimeError: boom\n"
    status = {"status": "failed", "step": 3, "total_steps": 9, "updated": 150.0, "error": "RuntimeError: boom!"}
    assert failure_cause(_run_dir(tmp_path, old_log="", new_log=log, returncode=1, status=status)) == (
        "RuntimeError: boom! (exit status 1)")
    stale = {**status, "updated": 50.0}  # written by an earlier attempt
    other = tmp_path / "other"
    other.mkdir()
    assert failure_cause(_run_dir(other, old_log="", new_log=log, returncode=1, status=stale)) == (
        "RuntimeError: boom (exit status 1)")


def test_a_killed_trainer_is_its_signal_and_the_step_it_reached(tmp_path: Path) -> None:
    status = {"status": "running", "step": 4, "total_steps": 40, "updated": 150.0, "error": None}
    path = _run_dir(tmp_path, old_log="", new_log="[predmask.rl] step 4 score=0.2\n", returncode=-9, status=status)
    assert failure_cause(path) == "killed by signal 9 (SIGKILL) at step 4/40"
    assert exit_text(-15) == "killed by signal 15 (SIGTERM)" and exit_text(3) == "exit status 3"


def test_nothing_written_by_this_attempt_says_nothing(tmp_path: Path) -> None:
    path = _run_dir(tmp_path, old_log="error: old\n", new_log="", returncode=None, status=None)
    (path / "exit_status.json").write_text(json.dumps({"started": 10.0, "returncode": -9}))  # an earlier attempt's
    assert failure_cause(path) is None
