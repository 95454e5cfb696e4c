"""Both criteria judged on the same tokens, end to end on a study whose answers are known by construction
(known_study.py): the three study-level tables in a real DuckDB file (spanning every stored seed, idempotent, empty
for an older study, written in the seeds' transaction), the report's first section as printed, and the drift point's
paired statistics, each against counts and rates computed here from the token rows."""

from __future__ import annotations

import math
from pathlib import Path

import duckdb
import numpy as np
import polars as pl
import pytest
from known_study import RESPONSE_TOKENS, SEEDS, kind_count, study
from rich.console import Console

from analysis.store import STUDY_RESULT_KEYS, connect, upsert_token_level
from analysis.token_level.summary.criteria import criteria_table, judge
from analysis.token_level.summary.report import StudyData, print_report
from analysis.token_level.summary.study_stats import drift_point
from analysis.token_level.summary.study_tables import STUDY_TABLES, judge_study, study_tables

TABLES = tuple(STUDY_RESULT_KEYS)


def _count(kind: str, seeds=SEEDS) -> int:
    return sum(kind_count(kind, s) for s in seeds)


def _tables(con: duckdb.DuckDBPyConnection, study_id: str) -> dict[str, pl.DataFrame]:
    out = {}
    for table in TABLES:
        keys = list(STUDY_RESULT_KEYS[table])
        out[table] = con.sql(f"SELECT * FROM {table} WHERE study_id = ?", params=[study_id]).pl().sort(keys)
    return out


def _row(frame: pl.DataFrame, **match: str) -> dict:
    rows = frame.filter(pl.all_horizontal(pl.col(k) == v for k, v in match.items()))
    assert rows.height == 1, (match, rows)
    return rows.row(0, named=True)


# ------------------------------------------------------------------------------------------------ the store


def test_the_tables_span_every_stored_seed_and_rewrite_idempotently(tmp_path: Path) -> None:
    rows, tokens = study()
    con = connect(tmp_path / "db.duckdb")
    try:
        first = [s for s in SEEDS if s < 3]
        w = upsert_token_level(
            con,
            "s1",
            {"x": 1},
            rows.filter(pl.col("seed").is_in(first)),
            tokens.filter(pl.col("seed").is_in(first)),
            derive=study_tables,
        )
        assert w.derived["token_level_criteria"] > 0
        upsert_token_level(
            con,
            "s1",
            {"x": 1},
            rows.filter(~pl.col("seed").is_in(first)),
            tokens.filter(~pl.col("seed").is_in(first)),
            derive=study_tables,
        )
        stored = _tables(con, "s1")
        crit = stored["token_level_criteria"]
        assert set(crit["n_seeds"].to_list()) == {len(SEEDS)}, "pooled over the seeds of both writes"
        # the disagreement set and the outside tokens, counted in SQL on the stored token rows
        n_dis, n_out = con.execute(
            "SELECT count(*) FILTER (WHERE keep_ratio <> keep_pred_agg), count(*) FILTER (WHERE a <> 0) "
            "FROM token_level_tokens WHERE study_id = 's1'"
        ).fetchone()
        assert n_dis == _count("D1") + _count("D2") and n_out == n_dis + _count("K") + _count("R")
        dis = _row(crit, token_set="disagree", truth="ddot_net", criterion="predictive")
        assert (dis["n_tokens"], dis["n_contexts"]) == (n_dis, 2 * len(SEEDS))
        assert dis["balanced_accuracy"] == 1.0 and dis["vs_ratio_balanced_higher"] == len(SEEDS)
        assert _row(crit, token_set="disagree", truth="ddot_net", criterion="ratio")["accuracy"] == 0.0
        # outside: the predictive criterion drops D1 (rises), keeps D2 and K (fall) and R (rises)
        out = _row(crit, token_set="outside", truth="ddot_net", criterion="predictive")
        rises = _count("D1") + _count("R")
        assert out["balanced_accuracy"] == pytest.approx(0.5 * (_count("D1") / rises + 1.0))
        assert out["accuracy"] == pytest.approx((n_out - _count("R")) / n_out)
        seeds = stored["token_level_criteria_seeds"]
        assert seeds.filter(
            (pl.col("token_set") == "disagree")
            & (pl.col("criterion") == "ratio")
            & (pl.col("truth") == "ddot_net")
        )["n_tokens"].to_list() == [kind_count("D1", s) + kind_count("D2", s) for s in SEEDS]
        agree = _row(stored["token_level_sign_agreement"], truth="ddot_net", ddot="ddot_agg")
        assert agree["agreement"] == pytest.approx(1 - _count("R") / n_out)

        # writing the same rows again changes nothing; a study stored before the ground truths gets no rows
        upsert_token_level(con, "s1", {"x": 1}, rows, tokens, derive=study_tables)
        old_rows, old_tokens = study(truths=False)
        w = upsert_token_level(con, "old", {"x": 2}, old_rows, old_tokens, derive=study_tables)
        again = _tables(con, "s1")
        assert all(again[t].equals(stored[t]) for t in TABLES)
        assert dict(w.derived) == dict.fromkeys(TABLES, 0)
        assert all(_tables(con, "old")[t].height == 0 for t in TABLES)
        # every column criteria.py builds is a column of the table
        for table, columns in STUDY_TABLES.items():
            assert set(columns) <= set(again[table].columns)
    finally:
        con.close()


def test_an_older_study_first_leaves_the_tables_empty_and_a_failing_derive_stores_nothing(
    tmp_path: Path,
) -> None:
    con = connect(tmp_path / "db.duckdb")
    try:
        rows, tokens = study(truths=False)
        upsert_token_level(con, "old", {}, rows, tokens, derive=study_tables)
        assert all(con.execute(f"SELECT count(*) FROM {t}").fetchone() == (0,) for t in TABLES)

        def broken(_tokens):
            raise ValueError("derive failed")

        rows, tokens = study()
        with pytest.raises(ValueError, match="derive failed"):
            upsert_token_level(con, "new", {}, rows, tokens, derive=broken)
        assert con.execute("SELECT count(*) FROM token_level_seeds WHERE study_id = 'new'").fetchone() == (0,)
        assert con.execute("SELECT count(*) FROM token_level_tokens WHERE study_id = 'new'").fetchone() == (
            0,
        )
        with pytest.raises(
            ValueError, match="unknown study-level table 'elsewhere'; valid: token_level_criteria"
        ):
            upsert_token_level(con, "new", {}, rows, tokens, derive=lambda t: {"elsewhere": pl.DataFrame()})
    finally:
        con.close()


# ----------------------------------------------------------------------------------------------- the report


def _printed(seed_rows: pl.DataFrame, tokens: pl.DataFrame, study_id: str = "known") -> str:
    console = Console(width=120, record=True, highlight=False)
    config = {"label": "synthetic", "delta": 0.15, "top_k": 20, "sequences": 16, "ratio_cap": 10.0}
    print_report(StudyData(study_id, config, seed_rows, tokens), console)
    return console.export_text()


def _lines_with(text: str, needle: str) -> list[str]:
    return [line for line in text.splitlines() if needle in line]


def test_the_report_opens_with_both_criteria_on_the_same_tokens() -> None:
    rows, tokens = study()
    text = _printed(rows, tokens)
    assert max(len(line) for line in text.splitlines()) <= 120
    first, paper = text.index("Both criteria on the same tokens"), text.index("The paper's definitions")
    assert first < text.index("Paired over seeds") < paper
    outside = sum(rows["n_outside"])
    share = f"{100 * outside / (RESPONSE_TOKENS * len(SEEDS)):.3g}%"
    # every table names the share of response tokens outside it was measured at (titles wrap: join the words)
    words = " ".join(text.split())
    assert words.count(f"at {share} of response tokens outside the trust region") == 6
    n_dis, n_out = _count("D1") + _count("D2"), sum(_count(k) for k in ("D1", "D2", "K", "R"))
    assert f"{n_dis} tokens, {len(SEEDS)} seeds" in text and f"{n_out} tokens, {len(SEEDS)} seeds" in text
    assert f"{2 * len(SEEDS)} distinct (context, token)" in text
    assert f"{4 * len(SEEDS)} distinct (context, token)" in text
    assert f"{100 * _count('D1') / n_dis:.1f}% rise (ddot_net > 0)" in text
    # disagreement set: the predictive criterion is right on every token, the ratio criterion on none
    ratio_lines = _lines_with(text, "ratio A(r−1)")
    pred_lines = _lines_with(text, "predictive, aggregated tail")
    assert "0.0% [0.0, 0.0]" in ratio_lines[0] and "100.0% [100.0, 100.0]" in pred_lines[0]
    # outside: balanced accuracy 1/2 (D1 / (D1 + R) + 1) for predictive, 1/2 (0 + K / (D2 + K)) for ratio
    bal_pred = 0.5 * (_count("D1") / (_count("D1") + _count("R")) + 1.0)
    bal_ratio = 0.5 * (_count("K") / (_count("D2") + _count("K")))
    assert f"{100 * bal_pred:.1f}% [" in pred_lines[1] and f"{100 * bal_ratio:.1f}% [" in ratio_lines[1]
    # the constant predictor: the majority class of each set
    const = _lines_with(text, "constant: ")
    assert "drop all (rises)" in const[0] and f"{100 * _count('D1') / n_dis:.1f}% [" in const[0]
    assert (
        "keep all (falls)" in const[1] and f"{100 * (_count('D2') + _count('K')) / n_out:.1f}% [" in const[1]
    )
    # paired over seeds: predictive higher on every seed, a sign test of 6 untied seeds gives 2 / 2^6
    assert "+100.0 pp [+100.0, +100.0]" in text
    assert f"0/0/{len(SEEDS)} of {len(SEEDS)}" in text
    assert f"{2 / 2 ** len(SEEDS):.3g}" in text
    # sign agreement of ddot_net with A·Ḋ: every kind but R
    agree = 1 - _count("R") / n_out
    assert any(f"{100 * agree:.1f}% [" in line for line in _lines_with(text, "own update (SGD) (ddot_net)"))
    assert "Wilson, assumes independent" in text
    # the paper's table keeps its statistics, with the share outside beside the paper's assumed band
    share_row = _lines_with(text, "share of response")
    assert len(share_row) == 1 and "0.017–0.14% (assumed)" in share_row[0]
    assert f"({outside}/{RESPONSE_TOKENS * len(SEEDS)})" in share_row[0] and "unsafe-keep," in text


def test_an_older_study_says_why_the_section_is_empty() -> None:
    rows, tokens = study(truths=False)
    words = " ".join(_printed(rows, tokens, "old").split())
    assert "Both criteria on the same tokens: not measured for study old" in words
    assert "no own-update ground truth (ddot_net)" in words
    assert "Paired over seeds" not in words and "The paper's definitions" in words


# ------------------------------------------------------------------------------------------ the drift point


def _per_seed_balanced(tokens: pl.DataFrame, keep: str) -> list[float]:
    """Balanced accuracy of one criterion on each seed's disagreement tokens, by hand."""
    out = []
    for s in SEEDS:
        t = tokens.filter((pl.col("seed") == s) & (pl.col("keep_ratio") != pl.col("keep_pred_agg")))
        rise = t["ddot_net"].to_numpy() > 0
        drop = ~t[keep].to_numpy()
        out.append(0.5 * ((drop & rise).sum() / rise.sum() + (~drop & ~rise).sum() / (~rise).sum()))
    return out


def test_a_drift_point_carries_the_paired_own_update_statistics() -> None:
    rows, tokens = study(flip=(0, 3))  # seeds 0 and 3: one rising D1 token falls instead
    point = drift_point(rows, criteria_table(judge(tokens, "disagree", "ddot_net").values()))
    pred, ratio = _per_seed_balanced(tokens, "keep_pred_agg"), _per_seed_balanced(tokens, "keep_ratio")
    diffs = np.subtract(pred, ratio)
    assert point.balanced_difference is not None
    assert point.balanced_difference.mean == pytest.approx(diffs.mean())
    half = point.balanced_difference.hi - point.balanced_difference.mean
    assert half == pytest.approx(
        2.570582 * diffs.std(ddof=1) / math.sqrt(len(SEEDS)), rel=1e-5
    )  # t(0.975, 5)
    assert (point.balanced_difference.n_higher, point.balanced_difference.n_seeds) == (len(SEEDS), len(SEEDS))
    dis = tokens.filter(pl.col("keep_ratio") != pl.col("keep_pred_agg"))
    rise = dis["ddot_net"].to_numpy() > 0
    drop_pred = ~dis["keep_pred_agg"].to_numpy()
    pooled = 0.5 * ((drop_pred & rise).sum() / rise.sum() + (~drop_pred & ~rise).sum() / (~rise).sum())
    assert point.balanced_predictive is not None and point.balanced_predictive.value == pytest.approx(pooled)
    assert point.balanced_ratio is not None and point.balanced_ratio.value == pytest.approx(1 - pooled)
    assert point.judged_disagree == dis.height
    # without the judged rows (an older study) the paper's statistics stay and the new ones are absent
    bare = drift_point(rows)
    assert (
        bare.balanced_difference is None and bare.balanced_predictive is None and bare.judged_disagree is None
    )
    assert bare.share_outside == point.share_outside and bare.disagree_per_seed == point.disagree_per_seed


def test_judge_study_ignores_truths_that_a_study_holds_only_as_nulls() -> None:
    """A database gives every study a column once one study has it: all-null truths are not judged."""
    _rows, tokens = study()
    with_nulls = tokens.with_columns(pl.lit(None, dtype=pl.Float64).alias("ddot_net_adam"))
    judged = judge_study(with_nulls, resamples=50)
    assert judged.reason is None
    assert {j.truth for j in judged.judgements} == {"ddot_net", "dd_cf", "dd_all"}
    assert judge_study(tokens.with_columns(pl.lit(None, dtype=pl.Float64).alias("ddot_net"))).reason
