"""analysis.results.curves: which logged metrics make a run's validation accuracy, the paper model a run stands
for, and how runs are keyed for pairing, on the known-values database and on hand-made inputs."""

from __future__ import annotations

import numpy as np
from report_database import GRPO_VAL

from analysis.results import curves

A24_16, A24_4, A25_16 = (
    "val-core/aime_2024/acc/mean@16",
    "val-core/aime_2024/acc/mean@4",
    "val-core/AIME2025/acc/mean@16",
)


def test_aime_names_prefer_avg_at_16():
    assert curves.aime_metric_names([A24_4, A24_16, A25_16, "val-core/math/acc/mean@16"]) == {
        "aime24": A24_16,
        "aime25": A25_16,
    }
    assert curves.aime_metric_names(["val-core/aime24/acc/mean@4", "val-core/aime24/acc/mean@8"]) == {
        "aime24": "val-core/aime24/acc/mean@8"
    }


def test_validation_is_the_mean_of_both_aime_scores(sql):
    aime = curves.aime_series(sql, ["m_grpo_e2e_s1", "sm_agg_s"])
    steps, values = curves.validation_series(aime["m_grpo_e2e_s1"])
    assert steps.tolist() == [1, 2, 3, 4]
    np.testing.assert_allclose(values, GRPO_VAL[1])  # AIME24 v - 0.02, AIME25 v + 0.02
    steps, values = curves.validation_series(aime["sm_agg_s"])  # AIME25 only at steps 4 and 6
    assert steps.tolist() == [4, 6]
    np.testing.assert_allclose(values, [1.2, 1.8])
    assert curves.validation_series({"aime24": aime["sm_agg_s"]["aime24"]}) is None


def test_paper_model():
    assert curves.paper_model("cpu_s") == "qwen3_4b_base"
    assert curves.paper_model("qwen3_4b_base") is None
    assert curves.paper_model("cpu_s", {"model": {"stands_in_for": "qwen3_8b_base"}}) == "qwen3_8b_base"
    assert curves.paper_model("gone_model") is None


class _R:
    def __init__(self, run_id: str, method: str, seed: int | None) -> None:
        self.run_id, self.method, self.seed = run_id, method, seed


def test_runs_are_keyed_by_seed_unless_seeds_do_not_identify_them():
    s = (np.array([1]), np.array([0.5]))
    runs = [_R("b0", "b", 0), _R("b1", "b", 1), _R("a0", "a", 0), _R("a0x", "a", 0), _R("c", "c", None)]
    out = curves.by_method_and_seed(
        runs, {r.run_id: s for r in runs if r.run_id != "b1"}, rank=lambda m: -ord(m)
    )
    assert list(out) == ["c", "b", "a"]  # by rank
    assert list(out["b"]) == [0]  # by seed; b1 has no series
    assert sorted(out["a"]) == ["a0", "a0x"]  # two runs of seed 0: keyed by run id
    assert list(out["c"]) == ["c"]  # no seed: run id
