"""Unit tests of the launch layer (launch/) that need no cluster: executors from the cluster configs, sbatch text,
shell quoting (checked by running bash itself), option validation, and CommandJob and the follow loop on
submitit's local executor (real subprocesses, no mocks)."""

from __future__ import annotations

import json
import os
import pickle
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from launch.command_job import CommandFailedError, CommandJob
from launch.executor import job_python, make_executor, sbatch_script, setup_lines
from launch.follow import follow
from launch.ray_job import RayJob
from launch.ray_slurm import JobContext, RayOptions, ray_options
from launch.shell import shell_join
from launch.slurm import NodeAddressError, gpus_per_node_from_env, node_address

CONF = Path(__file__).resolve().parents[2] / "conf" / "cluster"
NASTY = [
    "; rm -rf x",
    "$(touch pwned)",
    "`touch pwned2`",
    'it\'s "quoted" & | > out.txt',
    "$HOME *",
    "",
    "line\nbreak",
    "back\\slash",
]


def _sbatch(cluster: str, **overrides: Any) -> str:
    cfg = OmegaConf.merge(OmegaConf.load(CONF / f"{cluster}.yaml"), overrides)
    executor = make_executor("/tmp/predmask-unused", cfg, name="run")
    return executor._executor._make_submission_file_text("python -m x", "uid")


def test_cluster_configs_give_four_nodes_with_eight_gpus_each() -> None:
    for cluster in ("slurm_emulated", "h20_4x8"):
        text = _sbatch(cluster)
        for flag in ("--nodes=4", "--ntasks-per-node=1", "--gpus-per-node=8", "--partition=h20"):
            assert f"#SBATCH {flag}\n" in text, (cluster, flag)
    assert "#SBATCH --exclusive\n" in _sbatch("h20_4x8")
    assert "#SBATCH --time=2880\n" in _sbatch("h20_4x8")
    assert "#SBATCH --signal=USR2@300\n" in _sbatch("h20_4x8")
    assert (
        ray_options(OmegaConf.load(CONF / "h20_4x8.yaml")).num_cpus == 64
    )  # interpolated from cpus_per_task


def test_sbatch_exports_are_shell_quoted_and_arrive_literally(tmp_path: Path) -> None:
    """Run the generated export lines with bash: every value comes back byte for byte, nothing executes."""
    env = {f"V{i}": value for i, value in enumerate(NASTY)}
    lines = setup_lines({"setup": [], "env": {}}, env)
    script = "\n".join(lines) + "\n" + "".join(f'printf "%s\\0" "$V{i}"\n' for i in range(len(NASTY)))
    out = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, check=True)
    assert out.stdout.split(b"\0")[:-1] == [v.encode() for v in NASTY]
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    # the same lines are what the Slurm executor writes into the sbatch script
    assert "\n".join(lines) in _sbatch("slurm_emulated", env=env)


def test_setup_lines_load_modules_activate_the_env_and_export_in_order(tmp_path: Path) -> None:
    """The structured setup keys as real shell lines, run by bash: ``module`` (a function standing in for the
    site's Environment Modules) gets every name literally, the venv's own activate script runs, nothing else."""
    venv = tmp_path / "my env"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "activate").write_text('export ACTIVATED="$VIRTUAL_ENV_MARK"; echo activate >> order\n')
    modules = ["cuda/12.4", *NASTY[:4]]
    lines = setup_lines({"modules": modules, "activate": str(venv), "setup": ["echo setup >> order"],
                         "env": {"VIRTUAL_ENV_MARK": "$(touch pwned)"}})
    assert lines[:len(modules)] == [f"module load {shlex.quote(m)}" for m in modules]
    assert lines[len(modules)] == f"source {shlex.quote(str(venv / 'bin' / 'activate'))}"
    script = ('module() { printf "%s\\0" "$@" >> modules; echo module >> order; }\n' + "\n".join(lines)
              + '\nprintf "%s" "$VIRTUAL_ENV_MARK" > mark\n')
    subprocess.run(["bash", "-c", script], cwd=tmp_path, check=True)
    assert (tmp_path / "modules").read_bytes().split(b"\0")[:-1] == [
        w.encode() for m in modules for w in ("load", m)]
    assert (tmp_path / "order").read_text().split() == ["module"] * len(modules) + ["activate", "setup"]
    assert (tmp_path / "mark").read_text() == "$(touch pwned)"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mark", "modules", "my env", "order"]
    conda = setup_lines({"conda": "predmask env"})
    assert conda == ['eval "$(conda shell.bash hook)"', "conda activate 'predmask env'"]
    with pytest.raises(ValueError, match="set one of them, not both"):
        setup_lines({"activate": "/venv", "conda": "base"})


def test_the_job_interpreter_is_the_clusters_and_this_hosts_when_none_is_named() -> None:
    h20 = OmegaConf.to_container(OmegaConf.load(CONF / "h20_4x8.yaml"), resolve=True)
    assert job_python(h20) == "python3"
    assert job_python({**h20, "python": None}) == sys.executable  # a cluster that is this host
    assert job_python({"backend": "local", "python": None}) == sys.executable
    # a local cluster may name another environment of this checkout (verl_cpu: .venv-verl), relative to the checkout
    assert job_python({"backend": "local", "python": ".venv-verl/bin/python"}) == str(
        Path(__file__).resolve().parents[2] / ".venv-verl" / "bin" / "python")
    assert job_python({"backend": "local", "python": "/opt/env/bin/python"}) == "/opt/env/bin/python"
    assert "\n# setup\n" in sbatch_script("/f", h20) and " python3 -u -m submitit.core._submit /f\n" in \
        sbatch_script("/f", h20)
    with pytest.raises(ValueError, match="cluster python must be an interpreter command"):
        job_python({"backend": "slurm", "python": " "})


@pytest.mark.skipif(shutil.which("srun") is None, reason="submitit's Slurm executor needs srun on PATH")
@pytest.mark.parametrize("cluster", ["h20_4x8", "slurm_emulated"])
def test_the_script_rendered_without_slurm_is_the_one_submitit_submits(tmp_path: Path, cluster: str) -> None:
    cfg = OmegaConf.merge(OmegaConf.load(CONF / f"{cluster}.yaml"), {"modules": ["cuda/12.4"], "mem_gb": 900})
    executor = make_executor(tmp_path / "submitit", cfg, name="predmask-x-1", env={"A": "b c"})
    inner = executor._executor
    submitted = inner._make_submission_file_text(inner._submitit_command_str, "uid")
    assert sbatch_script(tmp_path / "submitit", cfg, name="predmask-x-1", env={"A": "b c"}) == submitted
    assert "#SBATCH --job-name=predmask-x-1\n" in submitted and "#SBATCH --mem=900GB\n" in submitted
    assert "\nmodule load cuda/12.4\n" in submitted and "\nexport A='b c'\n" in submitted


def _srun_line(text: str) -> list[str]:
    (line,) = [line for line in text.splitlines() if line.startswith("srun ")]
    return shlex.split(line)


def test_srun_gets_the_jobs_cpus_per_task_and_whole_nodes_all_their_memory() -> None:
    """The sbatch text of both cluster configs: submitit's srun line carries the job's --cpus-per-task (srun of
    Slurm 22.05 to 23.02 does not inherit sbatch's); mem_gb null asks for all of each node's memory (--mem=0) on a
    job of whole nodes (h20_4x8: exclusive), nothing on a job that shares them (the emulated cluster, or h20_4x8
    without exclusive, as the token-level study's workers run); a number of GB is that number."""
    h20 = OmegaConf.to_container(OmegaConf.load(CONF / "h20_4x8.yaml"), resolve=True)
    emulated = OmegaConf.to_container(OmegaConf.load(CONF / "slurm_emulated.yaml"), resolve=True)
    text = sbatch_script("/f", h20)
    srun = _srun_line(text)
    assert srun[srun.index("--cpus-per-task=64") + 1:] == ["python3", "-u", "-m", "submitit.core._submit", "/f"]
    assert "#SBATCH --cpus-per-task=64\n" in text and "#SBATCH --mem=0\n" in text and "#SBATCH --exclusive\n" in text
    text = sbatch_script("/f", emulated)
    assert "--cpus-per-task=1" in _srun_line(text) and "--mem" not in text
    shared = sbatch_script("/f", {**h20, "slurm_additional_parameters": {}})
    assert "--mem" not in shared and "--exclusive" not in shared
    assert "#SBATCH --mem=900GB\n" in sbatch_script("/f", {**h20, "mem_gb": 900})
    no_cpus = sbatch_script("/f", {**emulated, "cpus_per_task": None})
    assert not any(arg.startswith("--cpus-per-task") for arg in _srun_line(no_cpus))
    per_cpu = sbatch_script("/f", {**h20, "slurm_additional_parameters": {"exclusive": True, "mem-per-cpu": "8G"}})
    assert "#SBATCH --mem-per-cpu=8G\n" in per_cpu and "--mem=" not in per_cpu
    with pytest.raises(ValueError, match=re.escape("cluster mem_gb=900 and slurm_additional_parameters.mem: set one")):
        sbatch_script("/f", {**h20, "mem_gb": 900, "slurm_additional_parameters": {"mem": "100G"}})


def test_shell_join_round_trips_through_a_shell(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import json,sys; print(json.dumps(sys.argv[1:]))", *NASTY]
    out = subprocess.run(
        ["bash", "-c", shell_join(argv)], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout) == NASTY
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        ({"backend": "pbs"}, "cluster backend 'pbs' is not one of ['local', 'slurm']"),
        ({"backend": "local", "nodes": 4}, "the local backend runs on one node, got nodes=4"),
        ({"backend": "slurm", "nodes": 0}, "cluster nodes must be a positive integer, got 0"),
        ({"backend": "slurm", "env": {"1BAD": "x"}}, "bad environment variable name '1BAD'"),
    ],
)
def test_bad_cluster_config_is_one_clear_error(tmp_path: Path, cfg: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        make_executor(tmp_path, cfg)


def test_bad_ray_options_name_the_allowed_keys() -> None:
    with pytest.raises(ValueError, match=r"unknown ray option\(s\) \['num_cpu'\]; allowed: \["):
        RayOptions.from_mapping({"num_cpu": 2})
    with pytest.raises(ValueError, match="ray.num_cpus must be >= 1, got 0"):
        RayOptions(num_cpus=0)
    with pytest.raises(ValueError, match="command must be a non-empty argv list"):
        RayJob(command="python -m verl.trainer.main_ppo")


@pytest.mark.parametrize(("value", "gpus"), [("8", 8), ("h20:8", 8), ("gpu:h20:4(IDX:0-3)", 4), ("", 0)])
def test_gpus_per_node_from_slurm_environment(value: str, gpus: int) -> None:
    assert gpus_per_node_from_env({"SLURM_GPUS_PER_NODE": value}) == gpus


def test_node_address_resolves_known_hosts_and_names_unknown_ones() -> None:
    assert node_address("localhost").startswith("127.")
    with pytest.raises(NodeAddressError, match="cannot resolve node 'no-such-node-"):
        node_address("no-such-node-7f3a")


def test_nodes_of_one_job_get_disjoint_worker_port_ranges(tmp_path: Path) -> None:
    ranges = [
        JobContext("123", 0, rank, rank, 4, ["n"] * 4, 8, tmp_path, RayOptions()).worker_ports()
        for rank in range(4)
    ]
    ports = [set(range(low, high + 1)) for low, high in ranges]
    assert all(10002 <= low and high <= 32767 for low, high in ranges)
    assert sum(len(p) for p in ports) == len(set().union(*ports)) == 4 * 1000


def test_ray_job_pickles_and_checkpoint_requeues_the_same_callable() -> None:
    job = RayJob(
        command=["python", "-c", "pass"], run_dir="/r", env={"A": "$(x)"}, ray=RayOptions(num_cpus=2)
    )
    clone = pickle.loads(pickle.dumps(job))
    assert clone == job
    delayed = job.checkpoint()
    assert delayed.function is job and delayed.args == () and delayed.kwargs == {}


def test_command_job_on_the_local_executor_records_its_exit_status(tmp_path: Path) -> None:
    executor = make_executor(tmp_path / "submitit", {"backend": "local", "timeout_min": 5})
    script = (
        "import json,os,sys; json.dump({'argv': sys.argv[1:], 'cwd': os.getcwd()}, open('argv.json', 'w'))"
    )
    ok = executor.submit(
        CommandJob(command=[sys.executable, "-c", script, *NASTY], run_dir=str(tmp_path / "ok"))
    )
    bad = executor.submit(
        CommandJob(command=[sys.executable, "-c", "raise SystemExit(3)"], run_dir=str(tmp_path / "bad"))
    )
    record = ok.result()
    assert record["outcome"] == "completed" and record["returncode"] == 0
    assert json.loads((tmp_path / "ok" / "argv.json").read_text())["argv"] == NASTY
    assert json.loads((tmp_path / "ok" / "exit_status.json").read_text())["outcome"] == "completed"
    with pytest.raises(Exception, match="CommandFailedError: command exited with status 3"):
        bad.result()
    status = json.loads((tmp_path / "bad" / "exit_status.json").read_text())
    assert (status["outcome"], status["returncode"]) == ("failed", 3)
    assert issubclass(CommandFailedError, RuntimeError)


def test_follow_reports_every_job_once_with_its_result_its_error_or_its_death(tmp_path: Path) -> None:
    """follow pulls its jobs lazily (never more than max_parallel followed at once) and ends each exactly once:
    a result, the command's failure, and a job killed with SIGKILL (no result: reported, not waited on)."""
    executor = make_executor(tmp_path / "submitit", {"backend": "local", "timeout_min": 5})
    commands = {
        "ok": [sys.executable, "-c", "print('fine')"],
        "bad": [sys.executable, "-c", "raise SystemExit(3)"],
        "killed": [sys.executable, "-c", "import time; time.sleep(120)"],
    }
    pulled: list[str] = []
    widest = 0

    def submitted() -> Any:
        for key, command in commands.items():
            pulled.append(key)
            yield key, executor.submit(CommandJob(command=command, run_dir=str(tmp_path / key)))

    def on_poll(active: Any) -> None:
        nonlocal widest
        widest = max(widest, len(active))
        job = active.get("killed")
        if job is not None and (tmp_path / "killed").is_dir():  # the job is running its command
            os.kill(job._process.pid, signal.SIGKILL)

    ends = follow(submitted(), max_parallel=1, on_poll=on_poll, poll_s=0.1)
    assert pulled == [e.key for e in ends] == ["ok", "bad", "killed"] and widest == 1
    ok, bad, killed = ends
    assert ok.ok and ok.result["outcome"] == "completed" and ok.error is None
    assert not bad.ok and bad.result is None and bad.error is not None
    assert "CommandFailedError: command exited with status 3" in bad.error
    assert not killed.ok and killed.error is not None
    with pytest.raises(ValueError, match=re.escape("max_parallel must be >= 1 or None, got 0")):
        follow([], max_parallel=0)
