"""Table 1's source column: every value a run of the main comparison carries, on the cluster and on the CPU engine,
has a named source, and the values of verl's DPPO recipe are attributed to it on the cluster only.

The run configs are the real ones: ``sweeps.compose.expand_grid`` over conf/ (what ``python -m sweeps`` records)."""

from __future__ import annotations

import functools

import pytest

from reports.tables.hyperparameters import flatten
from reports.tables.value_sources import RECIPE, value_source
from sweeps.compose import expand_grid


@functools.cache
def _configs(cluster: str) -> list[dict]:
    return [spec.config for spec in expand_grid("main_comparison", [f"cluster={cluster}", "seeds=1"])]


@pytest.mark.parametrize("cluster", ["h20_4x8", "local"])
def test_every_value_of_the_main_comparison_has_a_source(cluster: str) -> None:
    missing = sorted({key for cfg in _configs(cluster) for key in flatten(cfg) if value_source(key, cfg) is None})
    assert missing == []
    assert value_source("no_such.key", _configs(cluster)[0]) is None  # an unnamed key has no source


def test_the_recipes_values_are_the_clusters_only() -> None:
    cluster = next(c for c in _configs("h20_4x8") if c["method"]["name"] == "dppo_topk_kl")
    cpu = next(c for c in _configs("local") if c["method"]["name"] == "dppo_topk_kl")
    assert (cluster["method"]["loss_agg_mode"], cluster["method"]["ratio_cap"]) == ("seq-mean-token-sum-norm", 10000.0)
    assert (cpu["method"]["loss_agg_mode"], cpu["method"]["ratio_cap"]) == ("token-mean", 10.0)
    for key in ("method.loss_agg_mode", "method.ratio_cap", "model.batch.ppo_mini_batch_prompts",
                "cluster.norm_adv_by_std"):
        assert value_source(key, cluster).startswith(RECIPE), key
    for key in ("method.loss_agg_mode", "method.ratio_cap"):
        assert value_source(key, cpu).startswith("ours:"), key
    assert value_source("delta", cluster).startswith("paper") and cluster["method"]["delta"] == 0.15
    grpo = next(c for c in _configs("h20_4x8") if c["method"]["name"] == "grpo_clip_higher")
    assert "ratio_cap" not in grpo["method"]  # a clipping method does not read the recipe's cap: not recorded
