"""`python -m sweeps` end to end: real CPU-engine runs, a real DuckDB file, real kills, a real (emulated) Slurm."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pytest

# A tiny configuration of the CPU engine: a base model built in seconds, a few GRPO steps.
TINY = ["trainer.steps=6", "trainer.val_every=3", "trainer.save_every=2", "trainer.val_n=2", "base.steps=40",
        "base.eval_problems=16", "task.eval_size=8", "trainer.train_batch_size=4", "trainer.ppo_mini_batch_size=2",
        "rollout.n=4"]
METHODS = "method=dppo_topk_kl,predmask_kl_agg"


def _env(tmp: Path) -> dict[str, str]:
    return {**os.environ, "PREDMASK_DB": str(tmp / "db.duckdb"), "PREDMASK_RUNS": str(tmp / "runs"),
            "PREDMASK_CACHE": str(tmp / "cache"), "OMP_NUM_THREADS": "1"}


def _sweeps(tmp: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sweeps", *args], cwd=tmp, env=_env(tmp), capture_output=True,
                          text=True, timeout=timeout, check=False)


def _metric_steps(db: Path) -> dict[str, list[int]]:
    con = duckdb.connect(str(db), read_only=True)
    try:
        rows = con.execute("SELECT run_id, step FROM metrics WHERE name = 'training/global_step' "
                           "ORDER BY run_id, step").fetchall()
    finally:
        con.close()
    out: dict[str, list[int]] = {}
    for run_id, step in rows:
        out.setdefault(run_id, []).append(step)
    return out


def _file_steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _wait_for_step(runs: Path, step: int, timeout: float) -> Path:
    deadline = time.time() + timeout
    while time.time() < deadline:
        for status in runs.glob("*/*/status.json"):
            try:
                if json.loads(status.read_text()).get("step", 0) >= step:
                    return status.parent
            except json.JSONDecodeError:
                pass
        time.sleep(0.5)
    raise AssertionError(f"no run reached step {step} within {timeout} s")


def _kill_everything_under(tmp: Path) -> None:
    """SIGKILL every process whose command line names this test's folder (sweep, submitit job, trainer)."""
    subprocess.run(["pkill", "-9", "-f", str(tmp)], check=False)
    time.sleep(1.0)


@pytest.mark.slow
def test_local_sweep_killed_midway_then_rerun_completes_without_duplicates(tmp_path: Path) -> None:
    # 40 steps, so that a run seen at step 3 is still running when the kill lands a moment later
    args = ["smoke", METHODS, *TINY, "trainer.steps=40", "trainer.val_every=20"]
    proc = subprocess.Popen([sys.executable, "-m", "sweeps", *args], cwd=tmp_path,
                            env=_env(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        killed_run = _wait_for_step(tmp_path / "runs", 3, timeout=400)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        _kill_everything_under(tmp_path)
    assert json.loads((killed_run / "status.json").read_text())["status"] == "running"

    done = _sweeps(tmp_path, *args)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 failed" in done.stdout
    steps = _metric_steps(tmp_path / "db.duckdb")
    assert len(steps) == 2
    for run_id, seen in steps.items():
        assert seen == list(range(41)), (run_id, seen)  # step 0 (validation) .. 40, each once
        assert _file_steps(tmp_path / "runs" / "smoke" / run_id) == list(range(41))

    # A rerun finds everything done, submits nothing and leaves the database as it was.
    before = duckdb.connect(str(tmp_path / "db.duckdb"), read_only=True)
    rows_before = before.execute("SELECT count(*) FROM metrics").fetchall()
    before.close()
    again = _sweeps(tmp_path, *args)
    assert again.returncode == 0 and "2 already done" in again.stdout, again.stdout + again.stderr
    after = duckdb.connect(str(tmp_path / "db.duckdb"), read_only=True)
    assert after.execute("SELECT count(*) FROM metrics").fetchall() == rows_before
    statuses = after.execute("SELECT status, backend, sweep FROM runs").fetchall()
    after.close()
    assert statuses == [("completed", "local", "smoke")] * 2


def test_second_invocation_on_a_running_sweep_is_refused(tmp_path: Path) -> None:
    from sweeps.run_dirs import sweep_lock

    with sweep_lock(tmp_path / "runs" / "smoke"):
        second = _sweeps(tmp_path, "smoke", METHODS, *TINY, timeout=120)
    assert second.returncode == 2
    assert "is in use by pid" in second.stderr and len(second.stderr.strip().splitlines()) == 1
    assert not list((tmp_path / "runs" / "smoke").glob("*/job.json"))


def test_local_dry_run_has_no_sbatch_and_the_exact_trainer_command(tmp_path: Path) -> None:
    out = _sweeps(tmp_path, "smoke", "--dry-run", "--format", "json", timeout=300)
    records = json.loads(out.stdout)["runs"]
    assert len(records) == 4 and all(r["sbatch"] is None for r in records)
    assert [r["seed"] for r in records] == [0] * 4  # the smoke sweep's own seed axis
    assert all(r["command"][0] == sys.executable for r in records)  # the local cluster is this host
    assert all(r["command"][1:3] == ["-m", "predmask.rl.train"] for r in records)
    assert all(any(a.startswith("run_dir=") and r["run_id"] in a for a in r["command"]) for r in records)


@pytest.mark.slurm
@pytest.mark.slow
def test_slurm_sweep_run_cancelled_midway_then_rerun_completes(tmp_path: Path, slurm_cluster: dict) -> None:
    """CPU-engine runs submitted through submitit to the real emulated Slurm; one is scancelled mid-run."""
    args = ["smoke", "method=predmask_kl_agg", "cluster=slurm_emulated", *TINY]
    proc = subprocess.Popen([sys.executable, "-m", "sweeps", *args], cwd=tmp_path, env=_env(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run = _wait_for_step(tmp_path / "runs", 3, timeout=400)
    job_id = json.loads((run / "job.json").read_text())["job_id"]
    subprocess.run(["scancel", job_id], check=True)  # a real cancel, not a signal that Slurm may requeue
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1 and f"failed {run.name}" in out, out

    done = _sweeps(tmp_path, *args)
    assert done.returncode == 0, done.stdout + done.stderr
    assert _file_steps(run) == list(range(7))
    assert _metric_steps(tmp_path / "db.duckdb")[run.name] == list(range(7))
    assert "0 failed" in done.stdout, done.stdout


@pytest.mark.parametrize(("override", "message"), [
    ("model.path=", "error: run config is missing model.path (needed for a VeRL run)"),
    ("cluster.data_dir=", "error: run config needs data.train_files/data.val_files, data.dir or cluster.data_dir"),
])
def test_cluster_run_without_model_or_data_is_refused_before_submission(tmp_path: Path, override: str,
                                                                        message: str) -> None:
    out = _sweeps(tmp_path, "smoke", "cluster=h20_4x8", "method=dppo_topk_kl", override, timeout=300)
    assert out.returncode == 2
    line = out.stderr.strip()
    assert line.startswith("error: run ") and message.removeprefix("error: ") in line and len(line.splitlines()) == 1
    assert not (tmp_path / "runs").exists() and not (tmp_path / "db.duckdb").exists()


HOLD_DB = "import duckdb, sys\ncon = duckdb.connect(sys.argv[1])\nprint('held', flush=True)\nsys.stdin.read()"


@pytest.mark.slow
def test_a_busy_database_defers_the_ingest_and_the_next_sweep_catches_up(tmp_path: Path) -> None:
    """Another process holds the database (a real DuckDB writer) for the whole sweep: the run completes, its
    ingest is deferred and retried at the end, the sweep says how to catch up; the next sweep ingests it."""
    db = tmp_path / "db.duckdb"
    args = ["smoke", "method=dppo_topk_kl", *TINY, "trainer.steps=2", "trainer.val_every=2"]
    holder = subprocess.Popen([sys.executable, "-c", HOLD_DB, str(db)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        env = {**_env(tmp_path), "PREDMASK_DB_WAIT": "1"}
        busy = subprocess.run([sys.executable, "-m", "sweeps", *args], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=600, check=False)
    finally:
        holder.communicate("", timeout=60)  # closes its stdin: it lets go of the database and exits
    (run_id,) = [p.name for p in (tmp_path / "runs" / "smoke").iterdir() if not p.name.startswith(".")]
    assert busy.returncode == 1, busy.stdout + busy.stderr
    assert f"ingest of {run_id} deferred: results database {db} is in use" in busy.stdout
    assert "1 completed, 0 already done, 0 failed" in busy.stdout
    assert f"not ingested {run_id}: results database {db} is in use" in busy.stdout
    assert f"catch up with: python -m analysis ingest {tmp_path / 'runs' / 'smoke'}" in busy.stdout
    assert _file_steps(tmp_path / "runs" / "smoke" / run_id) == [0, 1, 2]
    con = duckdb.connect(str(db), read_only=True)
    try:
        tables = {name for (name,) in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
        assert "runs" not in tables or con.execute("SELECT count(*) FROM runs").fetchone() == (0,)
    finally:
        con.close()

    again = _sweeps(tmp_path, *args)
    assert again.returncode == 0 and "0 completed, 1 already done, 0 failed" in again.stdout, again.stdout
    assert "deferred" not in again.stdout
    assert _metric_steps(db) == {run_id: [0, 1, 2]}
