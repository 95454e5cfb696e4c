"""The variational stage graph (predmask.vr_stages): what each stage reads, in pipeline order, against a table written
out here from the family's definition (math.md §8: q_phi's traces, weighted with pi_theta0, feed the vr_* finals)."""

from __future__ import annotations

import pytest

from predmask.schemas.variational_schema import FINAL_RECIPES
from predmask.vr_stages import STAGES, stage_inputs, with_upstream

READS = {"prior": set(), "posterior": set(), "traces": {"posterior"}, "weights": {"prior", "traces"}}


def test_each_stage_reads_only_earlier_stages_as_the_family_defines() -> None:
    for stage, reads in READS.items():
        assert set(stage_inputs(stage)) == reads
        assert all(STAGES.index(r) < STAGES.index(stage) for r in reads)
    for recipe in FINAL_RECIPES:
        assert set(stage_inputs("final", recipe)) == ({"traces", "weights"} if recipe.startswith("vr_") else set())


def test_upstream_closure_and_unknown_stage() -> None:
    assert with_upstream(["weights"]) == {"weights", "prior", "traces", "posterior"}
    assert with_upstream(["traces"]) == {"traces", "posterior"} and with_upstream([]) == set()
    with pytest.raises(ValueError, match="unknown stage 'dpo'; allowed: prior, posterior, traces, weights, final"):
        stage_inputs("dpo")


def test_the_cluster_graph_adds_pi_theta0_samples_for_rft_and_an_eval_per_model() -> None:
    from predmask.vr_stages import CLUSTER_STAGES

    assert set(stage_inputs("rft_samples", cluster=True)) == {"prior"}
    for recipe in FINAL_RECIPES:
        reads = {"traces", "weights"} if recipe.startswith("vr_") else {"rft_samples"} if recipe == "rft" else set()
        assert set(stage_inputs("final", recipe, cluster=True)) == reads
        assert stage_inputs("eval", recipe, cluster=True) == ("final",)
    assert stage_inputs("eval", "prior", cluster=True) == ("prior",)
    for stage in CLUSTER_STAGES:  # pipeline order: every stage reads only earlier ones
        for recipe in (*FINAL_RECIPES, "prior"):
            assert all(CLUSTER_STAGES.index(r) < CLUSTER_STAGES.index(stage)
                       for r in stage_inputs(stage, recipe, cluster=True))
    assert with_upstream(["rft_samples"], cluster=True) == {"rft_samples", "prior"}
    with pytest.raises(ValueError, match="unknown stage 'eval'; allowed: prior, posterior, traces, weights, final$"):
        stage_inputs("eval")  # the CPU engine has no eval stage
