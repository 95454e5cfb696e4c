"""The plan's warning block and expected cost, and --strict: each warning for its cause and gone once the cause is
fixed by a config override, the runs it names against the model files' own engines, the filesystem check against
written mount tables (this machine has no network filesystem to mount), and `python -m sweeps ... --strict` as real
subprocesses with Slurm's tools off PATH (a laptop), refused before anything is written."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from predmask.config import conf_dir
from sweeps.families import expand
from sweeps.plan import (
    ASSUMED_STEP_MINUTES,
    ENVIRONMENT_KEYS,
    PLACEHOLDERS,
    filesystem_type,
    plan_summary,
    plan_warnings,
    summary_lines,
)

CLUSTER = "cluster=h20_4x8"
#: every placeholder of h20_4x8.yaml set on the command line, an environment and FSDP models only: only the runs
#: root is left
SITE = ("cluster.partition=gpu", "cluster.cpus_per_task=32", "cluster.mem_gb=900", "cluster.ray.temp_root=/scratch",
        "cluster.activate=/shared/envs/predmask", "+setting=qwen3_4b_bf16,qwen3_8b_bf16")


def _mounts(tmp: Path, fstype: str) -> Path:
    """A mount table (the format of /proc/self/mounts) with ``tmp`` mounted as ``fstype`` under an ext4 root."""
    table = tmp / "mounts"
    table.write_text(f"/dev/sda1 / ext4 rw 0 0\nserver:/export {tmp} {fstype} rw 0 0\n")
    return table


def _causes(specs: list, root: Path, mounts: Path) -> dict[str, dict]:
    return {w["cause"]: w for w in plan_warnings(specs, root, mounts)}


def _expand(*overrides: str) -> list:
    return expand("main_comparison", [CLUSTER, *overrides])


@pytest.fixture(scope="module")
def main_specs() -> list:
    return expand("main_comparison", [CLUSTER])


def test_every_risk_of_the_paper_cluster_is_flagged_and_names_its_runs(main_specs: list, tmp_path: Path) -> None:
    """The shipped h20_4x8 plan: the Megatron runs (exactly those whose model file says engine: megatron), no
    environment, the four placeholders with their values, run directories on this host's ext4."""
    warnings = {w["cause"]: w for w in plan_warnings(main_specs, tmp_path / "runs", _mounts(tmp_path, "ext4"))}
    assert list(warnings) == ["unverified", "environment", "placeholder", "shared dirs"]
    engine = {name: yaml.safe_load((conf_dir() / "model" / f"{name}.yaml").read_text())["engine"]
              for name in {spec.model for spec in main_specs}}
    megatron = [spec.run_id for spec in main_specs if engine[spec.model] == "megatron"]
    assert len(megatron) == 8 and warnings["unverified"]["runs"] == megatron
    assert warnings["unverified"]["text"].startswith("8 of 16 runs use model.engine=megatron: ")
    assert "`python3` from their bare PATH" in warnings["environment"]["text"]
    assert warnings["placeholder"]["text"].startswith(
        "cluster.partition=h20, cluster.cpus_per_task=64, cluster.mem_gb=null, cluster.ray.temp_root=/tmp still hold")
    assert f"under {tmp_path / 'runs'}, on this host's ext4 filesystem" in warnings["shared dirs"]["text"]
    lines = summary_lines(plan_summary(main_specs, 16, "x", tmp_path / "runs"))
    assert lines[0].startswith("WARNINGS (4): ") and lines[5].startswith("plan: main_comparison on h20_4x8")
    assert [line.split()[1] for line in lines[1:5]] == ["unverified", "environment", "placeholder", "shared"]


@pytest.mark.parametrize(("cause", "fix"), [
    ("unverified", ["+setting=qwen3_4b_bf16,qwen3_8b_bf16"]),
    ("environment", ["cluster.activate=/shared/envs/predmask"]),
    ("environment", ["cluster.conda=predmask"]),
    ("environment", ["cluster.modules=[cuda/12.4]"]),
    ("environment", ["cluster.python=/shared/envs/predmask/bin/python"]),
    ("placeholder", ["cluster.partition=gpu", "cluster.cpus_per_task=32", "cluster.mem_gb=900",
                     "cluster.ray.temp_root=/scratch"]),
    ("placeholder", ["cluster.partition=h20", "cluster.cpus_per_task=64", "cluster.mem_gb=null",
                     "cluster.ray.temp_root=/tmp"]),  # the same values, confirmed on the command line
])
def test_each_warning_goes_once_its_cause_is_fixed(cause: str, fix: list[str], main_specs: list,
                                                  tmp_path: Path) -> None:
    mounts = _mounts(tmp_path, "ext4")
    assert cause in _causes(main_specs, tmp_path, mounts)
    after = _causes(_expand(*fix), tmp_path, mounts)
    assert cause not in after
    assert after  # the other causes stay


def test_a_placeholder_left_unset_is_still_named(tmp_path: Path) -> None:
    text = _causes(_expand("cluster.partition=gpu"), tmp_path, _mounts(tmp_path, "ext4"))["placeholder"]["text"]
    assert "partition" not in text and text.startswith("cluster.cpus_per_task=64, cluster.mem_gb=null, ")


def test_run_directories_on_a_shared_filesystem_raise_no_warning(tmp_path: Path) -> None:
    specs = _expand(*SITE)
    assert list(_causes(specs, tmp_path / "runs", _mounts(tmp_path, "xfs"))) == ["shared dirs"]
    assert _causes(specs, tmp_path / "runs", _mounts(tmp_path, "nfs4")) == {}
    assert _causes(specs, tmp_path / "runs", _mounts(tmp_path, "lustre")) == {}


def test_filesystem_type_takes_the_longest_mount_above_the_path(tmp_path: Path) -> None:
    table = tmp_path / "mounts"
    table.write_text("/dev/sda1 / ext4 rw 0 0\nsrv:/a /shared nfs rw 0 0\nsrv:/b /shared/my\\040runs lustre rw 0 0\n"
                     "tmpfs /sharedx tmpfs rw 0 0\n")
    assert filesystem_type(Path("/shared/x/runs"), table) == "nfs"  # need not exist
    assert filesystem_type(Path("/shared/my runs/a"), table) == "lustre"  # \040 is a space
    assert filesystem_type(Path("/sharedx/runs"), table) == "tmpfs"  # a prefix of the name is not a parent
    assert filesystem_type(Path("/home/me"), table) == "ext4"
    assert filesystem_type(Path("/home/me"), tmp_path / "absent") == "unknown"


def test_clusters_of_this_host_take_no_risk(tmp_path: Path) -> None:
    """The local backend and the emulated Slurm cluster (its nodes are this host: python null) warn of nothing."""
    mounts = _mounts(tmp_path, "ext4")
    assert plan_warnings(expand("smoke"), tmp_path, mounts) == []
    assert plan_warnings(expand("smoke", ["cluster=slurm_emulated"]), tmp_path, mounts) == []


def test_placeholders_are_the_keys_the_cluster_file_marks(tmp_path: Path) -> None:
    """PLACEHOLDERS and the environment keys are exactly the keys conf/cluster/h20_4x8.yaml comments as
    ``# placeholder`` (nested keys dotted), so a newly marked key cannot go unflagged."""
    marked, parents = set(), []
    for line in (conf_dir() / "cluster" / "h20_4x8.yaml").read_text().splitlines():
        match = re.match(r"^( *)([A-Za-z_]+):(.*)$", line)
        if not match:
            continue
        depth = len(match[1]) // 2
        parents[depth:] = [match[2]]
        if "# placeholder" in match[3]:
            marked.add(".".join(parents))
    assert marked == set(PLACEHOLDERS["h20_4x8"]) | (set(ENVIRONMENT_KEYS) - {"conda", "setup"})


def test_expected_cost_is_planned_steps_times_the_assumed_step_time(main_specs: list, tmp_path: Path) -> None:
    """16 runs x 500 steps (each model file's batch.total_steps) x 5 min x 32 GPUs = 21,333 GPU-hours, beside the
    24,576 of the worst case; capped per job at the requeue bound when the steps would outlast it."""
    steps = {name: yaml.safe_load((conf_dir() / "model" / f"{name}.yaml").read_text())["batch"]["total_steps"]
             for name in {spec.model for spec in main_specs}}
    s = plan_summary(main_specs, 16, "x", tmp_path)
    expected = sum(steps[spec.model] for spec in main_specs) * ASSUMED_STEP_MINUTES / 60 * 32
    assert s["expected_hours"] == pytest.approx(expected) == pytest.approx(16 * 500 * 5 / 60 * 32)
    assert s["planned_steps"] == 8000 and s["assumed_step_minutes"] == ASSUMED_STEP_MINUTES
    lines = summary_lines(s)
    worst = next(i for i, line in enumerate(lines) if line.startswith("  worst case "))
    assert lines[worst + 1] == (
        "  expected         ~21,333 GPU-hours, an estimate: 8,000 planned steps over 16 jobs x 5 min per step "
        "assumed (sweeps.plan.ASSUMED_STEP_MINUTES, not measured) x 32 GPUs")
    short = expand("main_comparison", [CLUSTER, "+setting=qwen3_4b_bf16", "cluster.timeout_min=60",
                                       "cluster.max_num_timeout=1"])
    capped = plan_summary(short, 16, "x", tmp_path)
    assert capped["expected_hours"] == pytest.approx(capped["worst_case_hours_with_requeues"])  # 4 jobs x 32 GPUs x 2 attempts of 1 h
    assert not any(line.startswith("  expected") for line in summary_lines(plan_summary(expand("smoke"), 2, "x")))


def _laptop_env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env.update(PATH=os.path.dirname(sys.executable), PREDMASK_DB=str(tmp / "db.duckdb"),
               PREDMASK_RUNS=str(tmp / "runs"), PREDMASK_DATA_DIR=str(tmp / "data"),
               PREDMASK_MODEL_ROOT=str(tmp / "models"))
    assert shutil.which("sbatch", path=env["PATH"]) is None
    return env


def _sweeps(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sweeps", "main_comparison", CLUSTER, *args], cwd=tmp,
                          env=_laptop_env(tmp), capture_output=True, text=True, timeout=300, check=False)


STRICT_LINE = ("error: --strict: {n} warning{s} remain{v} (the WARNINGS block at the top of the plan; --dry-run "
               "prints it); nothing submitted")


def test_strict_dry_run_prints_the_plan_then_refuses(tmp_path: Path) -> None:
    out = _sweeps(tmp_path, "--dry-run", "--strict")
    assert out.returncode == 2
    assert out.stderr.strip() == STRICT_LINE.format(n=4, s="s", v="")
    assert out.stdout.startswith("WARNINGS (4): ")
    assert out.stdout.rstrip().endswith("--strict")  # the submit line keeps the flag
    fixed = _sweeps(tmp_path, "--dry-run", "--strict", *SITE)
    assert fixed.returncode == 2 and fixed.stderr.strip() == STRICT_LINE.format(n=1, s="", v="s")  # the runs root


def test_strict_submit_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    """No sbatch on PATH: a submission that got past the refusal would fail at the path check or at sbatch; the
    refusal comes first, and nothing is written under the runs root. Without --strict the warnings print and the
    submission goes on to the path check (the data is missing here), as before."""
    out = _sweeps(tmp_path, "--strict")
    assert out.returncode == 2 and out.stderr.strip() == STRICT_LINE.format(n=4, s="s", v="")
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("*"))
    plain = _sweeps(tmp_path)
    assert plain.returncode == 2
    assert plain.stdout.startswith("WARNINGS (4): ")
    assert plain.stderr.startswith("error: data path ") and "nothing submitted" in plain.stderr
