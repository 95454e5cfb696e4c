"""Seed-clustered inference against independent computations: a bootstrap loop, enumerated tests, a simulation."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import scipy.stats
from hypothesis import given, settings
from hypothesis import strategies as st

from analysis import paired
from analysis.token_level.summary import study_stats as token_stats


def loop_bootstrap(num, den, resamples, level, seed):
    """The seed-cluster percentile bootstrap written out: one resample of seeds at a time, sums by hand, the
    quantiles by linear interpolation between order statistics."""
    rng = np.random.default_rng(seed)
    n = len(num)
    values = []
    for _ in range(resamples):
        picks = rng.integers(0, n, size=n)
        top = sum(float(num[i]) for i in picks)
        bottom = sum(float(den[i]) for i in picks)
        if bottom != 0:
            values.append(top / bottom)
    values.sort()

    def quantile(q):
        h = (len(values) - 1) * q
        j = math.floor(h)
        return values[j] + (h - j) * (values[min(j + 1, len(values) - 1)] - values[j])

    return quantile((1 - level) / 2), quantile((1 + level) / 2), resamples - len(values)


# ------------------------------------------------------------------------------------- cluster bootstrap


@pytest.mark.parametrize(("n_seeds", "level", "seed"), [(2, 0.95, 0), (7, 0.9, 3), (30, 0.95, 11)])
def test_the_bootstrap_is_the_loop_with_the_same_generator(n_seeds, level, seed):
    rng = np.random.default_rng(100 + n_seeds)
    den = rng.integers(0, 40, size=n_seeds).astype(float)
    den[0] = 0.0  # a seed with nothing in the set: some resamples are undefined when n is small
    num = np.floor(den * rng.uniform(size=n_seeds))
    ci = paired.cluster_bootstrap_ratio(num, den, level=level, resamples=500, seed=seed)
    lo, hi, undefined = loop_bootstrap(num, den, 500, level, seed)
    assert ci.estimate == pytest.approx(num.sum() / den.sum(), rel=1e-12)
    assert (ci.lo, ci.hi) == (pytest.approx(lo, rel=1e-12), pytest.approx(hi, rel=1e-12))
    assert ci.n_undefined == undefined and ci.n_seeds == n_seeds and ci.resamples == 500
    # two seeds: the percentile interval may miss the estimate
    assert ci.lo <= ci.estimate <= ci.hi or n_seeds == 2


def test_a_general_pooled_statistic_is_applied_to_the_resampled_sums():
    counts = np.array([[3, 10, 1, 2], [8, 9, 0, 1], [2, 4, 3, 3], [6, 6, 2, 5]], dtype=float)

    def balanced(s):
        return 0.5 * (s[..., 0] / s[..., 1] + s[..., 2] / s[..., 3])

    ci = paired.cluster_bootstrap(counts, balanced, resamples=200, seed=1)
    rng = np.random.default_rng(1)
    loop = []
    for _ in range(200):
        s = counts[rng.integers(0, 4, size=4)].sum(axis=0)
        loop.append(0.5 * (s[0] / s[1] + s[2] / s[3]))
    assert ci.estimate == pytest.approx(0.5 * (19 / 29 + 6 / 11))
    assert (ci.lo, ci.hi) == tuple(pytest.approx(q) for q in np.quantile(loop, [0.025, 0.975]))


def test_degenerate_cases_say_why_there_is_no_interval():
    none = paired.cluster_bootstrap_ratio([], [])
    assert (none.estimate, none.lo, none.hi, none.note) == (None, None, None, "no seed")
    zero = paired.cluster_bootstrap_ratio([0, 0], [0, 0])
    assert zero.estimate is None and "zero denominator" in zero.note and zero.text() == f"— ({zero.note})"
    one = paired.cluster_bootstrap_ratio([3], [4])
    assert (one.estimate, one.lo, one.hi) == (0.75, None, None) and one.note == "one seed: no interval"
    assert one.text() == "75.0% (one seed: no interval)" and not one.has_interval
    # every seed at 100%: the interval is the point
    full = paired.cluster_bootstrap_ratio([5, 7, 2], [5, 7, 2])
    assert (full.estimate, full.lo, full.hi) == (1.0, 1.0, 1.0) and full.n_undefined == 0
    assert full.text() == "100.0% [100.0, 100.0] (seed bootstrap, 3 seeds)"


def test_resamples_that_draw_only_empty_seeds_are_counted_and_left_out():
    # seed 1 has no tokens: a resample drawing it twice (probability 1/4) is undefined
    ci = paired.cluster_bootstrap_ratio([1, 0], [2, 0], resamples=4000, seed=2)
    assert ci.estimate == 0.5 and (ci.lo, ci.hi) == (0.5, 0.5)
    assert ci.n_undefined / 4000 == pytest.approx(0.25, abs=0.03)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: paired.cluster_bootstrap_ratio([1], [1], level=1.0),
            "confidence level must be in (0, 1), got 1.0",
        ),
        (lambda: paired.cluster_bootstrap_ratio([1, 2], [1]), "one value per seed each"),
        (lambda: paired.cluster_bootstrap_ratio([1], [-1]), "denominators must be >= 0, got -1.0"),
        (lambda: paired.cluster_bootstrap_ratio([1], [1], resamples=0), "resamples must be a positive"),
        (lambda: paired.cluster_bootstrap_ratio([np.nan], [1]), "counts must be finite"),
        (lambda: paired.cluster_bootstrap(np.ones(3), lambda s: s), "seeds × k array, got shape (3,)"),
        (lambda: paired.paired_comparison([1, 2], [1]), "aligned, got shapes (2,) and (1,)"),
    ],
)
def test_bad_input_is_one_clear_line(call, message):
    with pytest.raises(ValueError, match=None) as err:
        call()
    assert message in str(err.value) and "\n" not in str(err.value)


def test_cluster_interval_covers_the_pooled_rate_where_wilson_does_not():
    """Seeds with their own rate (a random effect around 0.3), tokens Bernoulli within a seed: the seed bootstrap
    covers the true pooled rate near its nominal 95%, the Wilson interval on pooled tokens far less often."""
    rng = np.random.default_rng(2024)
    true_rate, n_seeds, tokens, reps = 0.3, 20, 100, 500
    boot_hits = wilson_hits = 0
    for rep in range(reps):
        p = rng.beta(6.0, 14.0, size=n_seeds)  # mean 0.3, sd 0.1
        k = rng.binomial(tokens, p)
        ci = paired.cluster_bootstrap_ratio(k, np.full(n_seeds, tokens), resamples=400, seed=rep)
        boot_hits += ci.lo <= true_rate <= ci.hi
        lo, hi = paired.wilson_interval(int(k.sum()), n_seeds * tokens)
        wilson_hits += lo <= true_rate <= hi
    assert 0.90 <= boot_hits / reps <= 0.98
    assert wilson_hits / reps < 0.75


# ------------------------------------------------------------------------------------- Wilson


def test_the_wilson_interval_has_one_owner_and_solves_the_score_equation():
    assert token_stats.wilson_interval is paired.wilson_interval
    k, n, z = 7, 23, paired.z_of(0.95)
    lo, hi = paired.wilson_interval(k, n, z)
    for bound in (lo, hi):  # |p̂ − p| = z sqrt(p (1 − p) / n) at both bounds
        assert abs(k / n - bound) == pytest.approx(z * math.sqrt(bound * (1 - bound) / n), rel=1e-9)
    assert paired.z_of(0.95) == pytest.approx(1.959964, abs=1e-6)


# ------------------------------------------------------------------------------------- paired comparison


def sign_test_p(higher, lower):
    """Two-sided exact sign test by summing the binomial(n, 1/2) probabilities no likelier than the observed."""
    n = higher + lower
    probs = [math.comb(n, i) / 2**n for i in range(n + 1)]
    return min(1.0, sum(q for q in probs if q <= probs[higher] * (1 + 1e-9)))


def wilcoxon_exact_p(d):
    """Two-sided exact signed-rank p by enumerating every sign pattern (distinct non-zero |d|)."""
    d = np.asarray([x for x in d if x != 0])
    ranks = scipy.stats.rankdata(np.abs(d))
    observed = ranks[d > 0].sum()
    total = ranks.sum()
    stats = [sum(r for r, s in zip(ranks, signs) if s) for signs in itertools.product((0, 1), repeat=len(d))]
    dev = abs(observed - total / 2)
    return sum(abs(s - total / 2) >= dev - 1e-9 for s in stats) / len(stats)


def test_paired_comparison_against_hand_computations():
    a = np.array([0.50, 0.40, 0.90, 0.30, 0.70, 0.60, 0.80, np.nan, 0.55])
    b = np.array([0.45, 0.47, 0.71, 0.30, 0.38, 0.51, 0.58, 0.20, 0.41])
    cmp = paired.paired_comparison(a, b)
    d = (a - b)[:7].tolist() + [(a - b)[8]]
    assert cmp.n == 8 and cmp.n_dropped == 1
    assert (cmp.n_lower, cmp.n_tied, cmp.n_higher) == (1, 1, 6)
    assert cmp.interval.mean == pytest.approx(np.mean(d))
    lo, hi = scipy.stats.t.interval(0.95, 7, loc=np.mean(d), scale=scipy.stats.sem(d))
    assert (cmp.interval.lo, cmp.interval.hi) == (pytest.approx(lo), pytest.approx(hi))
    assert cmp.sign_p == pytest.approx(sign_test_p(6, 1))  # 16/128 = 0.125
    assert cmp.wilcoxon_p == pytest.approx(wilcoxon_exact_p(d))
    assert cmp.note == ""


def test_all_tied_seeds_give_p_one_with_the_reason():
    # every seed at the same rate on both sides, 100% included
    cmp = paired.paired_comparison([1.0, 1.0, 0.5], [1.0, 1.0, 0.5])
    assert (cmp.sign_p, cmp.wilcoxon_p) == (1.0, 1.0) and cmp.n_tied == 3
    assert "all 3 seeds tied" in cmp.note
    assert cmp.interval.mean == 0.0
    empty = paired.paired_comparison([np.nan], [0.3])
    assert (empty.n, empty.sign_p, empty.wilcoxon_p, empty.note) == (0, None, None, "no paired seed")


def test_too_few_untied_seeds_is_said():
    cmp = paired.paired_comparison([0.9, 0.8, 0.7, 0.6, 0.5, 0.5], [0.1, 0.2, 0.3, 0.4, 0.45, 0.5])
    assert cmp.n_lower + cmp.n_higher == 5 and cmp.sign_p == pytest.approx(2 / 32)
    assert cmp.wilcoxon_p == pytest.approx(2 / 32)  # all positive: the most extreme of 32 sign patterns
    assert "only 5 untied seeds (< 6)" in cmp.note and "0.0625" in cmp.note


@pytest.mark.parametrize("level", [0.5, 0.8, 0.9, 0.95, 0.99])
def test_min_untied_is_the_first_n_whose_smallest_p_reaches_alpha(level):
    first = next(n for n in range(1, 100) if 2 / 2**n <= 1 - level + 1e-15)
    assert paired.min_untied(level) == first


rates = st.floats(0.0, 1.0, allow_nan=False)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(rates, rates), min_size=1, max_size=8))
def test_swapping_the_two_rates_mirrors_the_comparison(pairs):
    a, b = (np.array(x) for x in zip(*pairs))
    ab, ba = paired.paired_comparison(a, b), paired.paired_comparison(b, a)
    assert ab.n_lower + ab.n_tied + ab.n_higher == len(pairs)
    assert (ab.n_lower, ab.n_tied, ab.n_higher) == (ba.n_higher, ba.n_tied, ba.n_lower)
    assert ab.sign_p == pytest.approx(ba.sign_p) and ab.wilcoxon_p == pytest.approx(ba.wilcoxon_p)
    assert 0.0 <= ab.sign_p <= 1.0 and 0.0 <= ab.wilcoxon_p <= 1.0
    assert ab.interval.mean == pytest.approx(-ba.interval.mean, abs=1e-12)
