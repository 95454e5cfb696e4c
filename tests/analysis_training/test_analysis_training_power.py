"""The power of a paired comparison of methods against a simulated paired t-test and a brute-force search."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats
from hypothesis import given, settings
from hypothesis import strategies as st

from analysis.training import stats


def simulated_power(difference, sd, n, reps=40_000, alpha=0.05, seed=0):
    """The share of simulated experiments (n normal paired differences) in which the two-sided paired t-test
    rejects at level alpha, with the t statistic written out."""
    d = np.random.default_rng(seed).normal(difference, sd, size=(reps, n))
    t = d.mean(axis=1) / (d.std(axis=1, ddof=1) / math.sqrt(n))
    return float((np.abs(t) > scipy.stats.t.ppf(1 - alpha / 2, n - 1)).mean())


@pytest.mark.parametrize(("n", "sd"), [(3, 0.03), (5, 0.02), (12, 0.05)])
def test_the_minimum_detectable_difference_has_power_080_in_simulation(n, sd):
    mde = stats.minimum_detectable_difference(n, sd)
    assert mde > 0
    assert simulated_power(mde, sd, n) == pytest.approx(0.8, abs=0.01)  # SE of the simulated share: 0.002
    assert simulated_power(mde, sd, n, seed=1) > simulated_power(0.8 * mde, sd, n, seed=1) + 0.05


def test_power_at_no_difference_is_alpha_and_matches_simulation():
    assert stats.paired_t_power(0.0, 1.0, 7) == pytest.approx(0.05, abs=1e-12)
    assert stats.paired_t_power(0.4, 1.0, 10) == pytest.approx(simulated_power(0.4, 1.0, 10), abs=0.01)
    assert stats.paired_t_power(-0.4, 1.0, 10) == pytest.approx(stats.paired_t_power(0.4, 1.0, 10))
    # noncentralities where scipy's nct.cdf returns NaN for the lower tail (df 1, nc 8; df 5, nc 10)
    for n, nc in ((2, 8.0), (6, 10.0)):
        d = nc / math.sqrt(n)
        assert stats.paired_t_power(d, 1.0, n) == pytest.approx(simulated_power(d, 1.0, n), abs=0.01)


def test_many_seeds_approach_the_normal_formula():
    z = scipy.stats.norm.ppf
    n = 5000
    assert stats.minimum_detectable_difference(n, 1.0) == pytest.approx(
        (z(0.975) + z(0.8)) / math.sqrt(n), rel=2e-3
    )


@settings(max_examples=25, deadline=None)
@given(st.floats(0.005, 0.05), st.floats(0.005, 0.1))
def test_seeds_needed_is_the_first_n_with_power_080(difference, sd):
    n = stats.seeds_needed(difference, sd)
    assert stats.paired_t_power(difference, sd, n) >= 0.8
    if n > 2:
        assert stats.paired_t_power(difference, sd, n - 1) < 0.8
    if n <= 400:  # brute force from two seeds up
        assert n == next(m for m in range(2, 401) if stats.paired_t_power(difference, sd, m) >= 0.8)


def test_two_points_on_table2_scale():
    # a 2-point difference with a 3-point SD of paired differences: 20 seeds, and 3 seeds detect about 9.8 points
    assert stats.seeds_needed(2.0, 3.0) == 20
    assert stats.minimum_detectable_difference(stats.seeds_needed(2.0, 3.0), 3.0) <= 2.0
    assert stats.minimum_detectable_difference(19, 3.0) > 2.0


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: stats.paired_t_power(1.0, 1.0, 1), "needs n >= 2 seeds, got 1"),
        (lambda: stats.minimum_detectable_difference(3, 0.0), "must be finite and > 0, got 0.0"),
        (lambda: stats.minimum_detectable_difference(3, 1.0, power=0.03), "power must be in (alpha, 1)"),
        (lambda: stats.minimum_detectable_difference(3, 1.0, alpha=1.5), "alpha must be in (0, 1), got 1.5"),
        (lambda: stats.seeds_needed(0.0, 1.0), "finite and non-zero, got 0.0"),
        (lambda: stats.seeds_needed(1e-4, 1.0, max_seeds=100), "more than max_seeds = 100"),
    ],
)
def test_bad_input_is_one_clear_line(call, message):
    with pytest.raises(ValueError) as err:
        call()
    assert message in str(err.value) and "\n" not in str(err.value)
