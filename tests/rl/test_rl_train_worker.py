"""The warm worker of local runs (``launch.warm_worker``), with real processes and real forks: a run through the worker
writes the metrics that the same run writes as its own process; a worker's child killed with SIGKILL mid-run resumes,
through the worker, to the same final metrics; a bad config reaches the caller as the process's exit status and line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from launch.warm_worker import WorkerRun, local_worker, start_in_worker, worker_module
from predmask.metrics import wall_clock
from predmask.rundir import read_metrics

REPO = Path(__file__).resolve().parents[2]
TINY = ["method=predmask_kl_agg", "model=cpu_s", "precision=bf16", "base.steps=40", "base.batch_size=16",
        "base.eval_problems=8", "task.eval_size=3", "rollout.n=4", "rollout.response_length=8",
        "trainer.train_batch_size=4", "trainer.ppo_mini_batch_size=2", "trainer.val_n=2", "trainer.progress=false",
        "trainer.steps=12", "trainer.save_every=4", "trainer.val_every=5"]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def _command(cache: Path, run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "predmask.rl.train", *TINY, f"cache_dir={cache}", f"run_dir={run_dir}", *extra]


def _scientific(run_dir: Path) -> list[tuple[int, dict]]:
    return [(r["step"], {k: v for k, v in r["data"].items() if not wall_clock(k)})
            for r in read_metrics(run_dir / "metrics.jsonl")]


def _in_worker(worker: str, command: list[str], log: Path) -> WorkerRun:
    log.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        run = start_in_worker(worker, command, env=ENV, cwd=str(log.parent), fds=[0, fd, fd])
    finally:
        os.close(fd)
    assert run is not None, "the worker did not take the run"
    return run


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with local_worker(tmp_path_factory.mktemp("runs"), ("hydra", "predmask.rl.train"), {"OMP_NUM_THREADS": "1"}) as path:
        assert path is not None
        yield path


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The base-model cache and one uninterrupted run, each run as its own process (as before the worker)."""
    tmp = tmp_path_factory.mktemp("reference")
    run_dir = tmp / "run"
    out = subprocess.run(_command(tmp / "cache", run_dir), env=ENV, cwd=tmp, capture_output=True, text=True,
                         timeout=600, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    return tmp / "cache", run_dir


def test_only_this_interpreters_module_commands_go_to_the_worker() -> None:
    assert worker_module([sys.executable, "-m", "predmask.rl.train", "a=1"]) == ("predmask.rl.train", ["a=1"])
    assert worker_module(["python3", "-m", "predmask.rl.train"]) is None
    assert worker_module([sys.executable, "-u", "-m", "x"]) is None
    assert start_in_worker("/nonexistent/socket", [sys.executable, "-m", "x"], env={}, cwd=None, fds=[0, 1, 2]) is None


@pytest.mark.slow
def test_a_run_through_the_worker_equals_the_run_as_its_own_process(worker: str, reference: tuple[Path, Path],
                                                                    tmp_path: Path) -> None:
    cache, ref_dir = reference
    run_dir = tmp_path / "run"
    run = _in_worker(worker, _command(cache, run_dir), tmp_path / "job.log")
    assert run.wait(timeout=600) == 0, (tmp_path / "job.log").read_text()
    assert run.pid != os.getpid() and os.getpgid(0) != run.pid
    assert _scientific(run_dir) == _scientific(ref_dir)
    assert "completed at step 12" in (tmp_path / "job.log").read_text()  # the child's stdout is the job's log


@pytest.mark.slow
def test_a_killed_worker_child_resumes_to_the_uninterrupted_runs_metrics(worker: str, reference: tuple[Path, Path],
                                                                          tmp_path: Path) -> None:
    cache, ref_dir = reference
    run_dir = tmp_path / "run"
    victim = _in_worker(worker, _command(cache, run_dir), tmp_path / "job.log")
    deadline = time.monotonic() + 300
    while victim.poll() is None and time.monotonic() < deadline:
        if (recs := read_metrics(run_dir / "metrics.jsonl")) and recs[-1]["step"] >= 6:
            break
        time.sleep(0.01)
    os.killpg(victim.pid, signal.SIGKILL)
    assert victim.wait(timeout=60) == -signal.SIGKILL, "the run finished before it was killed"
    assert read_metrics(run_dir / "metrics.jsonl")[-1]["step"] < 12
    resumed = _in_worker(worker, _command(cache, run_dir), tmp_path / "job.log")
    assert resumed.wait(timeout=600) == 0, (tmp_path / "job.log").read_text()
    assert "resumed from step_0000" in (run_dir / "train.log").read_text()
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == list(range(13))
    assert _scientific(run_dir) == _scientific(ref_dir)


@pytest.mark.slow
def test_a_bad_config_gives_the_processs_exit_status_and_line(worker: str, tmp_path: Path) -> None:
    command = _command(tmp_path / "cache", tmp_path / "run", "top_k=0")
    own = subprocess.run(command, env=ENV, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    run = _in_worker(worker, command, tmp_path / "w" / "job.log")
    assert (run.wait(timeout=300), (tmp_path / "w" / "job.log").read_text()) == (own.returncode, own.stdout + own.stderr)
    assert own.returncode == 2 and len((own.stdout + own.stderr).splitlines()) == 1


PROBE = """import os, sys, time
from pathlib import Path
first = not Path("pids").exists()
with Path("pids").open("a") as f:
    f.write(f"{os.getpid()} {os.getppid()} {os.getsid(0)}\\n")
time.sleep(120 if first else 0)
"""


def test_a_run_whose_worker_was_killed_is_stopped_and_runs_again_as_its_own_process(tmp_path: Path) -> None:
    """SIGKILL to the worker's session (the worker and the run's watcher) mid-run: the job kills the run, now
    unwatched, and starts the command again as a process of its own, which ends the run (status 0)."""
    import threading

    from launch.command_job import CommandJob
    from launch.warm_worker import WORKER_ENV

    (tmp_path / "probe.py").write_text(PROBE)  # found as ``python -m`` finds it: in the run's directory
    pids = tmp_path / "pids"
    with local_worker(tmp_path, ()) as path:
        assert path is not None
        job = CommandJob(command=[sys.executable, "-m", "probe"], run_dir=str(tmp_path),
                         log_file=str(tmp_path / "job.log"), env={WORKER_ENV: path}, stop_timeout_s=5)
        result: list[int] = []
        thread = threading.Thread(target=lambda: result.append(job._run_command(extra_env={})))
        thread.start()
        deadline = time.monotonic() + 60
        while not pids.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        first, watcher, session = (int(x) for x in pids.read_text().split())
        assert session == first and watcher != os.getpid()  # the worker's child, in its own session
        worker_pid = os.getsid(watcher)
        assert b"launch.warm_worker" in Path(f"/proc/{worker_pid}/cmdline").read_bytes()
        os.killpg(worker_pid, signal.SIGKILL)
        thread.join(timeout=60)
    assert result == [0], (tmp_path / "job.log").read_text()
    second = [int(x) for x in pids.read_text().splitlines()[1].split()]
    assert second[1] == os.getpid() and second[0] != first  # run again as the job's own process
    assert not _running(first)
    assert f"the warm worker lost run pid {first}" in (tmp_path / "job.log").read_text()


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
