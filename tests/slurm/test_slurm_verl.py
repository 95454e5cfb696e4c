"""verl 0.9.1's own trainer through the emulated Slurm cluster (``cluster=slurm_emulated_verl``): the sweep submits
each run with submitit -> sbatch -> srun on 2 emulated nodes (Ray head on rank 0, a Ray worker on rank 1) and
``predmask.verl.launch`` trains with ``trainer.nnodes=2 trainer.n_gpus_per_node=1`` on this CPU (FSDP2 on gloo, two
vLLM CPU engines).

Nothing is mocked. The run is requeued by Slurm (``scontrol requeue``) once it has logged step 2 with a checkpoint
every step; Slurm restarts the same job, verl resumes from its last checkpoint (``trainer.resume_mode=auto``), the
launcher keeps the first attempt's metrics as ``metrics.attempt-1.jsonl``, and ingest merges both attempts. Needs the
emulated cluster (``scripts/slurm-emulated.sh start``) and ``.venv-verl`` (``EXTRAS=verl-cpu bash
scripts/install.sh``). About 5 minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pytest

from launch.executor import CHECKOUT

pytestmark = [pytest.mark.slurm, pytest.mark.verl_cpu, pytest.mark.slow]

VERL_PYTHON = CHECKOUT / ".venv-verl" / "bin" / "python"
STEPS = 4
REQUEUE_AT = 2  # requeue once status.json says this step is done (its checkpoint is saved before it is logged)


def _steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def _need_verl_env() -> None:
    if not VERL_PYTHON.exists():
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{VERL_PYTHON} is missing under CI=true: .ci/run must run EXTRAS=verl-cpu bash scripts/install.sh")
        pytest.skip(f"no {VERL_PYTHON}: EXTRAS=verl-cpu bash scripts/install.sh builds it")


def test_requeued_verl_run_resumes_from_its_checkpoint(slurm_cluster: dict, tmp_path: Path) -> None:
    _need_verl_env()
    env = {**os.environ, "PREDMASK_DB": str(tmp_path / "db.duckdb"), "PREDMASK_RUNS": str(tmp_path / "runs"),
           "PREDMASK_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1", "SLURM_CONF": slurm_cluster["slurm_conf"]}
    args = [sys.executable, "-m", "sweeps", "smoke", "cluster=slurm_emulated_verl", "method=dppo_topk_kl",
            f"trainer.steps={STEPS}", f"trainer.val_every={STEPS}", "trainer.save_every=1"]
    log = (tmp_path / "sweep.log").open("w")
    sweep = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 900
        run_dir = status = None
        while True:  # the run's directory, then its step
            assert sweep.poll() is None, f"sweep ended before the requeue:\n{(tmp_path / 'sweep.log').read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no step {REQUEUE_AT} in time:\n{(tmp_path / 'sweep.log').read_text()[-3000:]}"
            found = [p for p in (tmp_path / "runs" / "smoke").glob("*/status.json")]
            if found:
                run_dir = found[0].parent
                status = json.loads(found[0].read_text())
                if status["status"] == "running" and status["step"] >= REQUEUE_AT:
                    break
            time.sleep(1)
        job_id = json.loads((run_dir / "job.json").read_text())["job_id"]
        subprocess.run(["scontrol", "requeue", str(job_id)], check=True, timeout=30)
        code = sweep.wait(timeout=max(60.0, deadline - time.monotonic()))
    finally:
        if sweep.poll() is None:
            sweep.kill()
            record_file = run_dir / "job.json" if run_dir else None
            job = json.loads(record_file.read_text())["job_id"] if record_file and record_file.is_file() else None
            if job:  # the sweep leaves Slurm jobs running when it stops: this one is the test's
                subprocess.run(["scancel", str(job)], check=False, timeout=30)
        log.close()
    out = (tmp_path / "sweep.log").read_text()
    assert code == 0, out[-3000:]
    assert json.loads((run_dir / "status.json").read_text())["status"] == "completed"
    # Slurm restarted the same job: the record of its second attempt, on 2 Ray nodes
    record = json.loads((run_dir / "exit_status.json").read_text())
    assert (record["job_id"], record["restart"], record["returncode"], record["ray_nodes"]) == (job_id, 1, 0, 2)
    # the first attempt's metrics kept aside; the second began at its checkpoint (verl validates at the loaded step
    # first), not at step 0, and trained only the steps after it
    first, second = _steps(run_dir / "metrics.attempt-1.jsonl"), _steps(run_dir / "metrics.jsonl")
    assert first[: REQUEUE_AT + 1] == list(range(REQUEUE_AT + 1)), first
    resumed_at = second[0]
    assert REQUEUE_AT <= resumed_at < STEPS and resumed_at <= first[-1], (first, second)
    assert (run_dir / "checkpoints" / f"global_step_{resumed_at}").is_dir()
    assert second[1:] == list(range(resumed_at + 1, STEPS + 1)), second
    # the database: every training step exactly once, from both attempts merged
    con = duckdb.connect(str(tmp_path / "db.duckdb"), read_only=True)
    try:
        steps = [r[0] for r in con.execute(
            "SELECT step FROM metrics WHERE name = 'training/global_step' ORDER BY step").fetchall()]
        dupes = con.execute("SELECT name, step, count(*) FROM metrics GROUP BY name, step HAVING count(*) > 1"
                            ).fetchall()
    finally:
        con.close()
    assert steps == list(range(1, STEPS + 1)), steps
    assert dupes == []
