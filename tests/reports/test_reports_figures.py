"""What each figure draws: the plotted arrays against values computed by hand from the test database."""

from __future__ import annotations

import math
import statistics
import types

import duckdb
import numpy as np
import pytest
from numpy.testing import assert_allclose

from analysis.token_level import stats
from reports import artefact, figures, registry, tables

QWEN4 = "Qwen3-4B-Base · BF16"
QWEN8 = "Qwen3-8B-Base · BF16"
ROLLOUT = "Qwen3-30B-A3B-Base · FP8 Rollout"
E2E = "Qwen3-30B-A3B-Base · FP8 E2E"


def _xy(series):
    return list(np.asarray(series.x)), list(np.asarray(series.y))


def test_fig1_val_accuracy_is_the_mean_of_both_aime_scores(ctx_factory):
    res = figures.fig1_main_comparison(ctx_factory())
    assert [p.title.split("\n")[0] for p in res.panels] == [QWEN4, QWEN8, ROLLOUT, E2E]
    p4 = res.panel(QWEN4)
    assert "cpu_s" in p4.title  # panels name the CPU stand-in and the paper model
    assert sorted(s.label for s in p4.series) == [
        "DPPO-TopK-KL (seed 0)",
        "DPPO-TopK-KL (seed 1)",
        "Predictive (aggregated tail)",
    ]
    x, y = _xy(p4.get("DPPO-TopK-KL (seed 0)"))
    assert x == [2, 4, 6] and y == pytest.approx([0.4, 0.8, 1.2])
    x, y = _xy(p4.get("DPPO-TopK-KL (seed 1)"))
    assert y == pytest.approx([0.41, 0.81, 1.21])
    # aime25 only at steps 4 and 6: the mean exists only where both were evaluated
    x, y = _xy(p4.get("Predictive (aggregated tail)"))
    assert x == [4, 6] and y == pytest.approx([1.2, 1.8])
    # the δ = 0.05 run and the smoke run are not in Figure 1
    assert {r.run_id for r in res.runs} == {"m_dppo_s0", "m_dppo_s1", "m_agg_s", "m_agg_moe", "m_grpo_e2e"}


def test_fig1_missing_setting_is_an_empty_labelled_panel(ctx_factory):
    res = figures.fig1_main_comparison(ctx_factory())
    p8 = res.panel(QWEN8)
    assert p8.series == [] and p8.note == "no runs for this setting"
    assert "cpu_m" in p8.title and "no runs" in p8.title


def test_fig1_shorter_run_ends_early_and_attempts_merge(ctx_factory):
    res = figures.fig1_main_comparison(ctx_factory())
    x, y = _xy(res.panel(ROLLOUT).get("Predictive (aggregated tail)"))
    assert x == [1, 2, 3]  # stops at its last step; nothing is padded
    assert y == pytest.approx([0.6, 0.6, 0.7])  # step 3 from the current attempt, 1-2 from attempt 1


def test_fig1_reads_cluster_style_aime_names_and_prefers_avg16(ctx_factory):
    res = figures.fig1_main_comparison(ctx_factory())
    x, y = _xy(res.panel(E2E).get("GRPO clip-higher"))
    assert x == [1, 2, 3, 4] and y == pytest.approx([0.2] * 4)  # the mean@4 value 0.9 is not used


def test_sweep_option_selects_runs(ctx_factory):
    res = figures.fig1_main_comparison(ctx_factory(sweeps=("smoke",)))
    assert {r.run_id for r in res.runs} == {"sm_agg_s"}
    x, y = _xy(res.panel(QWEN4).get("Predictive (aggregated tail)"))
    assert x == [1, 2] and y == pytest.approx([0.9, 0.9])
    assert all(not p.series for p in res.panels if not p.title.startswith(QWEN4))
    both = figures.fig1_main_comparison(ctx_factory(sweeps=("main_comparison", "smoke")))
    labels = [s.label for s in both.panel(QWEN4).series]
    assert labels.count("DPPO-TopK-KL (seed 0)") == 1 and len(labels) == 4


def test_fig2_uses_the_tight_threshold_runs(ctx_factory):
    res = figures.fig2_tight_threshold(ctx_factory())
    assert {r.run_id for r in res.runs} == {"t_dppo_s"}
    x, y = _xy(res.panel(QWEN4).get("DPPO-TopK-KL"))
    assert x == [1, 2, 3, 4] and y == pytest.approx([0.1] * 4)


def test_fig5_fig7_fig8_plot_the_logged_values(ctx_factory):
    ctx = ctx_factory()
    p = figures.fig5_training_reward(ctx).panel(QWEN4)
    assert _xy(p.get("Predictive (aggregated tail)")) == (
        [1, 2, 3, 4, 5, 6],
        pytest.approx([0.2 * s for s in range(1, 7)]),
    )
    assert _xy(p.get("DPPO-TopK-KL (seed 0)"))[1] == pytest.approx([s / 10 for s in range(1, 7)])
    p = figures.fig7_response_length(ctx).panel(QWEN4)
    assert _xy(p.get("Predictive (aggregated tail)"))[1] == pytest.approx([10.0 + s for s in range(1, 7)])
    res8 = figures.fig8_ppo_kl_clipfrac(ctx)
    assert {p.row for p in res8.panels} == {"PPO-KL", "clip fraction"}
    kl = res8.panel(ROLLOUT, row="PPO-KL").get("Predictive (aggregated tail)")
    clip = res8.panel(ROLLOUT, row="clip fraction").get("Predictive (aggregated tail)")
    assert _xy(kl)[1] == pytest.approx([0.001, 0.002, 0.003])
    assert _xy(clip)[1] == pytest.approx([0.01, 0.02, 0.03])


def test_fig6_draws_aime24_and_aime25_separately(ctx_factory):
    res = figures.fig6_aime24_aime25(ctx_factory())
    a24 = res.panel(QWEN4, row="AIME24").get("Predictive (aggregated tail)")
    a25 = res.panel(QWEN4, row="AIME25").get("Predictive (aggregated tail)")
    assert _xy(a24) == ([2, 4, 6], pytest.approx([0.4, 0.8, 1.2]))
    assert _xy(a25) == ([4, 6], pytest.approx([1.6, 2.4]))
    assert len(res.panels) == 8  # 2 rows x 4 settings


def test_smoothing_is_a_trailing_mean(ctx_factory):
    res = figures.fig5_training_reward(ctx_factory(smooth=3))
    y = _xy(res.panel(QWEN4).get("Predictive (aggregated tail)"))[1]
    raw = [0.2 * s for s in range(1, 7)]
    expected = [statistics.fmean(raw[max(0, i - 2) : i + 1]) for i in range(6)]
    assert y == pytest.approx(expected)


def _stored_seed_rows(report_db, study_id: str):
    """The study's token_level_seeds rows, read with a query of the test's own (not through reports.data)."""
    with duckdb.connect(str(report_db), read_only=True) as con:
        return con.sql("SELECT * FROM token_level_seeds WHERE study_id = ?", params=[study_id]).pl()


def test_fig3_paired_rates_mean_se_and_lower_count(ctx_factory):
    res = figures.fig3_unsafe_keep(ctx_factory())
    assert res.study.study_id == "st_tokens"  # the newest study by default
    pair = res.stats
    ratio, pred = [0.5, 0.4, 0.3], [0.25, 0.5, 0.2]  # seed 3 has no ratio rate: not paired
    assert list(pair.seeds) == [0, 1, 2] and pair.n_seeds == 4 and pair.n_paired == 3
    assert pair.ratio_mean.mean == pytest.approx(statistics.fmean(ratio))
    assert pair.ratio_mean.se == pytest.approx(statistics.stdev(ratio) / math.sqrt(3))
    assert pair.pred_mean.mean == pytest.approx(statistics.fmean(pred))
    assert pair.pred_mean.se == pytest.approx(statistics.stdev(pred) / math.sqrt(3))
    assert (pair.ratio_mean.n, pair.ratio_mean.over) == (3, "paired seeds")
    assert pair.n_lower == 2
    left, right = res.panels
    assert_allclose(left.get("ratio").y, ratio)
    assert_allclose(left.get("predictive").y, pred)
    assert_allclose(left.get("ratio").yerr, [statistics.stdev(ratio) / math.sqrt(3)])
    diff = right.get("difference")
    assert_allclose(diff.y, sorted(p - r for p, r in zip(pred, ratio)))
    assert list(diff.x) == [0, 2, 1]


@pytest.mark.parametrize("study_id", ["st_tokens", "st_counts"])
def test_fig3_fig4_and_the_summary_print_what_the_study_statistics_return(ctx_factory, report_db, study_id):
    expected = stats.study_summary(_stored_seed_rows(report_db, study_id))
    head = expected.headline.unsafe_keep
    ctx = ctx_factory(study_id=study_id)
    pair = figures.fig3_unsafe_keep(ctx).stats
    assert_allclose(pair.seeds, head.seeds)
    assert_allclose(pair.ratio, head.ratio)
    assert_allclose(pair.pred, head.pred)
    assert (pair.ratio_mean, pair.pred_mean, pair.n_lower) == (head.ratio_mean, head.pred_mean, head.n_lower)
    assert figures.fig4_corrective(ctx).stats == expected.corrective
    rows = {row[0]: row[2] for row in tables.token_level_summary(ctx).tables["summary"].rows}
    assert rows["unsafe-keep rate, ratio (mean ± SE over paired seeds)"] == head.ratio_mean.pct()
    assert (
        rows["unsafe-keep rate, predictive aggregated (mean ± SE over paired seeds)"] == head.pred_mean.pct()
    )
    assert rows["corrective fraction, ratio (pooled)"] == expected.corrective["ratio"].pct()


def test_fig3_fig4_with_another_study(ctx_factory):
    ctx = ctx_factory(study_id="st_counts")
    pair = figures.fig3_unsafe_keep(ctx).stats
    assert pair.n_paired == 2 and pair.n_lower == 1
    res4 = figures.fig4_corrective(ctx)  # this study stored no tokens: pooled from its seed counts
    assert {c: (p.k, p.n) for c, p in res4.stats.items()} == {"ratio": (4, 10), "predictive": (5, 10)}
    assert_allclose(res4.panels[0].series[0].y, [0.4, 0.5])


def test_fig4_pooled_corrective_fraction_over_seeds(ctx_factory):
    res = figures.fig4_corrective(ctx_factory())
    counts = {c: (p.k, p.n) for c, p in res.stats.items()}
    assert counts == {"ratio": (2, 3), "predictive": (2, 3), "predictive_uniform": (1, 1)}
    s = res.panels[0].series[0]
    assert list(s.x) == ["ratio", "predictive", "predictive_uniform"]
    assert_allclose(s.y, [2 / 3, 2 / 3, 1.0])
    lo, hi = s.y[0] - s.yerr[0][0], s.y[0] + s.yerr[1][0]
    assert (lo, hi) == pytest.approx((0.2077, 0.9385), abs=1e-4)  # Wilson 95% interval of 2/3


def test_unknown_study_is_refused(ctx_factory):
    with pytest.raises(ValueError, match="unknown study 'nope'; stored: st_tokens, st_counts"):
        figures.fig3_unsafe_keep(ctx_factory(study_id="nope"))


def test_registry_lists_every_paper_artefact():
    names = [a.name for a in registry.artefacts()]
    assert names[:8] == [
        "fig1_main_comparison",
        "fig2_tight_threshold",
        "fig3_unsafe_keep",
        "fig4_corrective",
        "fig5_training_reward",
        "fig6_aime24_aime25",
        "fig7_response_length",
        "fig8_ppo_kl_clipfrac",
    ]
    assert {"table1_hyperparameters", "token_level_summary"} <= set(names)
    again = types.ModuleType("again")
    again.fig1 = artefact.figure("fig1_main_comparison", "again")(lambda ctx: None)
    with pytest.raises(ValueError, match="artefact 'fig1_main_comparison' declared twice"):
        registry.collect([*registry.MODULES, again])


def test_aime_metric_names_match_cpu_and_cluster_spellings():
    from reports.data import aime_metric_names

    names = [
        "val-core/aime24_standin/acc/mean@16",
        "val-core/aime25_standin/acc/mean@16",
        "val-core/aime24_standin/acc/mean@4",
        "val-aux/aime24_standin/acc/maj@16/mean",
    ]
    assert aime_metric_names(names) == {
        "aime24": "val-core/aime24_standin/acc/mean@16",
        "aime25": "val-core/aime25_standin/acc/mean@16",
    }
    cluster = [
        "val-core/math-ai/aime24/acc/mean@32",
        "val-core/AIME_2025/acc/mean@8",
        "val-core/gsm8k/acc/mean@16",
    ]
    assert aime_metric_names(cluster) == {
        "aime24": "val-core/math-ai/aime24/acc/mean@32",
        "aime25": "val-core/AIME_2025/acc/mean@8",
    }
