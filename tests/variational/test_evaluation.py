"""pass@k of math.md §8 (predmask.evaluation) against a brute-force enumeration of every k-subset of the samples.

The reference never calls predmask.evaluation: it lists all C(n, k) subsets with itertools.combinations and counts
those holding at least one correct sample, in exact fractions.
"""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from predmask.evaluation import pass_at_k, pass_at_k_curve


def brute_pass_at_k(row: list[bool], k: int) -> Fraction:
    subsets = list(itertools.combinations(range(len(row)), k))
    return Fraction(sum(any(row[i] for i in s) for s in subsets), len(subsets))


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_matches_the_enumeration_of_subsets(n: int) -> None:
    for c in range(n + 1):
        row = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(float(brute_pass_at_k(row, k)), abs=1e-14)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.booleans(), min_size=6, max_size=6), min_size=1, max_size=5))
def test_pass_at_k_curve_is_the_mean_of_the_enumerations(rows: list[list[bool]]) -> None:
    curve = pass_at_k_curve(torch.tensor(rows))
    assert list(curve) == list(range(1, 7))
    for k, value in curve.items():
        expected = sum(brute_pass_at_k(r, k) for r in rows) / len(rows)
        assert value == pytest.approx(float(expected), abs=1e-14)
    values = list(curve.values())
    assert values == sorted(values)  # more draws never lower pass@k
    assert curve[1] == pytest.approx(sum(map(sum, rows)) / (6 * len(rows)))  # pass@1 = mean accuracy
    assert curve[6] == pytest.approx(sum(any(r) for r in rows) / len(rows))  # pass@n = solved at all


def test_curve_takes_16_samples_and_0_1_input() -> None:
    correct = torch.zeros(3, 16, dtype=torch.long)
    correct[0, 5] = 1
    correct[2] = 1
    curve = pass_at_k_curve(correct)
    assert list(curve) == list(range(1, 17))
    assert curve[16] == pytest.approx(2 / 3)
    assert curve[1] == pytest.approx((1 / 16 + 1) / 3)


@pytest.mark.parametrize(
    ("call", "names"),
    [
        (lambda: pass_at_k(4, 1, 0), ["k = 0", "[1, 4]"]),
        (lambda: pass_at_k(4, 1, 5), ["k = 5", "[1, 4]"]),
        (lambda: pass_at_k(4, 5, 1), ["c (correct samples) = 5", "[0, 4]"]),
        (lambda: pass_at_k(0, 0, 1), ["n (samples per question) = 0", ">= 1"]),
        (lambda: pass_at_k_curve(torch.zeros(2, 0)), ["(2, 0)"]),
        (lambda: pass_at_k_curve(torch.tensor([[0, 2]])), ["0/1"]),
    ],
)
def test_bad_input_is_one_line_naming_the_value(call, names) -> None:
    with pytest.raises(ValueError) as err:
        call()
    assert "\n" not in str(err.value)
    for name in names:
        assert name in str(err.value)
