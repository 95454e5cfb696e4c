"""analysis.results on a database with known values: frames against direct SQL and the builder's numbers, pandas
and polars alike, the figures' smoothing, Table 2's and the study CLI's numbers, and one clear error per unknown
name."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import polars as pl
import pytest
from report_database import GRPO_VAL, SEEDS, UNI_OFFSET, dppo_val, train_metrics
from scipy import stats as sps

from analysis.results import UnknownNameError, open_results
from analysis.store import StoreError, connect
from analysis.training import stats as training_stats

SCORE, KL = "critic/score/mean", "actor/ppo_kl"


def _values(frame: pd.DataFrame | pl.DataFrame) -> dict[str, list]:
    """Column -> values with every missing value (None, NaN, NaT) as None, for comparing backends."""
    if isinstance(frame, pl.DataFrame):
        cols = {c: frame.get_column(c).to_list() for c in frame.columns}
    else:
        cols = {c: frame[c].tolist() for c in frame.columns}

    def norm(v):
        if v is None or (isinstance(v, float) and math.isnan(v)) or v is pd.NaT:
            return None
        if isinstance(v, pd.Timestamp):
            return v.to_pydatetime()
        return v

    return {c: [norm(v) for v in vs] for c, vs in cols.items()}


# ------------------------------------------------------------------------------------------------ runs


def test_runs_match_the_runs_table(res, sql):
    frame = res.runs()
    assert isinstance(frame, pd.DataFrame)
    rows = sql.execute(
        "SELECT run_id, sweep, method, model, precision, delta, seed, backend, status FROM runs ORDER BY sweep, run_id"
    ).fetchall()
    got = list(
        frame[
            ["run_id", "sweep", "method", "model", "precision", "delta", "seed", "backend", "status"]
        ].itertuples(index=False, name=None)
    )
    assert got == rows and len(rows) == 15


def test_runs_derive_setting_paper_model_anchor_and_scale(res):
    frame = res.runs().set_index("run_id")
    moe = frame.loc["m_agg_moe"]
    assert (moe.setting, moe.paper_model, moe.precision) == (
        "qwen3_30b_a3b_fp8_rollout",
        "qwen3_30b_a3b_base",
        "fp8_rollout",
    )
    assert frame.loc["m_grpo_e2e_s0", "setting"] == "qwen3_30b_a3b_fp8_e2e"
    assert frame.loc["m_dppo_s0", "setting"] == "qwen3_4b_bf16"
    # grpo_clip_higher anchors on pi_old as verl does, the divergence methods on the rollout's mu
    assert frame.loc["m_grpo_e2e_s1", "anchor"] == "old"
    assert set(frame.loc[["m_dppo_s0", "m_agg_s1", "m_uni_s2", "sm_agg_s"], "anchor"]) == {"rollout"}
    assert "stand-in for Qwen3-4B-Base" in frame.loc["m_dppo_s0", "scale"]


def test_runs_filters(res):
    assert res.runs(sweep="main_comparison", method="dppo_topk_kl", seed=1)["run_id"].tolist() == [
        "m_dppo_s1"
    ]
    by_setting = res.runs(setting="qwen3_30b_a3b_fp8_e2e")["run_id"].tolist()
    assert by_setting == [f"m_grpo_e2e_s{s}" for s in SEEDS]
    both = res.runs(sweep=["smoke", "tight_threshold"])["run_id"].tolist()
    assert both == ["sm_agg_s", "t_dppo_s"]


# --------------------------------------------------------------------------------------------- metrics


def test_metrics_tidy_match_sql_and_the_logged_values(res, sql):
    frame = res.metrics([SCORE, KL], sweep="main_comparison")
    want = sql.execute(
        "SELECT m.run_id, m.step, m.name, m.value FROM metrics m JOIN runs r USING (run_id) "
        "WHERE r.sweep = 'main_comparison' AND m.name IN (?, ?) ORDER BY m.run_id, m.name, m.step",
        [SCORE, KL],
    ).fetchall()
    assert list(frame[["run_id", "step", "name", "value"]].itertuples(index=False, name=None)) == want
    # the run axes joined on every row
    axes = res.runs().set_index("run_id")
    for col in ("sweep", "method", "setting", "model", "precision", "seed"):
        assert frame[col].tolist() == axes.loc[frame["run_id"], col].tolist()
    # the builder's numbers: critic/score/mean = scale * step / 10 + 0.01 * seed (scale 2 for the uniform mask)
    uni = frame[(frame.run_id == "m_uni_s2") & (frame.name == SCORE)]
    assert uni["value"].tolist() == pytest.approx([train_metrics(s, 2.0, 2)[SCORE] for s in range(1, 7)])


def test_metrics_of_chosen_runs_and_wide(res, sql):
    wide = res.metrics([KL, SCORE], runs=["m_dppo_s0", "sm_agg_s"], wide=True)
    assert list(wide.columns[-3:]) == ["step", KL, SCORE]
    assert wide[["run_id", "step"]].drop_duplicates().shape[0] == len(wide) == 12
    for name in (KL, SCORE):
        want = sql.execute(
            "SELECT run_id, step, value FROM metrics WHERE name = ? AND run_id IN ('m_dppo_s0', 'sm_agg_s') "
            "ORDER BY run_id, step",
            [name],
        ).fetchall()
        assert list(wide[["run_id", "step", name]].itertuples(index=False, name=None)) == want
    # a metric some steps lack is null there: sm_agg_s logged AIME25 only at steps 4 and 6
    a25 = "val-core/aime25_standin/acc/mean@16"
    sparse = res.metrics([SCORE, a25], runs="sm_agg_s", wide=True)
    assert sparse[a25].isna().tolist() == [True, True, True, False, True, False]


def _ema_by_hand(values: list[float], half_life: float) -> list[float]:
    """The documented EMA written out: point t = sum_i w^(t-i) x_i / sum_i w^(t-i), w = 0.5^(1/half_life)."""
    w = 0.5 ** (1.0 / half_life)
    return [
        sum(w ** (t - i) * values[i] for i in range(t + 1)) / sum(w ** (t - i) for i in range(t + 1))
        for t in range(len(values))
    ]


def test_smoothing_is_the_figures_ema(res, sql):
    rows = sql.execute(
        "SELECT step, value FROM metrics WHERE run_id = 'm_uni_s1' AND name = ? ORDER BY step", [SCORE]
    ).fetchall()
    steps = np.array([r[0] for r in rows])
    raw = np.array([r[1] for r in rows])
    got = res.metrics(SCORE, runs="m_uni_s1", smooth=training_stats.STEP_SMOOTHING)["value"].to_numpy()
    # the figures' path: each seed smoothed by seed_curve before the mean
    curve = training_stats.seed_curve({1: (steps, raw)}, training_stats.STEP_SMOOTHING)
    assert curve is not None
    np.testing.assert_allclose(got, curve.values[0], rtol=0, atol=1e-12)
    np.testing.assert_allclose(got, _ema_by_hand(list(raw), 5.0), rtol=1e-12)
    assert not np.allclose(got, raw)
    # a half-life as a number is the same Smoothing; 0 is raw
    by_number = res.metrics(SCORE, runs="m_uni_s1", smooth=5)["value"].to_numpy()
    np.testing.assert_array_equal(by_number, got)
    np.testing.assert_array_equal(res.metrics(SCORE, runs="m_uni_s1", smooth=0)["value"].to_numpy(), raw)


def test_each_run_is_smoothed_on_its_own_points(res):
    both = res.metrics(SCORE, runs=["m_dppo_s0", "m_dppo_s1"], smooth=1.0)
    one = res.metrics(SCORE, runs="m_dppo_s1", smooth=1.0)
    np.testing.assert_array_equal(
        both[both.run_id == "m_dppo_s1"]["value"].to_numpy(), one["value"].to_numpy()
    )


# --------------------------------------------------------------------------------------------- summary


def _t(values: list[float]) -> tuple[float, float, float]:
    x = np.asarray(values, dtype=float)
    half = sps.t.ppf(0.975, len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x))
    return float(x.mean()), float(x.mean() - half), float(x.mean() + half)


def test_summary_has_the_builders_numbers(res):
    s = res.summary("main_comparison").set_index(["setting", "method"])
    dppo = s.loc[("qwen3_4b_bf16", "dppo_topk_kl")]
    final = [
        dppo_val(6, seed) for seed in SEEDS
    ]  # validation = mean of AIME24 (v - 0.05) and AIME25 (v + 0.05)
    assert (dppo.final_mean, dppo.final_lo, dppo.final_hi) == pytest.approx(_t(final))
    assert dppo.n_seeds == 3 and dppo.seeds == "0, 1, 2"
    # trapezoid over steps 2, 4, 6 divided by the span 4
    auc = [sum(dppo_val(a, seed) + dppo_val(b, seed) for a, b in ((2, 4), (4, 6))) / 4 for seed in SEEDS]
    assert dppo.auc_mean == pytest.approx(np.mean(auc))
    uni = s.loc[("qwen3_4b_bf16", "predmask_kl_uniform")]
    assert uni.reference == "dppo_topk_kl"
    diffs = [UNI_OFFSET[seed] for seed in SEEDS]
    assert (uni.d_final_mean, uni.d_final_lo, uni.d_final_hi) == pytest.approx(_t(diffs))
    assert (uni.d_final_n, uni.d_final_positive) == (3, 2)
    grpo = s.loc[("qwen3_30b_a3b_fp8_e2e", "grpo_clip_higher")]
    assert grpo.best_mean == pytest.approx(np.mean([max(v) for v in GRPO_VAL.values()]))
    assert (grpo.n_collapsed, grpo.collapsed_seeds) == (1, "0")
    one = s.loc[("qwen3_30b_a3b_fp8_rollout", "predmask_kl_agg")]
    assert one.n_seeds == 1 and one.final_mean == pytest.approx(0.7) and math.isnan(one.final_lo)


def test_summary_equals_table2(results_db, res):
    """The same numbers as Table 2 of the reports (its own path: reports.tables.main_results on its own connection)."""
    import duckdb

    from reports.artefact import ReportContext
    from reports.tables.main_results import table2_main_results

    con = duckdb.connect(str(results_db), read_only=True)
    try:
        table = table2_main_results(
            ReportContext(con=con, out=res.path.parent, sweeps=("main_comparison",), draw=False)
        )
    finally:
        con.close()
    s = res.summary("main_comparison").set_index(["paper_model", "precision", "model", "method"])
    seen = 0
    for key, by_method in table.stats:
        for method, r in by_method.items():
            row = s.loc[(key.paper_model, key.precision, key.model, method)]
            for field in ("final", "best", "auc"):
                iv = getattr(r, field)
                got = [row[f"{field}_mean"], row[f"{field}_lo"], row[f"{field}_hi"]]
                assert got == pytest.approx([iv.mean, iv.lo, iv.hi], nan_ok=True) or (
                    iv.lo is None and math.isnan(got[1]) and got[0] == pytest.approx(iv.mean)
                )
            if r.vs_final is not None:
                assert row.reference == r.vs_final.reference
                assert row.d_final_mean == pytest.approx(r.vs_final.interval.mean)
                assert row.d_auc_positive == r.vs_auc.n_positive
            assert row.n_collapsed == len(r.collapsed)
            seen += 1
    assert seen == len(s) == 5


def test_summary_of_a_sweep_of_one_run(res_pl):
    s = res_pl.summary("smoke")
    assert isinstance(s, pl.DataFrame)
    # AIME24 0.2 s at 2, 4, 6; AIME25 0.4 s at 4, 6: validation 0.3 s on steps 4 and 6
    assert s.get_column("final_mean").to_list() == pytest.approx([1.8])
    assert s.get_column("auc_mean").to_list() == pytest.approx([1.5])


# ---------------------------------------------------------------------------------------- token level


def test_token_level_rows_match_sql(res, sql):
    seeds = res.token_level("st_tokens")
    want = sql.execute(
        "SELECT seed, n_outside, n_disagree FROM token_level_seeds WHERE study_id = 'st_tokens' ORDER BY seed"
    ).fetchall()
    assert list(seeds[["seed", "n_outside", "n_disagree"]].itertuples(index=False, name=None)) == want
    tokens = res.token_level("st_tokens", level="token")
    want = sql.execute(
        "SELECT seed, position, keep_ratio, dd_pred_agg FROM token_level_tokens WHERE study_id = 'st_tokens' "
        "ORDER BY seed, position"
    ).fetchall()
    assert (
        list(tokens[["seed", "position", "keep_ratio", "dd_pred_agg"]].itertuples(index=False, name=None))
        == want
    )
    assert res.token_level("st_counts")["seed"].tolist() == [0, 1]


def test_token_level_summary_has_the_builders_numbers(res):
    s = res.token_level_summary("st_tokens").set_index(["quantity", "criterion"])
    # paired seeds of the aggregated-tail comparison: 0, 1, 2 (seed 3: the ratio kept nothing)
    pred = s.loc[("unsafe-keep, predictive", "predictive")]
    assert (pred.value, pred.n, pred.over) == (pytest.approx(np.mean([0.25, 0.5, 0.2])), 3, "paired seeds")
    assert pred.se == pytest.approx(np.std([0.25, 0.5, 0.2], ddof=1) / math.sqrt(3))
    ratio = s.loc[("unsafe-keep, ratio", "predictive")]
    assert ratio.value == pytest.approx(0.4)
    lower = s.loc[("seeds where predictive is lower", "predictive")]
    assert (lower.value, lower.n) == (2, 3)
    corr = s.loc[("corrective, predictive", "predictive")]
    assert (corr.k, corr.n) == (2, 3) and corr.lo < 2 / 3 < corr.hi
    assert s.loc[("corrective, predictive", "predictive_uniform")][["k", "n"]].tolist() == [1, 1]
    assert pred.paper == "34.2%"
    # the paper reports its own (aggregated-tail) criterion only
    assert pd.isna(s.loc[("unsafe-keep, predictive", "predictive_uniform")].paper)


def test_token_level_summary_texts_are_the_clis(results_db, res):
    """The text column is what the study's CLI table prints in its aggregated-tail column."""
    import duckdb

    from analysis.token_level.summary.report import load_study, paper_table

    con = duckdb.connect(str(results_db), read_only=True)
    try:
        table = paper_table(load_study(con, "st_tokens"))
    finally:
        con.close()
    cli = {q: v for q, v in zip(table.columns[0]._cells, table.columns[2]._cells)}
    s = res.token_level_summary("st_tokens")
    head = s[s.criterion.isna() | (s.criterion == "predictive")]
    mine = dict(zip(head["quantity"], head["text"]))
    assert mine["seeds"] == cli["seeds"]
    assert mine["outside per seed"] == cli["tokens outside the trust region / seed"]
    assert mine["disagreement per seed"] == cli["disagreement set / seed"]
    assert mine["unsafe-keep, predictive"] == cli["unsafe-keep, predictive (mean ± SE)"]
    assert mine["unsafe-keep, ratio"] == cli["unsafe-keep, ratio (mean ± SE)"]
    assert mine["seeds where predictive is lower"] == cli["seeds where predictive is lower"]
    assert mine["corrective, predictive"] == cli["corrective, predictive (pooled)"]
    assert mine["corrective, ratio"] == cli["corrective, ratio (pooled)"]


# ---------------------------------------------------------------------------------------- backends


@pytest.mark.parametrize(
    "call",
    [
        lambda r: r.runs(),
        lambda r: r.metrics([SCORE, KL], sweep="main_comparison"),
        lambda r: r.metrics([SCORE, KL], sweep="main_comparison", smooth=2.0, wide=True),
        lambda r: r.summary("main_comparison"),
        lambda r: r.token_level("st_tokens"),
        lambda r: r.token_level("st_tokens", level="token"),
        lambda r: r.token_level_summary("st_tokens"),
    ],
    ids=["runs", "metrics", "metrics-wide-smoothed", "summary", "seeds", "tokens", "token-summary"],
)
def test_pandas_and_polars_give_the_same_values(res, res_pl, call):
    a, b = call(res), call(res_pl)
    assert isinstance(a, pd.DataFrame) and isinstance(b, pl.DataFrame)
    assert len(a) == b.height > 0
    assert _values(a) == _values(b)


# ------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda r: r.metrics("no/such/metric"), ["unknown metric 'no/such/metric'", SCORE]),
        (lambda r: r.metrics(SCORE, sweep="nope"), ["unknown sweep 'nope'", "main_comparison, smoke"]),
        (lambda r: r.metrics(SCORE, runs=["m_dppo_s0", "zz"]), ["unknown run 'zz'", "m_dppo_s0"]),
        (lambda r: r.runs(method="ppo"), ["unknown method 'ppo'", "dppo_topk_kl"]),
        (lambda r: r.runs(setting="qwen3_8b_bf16"), ["unknown setting 'qwen3_8b_bf16'", "qwen3_4b_bf16"]),
        (lambda r: r.runs(seed=7), ["unknown seed 7", "0, 1, 2"]),
        (lambda r: r.summary("nope"), ["unknown sweep 'nope'", "tight_threshold"]),
        (lambda r: r.token_level("nope"), ["unknown study 'nope'", "st_counts, st_tokens"]),
        (lambda r: r.token_level_summary("nope"), ["unknown study 'nope'", "st_counts, st_tokens"]),
        (lambda r: r.token_level("st_tokens", level="tokens"), ["unknown level 'tokens'", "seed, token"]),
    ],
    ids=[
        "metric",
        "sweep",
        "run",
        "method",
        "setting",
        "seed",
        "summary-sweep",
        "study",
        "summary-study",
        "level",
    ],
)
def test_unknown_names_say_what_exists(res, call, words):
    with pytest.raises(UnknownNameError) as err:
        call(res)
    text = str(err.value)
    assert "\n" not in text and isinstance(err.value, ValueError)
    for w in words:
        assert w in text


def test_unknown_backend_and_ambiguous_study(results_db, res):
    with pytest.raises(UnknownNameError, match=r"unknown backend 'arrow'.*pandas, polars"):
        open_results(results_db, backend="arrow")
    import duckdb

    with duckdb.connect(str(results_db), read_only=True) as con:
        studies = [r[0] for r in con.execute("SELECT study_id FROM token_level_studies ORDER BY study_id").fetchall()]
    assert {"st_counts", "st_tokens"} <= set(studies)
    with pytest.raises(ValueError, match=rf"{len(studies)} token-level studies; name one: {', '.join(studies)}$"):
        res.token_level()


def test_missing_database_is_one_line(tmp_path):
    with pytest.raises(StoreError, match="does not exist"):
        open_results(tmp_path / "none.duckdb")


def test_default_path_is_the_commands(results_db, monkeypatch, tmp_path):
    monkeypatch.setenv("PREDMASK_DB", str(results_db))
    r = open_results()
    assert r.path == results_db and len(r.runs()) == 15
    monkeypatch.delenv("PREDMASK_DB")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(StoreError, match=str(tmp_path / "results" / "predmask.duckdb")):
        open_results()


def test_an_open_library_never_blocks_the_writer(tmp_path):
    """A notebook keeps its Results for hours while a sweep ingests: between calls it holds no connection, so the
    one writer opens the file (DuckDB refuses a writer while another connection holds it), and the next call sees
    what the writer stored."""
    from report_database import build_db

    db = build_db(tmp_path, with_study=False)
    r = open_results(db)
    assert r.runs(sweep="smoke")["status"].tolist() == ["completed"]
    con = connect(db)
    try:
        con.execute("UPDATE runs SET status = 'failed' WHERE run_id = 'sm_agg_s'")
    finally:
        con.close()
    assert r.runs(sweep="smoke")["status"].tolist() == ["failed"]


def test_a_database_without_a_study(tmp_path):
    from report_database import build_db

    r = open_results(build_db(tmp_path, with_study=False))
    assert r.studies() == []
    with pytest.raises(ValueError, match="no token-level study"):
        r.token_level_summary()
