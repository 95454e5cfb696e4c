"""The trainer (predmask.rl.train) against faults, on real files and real processes: a truncated newest checkpoint,
a runs root moved with mv, a rerun asking for fewer steps than the run reached, Ctrl-C, a full disk."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from test_rl_train import _cli, _overrides, _scientific, cache_dir  # noqa: F401 - cache_dir: the tiny base-model fixture

from predmask.config import compose
from predmask.rl.train import run
from predmask.rundir import read_metrics, run_status, run_writer_alive


def _steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")]


def _problem_lines(out: str) -> list[str]:
    """The output lines that are not the trainer's own log and progress lines (``[predmask.rl] ...``, ``GRPO ...``)."""
    return [ln for ln in out.splitlines() if ln.strip() and not ln.startswith(("[predmask.rl] ", "GRPO "))]


def test_a_truncated_newest_checkpoint_is_moved_aside_and_the_run_resumes_from_the_older(
        cache_dir: Path, tmp_path: Path) -> None:  # noqa: F811 - the fixture imported above
    run_dir = tmp_path / "run"
    args = _overrides(cache_dir, run_dir, "trainer.steps=6", "trainer.save_every=2", "trainer.val_every=3",
                      "trainer.keep_checkpoints=3")
    run(compose("train", args))
    reference = _scientific(read_metrics(run_dir / "metrics.jsonl"))
    newest = run_dir / "checkpoints" / "step_000006.pt"
    cut = newest.read_bytes()[: newest.stat().st_size // 2]
    newest.write_bytes(cut)  # a copy or a disk that cut the file short

    summary = run(compose("train", args))  # the same command again

    assert summary["resumed"] and summary["step"] == 6
    log = (run_dir / "train.log").read_text()
    assert f"damaged: {newest}, unreadable (" in log
    assert "moved aside to step_000006.pt.damaged (kept, not deleted)" in log
    assert "resumed from step_000004.pt (step 4)" in log
    assert (run_dir / "checkpoints" / "step_000006.pt.damaged").read_bytes() == cut  # kept byte for byte
    assert _steps(run_dir) == list(range(7))
    assert _scientific(read_metrics(run_dir / "metrics.jsonl")) == reference  # steps 5-6 redone identically


def test_a_moved_runs_root_resumes_and_a_shorter_rerun_is_refused(cache_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    """``mv runs runs2``: the run resumes from its checkpoint at its new place (run_dir is where a run is, not what it
    is); asking it for fewer steps than it reached is refused in one line and changes no file; another seed is still
    another run."""
    old_dir, new_dir = tmp_path / "runs" / "s" / "x", tmp_path / "runs2" / "s" / "x"
    common = ("trainer.save_every=2", "trainer.val_every=0")
    run(compose("train", _overrides(cache_dir, old_dir, "trainer.steps=2", *common)))
    os.rename(tmp_path / "runs", tmp_path / "runs2")

    summary = run(compose("train", _overrides(cache_dir, new_dir, "trainer.steps=4", *common)))

    assert summary["resumed"] and summary["step"] == 4
    assert "resumed from step_000002.pt (step 2)" in (new_dir / "train.log").read_text()
    assert _steps(new_dir) == [0, 1, 2, 3, 4]
    config = (new_dir / "config.yaml").read_text()
    assert f"run_dir: {new_dir}\n" in config and "  steps: 4\n" in config
    files = {name: (new_dir / name).read_bytes() for name in ("config.yaml", "status.json", "metrics.jsonl")}

    with pytest.raises(ValueError, match=re.escape(
            f"run_dir {new_dir} has reached step 4 (step_000004.pt) and trainer.steps=3 would shorten it; a resume "
            "only continues a run: pass trainer.steps=4 or more, or use another run_dir for a 3-step run "
            "(nothing was changed)")):
        run(compose("train", _overrides(cache_dir, new_dir, "trainer.steps=3", *common)))
    assert {name: (new_dir / name).read_bytes() for name in files} == files
    with pytest.raises(ValueError, match=r"holds a run with a different config \(seed\); use another run_dir"):
        run(compose("train", _overrides(cache_dir, new_dir, "trainer.steps=4", "seed=5", *common)))
    assert {name: (new_dir / name).read_bytes() for name in files} == files


def _default_sigint() -> None:
    """The child takes SIGINT as Python's KeyboardInterrupt even when this test runs with SIGINT ignored (nohup, a
    background job of a non-interactive shell)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        steps = _steps(run_dir)
        if steps and steps[-1] >= step:
            return
        time.sleep(0.02)
    raise AssertionError(f"the trainer did not reach step {step} (exit {proc.poll()}): {proc.communicate()[0]}")


@pytest.mark.slow
def test_ctrl_c_stops_a_trainer_with_one_line_and_exit_130(cache_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    run_dir = tmp_path / "run"
    proc = _cli(_overrides(cache_dir, run_dir, "trainer.steps=500", "trainer.save_every=2", "trainer.val_every=0"),
                cwd=tmp_path, preexec_fn=_default_sigint)
    try:
        _wait_for_step(proc, run_dir, 3)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    problems = _problem_lines(out)
    assert len(problems) == 1, out
    assert re.fullmatch(rf"interrupted: run_dir {re.escape(str(run_dir))} stopped at step \d+ \(newest checkpoint: "
                        r"step_\d{6}\.pt\); rerun the same command to resume it", problems[0]), problems[0]
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "failed" and status["error"] == problems[0]
    assert not run_writer_alive(run_dir)


@pytest.fixture
def small_disk(tmpfs) -> Path:
    """A real 2 MiB tmpfs (one checkpoint of the tiny model fits, two do not); tests/conftest.py's ``tmpfs``."""
    return tmpfs(2)


def _fill(path: Path) -> None:
    """Write zeros to ``path`` until the file system says it is full."""
    with open(path, "wb", buffering=0) as fh:
        try:
            while True:
                fh.write(b"\0" * 65536)
        except OSError:
            pass
        try:
            while True:
                fh.write(b"\0")
        except OSError:
            pass


def _fill_between_writes(proc: subprocess.Popen, run_dir: Path, filler: Path, timeout: float = 120) -> None:
    """Fill the disk while the trainer is stopped (SIGSTOP) between two writes: no temporary file of an atomic write
    and no checkpoint awaiting its pruning. Any write after that fails without its clean-up freeing a page, so the
    cause cannot be recorded in status.json either; filled in the middle of a checkpoint's write, the removed partial
    checkpoint would give back the room that status.json needs, and what the test sees would depend on timing."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            between = (not any(run_dir.rglob(".*.tmp"))
                       and len(list((run_dir / "checkpoints").glob("step_*.pt"))) == 1)
            if between:
                _fill(filler)
                return
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        time.sleep(0.005)
    raise AssertionError(f"the trainer was never stopped between two writes (exit {proc.poll()})")


@pytest.mark.slow
def test_a_full_disk_stops_the_trainer_with_one_line_and_the_rerun_resumes(
        cache_dir: Path, tmp_path: Path, small_disk: Path) -> None:  # noqa: F811
    run_dir = small_disk / "run"
    args = _overrides(cache_dir, run_dir, "trainer.steps=40", "trainer.save_every=2", "trainer.val_every=0",
                      "trainer.keep_checkpoints=1")
    remedy = "No space left on device; free space on its file system, then rerun the same command to resume"

    # 1. the second checkpoint does not fit: one line naming it, exit 1, status.json records the cause
    first = _cli(args, cwd=tmp_path)
    out, _ = first.communicate(timeout=300)
    assert first.returncode == 1, out
    assert "Traceback" not in out, out
    line = f"cannot write {run_dir / 'checkpoints' / 'step_000004.pt'}: {remedy}"
    assert _problem_lines(out) == [f"error: {line}"], out
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "failed" and status["error"] == line
    assert _steps(run_dir) == [0, 1, 2, 3, 4]

    # 2. more room, the same command resumes; the disk fills up mid-run, status.json included: the cause goes to
    # the job's output, and the run reads as dead (its lock is free)
    subprocess.run(["mount", "-o", "remount,size=16m", str(small_disk)], check=True)
    second = _cli(args, cwd=tmp_path)
    try:
        _wait_for_step(second, run_dir, 6)
        _fill_between_writes(second, run_dir, small_disk / "filler")
        out, _ = second.communicate(timeout=300)
    finally:
        if second.poll() is None:
            second.kill()
            second.wait()
    assert second.returncode == 1, out
    assert "Traceback" not in out, out
    problems = [ln for ln in _problem_lines(out) if not re.fullmatch(
        rf"warning: cannot write {re.escape(str(run_dir / 'train.log'))}: No space left on device; its lines are "
        r"lost until it can be written", ln)]
    assert len(problems) == 1, out
    assert re.fullmatch(rf"error: cannot write {re.escape(str(run_dir))}/\S+: {remedy}; status\.json could not "
                        rf"record it: cannot write {re.escape(str(run_dir / 'status.json'))}: {remedy}",
                        problems[0]), problems[0]
    assert run_status(run_dir, json.loads((run_dir / "status.json").read_text())["status"]) == "dead"

    # 3. space freed: the same command completes the run, each step once
    (small_disk / "filler").unlink()
    third = _cli(args, cwd=tmp_path)
    out, _ = third.communicate(timeout=600)
    assert third.returncode == 0, out
    assert _steps(run_dir) == list(range(41))
    assert json.loads((run_dir / "status.json").read_text())["status"] == "completed"


@pytest.mark.slow
def test_a_read_only_run_directory_is_one_line_naming_the_file(
        cache_dir: Path, tmp_path: Path, small_disk: Path) -> None:  # noqa: F811
    """A run resumed on a file system that went read-only (remounted: a full or failing disk, a snapshot)."""
    run_dir = small_disk / "run"
    common = ("trainer.save_every=2", "trainer.val_every=0", "trainer.keep_checkpoints=1")
    run(compose("train", _overrides(cache_dir, run_dir, "trainer.steps=2", *common)))
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)

    proc = _cli(_overrides(cache_dir, run_dir, "trainer.steps=4", *common), cwd=tmp_path)
    out, _ = proc.communicate(timeout=300)

    assert proc.returncode == 1, out
    assert "Traceback" not in out, out
    line = (f"error: cannot write {run_dir / '.run.lock'}: Read-only file system; make its file system writable (or "
            "point the run elsewhere, e.g. PREDMASK_RUNS), then rerun the same command to resume")
    assert _problem_lines(out) == [line], out
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before
