"""The dry-run plan of a sweep and the path check before submission: `python -m sweeps` as real subprocesses
with Slurm's tools off PATH and no SLURM_CONF (a laptop), the plan's numbers against the figures worked out by
hand for the paper's cluster sweep, real files for the data and model paths."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sweeps.families import expand
from sweeps.plan import check_paths, max_parallel, plan_summary
from sweeps.run_dirs import read_state

DATA_FILES = ("dapo_math_13k.parquet", "aime24.parquet", "aime25.parquet")


def _laptop_env(tmp: Path, **extra: str) -> dict[str, str]:
    """This environment without Slurm: PATH holds only the interpreter's own bin directory, no SLURM_CONF."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env.update(PATH=os.path.dirname(sys.executable), PREDMASK_DB=str(tmp / "db.duckdb"),
               PREDMASK_RUNS=str(tmp / "runs"), PREDMASK_DATA_DIR=str(tmp / "data"),
               PREDMASK_MODEL_ROOT=str(tmp / "models"), **extra)
    for tool in ("srun", "sbatch", "squeue", "sinfo"):
        assert shutil.which(tool, path=env["PATH"]) is None, f"{tool} is still on the test's PATH"
    return env


def _sweeps(tmp: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sweeps", *args], cwd=tmp, env=_laptop_env(tmp, **env),
                          capture_output=True, text=True, timeout=300, check=False)


def _prepare(tmp: Path, models: tuple[str, ...]) -> None:
    (tmp / "data").mkdir()
    for name in DATA_FILES:
        (tmp / "data" / name).write_bytes(b"")
    for model in models:
        (tmp / "models" / model).mkdir(parents=True)


def test_cluster_dry_run_without_slurm_opens_with_the_plan_of_the_main_comparison(tmp_path: Path) -> None:
    """16 cells x 1 seed -> 16 jobs of 4 nodes x 8 GPUs; max_parallel 16 -> 512 GPUs at once; 2880 min per
    attempt -> 16 x 32 x 48 h = 24,576 GPU-hours, x 11 with the 10 requeues after a time-out."""
    _prepare(tmp_path, models=("Qwen3-4B-Base",))
    out = _sweeps(tmp_path, "main_comparison", "cluster=h20_4x8", "--dry-run", "--format", "json")
    assert out.returncode == 0, out.stderr
    payload = json.loads(out.stdout)
    summary, records = payload["summary"], payload["runs"]
    assert {k: summary[k] for k in ("jobs", "nodes_per_job", "resource", "per_node", "per_job", "max_parallel",
                                    "at_once", "timeout_min", "worst_case_hours", "max_num_timeout",
                                    "worst_case_hours_with_requeues", "partition", "backend", "trainer")} == {
        "jobs": 16, "nodes_per_job": 4, "resource": "GPU", "per_node": 8, "per_job": 32, "max_parallel": 16,
        "at_once": 512, "timeout_min": 2880, "worst_case_hours": 24576.0, "max_num_timeout": 10,
        "worst_case_hours_with_requeues": 24576.0 * 11, "partition": "h20", "backend": "slurm", "trainer": "verl"}
    assert summary["submit"] == "python -m sweeps main_comparison cluster=h20_4x8"
    data, models = tmp_path / "data", tmp_path / "models"
    assert {(p["kind"], p["path"], p["exists"], p["runs"]) for p in summary["paths"]} == {
        *{("data", str(data / name), True, 16) for name in DATA_FILES},
        ("model", str(models / "Qwen3-4B-Base"), True, 4), ("model", str(models / "Qwen3-8B-Base"), False, 4),
        ("model", str(models / "Qwen3-30B-A3B-Base"), False, 8)}
    assert len(records) == 16 and len({r["run_id"] for r in records}) == 16 and {r["seed"] for r in records} == {0}
    for rec in records:
        cmd, sbatch = rec["command"], rec["sbatch"]
        assert cmd[:3] == ["python3", "-m", "predmask.verl.launch"]  # the cluster's interpreter, not this host's
        assert "trainer.nnodes=4" in cmd and "trainer.n_gpus_per_node=8" in cmd
        assert f"actor_rollout_ref.actor.policy_loss.loss_mode={rec['method']}" in cmd
        assert ("actor_rollout_ref.rollout.quantization=fp8" in cmd) == rec["precision"].startswith("fp8")
        assert ("predmask.top_k=20" in cmd) == (rec["method"] != "grpo_clip_higher")  # K of the rollout support
        for flag in ("--nodes=4", "--gpus-per-node=8", "--time=2880", "--partition=h20",
                     f"--job-name=predmask-main_comparison-{rec['run_id']}"):
            assert f"\n#SBATCH {flag}\n" in sbatch, flag
        assert f"\n#   {shlex.join(cmd)}\n" in sbatch  # the trainer command, one comment line
        assert f" python3 -u -m submitit.core._submit {tmp_path / 'runs' / 'main_comparison' / '.submitit'}\n" \
            in sbatch
        written = tmp_path / "runs" / "main_comparison" / "dry-run" / f"{rec['run_id']}.cmd"
        assert shlex.split(written.read_text()) == cmd
    assert sum(r["precision"].startswith("fp8") for r in records) == 8
    assert json.loads((tmp_path / "runs" / "main_comparison" / "dry-run" / "plan.json").read_text()) == payload
    assert not (tmp_path / "db.duckdb").exists()

    text = _sweeps(tmp_path, "main_comparison", "cluster=h20_4x8", "--dry-run")
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    start = lines.index("plan: main_comparison on h20_4x8 (slurm, verl trainer): 16 runs (16 cells x 1 seed)")
    assert lines[0].startswith(f"WARNINGS ({start - 1}): ")  # the risks first (tests/sweeps/test_plan_warnings.py)
    assert "  jobs             16, each 4 nodes x 8 GPUs = 32 GPUs" in lines[start:start + 8]
    assert "  at once          512 GPUs (max_parallel 16)" in lines[start:start + 8]
    assert any(line.startswith("  worst case       24,576 GPU-hours") for line in lines[start:start + 8])
    assert f"    model MISSING {models / 'Qwen3-8B-Base'}  (4 runs)  -> download the model to this path, or set " \
           "model.path=DIR" in lines
    assert lines[-1] == "  submit           python -m sweeps main_comparison cluster=h20_4x8"
    for rec in records:  # never wrapped: every command and comment line comes out whole
        assert shlex.join(rec["command"]) in lines and f"#   {shlex.join(rec['command'])}" in lines


def test_local_dry_run_has_the_same_plan_shape_in_cpu_cores() -> None:
    cluster = expand("main_comparison", ["cluster=h20_4x8"])
    local = expand("smoke")
    big = plan_summary(cluster, max_parallel(cluster), "x")
    small = plan_summary(local, max_parallel(local), "python -m sweeps smoke")
    assert small.keys() == big.keys()
    assert {k: small[k] for k in ("jobs", "nodes_per_job", "resource", "per_node", "per_job", "max_parallel",
                                  "at_once", "timeout_min", "worst_case_hours", "partition", "paths")} == {
        "jobs": 4, "nodes_per_job": 1, "resource": "CPU core", "per_node": 1, "per_job": 1, "max_parallel": 2,
        "at_once": 2, "timeout_min": 24 * 60, "worst_case_hours": 4 * 24.0, "partition": None, "paths": []}
    assert plan_summary(local, max_parallel(local, 9), "x")["at_once"] == 4  # never more than the jobs


def test_a_missing_path_refuses_the_submission_in_one_line_and_writes_nothing(tmp_path: Path) -> None:
    args = ("smoke", "cluster=h20_4x8", "method=dppo_topk_kl")
    no_data = _sweeps(tmp_path, *args)
    assert no_data.returncode == 2
    assert no_data.stderr.strip().splitlines() == [
        (f"error: data path {tmp_path / 'data' / DATA_FILES[0]} does not exist: python -m sweeps.datasets prepare --out "
        f"{tmp_path / 'data'} (3 more missing paths: see --dry-run); nothing submitted "
        "(cluster.check_paths=false skips this check)")]
    _prepare(tmp_path, models=())
    no_model = _sweeps(tmp_path, *args)
    assert no_model.returncode == 2
    assert no_model.stderr.strip().splitlines() == [
        (f"error: model path {tmp_path / 'models' / 'Qwen3-4B-Base'} does not exist: download the model to this "
        "path, or set model.path=DIR; nothing submitted (cluster.check_paths=false skips this check)")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]  # no runs/, no database


def test_every_path_present_or_the_check_skipped_passes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREDMASK_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("PREDMASK_MODEL_ROOT", str(tmp_path / "models"))
    specs = expand("smoke", ["cluster=h20_4x8", "method=dppo_topk_kl"])
    with pytest.raises(ValueError, match="does not exist"):
        check_paths(specs)
    check_paths(expand("smoke", ["cluster=h20_4x8", "method=dppo_topk_kl", "cluster.check_paths=false"]))
    _prepare(tmp_path, models=("Qwen3-4B-Base",))
    check_paths(specs)
    assert read_state(tmp_path / "runs" / "none").status == "new"  # nothing was created by the checks
    assert not (tmp_path / "runs").exists()


def test_the_plan_takes_the_skipped_old_log_prob_forward_off_the_rollout_anchored_runs() -> None:
    """main_comparison: the runs whose method anchors on the rollout (every method but GRPO clip-higher, anchored
    on pi_old) skip verl's forward; each such job's 32 GPUs x 48 h lose the assumed share; the CPU engine's plan
    has no such line."""
    from predmask.methods import method_anchor
    from predmask.verl.trainer_hook import ASSUMED_OLD_LOG_PROB_SHARE
    from sweeps.plan import summary_lines

    cluster = expand("main_comparison", ["cluster=h20_4x8"])
    rollout = [spec for spec in cluster if method_anchor(spec.config["method"]) == "rollout"]
    assert {spec.config["method"]["name"] for spec in cluster} - {spec.config["method"]["name"] for spec in rollout} \
        == {"grpo_clip_higher"}
    s = plan_summary(cluster, max_parallel(cluster), "x")
    assert s["old_log_prob_skipped"] == len(rollout) > 0
    assert s["worst_case_hours_with_skip"] == pytest.approx(
        24576.0 - len(rollout) * 32 * 48 * ASSUMED_OLD_LOG_PROB_SHARE)
    assert any(line.startswith(f"  old log-prob     {len(rollout)} of 16 runs skip") for line in summary_lines(s))
    local = expand("smoke")
    assert not any("old log-prob" in line for line in summary_lines(plan_summary(local, 1, "x")))


def test_the_plan_says_what_the_runs_attend_with() -> None:
    """main_comparison on h20_4x8: the 8 FSDP runs (Qwen3-4B, 8B) load their model with the cluster's
    flash_attention_2, which needs flash_attn on the nodes; the 8 Megatron runs (30B-A3B) use Megatron's own;
    cluster.attn_implementation=sdpa needs nothing more; the variational sweep's SFT stages and grpo run load theirs
    (its vLLM stages none); the CPU engine's plan has no such line."""
    from predmask.vr_stages import SFT_STAGES
    from sweeps.plan import summary_lines

    def attention(sweep: str, *overrides: str) -> tuple[list[dict], list[str]]:
        specs = expand(sweep, ["cluster=h20_4x8", *overrides])
        s = plan_summary(specs, max_parallel(specs), "x")
        return s["attention"], [line for line in summary_lines(s) if line.startswith("  attention")]

    summary, lines = attention("main_comparison")
    assert summary == [{"attention": "flash_attention_2", "runs": 8, "needs": "flash_attn"},
                       {"attention": "megatron", "runs": 8, "needs": None}]
    assert lines == [("  attention        flash_attention_2 for 8 runs (the nodes must import flash_attn, which "
                      "scripts/gpu_check.py checks; cluster.attn_implementation=sdpa needs nothing beyond torch); "
                      "megatron for 8 runs (Megatron's own attention, verl's megatron attention_backend; not "
                      "cluster.attn_implementation)")]
    summary, lines = attention("main_comparison", "cluster.attn_implementation=sdpa")
    assert summary[0] == {"attention": "sdpa", "runs": 8, "needs": None} and lines[0].startswith(
        "  attention        sdpa for 8 runs; megatron for 8 runs")
    vr = expand("variational_reasoning", ["cluster=h20_4x8", "model=qwen3_4b_base"])
    stages = [spec for spec in vr if spec.stage in SFT_STAGES]
    summary, _ = attention("variational_reasoning", "model=qwen3_4b_base")
    assert summary == [{"attention": "flash_attention_2", "runs": len(stages) + 1, "needs": "flash_attn"}]  # + grpo
    assert not any(line.startswith("  attention") for line in summary_lines(plan_summary(expand("smoke"), 1, "x")))
