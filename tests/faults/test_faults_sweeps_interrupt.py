"""Ctrl-C to a real `python -m sweeps` mid-sweep, sent as a terminal sends it (SIGINT to the whole foreground process
group): one line, ``interrupted: ... rerun the same command to resume them``, exit status 130, and no traceback from
the sweep, its jobs' controllers or their workers. On the local backend the runs train in the sweep's warm worker
(``launch.warm_worker``) and every run's processes, the worker's included, are gone afterwards;
on Slurm the jobs go on (a rerun joins them) and the test cancels them itself."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch.procs import pids_using_dir

REPO = Path(__file__).resolve().parents[2]
#: two runs, long enough (40 steps) to be interrupted while they train, on a base model built in seconds
TINY = ["smoke", "method=dppo_topk_kl,grpo_clip_higher", "trainer.steps=40", "trainer.val_every=40",
        "trainer.save_every=2", "trainer.val_n=2", "base.steps=40", "base.eval_problems=16", "task.eval_size=8",
        "trainer.train_batch_size=4", "trainer.ppo_mini_batch_size=2", "rollout.n=4"]
TRAINING = re.compile(r".* step [1-9]\d*/40\b.*")


def _interrupt_mid_sweep(tmp: Path, *extra: str, sig: int = signal.SIGINT,
                         training: list[list[str]] | None = None) -> tuple[int, list[str]]:
    """Start the sweep in a process group of its own, send ``sig`` to the group once a run has trained a step; its
    exit status and output lines. ``training`` gets the command lines of the processes under the runs root then."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PREDMASK_RUNS": str(tmp / "runs"),
           "PREDMASK_CACHE": str(tmp / "cache"), "OMP_NUM_THREADS": "1", "PREDMASK_PROGRESS_INTERVAL_S": "0.2"}
    proc = subprocess.Popen([sys.executable, "-m", "sweeps", *TINY, *extra, "--db", str(tmp / "db.duckdb")],
                            cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 900
    try:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if TRAINING.fullmatch(line.strip()):
                if training is not None:
                    training += [_cmdline(pid) for pid in pids_using_dir(str(tmp / "runs"))]
                break
            assert time.monotonic() < deadline, "\n".join(lines[-20:])
        else:
            pytest.fail("the sweep ended before a run trained a step:\n" + "\n".join(lines[-30:]))
        os.killpg(proc.pid, sig)
        rest, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, lines + rest.splitlines()


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []


def _assert_one_clean_line(code: int, lines: list[str], stopped: str) -> None:
    text = "\n".join(lines)
    assert code == 130, text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    assert [ln for ln in lines if "interrupted" in ln] == [
        f"interrupted: {stopped}; rerun the same command to resume them"], text


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP], ids=["ctrl-c", "terminal-closed"])
def test_ctrl_c_to_a_local_sweep_is_one_line_exit_130_and_stops_every_run(tmp_path: Path, sig: int) -> None:
    """SIGHUP (the terminal closed) stops the runs as Ctrl-C does: their controllers never see the terminal's
    signals, the sweep cancels them."""
    training: list[list[str]] = []
    code, lines = _interrupt_mid_sweep(tmp_path, sig=sig, training=training)
    _assert_one_clean_line(code, lines, "local runs stopped")
    # the runs trained in the sweep's warm worker (launch.warm_worker: imports once, a forked child per run)
    assert len([cmd for cmd in training if "launch.warm_worker" in cmd]) >= 3, training  # the worker, a watcher, a run
    assert not [cmd for cmd in training if "predmask.rl.train" in cmd and "launch.warm_worker" not in cmd], training
    deadline = time.monotonic() + 60  # the controllers stop their tasks, which stop their trainers
    while pids_using_dir(str(tmp_path / "runs")) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert pids_using_dir(str(tmp_path / "runs")) == []


@pytest.mark.slow
@pytest.mark.slurm
def test_ctrl_c_while_following_slurm_jobs_is_one_line_exit_130_and_the_jobs_go_on(tmp_path: Path) -> None:
    try:
        code, lines = _interrupt_mid_sweep(tmp_path, "cluster=slurm_emulated", "seeds=1")
        _assert_one_clean_line(code, lines, "the Slurm jobs go on (a rerun joins them)")
        ids = re.findall(r"^run \w+ .*: job (\d+)$", "\n".join(lines), flags=re.MULTILINE)
        assert ids
        queued = subprocess.run(["squeue", "-h", "-o", "%i", "-j", ",".join(ids)], capture_output=True, text=True,
                                check=False).stdout.split()
        assert queued, "the Slurm jobs were cancelled by the interrupt"
    finally:
        names = [f"predmask-smoke-{p.name}" for p in (tmp_path / "runs" / "smoke").glob("[0-9a-f]*")]
        for name in names:
            subprocess.run(["scancel", "-n", name], check=False)
