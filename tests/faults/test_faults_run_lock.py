"""The run directory's writer lock with real processes and real kills: a second writer is refused with one line
naming the first one's pid, and a SIGKILLed writer leaves the lock free, so its "running" status reads as dead."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from predmask.rundir import DEAD, RunDirBusyError, hold_run_lock, run_status, run_writer_alive

REPO = Path(__file__).resolve().parents[2]


def _writer(run_dir: Path) -> subprocess.Popen[str]:
    """A process holding run_dir's lock through hold_run_lock until it is killed; it says "ok" once it holds it."""
    code = ("import sys, time; from pathlib import Path; from predmask.rundir import hold_run_lock\n"
            f"with hold_run_lock(Path({str(run_dir)!r})):\n    print('ok', flush=True); time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ok"
    return proc


def test_a_second_writer_is_refused_and_a_killed_writer_is_dead(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "s" / "r"
    assert not run_writer_alive(run_dir) and run_status(run_dir, "running") == DEAD  # nothing ever held it
    first = _writer(run_dir)
    try:
        assert run_writer_alive(run_dir)
        assert run_status(run_dir, "running") == "running"
        with pytest.raises(RunDirBusyError) as err, hold_run_lock(run_dir):
            pytest.fail("the lock was taken twice")
        assert str(err.value) == f"run_dir {run_dir} is being written by another trainer (pid {first.pid})"
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert first.returncode == -signal.SIGKILL
    assert not run_writer_alive(run_dir)
    assert run_status(run_dir, "running") == DEAD
    assert run_status(run_dir, "completed") == "completed" and run_status(run_dir, "failed") == "failed"
    with hold_run_lock(run_dir):  # free again: the next writer takes it (and reads as alive meanwhile)
        assert run_writer_alive(run_dir)
    assert not run_writer_alive(run_dir)


def test_a_run_lock_linked_out_of_the_run_directory_is_refused_and_its_target_kept(tmp_path: Path) -> None:
    """The lock file is truncated when taken: through a link that would empty a file elsewhere (the one lock
    primitive, predmask.rundir.hold_lock, opens it without following links)."""
    import errno

    outside = tmp_path / "elsewhere.txt"
    outside.write_text("must survive\n")
    run_dir = tmp_path / "runs" / "s" / "r"
    run_dir.mkdir(parents=True)
    (run_dir / ".run.lock").symlink_to(outside)
    with pytest.raises(OSError) as err, hold_run_lock(run_dir):
        pytest.fail("the lock was taken through a link")
    assert err.value.errno == errno.ELOOP
    assert isinstance(err.value, ValueError)  # the trainer's one-line refusal (exit 2), not a traceback
    assert str(err.value) == (f"{run_dir / '.run.lock'} is a symlink (to {outside}); nothing written or deleted: "
                             "remove that link")
    assert outside.read_text() == "must survive\n"
