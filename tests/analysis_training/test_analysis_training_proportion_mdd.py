"""The minimum detectable difference of two accuracies over problems x seeds, against scipy's normal distribution
and a simulated two-proportion z-test."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats

from analysis.training import stats


def z_test_power(difference: float, p: float, trials: int, alpha: float = 0.05) -> float:
    """Power of the two-sided z-test of two proportions at the standard error sqrt(2 p (1 - p) / trials), both
    rejection tails, written out from scipy's normal distribution."""
    se = math.sqrt(2 * p * (1 - p) / trials)
    crit = scipy.stats.norm.ppf(1 - alpha / 2)
    return float(scipy.stats.norm.sf(crit - difference / se) + scipy.stats.norm.cdf(-crit - difference / se))


@pytest.mark.parametrize(("trials", "p"), [(90, 0.5), (90, 0.3), (1_000, 0.5), (4_350, 0.42)])
def test_at_the_mdd_the_z_test_has_power_080(trials: int, p: float) -> None:
    mdd = stats.proportion_mdd(trials, p)
    assert z_test_power(mdd, p, trials) == pytest.approx(0.8, abs=1e-3)  # the far tail adds < 1e-3
    assert z_test_power(0.9 * mdd, p, trials) < 0.8 < z_test_power(1.1 * mdd, p, trials)


def test_hand_value_and_the_trials_a_difference_needs() -> None:
    # (1.959964 + 0.841621) * sqrt(2 * 0.25 / 90) = 2.801585 * 0.0745356 = 0.208818
    assert stats.proportion_mdd(90) == pytest.approx(0.208818, abs=1e-6)
    needed = math.ceil(90 * (stats.proportion_mdd(90) / 0.03) ** 2)
    assert stats.proportion_mdd(needed) <= 0.03 < stats.proportion_mdd(needed - 1)
    assert stats.proportion_mdd(90, power=0.9, alpha=0.01) > stats.proportion_mdd(90)


def test_simulated_two_proportion_test_detects_the_mdd_eight_times_in_ten() -> None:
    trials, p = 2_000, 0.4
    d = stats.proportion_mdd(trials, p)
    rng = np.random.default_rng(0)
    a = rng.binomial(trials, p - d / 2, size=40_000) / trials
    b = rng.binomial(trials, p + d / 2, size=40_000) / trials
    pooled = (a + b) / 2
    z = (b - a) / np.sqrt(2 * pooled * (1 - pooled) / trials)
    assert float((np.abs(z) > scipy.stats.norm.ppf(0.975)).mean()) == pytest.approx(0.8, abs=0.01)


@pytest.mark.parametrize(("call", "needle"), [
    (lambda: stats.proportion_mdd(0), "trials must be an integer >= 1 (problems x seeds), got 0"),
    (lambda: stats.proportion_mdd(30.0), "got 30.0"),
    (lambda: stats.proportion_mdd(30, p=1.0), "the accuracy p must be in (0, 1), got 1.0"),
    (lambda: stats.proportion_mdd(30, power=0.01), "power must be in (alpha, 1)"),
])
def test_bad_input_is_one_line(call, needle: str) -> None:
    with pytest.raises(ValueError) as err:
        call()
    assert needle in str(err.value) and "\n" not in str(err.value)
