"""Metric names given to ``Results.metrics``: a name twice is read once (also as wide columns), and anything but a
string or a list of strings is refused in one line saying what is allowed. The shared report database of
this folder's conftest, read through the library and through SQL."""

from __future__ import annotations

import pytest

KL = "actor/ppo_kl"
SCORE = "critic/score/mean"


def test_a_name_given_twice_is_read_once_also_wide(res_pl):
    twice = res_pl.metrics([SCORE, KL, SCORE], runs="m_dppo_s0", wide=True)
    once = res_pl.metrics([SCORE, KL], runs="m_dppo_s0", wide=True)
    assert twice.columns == once.columns and twice.columns[-2:] == [SCORE, KL]
    assert twice.equals(once)
    tidy = res_pl.metrics((KL, KL), runs="m_dppo_s0")
    assert tidy.equals(res_pl.metrics(KL, runs="m_dppo_s0")) and len(tidy) > 0


@pytest.mark.parametrize(
    ("names", "shown"),
    [(SCORE.encode(), f"bytes {SCORE.encode()!r}"), ([SCORE, 99], "int 99"), (99, "int 99"),
     ({SCORE: 1}, "dict"), ([SCORE.encode()], "bytes")],
)
def test_a_name_that_is_not_a_string_says_what_is_allowed(res_pl, names, shown):
    with pytest.raises(TypeError) as err:
        res_pl.metrics(names)
    message = str(err.value)
    assert "\n" not in message and shown in message
    assert "metric names are strings: give a name or a list of names" in message
    assert "unknown metric" not in message
