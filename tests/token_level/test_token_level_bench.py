"""The study's benchmark: the ground truths' cost as a ratio measured in one run, and the extrapolation's fit."""

from __future__ import annotations

import numpy as np
import pytest

from analysis.token_level.bench import (
    GROUND_TRUTH_RATIO_MAX,
    extrapolate,
    ground_truth_ratio,
    ground_truth_target,
)


def test_the_ratio_is_the_time_with_ground_truths_over_the_time_without_them() -> None:
    rows = [{"wall": 3.0, "seconds_ground_truth": 1.0}, {"wall": 5.0, "seconds_ground_truth": 1.0}]
    assert ground_truth_ratio(rows) == pytest.approx(8.0 / 6.0)
    row = ground_truth_target(rows)
    assert row is not None and row["pass"] and row["value"] == pytest.approx(8.0 / 6.0)
    slow = [{"wall": 4.0, "seconds_ground_truth": 2.0}]
    assert ground_truth_ratio(slow) == pytest.approx(2.0)
    assert GROUND_TRUTH_RATIO_MAX == 1.5 and ground_truth_target(slow)["pass"] is False


def test_a_study_without_ground_truths_says_so() -> None:
    rows = [{"wall": 3.0}, {"wall": 2.0, "seconds_ground_truth": 0.0}]
    assert ground_truth_ratio(rows) is None
    assert ground_truth_target(rows) is None


def test_the_extrapolation_fits_cpu_time_against_the_batch_size() -> None:
    xs, cpu = [256, 256, 512, 1024], [1.0, 1.2, 2.1, 3.9]
    result = {"seeds": [{"sequences": x, "cpu": c, "wall": 2 * c} for x, c in zip(xs, cpu)],
              "startup_wall": 3.0, "backend_load": {"wall": 2.0}}
    extrapolate(result, seeds=61, sequences=1024, workers=2)
    b, a = np.polyfit(xs, cpu, 1)
    assert result["fit"]["cpu"] == pytest.approx({"a": a, "b_per_sequence": b})
    assert result["fit"]["wall"] == pytest.approx({"a": 2 * a, "b_per_sequence": 2 * b})
    x = result["extrapolation"]
    assert x["seeds_per_worker"] == 31 and x["cpu_per_seed"] == pytest.approx(a + 1024 * b)
    assert x["wall_estimate"] == pytest.approx(31 * (a + 1024 * b) + 5.0)
