"""The weights table's columns (predmask.vr_weights.weights_columns): today's columns in today's order, and one more
weight column for an estimator registered in a test (the registry patched by monkeypatch, restored after)."""

from __future__ import annotations

import math

import pytest
from vr_stage_helpers import register_uniform

import predmask.vr_weights as vr
from predmask.verl.vr_sample import weight_rows

TODAY = ("question", "trace", "trace_tokens", "answer_tokens", "log_prior", "log_posterior", "log_ratio",
         "answer_logp", "acc", "posterior_correct", "weight_acc", "weight_gml", "weight_likelihood")


def test_weights_columns_are_todays_in_todays_order() -> None:
    assert vr.weights_columns() == TODAY
    assert vr.weight_column("acc") == "weight_acc"


def test_a_registered_estimator_adds_its_weight_column_last(monkeypatch: pytest.MonkeyPatch) -> None:
    register_uniform(monkeypatch)
    assert vr.weights_columns() == (*TODAY, "weight_uniform")
    monkeypatch.undo()
    assert vr.weights_columns() == TODAY


def test_the_cluster_weight_rows_hold_every_weights_column(monkeypatch: pytest.MonkeyPatch) -> None:
    register_uniform(monkeypatch)
    raw = [{"question": q, "trace": k, "trace_tokens": 2, "answer_tokens": 3, "log_prior": -1.0 - k,
            "log_posterior": -1.0, "answer_logp": -0.5, "correct": [True, k == 0], "posterior_correct": True}
           for q in (0, 1) for k in (0, 1)]
    rows = weight_rows(raw)
    assert vr.weights_columns() == (*TODAY, "weight_uniform")
    assert all(tuple(r) == vr.weights_columns() for r in rows)
    # log ratios 0 and -0.5 per question: softmax of the log ratios alone
    want = [1 / (1 + math.exp(-0.5)), 1 / (1 + math.exp(0.5))] * 2
    assert [r["weight_uniform"] for r in rows] == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("name", ["Acc", "acc; DROP TABLE vr_traces", "2x", "", "a-b"])
def test_an_estimator_name_that_cannot_be_a_column_is_refused_in_one_line(name: str) -> None:
    with pytest.raises(ValueError, match=r"^estimator name .* is not allowed: lower-case letters, digits and _") as info:
        vr.register_estimator(name, label="x", inputs=("correct",))
    assert "\n" not in str(info.value) and name not in vr.ESTIMATORS
