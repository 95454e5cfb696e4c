"""Both criteria judged on the same tokens in the token-level figures and table (docs/math.md §5.1): what fig3, fig4,
fig9, fig10 and token_level_summary show against balanced accuracies counted here from the test database's token
rows, and against the judgement ingest stored (read with the test's own queries, not through reports)."""

from __future__ import annotations

import warnings

import duckdb
import numpy as np
import polars as pl
import pytest
from numpy.testing import assert_allclose
from report_database import GRID_CELLS, STUDY_TOKENS

from analysis.token_level.summary.study_stats import paper_share_outside
from reports import queries, same_tokens
from reports.artefact import ReportContext
from reports.figures import token_level as token_level_figures
from reports.tables import token_level as token_level_table

PAIR = ("ratio", "predictive")
NOT_JUDGED_CELL = next(c for c in GRID_CELLS if not c[-1])
JUDGED_CELLS = [c for c in GRID_CELLS if c[-1]]


def balanced_accuracy(keep: np.ndarray, truth: np.ndarray) -> float:
    """½ (rising tokens dropped / rising tokens + falling tokens kept / falling tokens), written out; NaN when the
    tokens hold one class only."""
    rises = truth > 0
    if rises.all() or not rises.any():
        return float("nan")
    return 0.5 * ((~keep & rises).sum() / rises.sum() + (keep & ~rises).sum() / (~rises).sum())


def _by_hand(tokens: pl.DataFrame) -> tuple[dict[str, float], dict[str, dict[int, float]]]:
    """Pooled and per-seed balanced accuracy of both criteria on the disagreement set against ddot_net > 0."""
    dis = tokens.filter(pl.col("keep_ratio") != pl.col("keep_pred_agg"))
    keep = {"ratio": "keep_ratio", "predictive": "keep_pred_agg"}
    pooled = {c: balanced_accuracy(dis[k].to_numpy(), dis["ddot_net"].to_numpy()) for c, k in keep.items()}
    per_seed = {c: {} for c in keep}
    for seed in sorted(set(tokens["seed"].to_list())):
        s = dis.filter(pl.col("seed") == seed)
        for c, k in keep.items():
            per_seed[c][seed] = balanced_accuracy(s[k].to_numpy(), s["ddot_net"].to_numpy())
    return pooled, per_seed


def _stored(report_db, study_id: str) -> dict[str, dict]:
    """criterion -> the stored token_level_criteria row of the disagreement set against ddot_net."""
    with duckdb.connect(str(report_db), read_only=True) as con:
        rows = con.sql(
            "SELECT * FROM token_level_criteria WHERE study_id = ? AND token_set = 'disagree' "
            "AND truth = 'ddot_net'",
            params=[study_id],
        ).pl()
    return {r["criterion"]: r for r in rows.iter_rows(named=True)}


def _tokens(report_db, study_id: str) -> pl.DataFrame:
    with duckdb.connect(str(report_db), read_only=True) as con:
        return con.sql(
            "SELECT seed, keep_ratio, keep_pred_agg, ddot_net FROM token_level_tokens WHERE study_id = ?",
            params=[study_id],
        ).pl()


# --------------------------------------------------------------------------------------- the study: fig3, fig4


def test_fig3_same_token_panels_show_each_seeds_balanced_accuracy(ctx_factory, report_db):
    pooled, per_seed = _by_hand(pl.DataFrame(STUDY_TOKENS))
    assert pooled == pytest.approx({"ratio": 2 / 7, "predictive": 5 / 7})  # the counts in report_database.py
    res = token_level_figures.fig3_unsafe_keep(ctx_factory())
    paper_left, paper_right, left, right = res.panels
    assert paper_left.title.startswith("paper's definition (different token sets per criterion)")
    assert paper_right.title.startswith("paper's definition (different token sets per criterion)")
    assert left.title.startswith("same tokens") and right.title.startswith("same tokens")
    # seed 1 holds one disagreement token (one class): no balanced accuracy, left out of the paired dots
    assert np.isnan(per_seed["ratio"][1])
    for crit in PAIR:
        s = left.get(crit)
        assert list(s.x) == [0, 2, 3]
        assert_allclose(s.y, [per_seed[crit][k] for k in (0, 2, 3)])
    stored = _stored(report_db, "st_tokens")
    got = left.get("pooled")
    assert list(got.x) == list(PAIR)
    assert_allclose(got.y, [pooled[c] for c in PAIR])
    assert_allclose(got.y, [stored[c]["balanced_accuracy"] for c in PAIR])
    lo = [stored[c]["balanced_accuracy_lo"] for c in PAIR]
    hi = [stored[c]["balanced_accuracy_hi"] for c in PAIR]
    assert_allclose(got.y - got.yerr[0], lo)  # the seed-cluster interval as stored, not a Wilson interval
    assert_allclose(got.y + got.yerr[1], hi)
    assert_allclose(left.get("constant predictor").y, [0.5, 0.5])
    diffs = sorted(per_seed["predictive"][k] - per_seed["ratio"][k] for k in (0, 2, 3))
    assert_allclose(right.get("difference").y, diffs)
    assert list(right.get("difference").x) == [3, 0, 2]  # tied, then +1/6, then +1
    # the stored paired comparison counts the same seeds: none lower, one tied, two higher
    p = stored["predictive"]
    assert (p["vs_ratio_balanced_lower"], p["vs_ratio_balanced_tied"], p["vs_ratio_balanced_higher"]) == (
        0,
        1,
        2,
    )
    assert p["vs_ratio_balanced_mean"] == pytest.approx(np.mean(diffs))
    # where the study was measured: 37 outside of 400 response tokens (STUDY_SEEDS), beside the paper's band
    lo_p, hi_p = paper_share_outside()
    assert (
        f"measured at 9.25% of response tokens outside the trust region (paper: {100 * lo_p:.2g}"
        in res.caption
    )
    assert f"{100 * hi_p:.2g}%, assumed)" in res.caption


def test_fig4_same_token_panel_shows_pooled_values_with_cluster_intervals(ctx_factory, report_db):
    res = token_level_figures.fig4_corrective(ctx_factory())
    paper, same = res.panels
    assert paper.title.startswith("paper's definition (different token sets per criterion)")
    stored = _stored(report_db, "st_tokens")
    s = same.get("pooled")
    assert_allclose(s.y, [stored[c]["balanced_accuracy"] for c in PAIR])
    assert_allclose(s.y - s.yerr[0], [stored[c]["balanced_accuracy_lo"] for c in PAIR])
    assert_allclose(s.y + s.yerr[1], [stored[c]["balanced_accuracy_hi"] for c in PAIR])
    assert_allclose(same.get("constant predictor").y, [stored["ratio"]["constant_balanced_accuracy"]] * 2)


def test_a_study_without_the_judgement_is_named_in_fig3_fig4_and_the_table(ctx_factory):
    ctx = ctx_factory(study_id="st_counts")  # stored seed rows only: nothing was judged
    for res, panels in (
        (token_level_figures.fig3_unsafe_keep(ctx), slice(2, 4)),
        (token_level_figures.fig4_corrective(ctx), slice(1, 2)),
    ):
        for p in res.panels[panels]:
            assert p.series == []
            assert p.note.startswith("study st_counts: not judged on the same tokens")
        assert res.has_data  # the paper's panels still draw
    rows = {r[0]: r[2] for r in token_level_table.token_level_summary(ctx).tables["summary"].rows}
    assert rows["disagreement tokens judged (pooled over seeds)"].startswith("study st_counts: not judged")
    assert rows["balanced accuracy, ratio (pooled, 95% seed-cluster bootstrap interval)"] == "—"


def test_the_summary_table_prints_the_stored_judgement_beside_the_paper(ctx_factory, report_db):
    stored = _stored(report_db, "st_tokens")
    rows = {r[0]: r[1:] for r in token_level_table.token_level_summary(ctx_factory()).tables["summary"].rows}
    pred = rows["balanced accuracy, predictive aggregated (pooled, 95% seed-cluster bootstrap interval)"]
    p = stored["predictive"]
    lo, hi = p["balanced_accuracy_lo"], p["balanced_accuracy_hi"]
    assert pred == ["not reported", f"71.4% [{100 * lo:.1f}, {100 * hi:.1f}]"]
    assert (
        rows["seeds where predictive's balanced accuracy is lower / tied / higher"][1]
        == "0 / 1 / 2 of 3 seeds"
    )
    assert rows["disagreement tokens judged (pooled over seeds)"][1] == "14 tokens, 4 seeds"
    sign, wilcoxon = p["vs_ratio_balanced_sign_p"], p["vs_ratio_balanced_wilcoxon_p"]
    assert rows["p-values of predictive vs ratio: two-sided sign test; Wilcoxon signed-rank"][1].startswith(
        f"{sign:.3g}; {wilcoxon:.3g} (only 2 untied seeds"
    )
    assert rows["share of response tokens outside the trust region (pooled over seeds)"][1].startswith(
        "9.25% "
    )
    # headings label the two groups of rows; the paper's group keeps the paper's numbers
    assert rows["by the paper's definitions (different token sets per criterion):"] == ["", ""]
    assert rows["unsafe-keep rate, ratio (mean ± SE over paired seeds)"][0] == "36.9%"


# ------------------------------------------------------------------------------------ the drift grid: fig9, fig10


def _shares(report_db) -> dict[str, float]:
    with duckdb.connect(str(report_db), read_only=True) as con:
        rows = con.execute(
            "SELECT study_id, sum(n_outside) / sum(n_tokens) FROM token_level_seeds GROUP BY study_id"
        ).fetchall()
    return dict(rows)


def test_fig10_plots_each_criterions_balanced_accuracy_against_the_share_outside(ctx_factory, report_db):
    res = token_level_figures.fig10_criteria_vs_drift(ctx_factory())
    assert res.has_data
    (panel,) = res.panels
    shares = _shares(report_db)
    for precision, label in (("bf16", "BF16"), ("fp8_rollout", "FP8 Rollout")):
        cells = sorted((c for c in JUDGED_CELLS if c[1] == precision), key=lambda c: shares[c[0]])
        for crit in ("predictive", "ratio"):
            s = panel.get(f"{label}: {crit}")
            assert_allclose(s.x, [shares[c[0]] for c in cells])
            rows = [_stored(report_db, c[0])[crit] for c in cells]
            assert_allclose(s.y, [r["balanced_accuracy"] for r in rows])
            assert_allclose(s.y - s.yerr[0], [r["balanced_accuracy_lo"] for r in rows])
            assert_allclose(s.y + s.yerr[1], [r["balanced_accuracy_hi"] for r in rows])
            # and the stored value is the balanced accuracy counted here from the cell's tokens
            by_hand = [_by_hand(_tokens(report_db, c[0]))[0][crit] for c in cells]
            assert_allclose(s.y, by_hand)
    assert_allclose(panel.get("constant predictor").y, [0.5, 0.5])
    # the cell whose study was stored without the ground truth is not drawn, and the subtitle names it
    old = NOT_JUDGED_CELL
    assert not any(
        np.isclose(s.x, shares[old[0]]).any() for s in panel.series if s.label != "constant predictor"
    )
    assert panel.text == (
        "left out, not judged, its tokens carry no own-update truth (ddot_net): FP8 Rollout, lr 0.0003, "
        f"{old[3]} stale updates"
    )


def test_fig9_adds_the_paired_balanced_accuracy_difference(ctx_factory, report_db):
    res = token_level_figures.fig9_drift_sensitivity(ctx_factory())
    diff = res.panel("same tokens")
    shares = _shares(report_db)
    cells = sorted((c for c in JUDGED_CELLS if c[1] == "bf16"), key=lambda c: shares[c[0]])
    s = diff.get("BF16")
    rows = [_stored(report_db, c[0])["predictive"] for c in cells]
    assert_allclose(s.x, [shares[c[0]] for c in cells])
    assert_allclose(s.y, [r["vs_ratio_balanced_mean"] for r in rows])
    assert_allclose(s.y - s.yerr[0], [r["vs_ratio_balanced_lo"] for r in rows])
    assert_allclose(s.y + s.yerr[1], [r["vs_ratio_balanced_hi"] for r in rows])
    assert NOT_JUDGED_CELL[1] == "fp8_rollout" and diff.get("FP8 Rollout").x.size == len(JUDGED_CELLS) - len(
        cells
    )
    assert (
        diff.text.startswith("left out, not judged")
        and "FP8 Rollout, lr 0.0003, 3 stale updates" in diff.text
    )
    # the paper's statistics keep their panels, and the paper's band of share outside
    assert [p.title for p in res.panels[:3]] == [
        "disagreement share of outside tokens (pooled)",
        "unsafe-keep rate (mean over paired seeds)",
        "corrective fraction (pooled)",
    ]


def test_without_a_grid_fig10_says_so(tmp_path):
    from analysis.store import connect

    connect(tmp_path / "db.duckdb").close()
    with duckdb.connect(str(tmp_path / "db.duckdb"), read_only=True) as con:
        res = token_level_figures.fig10_criteria_vs_drift(ReportContext(con=con, out=tmp_path, draw=False))
    assert not res.has_data and res.panels[0].note.startswith("no drift grid in the database")


def test_the_figures_render_without_warnings(report_db, tmp_path):
    with duckdb.connect(str(report_db), read_only=True) as con:
        for study_id in (None, "st_counts"):
            ctx = ReportContext(con=con, out=tmp_path, formats=("png",), study_id=study_id)
            for fig in (
                token_level_figures.fig3_unsafe_keep,
                token_level_figures.fig4_corrective,
                token_level_figures.fig9_drift_sensitivity,
                token_level_figures.fig10_criteria_vs_drift,
            ):
                with warnings.catch_warnings():
                    warnings.simplefilter("error")
                    files = fig(ctx).files
                assert [f.name for f in files] == [f"{fig.name}.png"]
                assert files[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_study_table_is_read_by_its_name_only(report_db):
    with duckdb.connect(str(report_db), read_only=True) as con:
        assert queries.study_table(con, "token_level_criteria", "st_counts").height == 0
        with pytest.raises(ValueError, match="unknown study-level table 'runs'; valid: token_level_criteria"):
            queries.study_table(con, "runs", "st_tokens")
        judged = same_tokens.same_tokens(con, "st_tokens")
    assert judged is not None and list(judged.seeds) == [0, 1, 2, 3]
