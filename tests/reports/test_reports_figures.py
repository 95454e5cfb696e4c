"""What each figure draws: the plotted arrays against values computed by hand from the test database."""

from __future__ import annotations

import math
import statistics
import types

import duckdb
import numpy as np
import pytest
import scipy.stats
from numpy.testing import assert_allclose
from report_database import GRPO_VAL, SEEDS, STUDY_SEEDS, UNI_OFFSET, dppo_val

from analysis.token_level.summary import study_stats as stats
from reports import artefact, artefact_registry
from reports.figures import draw
from reports.figures import token_level as token_level_figures
from reports.figures import training as training_figures
from reports.tables import render
from reports.tables import token_level as token_level_table

QWEN4 = "Qwen3-4B-Base · BF16"
QWEN8 = "Qwen3-8B-Base · BF16"
ROLLOUT = "Qwen3-30B-A3B-Base · FP8 Rollout"
E2E = "Qwen3-30B-A3B-Base · FP8 E2E"


def _xy(series):
    return list(np.asarray(series.x)), list(np.asarray(series.y))


def t_band(rows):
    """Mean and 95% t-interval per column of a seeds × steps array, from scipy's t distribution."""
    a = np.asarray(rows, dtype=float)
    n = a.shape[0]
    mean = a.mean(axis=0)
    lo, hi = scipy.stats.t.interval(0.95, n - 1, loc=mean, scale=a.std(axis=0, ddof=1) / math.sqrt(n))
    return mean, lo, hi


def ema_loop(values, half_life):
    """Debiased EMA written out: each point the weighted mean of the points so far, weight 2^(-age / half-life)."""
    out = []
    for t in range(len(values)):
        w = [0.5 ** ((t - i) / half_life) for i in range(t + 1)]
        out.append(sum(wi * values[i] for i, wi in enumerate(w)) / sum(w))
    return out


def _assert_line(series, x, rows, value_range=(-np.inf, np.inf)):
    """The line is the mean of `rows` (seeds × x) with the t-band clipped to the quantity's `value_range`, and
    carries the rows it averaged."""
    mean, lo, hi = t_band(rows)
    lo, hi = np.clip(lo, *value_range), np.clip(hi, *value_range)
    assert list(series.x) == x
    assert_allclose(series.y, mean, rtol=1e-12)
    assert_allclose(series.seeds, rows, rtol=1e-12)
    assert_allclose(series.band[0], lo, rtol=1e-9)
    assert_allclose(series.band[1], hi, rtol=1e-9)


DPPO, AGG, UNI = (
    "DPPO-TopK-KL (3 seeds)",
    "Predictive (aggregated tail) (3 seeds; identical to DPPO-TopK-KL)",
    ("Predictive (uniform tail) (3 seeds)"),
)


def test_fig1_lines_are_means_over_seeds_with_t_bands(ctx_factory):
    res = training_figures.fig1_main_comparison(ctx_factory(raw=True))
    assert [p.title.split("\n")[0] for p in res.panels] == [QWEN4, QWEN8, ROLLOUT, E2E]
    p4 = res.panel(QWEN4)
    assert "cpu_s" in p4.title  # panels name the CPU stand-in and the paper model
    assert [s.label for s in p4.series] == [DPPO, AGG, UNI]  # one line per method, in method order
    steps = [2, 4, 6]
    dppo = [[dppo_val(s, seed) for s in steps] for seed in SEEDS]
    _assert_line(p4.get(DPPO), steps, dppo)
    _assert_line(p4.get(UNI), steps, [[v + UNI_OFFSET[seed] for v in row] for seed, row in zip(SEEDS, dppo)])
    assert p4.get(DPPO).seed_keys == SEEDS
    # the δ = 0.05 run and the smoke run are not in Figure 1
    assert {r.run_id for r in res.runs} == {
        *(f"m_{m}_s{k}" for m in ("dppo", "agg", "uni") for k in SEEDS),
        "m_agg_moe",
        *(f"m_grpo_e2e_s{k}" for k in SEEDS),
    }


def test_identical_runs_are_marked_in_every_figure_and_drawn(ctx_factory):
    ctx = ctx_factory(raw=True)
    for res in (training_figures.fig1_main_comparison(ctx), training_figures.fig5_training_reward(ctx)):
        p4 = res.panel(QWEN4)
        agg, dppo = p4.get(AGG), p4.get(DPPO)
        assert (agg.identical_to, agg.method, dppo.identical_to) == ("dppo_topk_kl", "predmask_kl_agg", None)
        assert_allclose(agg.y, dppo.y)  # drawn, with the same values, never dropped
        assert p4.get(UNI).identical_to is None


def test_one_seed_has_no_band_and_attempts_merge(ctx_factory):
    res = training_figures.fig1_main_comparison(ctx_factory(raw=True))
    line = res.panel(ROLLOUT).get("Predictive (aggregated tail) (1 seed)")
    assert line.band is None
    x, y = _xy(line)
    assert x == [1, 2, 3]  # stops at its last step; nothing is padded
    assert y == pytest.approx([0.6, 0.6, 0.7])  # step 3 from the current attempt, 1-2 from attempt 1


def test_fig1_missing_setting_is_an_empty_labelled_panel(ctx_factory):
    res = training_figures.fig1_main_comparison(ctx_factory())
    p8 = res.panel(QWEN8)
    assert p8.series == [] and p8.note == "no runs for this setting\n(python -m sweeps main_comparison)"
    assert "cpu_m" in p8.title and "no runs" in p8.title


def test_fig1_reads_cluster_style_aime_names_and_prefers_avg16(ctx_factory):
    res = training_figures.fig1_main_comparison(ctx_factory(raw=True))
    line = res.panel(E2E).get("GRPO clip-higher (3 seeds)")
    # the mean@4 value 0.9 is not used; an accuracy's band stops at 0
    _assert_line(line, [1, 2, 3, 4], [GRPO_VAL[k] for k in SEEDS], value_range=(0.0, 1.0))


def test_sweep_option_selects_runs(ctx_factory):
    res = training_figures.fig1_main_comparison(ctx_factory(sweeps=("smoke",), raw=True))
    assert {r.run_id for r in res.runs} == {"sm_agg_s"}
    # aime25 only at steps 4 and 6: the validation mean exists only where both were evaluated
    x, y = _xy(res.panel(QWEN4).get("Predictive (aggregated tail) (1 seed)"))
    assert x == [4, 6] and y == pytest.approx([1.2, 1.8])
    assert all(not p.series for p in res.panels if not p.title.startswith(QWEN4))
    both = training_figures.fig1_main_comparison(ctx_factory(sweeps=("main_comparison", "smoke"), raw=True))
    p4 = both.panel(QWEN4)
    # two runs of seed 0: counted as runs, never averaged as if paired, and no longer identical to DPPO's
    agg = p4.get("Predictive (aggregated tail) (4 runs)")
    assert agg.identical_to is None and list(agg.x) == [4, 6]
    assert [s.label for s in p4.series] == [DPPO, "Predictive (aggregated tail) (4 runs)", UNI]


def test_fig2_uses_the_tight_threshold_runs(ctx_factory):
    res = training_figures.fig2_tight_threshold(ctx_factory(raw=True))
    assert {r.run_id for r in res.runs} == {"t_dppo_s"}
    x, y = _xy(res.panel(QWEN4).get("DPPO-TopK-KL (1 seed)"))
    assert x == [1, 2, 3, 4] and y == pytest.approx([0.1] * 4)
    # the settings tight_threshold did not run name the command that fills them
    for setting in (QWEN8, ROLLOUT, E2E):
        assert res.panel(setting).note == "no runs for this setting\n(python -m sweeps tight_threshold)"


def test_fig5_fig7_fig8_plot_the_logged_values(ctx_factory):
    ctx = ctx_factory(raw=True)
    steps = list(range(1, 7))
    p = training_figures.fig5_training_reward(ctx).panel(QWEN4)
    _assert_line(p.get(UNI), steps, [[0.2 * s + 0.01 * k for s in steps] for k in SEEDS])
    _assert_line(p.get(DPPO), steps, [[s / 10 + 0.01 * k for s in steps] for k in SEEDS])
    p = training_figures.fig7_response_length(ctx).panel(QWEN4)
    _assert_line(p.get(DPPO), steps, [[10.0 + s + k for s in steps] for k in SEEDS])
    # the same response lengths in all three methods' runs: both later lines are marked, none is hidden
    assert [s.label for s in p.series][1:] == [
        AGG,
        "Predictive (uniform tail) (3 seeds; identical to DPPO-TopK-KL)",
    ]
    res8 = training_figures.fig8_ppo_kl_clipfrac(ctx)
    assert {p.row for p in res8.panels} == {"PPO-KL", "clip fraction"}
    # fig8's legend names the anchor each method's ppo_kl is taken against (μ for the divergence methods)
    kl = res8.panel(ROLLOUT, row="PPO-KL").get("Predictive (aggregated tail) (1 seed; ppo_kl vs μ)")
    clip = res8.panel(ROLLOUT, row="clip fraction").get("Predictive (aggregated tail) (1 seed; ppo_kl vs μ)")
    assert _xy(kl)[1] == pytest.approx([0.001, 0.002, 0.003])
    assert _xy(clip)[1] == pytest.approx([0.01, 0.02, 0.03])
    # every seed has the same PPO-KL: the band has zero width, and the methods' lines all coincide
    kl4 = res8.panel(QWEN4, row="PPO-KL")
    assert_allclose(kl4.series[0].band[0], kl4.series[0].y)
    assert [s.identical_to for s in kl4.series] == [None, "dppo_topk_kl", "dppo_topk_kl"]


def test_fig6_draws_aime24_and_aime25_separately(ctx_factory):
    res = training_figures.fig6_aime24_aime25(ctx_factory(raw=True))
    a24 = res.panel(QWEN4, row="AIME24").get(DPPO)
    a25 = res.panel(QWEN4, row="AIME25").get(DPPO)
    steps = [2, 4, 6]
    _assert_line(a24, steps, [[dppo_val(s, k) - 0.05 for s in steps] for k in SEEDS])
    _assert_line(a25, steps, [[dppo_val(s, k) + 0.05 for s in steps] for k in SEEDS])
    assert len(res.panels) == 8  # 2 rows x 4 settings


def test_default_smoothing_is_a_labelled_ema_per_seed(ctx_factory):
    ctx = ctx_factory()
    res5 = training_figures.fig5_training_reward(ctx)
    steps = list(range(1, 7))
    smoothed = [ema_loop([s / 10 + 0.01 * k for s in steps], 5.0) for k in SEEDS]
    _assert_line(res5.panel(QWEN4).get(DPPO), steps, smoothed)
    assert "EMA, half-life 5 logged points (alpha = 0.129)" in res5.caption and "--raw" in res5.caption
    res1 = training_figures.fig1_main_comparison(ctx)  # validation curves: fewer points, a shorter half-life
    smoothed = [ema_loop([dppo_val(s, k) for s in (2, 4, 6)], 1.0) for k in SEEDS]
    _assert_line(res1.panel(QWEN4).get(DPPO), [2, 4, 6], smoothed)
    assert "EMA, half-life 1 logged point (alpha = 0.500)" in res1.caption
    assert "mean ± 95% t-interval over n seeds" in res1.caption
    raw = training_figures.fig5_training_reward(ctx_factory(raw=True))
    assert "raw values (no smoothing)" in raw.caption and "EMA" not in raw.caption


def _stored_seed_rows(report_db, study_id: str):
    """The study's token_level_seeds rows, read with a query of the test's own (not through reports.queries)."""
    with duckdb.connect(str(report_db), read_only=True) as con:
        return con.sql("SELECT * FROM token_level_seeds WHERE study_id = ?", params=[study_id]).pl()


def test_fig3_paired_rates_mean_se_and_lower_count(ctx_factory):
    res = token_level_figures.fig3_unsafe_keep(ctx_factory())
    assert res.study.study_id == "st_tokens"  # the newest study by default
    tokens = sum(STUDY_SEEDS["n_tokens"])  # the units its numbers are over, on the page and in the subtitle
    assert res.selection_rule == f"study st_tokens: {len(STUDY_SEEDS['seed'])} seeds, {tokens:,} response tokens"
    pair = res.stats
    ratio, pred = [0.5, 0.4, 0.3], [0.25, 0.5, 0.2]  # seed 3 has no ratio rate: not paired
    assert list(pair.seeds) == [0, 1, 2] and pair.n_seeds == 4 and pair.n_paired == 3
    assert pair.ratio_mean.mean == pytest.approx(statistics.fmean(ratio))
    assert pair.ratio_mean.se == pytest.approx(statistics.stdev(ratio) / math.sqrt(3))
    assert pair.pred_mean.mean == pytest.approx(statistics.fmean(pred))
    assert pair.pred_mean.se == pytest.approx(statistics.stdev(pred) / math.sqrt(3))
    assert (pair.ratio_mean.n, pair.ratio_mean.over) == (3, "paired seeds")
    assert pair.n_lower == 2
    left, right = res.panels[:2]  # the paper's definition; the same-token panels follow (test_reports_same_tokens)
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
    pair = token_level_figures.fig3_unsafe_keep(ctx).stats
    assert_allclose(pair.seeds, head.seeds)
    assert_allclose(pair.ratio, head.ratio)
    assert_allclose(pair.pred, head.pred)
    assert (pair.ratio_mean, pair.pred_mean, pair.n_lower) == (head.ratio_mean, head.pred_mean, head.n_lower)
    assert token_level_figures.fig4_corrective(ctx).stats == expected.corrective
    rows = {row[0]: row[2] for row in token_level_table.token_level_summary(ctx).tables["summary"].rows}
    assert rows["unsafe-keep rate, ratio (mean ± SE over paired seeds)"] == head.ratio_mean.pct()
    assert (
        rows["unsafe-keep rate, predictive aggregated (mean ± SE over paired seeds)"] == head.pred_mean.pct()
    )
    assert rows["corrective fraction, ratio (pooled)"] == expected.corrective["ratio"].pct()


def test_fig3_fig4_with_another_study(ctx_factory):
    ctx = ctx_factory(study_id="st_counts")
    pair = token_level_figures.fig3_unsafe_keep(ctx).stats
    assert pair.n_paired == 2 and pair.n_lower == 1
    res4 = token_level_figures.fig4_corrective(ctx)  # this study stored no tokens: pooled from its seed counts
    assert {c: (p.k, p.n) for c, p in res4.stats.items()} == {"ratio": (4, 10), "predictive": (5, 10)}
    assert_allclose(res4.panels[0].series[0].y, [0.4, 0.5])


def test_fig4_pooled_corrective_fraction_over_seeds(ctx_factory):
    res = token_level_figures.fig4_corrective(ctx_factory())
    counts = {c: (p.k, p.n) for c, p in res.stats.items()}
    assert counts == {"ratio": (2, 3), "predictive": (2, 3), "predictive_uniform": (1, 1)}
    s = res.panels[0].series[0]
    assert list(s.x) == ["ratio", "predictive", "predictive_uniform"]
    assert_allclose(s.y, [2 / 3, 2 / 3, 1.0])
    lo, hi = s.y[0] - s.yerr[0][0], s.y[0] + s.yerr[1][0]
    assert (lo, hi) == pytest.approx((0.2077, 0.9385), abs=1e-4)  # Wilson 95% interval of 2/3


def test_unknown_study_is_refused(ctx_factory):
    with pytest.raises(ValueError, match="unknown study 'nope'; stored: st_tokens, st_counts"):
        token_level_figures.fig3_unsafe_keep(ctx_factory(study_id="nope"))


def test_registry_lists_every_paper_artefact():
    names = [a.name for a in artefact_registry.artefacts()]
    assert names[:10] == [  # numbers sort as numbers: fig10 after fig9
        "fig1_main_comparison",
        "fig2_tight_threshold",
        "fig3_unsafe_keep",
        "fig4_corrective",
        "fig5_training_reward",
        "fig6_aime24_aime25",
        "fig7_response_length",
        "fig8_ppo_kl_clipfrac",
        "fig9_drift_sensitivity",
        "fig10_criteria_vs_drift",
    ]
    assert {"table1_hyperparameters", "table2_main_results", "token_level_summary"} <= set(names)
    again = types.ModuleType("again")

    def fig1_main_comparison(ctx):
        return None

    again.fig1 = draw.figure("again")(fig1_main_comparison)
    with pytest.raises(ValueError, match="artefact 'fig1_main_comparison' declared twice"):
        artefact_registry.collect([*artefact_registry.MODULES, again])


def test_the_declaration_owns_the_name_of_what_an_artefact_returns(ctx_factory):
    names = iter(["", "another"])  # a result left unnamed, then one that names itself otherwise

    def some_table(ctx):
        return artefact.ArtefactResult("t", "c", name=next(names))

    unnamed = other = render.table("t")(some_table)
    assert unnamed(ctx_factory()).name == "some_table"  # filled in from the declared function's name
    with pytest.raises(ValueError, match="artefact 'some_table' returned a result named 'another'"):
        other(ctx_factory())


def test_aime_metric_names_match_cpu_and_cluster_spellings():
    from analysis.results.curves import aime_metric_names

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
