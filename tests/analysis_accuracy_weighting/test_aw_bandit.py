"""The closed forms of analysis.accuracy_weighting.theory against the exact expectation of each method's real loss
(the engine's grpo_advantages, predmask.vr_weights's weighted SFT, autograd) on a one-question softmax bandit whose
every G-tuple of samples is enumerated, and against limits computed separately."""

from __future__ import annotations

import math

import numpy as np
import pytest

from analysis.accuracy_weighting.measure import BanditCase, bandit_weights, check_sampling
from analysis.accuracy_weighting.theory import METHODS, batch_weight, predicted_weight

ACCURACIES = (1e-3, 0.05, 0.3, 0.5, 0.7, 0.95, 0.999)
GROUPS = (1, 2, 3, 5)


@pytest.mark.parametrize("g", GROUPS)
@pytest.mark.parametrize("p", ACCURACIES)
def test_bandit_expectation_equals_closed_form(p: float, g: int) -> None:
    measured = bandit_weights(BanditCase(p=p, group_size=g, arms=3, correct=1, seed=g))
    for method in METHODS:
        w, residual = measured[method]
        predicted = float(predicted_weight(method, p, group_size=g))
        # the expected gradient lies along ∇ log p: nothing orthogonal to it
        assert residual <= 1e-9 * max(1.0, abs(w)), (method, p, g, residual)
        # every method in float64, GRPO's advantages included (grpo_advantages(dtype=float64))
        assert w == pytest.approx(predicted, rel=1e-9, abs=1e-12), (method, p, g)


def test_bandit_with_more_correct_arms_and_other_shape() -> None:
    for p in (0.01, 0.6, 0.99):
        measured = bandit_weights(BanditCase(p=p, group_size=4, arms=5, correct=2, seed=7))
        for method in METHODS:
            assert measured[method][0] == pytest.approx(float(predicted_weight(method, p, group_size=4)), rel=1e-9)


def _grpo_by_hand(p: float, g: int, eps: float) -> float:
    """GRPO's weight summed over every 0/1 reward vector of a group (written without the theory module's sum)."""
    total = 0.0
    for bits in range(2 ** g):
        r = [(bits >> i) & 1 for i in range(g)]
        k = sum(r)
        prob = p ** k * (1 - p) ** (g - k)
        if k in (0, g):
            continue
        mean = k / g
        std = math.sqrt(sum((x - mean) ** 2 for x in r) / (g - 1))
        adv0 = (r[0] - mean) / (std + eps)
        # given the rewards, y_1 ~ π(·|r_1): E[∇log π(y_1)] = g if r_1 = 1, −p/(1−p)·g if r_1 = 0 (E_π[∇log π] = 0)
        total += prob * adv0 * (1.0 if r[0] == 1 else -p / (1 - p))
    return total


@pytest.mark.parametrize("g", (2, 3, 4, 6))
@pytest.mark.parametrize("p", (0.02, 0.4, 0.9))
def test_grpo_finite_group_form_against_enumerated_rewards(p: float, g: int) -> None:
    assert float(predicted_weight("grpo", p, group_size=g, eps=1e-6)) == pytest.approx(_grpo_by_hand(p, g, 1e-6), rel=1e-12)


def test_limits_and_special_cases() -> None:
    p = np.array([0.05, 0.3, 0.5, 0.8])
    # large groups: GRPO -> sqrt(p / (1 - p)) (eps 0), VR -> 1
    assert np.allclose(predicted_weight("grpo", p, group_size=20000, eps=0.0), np.sqrt(p / (1 - p)), rtol=2e-3)
    assert np.allclose(predicted_weight("grpo", p, eps=0.0), np.sqrt(p / (1 - p)), rtol=1e-12)
    assert np.allclose(predicted_weight("vr", p, group_size=20000), 1.0)
    # G = 2: the advantages are ±1/√2 on a mixed pair, so the weight is p/√2 (with eps 0)
    assert np.allclose(predicted_weight("grpo", p, group_size=2, eps=0.0), p / math.sqrt(2), rtol=1e-12)
    # finite groups cap GRPO's weight: (G − 1)/√G at p = 1, and ~ p (G − 1)/√G near p = 0
    assert float(predicted_weight("grpo", 1.0, group_size=9, eps=0.0)) == pytest.approx(8 / 3)
    assert float(predicted_weight("grpo", 1e-6, group_size=9, eps=0.0)) == pytest.approx(1e-6 * 8 / 3, rel=1e-4)
    assert np.all(predicted_weight("grpo", p, group_size=1) == 0.0)
    for m in ("rft", "reinforce"):
        assert np.array_equal(predicted_weight(m, p, group_size=3), p)
    assert np.array_equal(batch_weight("vr", p, group_size=4), np.ones_like(p))


@pytest.mark.parametrize(
    ("call", "needle"),
    [
        (lambda: predicted_weight("ppo", 0.5), "unknown method 'ppo'"),
        (lambda: predicted_weight("grpo", 1.5), "accuracy p must lie in [0, 1]"),
        (lambda: predicted_weight("grpo", 0.5, group_size=0), "group_size = 0"),
        (lambda: BanditCase(p=1.0, group_size=2), "bandit p = 1.0"),
        (lambda: BanditCase(p=0.5, group_size=2, arms=3, correct=3), "bandit correct = 3"),
        (lambda: BanditCase(p="0.5", group_size=2), "bandit p = '0.5'"),
        (lambda: BanditCase(p=0.5, group_size=2.0), "bandit group_size = 2.0"),
        (lambda: BanditCase(p=0.5, group_size=11), "4^11 batches is too many"),
        (lambda: predicted_weight("grpo", 0.5, group_size=2, eps=-1.0), "eps = -1.0"),
        (lambda: check_sampling(1, 4, True), "group_size = True"),
        (lambda: check_sampling(0, 4, 2), "questions = 0"),
    ],
)
def test_bad_input_is_one_line(call, needle: str) -> None:
    with pytest.raises(ValueError) as err:
        call()
    assert needle in str(err.value) and "\n" not in str(err.value)
