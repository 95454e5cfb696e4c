"""Hydra config tree and sweep expansion: every config composes, every sweep expands, bad input is one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from predmask.config import group_options, stable_id
from sweeps.compose import GROUPS, SweepError, sweep_names
from sweeps.families import expand


def test_every_sweep_expands_to_its_grid() -> None:
    """Cells x seeds: 3 seeds per cell on the local CPU engine (conf/cluster/local.yaml), smoke one seed."""
    sizes = {name: len(expand(name)) for name in sweep_names()}
    assert sizes["main_comparison"] == 16 * 3
    assert sizes["tight_threshold"] == 12 * 3
    assert sizes["smoke"] == 4


def test_main_comparison_local_maps_settings_to_cpu_standins() -> None:
    runs = expand("main_comparison")
    pairs = {(r.config["model"]["name"], r.config["model"]["stands_in_for"], r.precision) for r in runs}
    assert pairs == {("cpu_s", "qwen3_4b_base", "bf16"), ("cpu_m", "qwen3_8b_base", "bf16"),
                     ("cpu_moe", "qwen3_30b_a3b_base", "fp8_rollout"), ("cpu_moe", "qwen3_30b_a3b_base", "fp8_e2e")}
    assert {r.method for r in runs} == {"grpo_clip_higher", "dppo_topk_kl", "predmask_kl_agg", "predmask_kl_uniform"}
    assert {r.delta for r in runs} == {0.15}
    assert all(r.config["method"].get("delta", 0.15) == 0.15 for r in runs)


def test_each_sweep_runs_at_its_own_delta_unless_the_command_line_sweeps_it() -> None:
    assert {r.delta for r in expand("tight_threshold")} == {0.05}
    assert {r.config["method"]["delta"] for r in expand("tight_threshold")} == {0.05}
    assert {r.delta for r in expand("tight_threshold", ["delta=0.1"])} == {0.1}


def test_cluster_runs_keep_the_paper_models() -> None:
    runs = expand("main_comparison", ["cluster=h20_4x8"])
    assert {r.model for r in runs} == {"qwen3_4b_base", "qwen3_8b_base", "qwen3_30b_a3b_base"}


def test_command_line_axes_replace_the_sweeps_own() -> None:
    runs = expand("main_comparison", ["method=dppo_topk_kl,predmask_kl_agg", "delta=0.05,0.15", "seeds=1"])
    assert len(runs) == 2 * 2 * 4
    assert {r.delta for r in runs} == {0.05, 0.15}
    assert {r.config["method"]["delta"] for r in runs} == {0.05, 0.15}


def test_run_ids_are_stable_and_ignore_launcher_keys() -> None:
    a = [r.run_id for r in expand("smoke")]
    b = [r.run_id for r in expand("smoke")]
    assert a == b and len(set(a)) == 4
    assert a == [stable_id(r.config) for r in expand("smoke")]
    cfg = expand("smoke")[0].config
    moved = json.loads(json.dumps(cfg))
    moved["run_dir"] = "/elsewhere"
    moved["cluster"] = {"name": "other"}
    assert stable_id(moved) == stable_id(cfg)
    moved["delta"] = 0.5
    assert stable_id(moved) != stable_id(cfg)


@pytest.mark.parametrize("group", [g for g in GROUPS if g not in ("sweep",)])
def test_every_option_of_every_group_composes(group: str) -> None:
    """Each config file composes into a run of the smoke sweep (the group replaced by that option)."""
    for option in group_options(group):
        key = "+setting" if group == "setting" else group
        runs = expand("smoke", [f"{key}={option}", "method=dppo_topk_kl"])
        assert runs, (group, option)


@pytest.mark.parametrize(("overrides", "message"), [
    (["method=nope"], "unknown method 'nope'; valid: dppo_binary_kl"),
    (["+setting=qwen3_4b_bf16,bad"], "unknown setting 'bad'; valid: "),
    (["precision=fp4"], "unknown precision 'fp4'; valid: bf16"),
    (["delta=0"], "delta must be a finite number > 0"),
    (["delta=-0.1"], "delta must be a finite number > 0"),
    (["delta=abc"], "delta must be a finite number > 0 (the trust-region threshold, e.g. delta=0.15), got 'abc'"),
    (["top_k=abc"], "top_k must be an integer >= 1 (K of the rollout's top-K, e.g. top_k=20), got 'abc'"),
    (["top_k=true"], "top_k must be an integer >= 1"),
])
def test_bad_input_is_one_clear_line(overrides: list[str], message: str) -> None:
    with pytest.raises(SweepError) as err:
        expand("smoke", overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_unknown_sweep_from_the_command_line(tmp_path) -> None:
    proc = subprocess.run([sys.executable, "-m", "sweeps", "nonesuch"], capture_output=True, text=True,
                          cwd=tmp_path, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: unknown sweep 'nonesuch'; valid: {', '.join(sweep_names())}"]
    assert not (tmp_path / "runs").exists()
