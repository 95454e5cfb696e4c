"""The criteria judged against per-token ground truths, checked against counts written out on hand-made frames, a
token loop on random frames, and a real DuckDB table."""

from __future__ import annotations

import math

import duckdb
import numpy as np
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from analysis import paired
from analysis.token_level.summary import criteria as C

KEEPS = ("keep_ratio", "keep_pred_agg", "keep_pred_uniform", "keep_pred_exact")


def hand_frame() -> pl.DataFrame:
    """Two seeds, eight tokens. Truth > 0 means keeping raises D, so a right decision drops exactly those.

    seed 0: truths + + - + (and a token with A = 0, outside the judged set); seed 1: truths + - NaN +.
    The ratio criterion drops tokens 0, 2 (seed 0) and 6 (seed 1); the aggregated predictive criterion drops
    0, 1, 3 (seed 0) and 5, 8 (seed 1). Rows are numbered 0-8 across both seeds.
    """
    return pl.DataFrame(
        {
            "seed": [0, 0, 0, 0, 0, 1, 1, 1, 1],
            "a": [1.0, -1.0, 2.0, 1.0, 0.0, 1.0, -1.0, 1.0, 1.0],
            "ddot_net": [0.3, 0.1, -0.2, 0.4, 0.0, 0.2, -0.1, float("nan"), 0.5],
            "context_id": [11, 12, 13, 11, 14, 21, 22, 23, 21],
            "keep_ratio": [False, True, False, True, True, True, False, True, True],
            "keep_pred_agg": [False, False, True, False, True, False, True, True, False],
        }
    )


def test_accuracy_balanced_accuracy_and_the_constant_predictor_by_hand():
    js = C.judge(hand_frame(), "outside", "ddot_net", resamples=200)
    ratio, pred = js["ratio"], js["predictive"]
    # judged: seed 0 tokens 0-3 (truth + + - +), seed 1 tokens 5, 6, 8 (+ - +); token 7's truth is NaN
    assert ratio.n_tokens == pred.n_tokens == 7 and ratio.n_missing == 1
    assert ratio.n_contexts == 5  # 11, 12, 13 | 21, 22
    # ratio drops 0, 2 | 6: right only on 0 (+, dropped); 1, 3, 5, 8 rise but are kept, 2 and 6 fall but are dropped
    assert list(ratio.counts[:, 0]) == [1, 0] and list(ratio.counts[:, 1]) == [4, 3]
    # predictive drops 0, 1, 3 | 5, 8: right on every token
    assert pred.accuracy.estimate == 1.0 and ratio.accuracy.estimate == pytest.approx(1 / 7)
    # ratio: TP 1 of 5 positives, TN 0 of 2 negatives
    assert ratio.balanced_accuracy.estimate == pytest.approx(0.5 * (1 / 5 + 0 / 2))
    assert pred.balanced_accuracy.estimate == 1.0
    assert ratio.share_positive.estimate == pytest.approx(5 / 7)
    assert ratio.constant_class == "rises" and ratio.constant_accuracy.estimate == pytest.approx(5 / 7)
    assert ratio.constant_balanced_accuracy == 0.5
    assert list(pred.seed_accuracy) == [1.0, 1.0] and list(ratio.seed_accuracy) == pytest.approx([0.25, 0.0])
    assert ratio.vs_ratio_accuracy is None
    cmp = pred.vs_ratio_accuracy
    assert list(cmp.diffs) == pytest.approx([0.75, 1.0])
    assert (cmp.n_lower, cmp.n_tied, cmp.n_higher) == (0, 0, 2)
    assert "only 2 untied seeds" in cmp.note
    assert ratio.accuracy_wilson == pytest.approx(paired.wilson_interval(1, 7), abs=1e-8)


def test_a_set_of_one_class_has_no_balanced_accuracy():
    frame = hand_frame().with_columns(pl.col("ddot_net").abs() + 0.1)  # every token rises
    ratio = C.judge(frame, "outside", "ddot_net", resamples=50)["ratio"]
    assert ratio.balanced_accuracy.estimate is None and ratio.constant_balanced_accuracy is None
    assert ratio.constant_accuracy.estimate == 1.0 and ratio.share_positive.estimate == 1.0


def test_tokens_without_advantage_are_not_judged_and_the_disagreement_set_is_where_decisions_differ():
    frame = hand_frame()
    assert C.token_set(frame, "outside").height == 8
    disagree = C.token_set(frame, "disagree")
    assert disagree.height == int((frame["keep_ratio"] != frame["keep_pred_agg"]).sum()) == 6
    js = C.judge(frame, "disagree", "ddot_net", resamples=50)
    acc_r, acc_p = js["ratio"].seed_accuracy, js["predictive"].seed_accuracy
    assert np.allclose(acc_r + acc_p, 1.0)  # opposite decisions on every token: one is right, the other wrong


def random_frame(rng: np.random.Generator, n_seeds: int, per_seed: int, p_rise: float = 0.7) -> pl.DataFrame:
    n = n_seeds * per_seed
    truth = np.where(rng.uniform(size=n) < p_rise, 1.0, -1.0) * rng.uniform(0.01, 1, size=n)
    truth[rng.uniform(size=n) < 0.05] = np.nan
    cols = {k: rng.uniform(size=n) < 0.5 for k in KEEPS}
    return pl.DataFrame(
        {
            "seed": np.repeat(np.arange(n_seeds) * 3 + 1, per_seed),
            "a": np.where(rng.uniform(size=n) < 0.1, 0.0, rng.normal(size=n)),
            "ddot_agg": rng.normal(size=n),
            "ddot_uniform": rng.normal(size=n),
            "ddot_exact": rng.normal(size=n),
            "dd_cf": truth,
            "ddot_net": rng.normal(size=n),
            "context_id": rng.integers(0, max(1, n // 2), size=n),
            **cols,
        }
    )


def loop_counts(frame: pl.DataFrame, keep: str, truth: str, seeds: list[int]) -> np.ndarray:
    """Per seed (right, tokens, rising dropped, rising, falling kept, falling) over the outside tokens with A != 0
    and a finite truth, one token at a time."""
    out = {s: [0] * 6 for s in seeds}
    for row in frame.iter_rows(named=True):
        if row["a"] == 0 or not math.isfinite(row[truth]):
            continue
        drop, rises = not row[keep], row[truth] > 0
        c = out[row["seed"]]
        c[0] += drop == rises
        c[1] += 1
        if rises:
            c[2] += drop
            c[3] += 1
        else:
            c[4] += not drop
            c[5] += 1
    return np.array([out[s] for s in seeds], dtype=float).reshape(-1, 6)


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 6), st.integers(0, 12), st.integers(0, 2**32 - 1))
def test_pooled_and_per_seed_accuracy_against_a_token_loop(n_seeds, per_seed, seed):
    frame = random_frame(np.random.default_rng(seed), n_seeds, per_seed)
    seeds = sorted(set(frame["seed"].to_list()))
    js = C.judge(frame, "outside", "dd_cf", resamples=100, seed=7)
    for crit, keep in zip(("ratio", "predictive", "predictive_uniform", "predictive_exact"), KEEPS):
        c = loop_counts(frame, keep, "dd_cf", seeds)
        j = js[crit]
        assert list(j.seeds) == seeds and np.array_equal(j.counts, c)
        want = paired.cluster_bootstrap_ratio(c[:, 0], c[:, 1], resamples=100, seed=7)
        assert (j.accuracy.estimate, j.accuracy.lo, j.accuracy.hi) == (want.estimate, want.lo, want.hi)
        tp, pos, tn, neg = c[:, 2:].sum(axis=0)
        bal = j.balanced_accuracy.estimate
        assert bal == (pytest.approx(0.5 * (tp / pos + tn / neg)) if pos and neg else None)
        assert j.n_tokens == js["ratio"].n_tokens  # every criterion on the same tokens


def test_the_constant_guess_beats_both_criteria_when_nearly_every_token_rises():
    frame = random_frame(np.random.default_rng(3), 8, 200, p_rise=0.99)
    js = C.judge(frame, "outside", "dd_cf", resamples=200)
    for j in js.values():
        assert j.constant_class == "rises" and j.constant_accuracy.estimate > 0.97
        assert j.accuracy.estimate < j.constant_accuracy.estimate
        assert (
            j.balanced_accuracy.estimate == pytest.approx(0.5, abs=0.15)
            and j.constant_balanced_accuracy == 0.5
        )


def test_the_long_table_has_one_row_per_set_truth_and_criterion_and_goes_into_duckdb():
    frame = random_frame(np.random.default_rng(4), 5, 40)
    js = C.judge_all(frame, resamples=100)
    table = C.criteria_table(js)
    assert table.schema == pl.Schema(C.CRITERIA_COLUMNS)
    assert table.height == 4 * 2 * 4  # token sets × truths (dd_cf, ddot_net) × criteria
    assert table.select("token_set", "truth", "criterion").n_unique() == table.height
    ratio_rows = table.filter(pl.col("criterion") == "ratio")
    assert ratio_rows["vs_ratio_accuracy_mean"].null_count() == ratio_rows.height
    con = duckdb.connect(":memory:")
    con.register("frame", table.to_arrow())
    con.execute("CREATE TABLE token_level_criteria AS SELECT * FROM frame")
    back = con.execute("SELECT count(*), sum(n_tokens) FROM token_level_criteria").fetchone()
    assert back == (table.height, table["n_tokens"].sum())
    seeds = C.per_seed_table(js)
    assert seeds.height == len(js) * 5
    assert seeds["n_right"].sum() == sum(int(j.counts[:, 0].sum()) for j in js)


def test_sign_agreement_against_a_token_loop():
    frame = random_frame(np.random.default_rng(5), 4, 30)
    g = C.sign_agreement(frame, "ddot_net", "ddot_exact", resamples=100)
    k = n = 0
    for row in frame.iter_rows(named=True):
        if row["a"] == 0:
            continue
        n += 1
        k += np.sign(row["ddot_net"]) == np.sign(row["a"] * row["ddot_exact"])
    assert (g.n_tokens, g.agreement.estimate) == (n, pytest.approx(k / n))
    assert g.wilson == pytest.approx(paired.wilson_interval(k, n), abs=1e-8)
    table = C.agreement_table(frame, resamples=100)
    assert table.height == 3 and table.schema == pl.Schema(C.AGREEMENT_COLUMNS)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda f: C.judge(f, "outside", "nope"), "unknown ground truth 'nope'; valid: ddot_net"),
        (lambda f: C.token_set(f, "inside"), "unknown token set 'inside'; valid: outside, disagree"),
        (lambda f: C.judge(f, "outside", "dd_all"), "needs token columns dd_all"),
        (lambda f: C.sign_agreement(f, "dd_cf"), "network-aware truth; got 'dd_cf'"),
        (
            lambda f: C.token_set(f, "disagree_exact"),
            "token set disagree_exact needs token columns keep_pred_exact",
        ),
    ],
)
def test_bad_input_is_one_clear_line(call, message):
    with pytest.raises(ValueError) as err:
        call(hand_frame())
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_keep_column_stored_as_all_null_is_not_judged() -> None:
    """A database gives a study the columns another study carries, as NULL: such a criterion is left out, not judged
    wrong on every token."""
    import polars as pl

    from analysis.token_level.summary.criteria import _criteria

    frame = pl.DataFrame({
        "seed": [0, 0, 1],
        "keep_ratio": [True, False, True],
        "keep_pred_agg": [False, True, True],
        "keep_pred_exact": pl.Series([None, None, None], dtype=pl.Boolean),
    })
    assert "predictive_exact" not in _criteria(frame)
    assert {"ratio", "predictive"} <= set(_criteria(frame))
