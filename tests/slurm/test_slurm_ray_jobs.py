"""Integration tests of the launch layer (launch/) on the real emulated Slurm cluster (scripts/slurm-emulated.sh start).

Every job goes through submitit -> sbatch -> srun -> slurmd. The command of each job is a small CPU program
(tests/slurm/ray_standin.py) standing in for VeRL's trainer; nothing else is replaced: the Ray head and
workers are real `ray start` processes, one per emulated node, and the GPUs are the cluster's GPU tokens.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from launch.command_job import CommandJob
from launch.executor import make_executor
from launch.follow import follow
from launch.ray_job import RayJob
from launch.ray_slurm import ray_options
from launch.slurm import slurm_job_state

pytestmark = pytest.mark.slurm


def _ray_processes_mentioning(text: str) -> list[int]:
    needle = text.encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_four_node_job_starts_ray_head_and_three_workers(
    tmp_path: Path, cluster_cfg: dict, jobs: Any, standin: Any
) -> None:
    """4 nodes x 8 GPUs: Ray sees 4 alive nodes and 32 GPUs, a task runs on every node, and the job stops
    only its own Ray processes (a bystander Ray head on the same machine survives)."""
    bystander_dir = Path(tempfile.mkdtemp(prefix="rb-", dir="/tmp"))  # short: Ray's unix sockets live here
    bystander_log = tmp_path / "bystander.log"
    bystander = subprocess.Popen(
        [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--num-cpus=0",
         "--include-dashboard=false", "--port=0", f"--temp-dir={bystander_dir}", "--disable-usage-stats"],
        env={**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"},
        stdout=bystander_log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        executor = make_executor(tmp_path / "submitit", cluster_cfg, name="ray4x8")
        run_dir = tmp_path / "run"
        out = run_dir / "probe.json"
        job = jobs.track(
            executor.submit(
                RayJob(
                    command=standin("probe", "--out", str(out)),
                    run_dir=str(run_dir),
                    ray=ray_options(cluster_cfg),
                )
            )
        )
        t0 = time.monotonic()
        head = jobs.wait(job, timeout_s=240)
        elapsed = time.monotonic() - t0
        results = job.results()
        assert results[0] == head
        head, workers = results[0], results[1:]
        probe = json.loads(out.read_text())
        assert len(probe["alive_nodes"]) == 4
        assert probe["gpus"] == 32.0
        assert probe["task_nodes"] == probe["alive_nodes"]  # one pinned task executed on each of the 4 nodes
        assert head["returncode"] == 0 and head["ray_nodes"] == 4 and head["ray_gpus"] == 32.0
        assert probe["ray_address"] == head["ray_address"]
        assert [w["joined"] for w in workers] == [True, True, True]
        assert json.loads((run_dir / "exit_status.json").read_text())["returncode"] == 0
        # the job's own Ray processes are gone, another Ray on the machine is untouched
        deadline = time.monotonic() + 20
        while _ray_processes_mentioning(f"/tmp/ray-{job.job_id}-") and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _ray_processes_mentioning(f"/tmp/ray-{job.job_id}-") == []
        assert bystander.poll() is None, (
            f"a Ray the job did not start has died:\n{bystander_log.read_text()[-3000:]}"
        )
        print(f"4-node Ray job: {elapsed:.1f} s")
    finally:
        bystander.terminate()
        try:
            bystander.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(bystander.pid, 9)
        for pid in _ray_processes_mentioning(str(bystander_dir)):
            os.kill(pid, 9)
        shutil.rmtree(bystander_dir, ignore_errors=True)


def test_job_array_runs_every_task(tmp_path: Path, cluster_cfg: dict, jobs: Any, standin: Any) -> None:
    """A submitit batch of 6 single-task jobs becomes one Slurm job array whose tasks all complete."""
    cfg = {**cluster_cfg, "nodes": 1, "gpus_per_node": 0}
    executor = make_executor(tmp_path / "submitit", cfg, name="array")
    outs = [tmp_path / f"square-{x}.json" for x in range(6)]
    with executor.batch():
        submitted = [
            executor.submit(CommandJob(command=standin("square", "--x", str(x), "--out", str(o))))
            for x, o in enumerate(outs)
        ]
    for job in submitted:
        jobs.track(job)
    array_ids = {str(j.job_id).split("_")[0] for j in submitted}
    assert len(array_ids) == 1 and all("_" in str(j.job_id) for j in submitted), [j.job_id for j in submitted]
    records = [jobs.wait(j, timeout_s=120) for j in submitted]
    assert [r["returncode"] for r in records] == [0] * 6
    assert [json.loads(o.read_text())["square"] for o in outs] == [x * x for x in range(6)]
    # the result file is written just before each task exits: give Slurm a moment to record the end
    deadline = time.monotonic() + 30
    while {slurm_job_state(str(j.job_id)) for j in submitted} != {
        "COMPLETED"
    } and time.monotonic() < deadline:
        time.sleep(0.5)
    assert {slurm_job_state(str(j.job_id)) for j in submitted} == {"COMPLETED"}  # known without sacct


def test_follow_reports_a_cancelled_job_instead_of_waiting_on_it(
    tmp_path: Path, cluster_cfg: dict, jobs: Any, standin: Any
) -> None:
    """A Slurm job scancelled mid-run writes no result; the follow loop sees it leave the queue (squeue and
    scontrol, no sacct) and reports it as ended without a result."""
    cfg = {**cluster_cfg, "nodes": 1, "gpus_per_node": 0}
    executor = make_executor(tmp_path / "submitit", cfg, name="dead")
    run_dir = tmp_path / "run"
    state = run_dir / "progress.json"
    command = standin("steps", "--state", str(state), "--log", str(run_dir / "steps.jsonl"),
                      "--out", str(run_dir / "done.json"), "--total", "1000", "--sleep", "0.5")  # fmt: skip
    job = jobs.track(executor.submit(CommandJob(command=command, run_dir=str(run_dir))))
    cancelled = False

    def cancel_once_running(active: Any) -> None:
        nonlocal cancelled
        if not cancelled and state.exists():
            subprocess.run(["scancel", str(job.job_id)], check=True, timeout=30)
            cancelled = True

    [end] = follow([("run", job)], on_poll=cancel_once_running, poll_s=0.5)
    assert cancelled and not job.done()
    assert (end.key, end.ok, end.result) == ("run", False, None)
    assert end.error == f"job {job.job_id} ended without a result (cancelled or killed)"
    assert not (run_dir / "done.json").exists()


def test_requeued_run_resumes_from_its_progress(
    tmp_path: Path, cluster_cfg: dict, jobs: Any, standin: Any
) -> None:
    """`scontrol requeue` mid-run: Slurm restarts the same job (Ray head and worker rebuilt), the command is
    rerun with the same run dir and continues from its saved step instead of starting from zero."""
    cfg = {**cluster_cfg, "nodes": 2}
    executor = make_executor(tmp_path / "submitit", cfg, name="requeue")
    run_dir = tmp_path / "run"
    state, log, out = run_dir / "progress.json", run_dir / "steps.jsonl", run_dir / "done.json"
    total = 16
    command = standin("steps", "--state", str(state), "--log", str(log), "--out", str(out), "--total", str(total),
                       "--sleep", "0.4")  # fmt: skip
    job = jobs.track(executor.submit(RayJob(command=command, run_dir=str(run_dir), ray=ray_options(cfg))))
    deadline = time.monotonic() + 180
    while not (state.exists() and json.loads(state.read_text())["step"] >= 4):
        assert time.monotonic() < deadline, f"no progress before requeue; squeue: {jobs.state(job)!r}"
        assert not job.done(), f"finished before the requeue: {job.stdout()}"
        time.sleep(0.3)
    subprocess.run(["scontrol", "requeue", str(job.job_id)], check=True, timeout=30)
    record = jobs.wait(job, timeout_s=240)
    done = json.loads(out.read_text())
    executed = [json.loads(line) for line in log.read_text().splitlines()]
    first = [e["step"] for e in executed if e["attempt"] == 0]
    second = [e["step"] for e in executed if e["attempt"] == 1]
    assert record["restart"] == 1 and record["returncode"] == 0 and record["ray_nodes"] == 2
    assert done == {"attempt": 1, "started_at": done["started_at"], "final_step": total}
    assert 4 <= done["started_at"] < total, done  # resumed mid-way ...
    assert first[:4] == [0, 1, 2, 3] and second[0] == done["started_at"]  # ... not restarted from zero
    assert sorted(set(first) | set(second)) == list(range(total))
    assert len(second) < total
    first_attempt = json.loads(
        (tmp_path / "submitit" / "ray" / f"{job.job_id}.r0" / "exit_status.json").read_text()
    )
    assert first_attempt["outcome"] == "interrupted" and first_attempt["restart"] == 0
    jobs.kill_ray(job)  # attempt 0 was killed by Slurm: remove its leftovers (temp dirs)


def test_override_with_shell_syntax_reaches_the_command_literally(
    tmp_path: Path, cluster_cfg: dict, jobs: Any, standin: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Values that look like shell code arrive byte for byte in the command's argv (pickled argv, no shell)
    and in its environment (exported through the sbatch script, shell-quoted); nothing is executed."""
    monkeypatch.chdir(tmp_path)  # the sbatch script runs here: an injection would leave files here
    (tmp_path / "x").write_text("must survive")
    nasty = [
        "actor_rollout_ref.model.path=/m; rm -rf x",
        "trainer.experiment_name=$(touch pwned)",
        "data.train_files=`touch pwned2`",
        'a=it\'s "quoted" & | > out.txt',
        "*",
        "--flag=$HOME",
        "",
        "line\nbreak",
    ]
    env_value = "$(touch pwned3); echo 'hi' `id` \"$HOME\""
    cfg = {**cluster_cfg, "nodes": 1, "env": {"PREDMASK_TEST_VALUE": env_value}}
    executor = make_executor(tmp_path / "submitit", cfg, name="quoting")
    out = tmp_path / "argv.json"
    command = standin("argv", "--out", str(out), "--", *nasty)
    job = jobs.track(
        executor.submit(RayJob(command=command, run_dir=str(tmp_path / "run"), ray=ray_options(cfg)))
    )
    jobs.wait(job, timeout_s=180)
    seen = json.loads(out.read_text())
    assert seen["argv"] == nasty
    assert seen["env"] == env_value
    assert (tmp_path / "x").read_text() == "must survive"
    leftovers = {"pwned", "pwned2", "pwned3", "out.txt"} & {p.name for p in tmp_path.rglob("*")}
    assert leftovers == set()


def test_srun_gets_the_jobs_cpus_and_a_whole_node_job_all_its_memory(
    tmp_path: Path, cluster_cfg: dict, jobs: Any, standin: Any
) -> None:
    """The srun that launches a task is given the job's CPUs per task (srun of Slurm 22.05 to 23.02 no longer reads
    sbatch's, and submitit's srun line has none), read from the running srun's own argv (``scontrol show step``
    names its pid); a job of whole nodes with ``mem_gb: null`` asks for all their memory (``--mem=0``), which the
    emulated cluster (memory not consumable) runs as it is."""
    cfg = {**cluster_cfg, "nodes": 1, "gpus_per_node": 0, "cpus_per_task": 2, "mem_gb": None,
           "slurm_additional_parameters": {"exclusive": True}}
    executor = make_executor(tmp_path / "submitit", cfg, name="resources")
    out = tmp_path / "step.json"
    record = jobs.wait(jobs.track(executor.submit(CommandJob(command=standin("step", "--out", str(out))))), 120)
    seen = json.loads(out.read_text())
    assert record["returncode"] == 0
    assert seen["srun"][0].endswith("srun") and "--cpus-per-task=2" in seen["srun"], seen["srun"]
    assert seen["job"]["CPUs/Task"] == "2" and seen["job"]["MinMemoryNode"] == "0", seen["job"]
    assert seen["job"]["OverSubscribe"] == "NO", seen["job"]  # --exclusive: whole nodes
