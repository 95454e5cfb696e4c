"""The study's statistics against independent hand computations: paired-seed means (a numpy loop), pooled fractions
(counted on the token rows), the Wilson interval (the roots of its defining quadratic), and the printed forms."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest

from analysis.token_columns import CRITERIA, PREDICTIVE
from analysis.token_level.summary.study_stats import (
    PAPER_TOKEN_LEVEL,
    mean_se,
    paired_unsafe_keep,
    paper_text,
    seed_summary,
    study_summary,
    wilson_interval,
)

# A small per-seed table: seed 3 has no ratio rate, seed 5 no predictive rate, seed 6 neither.
RATIO = [0.50, 0.40, 0.30, None, 0.80, 0.60, None, 0.25]
PRED = [0.25, 0.50, 0.20, 0.90, 0.70, None, None, 0.25]


def _by_hand(ratio: list[float | None], pred: list[float | None]) -> dict[str, float | int]:
    """Means and SEs over the seeds where both rates exist, in a plain loop."""
    r_vals, p_vals = [], []
    for a, b in zip(ratio, pred):
        if a is not None and b is not None:
            r_vals.append(a)
            p_vals.append(b)
    n = len(r_vals)
    out: dict[str, float | int] = {"n": n, "lower": 0, "tied": 0}
    for name, vals in (("ratio", r_vals), ("pred", p_vals)):
        total = 0.0
        for v in vals:
            total += v
        mean = total / n
        ss = 0.0
        for v in vals:
            ss += (v - mean) ** 2
        out[f"{name}_mean"], out[f"{name}_se"] = mean, math.sqrt(ss / (n - 1)) / math.sqrt(n)
    for a, b in zip(r_vals, p_vals):
        out["lower"] += int(b < a)
        out["tied"] += int(b == a)
    return out


@pytest.mark.parametrize("as_frame", [True, False])
def test_paired_seed_mean_equals_a_hand_computation(as_frame: bool) -> None:
    cols = {"seed": list(range(len(RATIO))), "unsafe_keep_ratio": RATIO, "unsafe_keep_predictive": PRED}
    # the reports pass column arrays with NaN for NULL; the CLI a polars frame with nulls
    rows = pl.DataFrame(cols) if as_frame else {k: np.array(v, dtype=float) for k, v in cols.items()}
    got = paired_unsafe_keep(rows)
    want = _by_hand(RATIO, PRED)
    assert list(got.seeds) == [0, 1, 2, 4, 7] and got.n_paired == want["n"] == 5 and got.n_seeds == len(RATIO)
    assert got.ratio_mean.mean == pytest.approx(want["ratio_mean"])
    assert got.ratio_mean.se == pytest.approx(want["ratio_se"])
    assert got.pred_mean.mean == pytest.approx(want["pred_mean"])
    assert got.pred_mean.se == pytest.approx(want["pred_se"])
    assert (got.n_lower, got.n_tied) == (want["lower"], want["tied"]) == (3, 1)
    assert got.ratio_mean.n == got.pred_mean.n == 5 and got.ratio_mean.over == "paired seeds"
    # each rate over its own seeds would differ: the paired definition is the one used
    own = mean_se(RATIO)
    assert own.n == 6 and own.mean != pytest.approx(got.ratio_mean.mean)


def test_printed_means_name_their_seeds() -> None:
    got = paired_unsafe_keep(
        {"seed": [0, 1, 2], "unsafe_keep_ratio": [0.5, 0.4, None], "unsafe_keep_predictive": [0.25, 0.5, 0.2]}
    )
    se = math.sqrt(((0.5 - 0.45) ** 2 + (0.4 - 0.45) ** 2) / 1) / math.sqrt(2)
    assert got.ratio_mean.pct() == f"45.0% ± {100 * se:.1f} (n = 2 paired seeds)"
    assert mean_se([3.0]).count() == "3.0 (n = 1 seeds)"
    assert mean_se([None, float("nan")]).pct() == "—"


def _tokens(rng: np.random.Generator, seed: int, n: int) -> pl.DataFrame:
    cols: dict[str, object] = {"seed": [seed] * n}
    for keep, dd in CRITERIA.values():
        cols[keep] = rng.random(n) < 0.5
        cols[dd] = rng.normal(size=n)
    return pl.DataFrame(cols)


def test_pooled_corrective_from_seed_rows_equals_counting_the_tokens() -> None:
    rng = np.random.default_rng(0)
    tokens = [_tokens(rng, s, n) for s, n in enumerate((40, 0, 25, 60))]
    rows = pl.DataFrame([{"seed": s, **seed_summary(t, 100)} for s, t in enumerate(tokens)])
    summary = study_summary(rows)
    every = pl.concat([t for t in tokens if t.height])
    ratio_keep = every["keep_ratio"].to_numpy()
    for crit in PREDICTIVE:
        keep_c, dd_c = CRITERIA[crit]
        kp = every[keep_c].to_numpy()
        dis = kp != ratio_keep
        pair = summary.pairs[crit]
        kept_p = dis & kp
        assert (pair.corrective_pred.k, pair.corrective_pred.n) == (
            int((kept_p & (every[dd_c].to_numpy() < 0)).sum()),
            int(kept_p.sum()),
        )
        kept_r = dis & ratio_keep
        assert (pair.corrective_ratio.k, pair.corrective_ratio.n) == (
            int((kept_r & (every["dd_ratio"].to_numpy() < 0)).sum()),
            int(kept_r.sum()),
        )
        assert summary.corrective[crit] == pair.corrective_pred
    assert summary.corrective["ratio"] == summary.pairs["predictive"].corrective_ratio
    assert summary.outside.mean == pytest.approx((40 + 0 + 25 + 60) / 4) and summary.outside.n == 4


@pytest.mark.parametrize(("k", "n"), [(2, 3), (0, 10), (10, 10), (37, 120)])
def test_wilson_bounds_solve_the_score_equation(k: int, n: int) -> None:
    z = 1.959964
    lo, hi = wilson_interval(k, n)
    p_hat = k / n
    for p in (lo, hi):  # (p_hat - p)^2 = z^2 p (1 - p) / n at both ends
        assert (p_hat - p) ** 2 == pytest.approx(z * z * p * (1 - p) / n, abs=1e-12)
    assert 0 <= lo <= p_hat + 1e-12 and p_hat - 1e-12 <= hi <= 1
    assert wilson_interval(2, 3) == pytest.approx((0.2077, 0.9385), abs=1e-4)
    assert all(math.isnan(v) for v in wilson_interval(0, 0))


def test_the_papers_numbers_print_as_published() -> None:
    assert [paper_text(k) for k in PAPER_TOKEN_LEVEL] == [
        "61",
        "1,435",
        "≈ 82",
        "34.2%",
        "36.9%",
        "38 of 61",
        "65.1%",
        "62.9%",
    ]
    with pytest.raises(KeyError, match="unknown paper number 'nope'"):
        paper_text("nope")
