"""The study's benchmark reports the ground truths' cost as a ratio measured in one run."""

from __future__ import annotations

import pytest

from analysis.token_level.bench import ground_truth_ratio, ground_truth_ratio_line


def test_the_ratio_is_the_time_with_ground_truths_over_the_time_without_them() -> None:
    rows = [{"wall": 3.0, "seconds_ground_truth": 1.0}, {"wall": 5.0, "seconds_ground_truth": 1.0}]
    assert ground_truth_ratio(rows) == pytest.approx(8.0 / 6.0)
    assert "1.33x" in ground_truth_ratio_line(rows) and "PASS" in ground_truth_ratio_line(rows)
    slow = [{"wall": 4.0, "seconds_ground_truth": 2.0}]
    assert ground_truth_ratio(slow) == pytest.approx(2.0)
    assert "FAIL" in ground_truth_ratio_line(slow)


def test_a_study_without_ground_truths_says_so() -> None:
    rows = [{"wall": 3.0}, {"wall": 2.0, "seconds_ground_truth": 0.0}]
    assert ground_truth_ratio(rows) is None
    assert "not computed" in ground_truth_ratio_line(rows)
