"""The statistics of training runs against independent computations: scipy's t distribution, loops written here."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.testing import assert_allclose

from analysis.training import stats

finite = st.floats(-1e3, 1e3, allow_nan=False)


def scipy_interval(x):
    """scipy's 95% t-interval of the mean (zero width when every value is equal, where scipy returns NaN)."""
    x = np.asarray(x, dtype=float)
    sem = scipy.stats.sem(x)
    if sem == 0:
        return x.mean(), x.mean()
    return scipy.stats.t.interval(0.95, len(x) - 1, loc=x.mean(), scale=sem)


# ----------------------------------------------------------------------------------------------- intervals


@settings(max_examples=60, deadline=None)
@given(st.lists(finite, min_size=2, max_size=12))
def test_t_interval_is_scipys_t_interval_of_the_mean(values):
    iv = stats.t_interval(values)
    lo, hi = scipy_interval(values)
    assert iv.n == len(values) and iv.mean == pytest.approx(np.mean(values), abs=1e-9)
    assert (iv.lo, iv.hi) == (pytest.approx(lo, abs=1e-7), pytest.approx(hi, abs=1e-7))


def test_t_interval_known_values_one_seed_and_missing_values():
    # n = 3, mean 2, s = 1: half-width t_{0.975, 2} / sqrt(3) = 4.302653 / 1.732051
    iv = stats.t_interval([1.0, 2.0, 3.0])
    assert iv.half_width == pytest.approx(2.484138, abs=1e-6)
    one = stats.t_interval([0.4, None, float("nan")])  # None and NaN are left out
    assert (one.mean, one.lo, one.hi, one.n) == (0.4, None, None, 1)
    assert one.text(100, ".1f", "%") == "40.0% (n = 1 seed, no interval)"
    assert stats.t_interval([]).text() == "—"
    assert iv.text() == "2.000 ± 2.484 (n = 3 seeds)"
    assert iv.text(with_n=False) == "2.000 ± 2.484"
    assert one.text(100, ".1f", "%", with_n=False) == "40.0% (one seed, no interval)"
    assert stats.interval_note(3) == "mean ± 95% t-interval over 3 seeds"
    assert "no interval" in stats.interval_note(1)


def test_t_band_is_the_interval_of_each_step():
    rng = np.random.default_rng(0)
    values = rng.normal(size=(4, 7))
    values[1, 3] = np.nan  # a step three seeds logged
    values[1:, 5] = np.nan  # a step one seed logged: a mean, no band
    mean, lo, hi = stats.t_band(values)
    for j in range(7):
        col = values[:, j][np.isfinite(values[:, j])]
        assert mean[j] == pytest.approx(col.mean())
        if len(col) >= 2:
            assert (lo[j], hi[j]) == pytest.approx(scipy_interval(col))
        else:
            assert np.isnan(lo[j]) and np.isnan(hi[j])


# ----------------------------------------------------------------------------------------------- smoothing


def ema_loop(values, alpha):
    """The debiased EMA written out: point t = sum_i w_i x_i / sum_i w_i over finite points i <= t, w_i = (1-a)^(t-i)."""
    out = []
    for t, x in enumerate(values):
        if not math.isfinite(x):
            out.append(float("nan"))
            continue
        pts = [(values[i], (1 - alpha) ** (t - i)) for i in range(t + 1) if math.isfinite(values[i])]
        out.append(sum(v * w for v, w in pts) / sum(w for _, w in pts))
    return out


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(finite, st.just(float("nan"))), min_size=1, max_size=30), st.floats(0.01, 1.0))
def test_ema_matches_the_loop(values, alpha):
    assert_allclose(stats.ema(np.array(values), alpha), ema_loop(values, alpha), rtol=1e-9, atol=1e-9)


def test_smoothing_by_half_life():
    s = stats.Smoothing(5.0)
    assert (1 - s.alpha) ** 5 == pytest.approx(0.5)  # a point's weight halves after 5 logged points
    assert s.describe() == "EMA, half-life 5 logged points (alpha = 0.129)"
    x = np.array([1.0, 3.0, 2.0])
    assert_allclose(stats.RAW.apply(x), x)
    assert stats.RAW.describe() == "raw values (no smoothing)"
    assert stats.STEP_SMOOTHING.half_life > stats.VAL_SMOOTHING.half_life > 0
    with pytest.raises(ValueError, match="half-life must be >= 0 logged points, got -1"):
        stats.Smoothing(-1)
    with pytest.raises(ValueError, match=r"alpha must be in \(0, 1\], got 0"):
        stats.ema(x, 0)


# ------------------------------------------------------------------------------------------------- curves


def test_seed_curve_on_common_steps_smoothed_per_seed():
    series = {
        0: (np.array([0, 10, 20, 30]), np.array([0.1, 0.2, 0.3, 0.4])),
        1: (np.array([0, 10, 20]), np.array([0.2, 0.2, 0.5])),  # stopped early
        2: (np.array([0, 10, 20, 30]), np.array([0.0, 0.3, 0.1, 0.2])),
    }
    raw = stats.seed_curve(series)
    assert list(raw.steps) == [0, 10, 20] and raw.keys == (0, 1, 2) and raw.n_left_out == 2
    rows = np.array([[0.1, 0.2, 0.3], [0.2, 0.2, 0.5], [0.0, 0.3, 0.1]])
    assert_allclose(raw.mean, rows.mean(axis=0))
    lo, hi = zip(*(scipy_interval(rows[:, j]) for j in range(3)))
    assert_allclose(raw.lo, lo)
    assert_allclose(raw.hi, hi)
    smooth = stats.seed_curve(series, stats.Smoothing(1.0))
    expected = [ema_loop(list(series[k][1]), 0.5)[:3] for k in (0, 1, 2)]  # each seed on its own points
    assert_allclose(smooth.values, expected)
    one = stats.seed_curve({7: series[0]})
    assert one.n == 1 and one.lo is None and one.hi is None
    assert_allclose(one.mean, series[0][1])
    assert stats.seed_curve({}) is None
    assert (
        stats.seed_curve({0: (np.array([1]), np.array([0.1])), 1: (np.array([2]), np.array([0.2]))}) is None
    )


def test_coincidence_needs_every_seed_identical():
    s = lambda *v: (np.arange(len(v)), np.array(v, dtype=float))
    dppo = {0: s(0.1, 0.2), 1: s(0.3, 0.4)}
    groups = {
        "dppo_topk_kl": dppo,
        "predmask_kl_agg": {0: s(0.1, 0.2 + 1e-13), 1: s(0.3, 0.4)},  # within 1e-12: identical
        "predmask_kl_uniform": {0: s(0.1, 0.2), 1: s(0.3, 0.4 + 1e-9)},  # one seed differs
        "predmask_kl_exact": {0: s(0.1, 0.2)},  # a seed missing
        "predmask_tv_agg": {0: s(0.1, 0.2), 1: s(0.3, 0.4)},
    }
    assert stats.coincidences(groups) == {
        "predmask_kl_agg": "dppo_topk_kl",
        "predmask_tv_agg": "dppo_topk_kl",
    }
    assert not stats.identical(s(0.1, 0.2), (np.array([0, 2]), np.array([0.1, 0.2])))  # other steps
    assert stats.identical(s(0.1, float("nan")), s(0.1, float("nan")))
    # the reference is the first method of the order given
    assert stats.coincidences({"b": dppo, "a": dppo}) == {"a": "b"}


# ------------------------------------------------------------------------------------------- run summaries


def test_run_summary_final_best_and_normalised_area():
    steps, values = np.array([0, 20, 40, 100]), np.array([0.1, 0.5, 0.3, 0.4])
    area = sum((steps[i + 1] - steps[i]) * (values[i] + values[i + 1]) / 2 for i in range(3))
    r = stats.run_summary(steps, values)
    assert (r.final, r.best, r.best_step, r.first_step, r.last_step, r.n_points) == (0.4, 0.5, 20, 0, 100, 4)
    assert r.auc == pytest.approx(area / 100)
    assert stats.area_under_curve(np.array([5]), np.array([0.3])) == 0.3  # one point: that point
    assert stats.run_summary(np.array([1, 2]), np.array([np.nan, np.nan])) is None


@pytest.mark.parametrize(
    ("values", "collapsed", "since"),
    [
        ([0.1, 0.4, 0.3, 0.1, 0.05], True, 3),  # best 0.4 at step 1, below 0.2 from step 3 to the end
        ([0.1, 0.4, 0.1, 0.05, 0.3], False, None),  # dipped, then recovered above half the best
        ([0.1, 0.4, 0.3, 0.3, 0.1], False, 4),  # one low last evaluation: fewer than 2 points, no collapse
        ([0.0, 0.0, 0.0, 0.0], False, None),  # never learned
        ([0.2, 0.2, 0.2], False, None),  # flat
        ([0.3], False, None),  # a single evaluation
        ([0.4, 0.1, 0.1], True, 1),  # best at the first evaluation
    ],
)
def test_collapse_rule_on_synthetic_curves(values, collapsed, since):
    c = stats.collapse(np.arange(len(values)), np.array(values))
    assert (c.collapsed, c.since_step) == (collapsed, since)
    assert c.best == max(values)
    assert stats.collapse(np.arange(len(values)), np.array(values), min_points=1).collapsed == (
        since is not None
    )


def test_collapse_refuses_a_bad_minimum():
    with pytest.raises(ValueError, match="min_points must be >= 1, got 0"):
        stats.collapse(np.arange(3), np.ones(3), min_points=0)


# ------------------------------------------------------------------------------------------ paired methods


def test_paired_difference_pairs_on_seed():
    pred = {0: 0.32, 1: 0.35, 2: 0.29, 5: 0.9}  # seed 5 has no reference run: not paired
    ref = {0: 0.30, 1: 0.31, 2: 0.30, 3: 0.1}
    d = stats.paired_difference("predmask_kl_agg", pred, "dppo_topk_kl", ref)
    diffs = [0.02, 0.04, -0.01]
    assert d.keys == (0, 1, 2) and d.n_positive == 2
    assert_allclose(d.diffs, diffs)
    lo, hi = scipy_interval(diffs)
    assert (d.interval.lo, d.interval.hi) == (pytest.approx(lo), pytest.approx(hi))
    assert d.text(100) == f"+1.7 [{100 * lo:+.1f}, {100 * hi:+.1f}] (2/3 seeds > 0)"
    one = stats.paired_difference("a", {0: 0.5}, "b", {0: 0.25})
    assert one.text(100) == "+25.0 (1/1 seeds > 0, no interval)"


def test_predictive_references_come_from_the_method_registry():
    from predmask.methods import METHODS

    names = list(METHODS)
    refs = stats.predictive_references(names)
    assert refs["predmask_kl_agg"] == "dppo_topk_kl" and refs["predmask_kl_uniform"] == "dppo_topk_kl"
    for name, ref in refs.items():
        m, r = METHODS[name], METHODS[ref]
        assert m.direction == "predictive" and r.direction == "ratio"
        assert (m.divergence, m.support) == (r.divergence, r.support)
    assert {n for n in names if METHODS[n].direction == "predictive"} == set(refs)
    assert stats.predictive_references(["grpo_clip_higher", "dppo_topk_kl", "not_a_method"]) == {}


def test_setting_results_over_seeds():
    steps = np.array([0, 10, 20])
    groups = {
        "grpo_clip_higher": {0: (steps, np.array([0.2, 0.6, 0.1])), 1: (steps, np.array([0.2, 0.4, 0.5]))},
        "dppo_topk_kl": {0: (steps, np.array([0.1, 0.2, 0.3])), 1: (steps, np.array([0.1, 0.3, 0.4]))},
        "predmask_kl_agg": {0: (steps, np.array([0.1, 0.3, 0.5])), 1: (steps, np.array([0.1, 0.2, 0.3]))},
        "predmask_kl_uniform": {0: (steps, np.array([np.nan] * 3))},  # no finite point: left out
    }
    res = stats.setting_results(groups)
    assert list(res) == ["grpo_clip_higher", "dppo_topk_kl", "predmask_kl_agg"]
    g = res["grpo_clip_higher"]
    # seed 0 collapsed only with one point below half of 0.6 -> not a collapse at the default 2 points
    assert g.collapsed == () and g.n == 2 and g.vs_final is None
    agg = res["predmask_kl_agg"]
    assert agg.vs_final.reference == "dppo_topk_kl"
    assert_allclose(agg.vs_final.diffs, [0.2, -0.1])
    assert agg.final.mean == pytest.approx(0.4) and agg.best.mean == pytest.approx(0.4)
    auc = lambda v: ((v[0] + v[1]) / 2 * 10 + (v[1] + v[2]) / 2 * 10) / 20
    expected = [auc([0.1, 0.3, 0.5]) - auc([0.1, 0.2, 0.3]), auc([0.1, 0.2, 0.3]) - auc([0.1, 0.3, 0.4])]
    assert_allclose(agg.vs_auc.diffs, expected)
