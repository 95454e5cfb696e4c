"""`python -m analysis drift`: the grid's cells, a tiny grid end to end with resume, the default rule, fig9's arrays."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import duckdb
import numpy as np
import polars as pl
import pytest
from token_level_helpers import tiny_study_overrides

from analysis.store import connect, upsert_token_level
from analysis.store.token_level_tables import grid_cells, upsert_grid
from analysis.token_level import cli, drift
from analysis.token_level.compute.fanout import SeedFiles
from analysis.token_level.compute.study_config import compose_study, study_id_of

GRID_KEYS = ("lr", "staleness", "sequences", "minibatches")


def test_the_default_grid_lists_lr_staleness_and_the_three_precisions() -> None:
    grid = drift.compose_grid()
    assert set(grid["axes"]) == {"precision", "lr", "staleness"}
    assert grid["axes"]["precision"] == ["bf16", "fp8_rollout", "fp8_e2e"]
    assert grid["fixed"]["minibatches"] == 8
    assert max(grid["axes"]["staleness"]) < grid["fixed"]["minibatches"]
    assert grid["seeds"] >= 1


def test_the_grid_expands_to_every_combination_with_distinct_study_ids() -> None:
    grid = drift.compose_grid(
        ["axes.precision=[bf16,fp8_e2e]", "axes.lr=[1e-4,3e-4]", "axes.staleness=[1,7]"]
    )
    cells = drift.expand(grid)
    combos = list(itertools.product(["bf16", "fp8_e2e"], [1e-4, 3e-4], [1, 7]))
    assert [(c.params["precision"], c.params["lr"], c.params["staleness"]) for c in cells] == combos
    assert [c.index for c in cells] == list(range(8))
    assert len({c.study_id for c in cells}) == 8
    for c, (prec, lr, st) in zip(cells, combos):
        # each cell is the study the study's own command composes from the same overrides
        alone = compose_study(
            [
                "minibatches=8",
                f"sequences={grid['fixed']['sequences']}",
                f"precision={prec}",
                f"lr={lr}",
                f"staleness={st}",
            ]
        )
        assert c.study_id == study_id_of(alone)
        assert (
            c.config["precision"]["name"],
            c.config["lr"],
            c.config["staleness"],
            c.config["minibatches"],
        ) == (prec, lr, st, 8)
    assert drift.grid_id_of(grid, cells) == drift.grid_id_of(grid, drift.expand(grid))
    assert drift.grid_id_of(grid, cells) != drift.grid_id_of(grid, cells[:-1])


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["lr=1e-3"], "lr is a grid axis; change it with axes.lr=[...]"),
        (["+fixed.lr=1e-3"], "lr is both a grid axis and a fixed override"),
        (["axes.staleness=[]"], "axes.staleness must be a non-empty list of values"),
        (["axes.lr=[1e-4,1e-4]"], "axes.lr lists a value twice"),
        (["seeds=0"], "seeds must be >= 1, got 0"),
        (
            ["fixed.sequences=100"],
            "cell 0 (precision=bf16, lr=0.0001, staleness=1): sequences must be a positive",
        ),
        (["axes.precision=[fp4]"], "unknown precision 'fp4'"),
        (
            ["rule.pooled_over_seeds=0"],
            "rule needs pooled_over_seeds >= 1 and min_pooled_disagree >= 0, got 0",
        ),
    ],
)
def test_bad_grid_input_is_one_line_and_writes_nothing(
    argv: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    small = [f"axes.{k}={v}" for k, v in (("precision", "[bf16]"), ("lr", "[1e-4]"), ("staleness", "[1]"))]
    small = [
        ov for ov in small if not any(a.lstrip("+").startswith(ov.split("=")[0]) for a in argv)
    ]  # one value per key
    rc = drift.main([*small, *argv, "--db", str(tmp_path / "db.duckdb"), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and needle in err, err
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------ end to end


def _tiny_grid(checkpoint: Path, seeds: int) -> list[str]:
    study = tiny_study_overrides(checkpoint, without=("lr", "staleness", "sequences", "minibatches"))
    grid = [
        f"seeds={seeds}",
        "name=tiny",
        "axes.precision=[bf16]",
        "axes.lr=[0.05]",
        "axes.staleness=[1,2]",
        "fixed.sequences=16",
        "fixed.minibatches=2",
    ]
    return [*grid, *study]


def test_a_tiny_grid_runs_into_duckdb_links_cells_to_studies_and_resumes(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    db, out = tmp_path / "db.duckdb", tmp_path / "out"
    where = ["--inline", "--db", str(db), "--out", str(out)]
    assert drift.main([*where, *_tiny_grid(checkpoint, 1)]) == 0
    text = capsys.readouterr().out
    assert "0 of 2 cell seeds done; 2 to run" in text and "benchmark: elapsed" in text
    assert text.splitlines()[-1] == f"next: python -m reports paper --db {db} (fig9_drift_sensitivity draws the grid)"

    grid_ovs, study_ovs = drift._split_overrides(_tiny_grid(checkpoint, 1))
    cells = drift.expand(drift.compose_grid(grid_ovs), study_ovs)
    con = duckdb.connect(str(db), read_only=True)
    try:
        rows = con.sql("SELECT * FROM token_level_grid ORDER BY cell").pl()
        seeds = con.sql("SELECT study_id, seed FROM token_level_seeds ORDER BY study_id, seed").fetchall()
        configs = dict(con.execute("SELECT study_id, config FROM token_level_studies").fetchall())
    finally:
        con.close()
    assert rows["study_id"].to_list() == [c.study_id for c in cells]
    assert rows["staleness"].to_list() == [1, 2] and rows["lr"].to_list() == [0.05, 0.05]
    assert rows["grid_id"].unique().to_list() == [drift.grid_id_of(drift.compose_grid(grid_ovs), cells)]
    assert sorted(seeds) == sorted((c.study_id, 0) for c in cells)
    for row in rows.iter_rows(named=True):  # the grid row says what the linked study computed
        stored = json.loads(configs[row["study_id"]])
        assert {k: stored[k] for k in GRID_KEYS} == {k: row[k] for k in GRID_KEYS}
        assert json.loads(row["params"]) == {"precision": "bf16", "lr": 0.05, "staleness": row["staleness"]}

    # rerun with two seeds: only the new seed of each cell runs; the finished seeds' files are left alone
    files = [SeedFiles(out / c.study_id) for c in cells]
    before = [f.row_path(0).stat().st_mtime_ns for f in files]
    assert drift.main([*where, *_tiny_grid(checkpoint, 2)]) == 0
    assert "2 of 4 cell seeds done; 2 to run" in capsys.readouterr().out
    assert [f.row_path(0).stat().st_mtime_ns for f in files] == before
    # a cell is a normal study: the study's own command finds its seeds stored and runs nothing
    cell0 = [*cells[0].overrides]
    assert cli.main(["--seeds", "2", "--inline", "--db", str(db), "--out", str(out), *cell0]) == 0
    assert "2 stored, 0 finished on disk, 0 to run" in capsys.readouterr().out
    # a seed finished on disk but not ingested (the main process died) is ingested, not recomputed
    (out / cells[1].study_id / "seed-000001.json").rename(tmp_path / "keep.json")
    con = connect(db)
    try:
        con.execute("DELETE FROM token_level_seeds WHERE study_id = ? AND seed = 1", [cells[1].study_id])
    finally:
        con.close()
    (tmp_path / "keep.json").rename(out / cells[1].study_id / "seed-000001.json")
    assert drift.main([*where, *_tiny_grid(checkpoint, 2)]) == 0
    assert "4 of 4 cell seeds done; 0 to run" in capsys.readouterr().out
    con = duckdb.connect(str(db), read_only=True)
    try:
        assert con.execute("SELECT count(*) FROM token_level_seeds").fetchone() == (4,)
        assert con.execute("SELECT count(*) FROM token_level_grid").fetchone() == (2,)
    finally:
        con.close()


# ------------------------------------------------------------------------------------ the default rule

RULE = {"precision": "bf16", "pooled_over_seeds": 61, "min_pooled_disagree": 1000}


def _row(cell: int, share: float, per_seed: float | None, seeds: int = 4, prec: str = "bf16") -> dict:
    return {
        "cell": cell,
        "precision": prec,
        "share_outside": share,
        "disagree_per_seed": per_seed,
        "n_seeds": seeds,
    }


def test_the_rule_prefers_the_lowest_drift_whose_pooled_disagreement_set_is_measurable() -> None:
    """Measurable: mean disagreement tokens per seed x 61 >= 1,000 (16.39 per seed); no seed needs a minimum."""
    rows = [
        _row(0, 0.001, 16.0),  # lowest drift, 976 pooled at 61 seeds: below 1,000
        _row(1, 0.004, 16.5),  # 1,006.5 pooled: measurable
        _row(2, 0.020, 40.0),  # measurable, more drift
        _row(3, 0.002, 30.0, prec="fp8_e2e"),  # measurable, lower drift, but not the rule's precision
        _row(4, 0.0001, None, seeds=0),  # no seeds
    ]
    assert [drift.measurable(r, RULE) for r in rows] == [False, True, True, True, False]
    assert [drift.pooled_disagree(r, RULE) for r in rows[:2]] == [976.0, pytest.approx(1006.5)]
    assert drift.choose_default(rows, RULE)["cell"] == 1
    assert drift.choose_default(rows, {**RULE, "precision": "fp8_e2e"})["cell"] == 3
    assert drift.choose_default(rows, {**RULE, "min_pooled_disagree": 2441}) is None  # 40 x 61 = 2,440
    assert drift.choose_default(rows, {**RULE, "pooled_over_seeds": 63})["cell"] == 0  # 16 x 63 = 1,008
    tie = [_row(7, 0.02, 20.0), _row(6, 0.02, 30.0)]
    assert drift.choose_default(tie, RULE)["cell"] == 6  # the same share: the earlier cell


def test_a_cell_row_reads_the_mean_disagreement_per_seed_of_its_drift_point() -> None:
    from analysis.token_level.summary.study_stats import drift_point

    seeds = pl.DataFrame(
        {"seed": [0, 1, 2], "n_tokens": [100] * 3, "n_outside": [20, 30, 40], "n_disagree": [3, 0, 12]}
    )
    row = drift.cell_row({"cell": 0, "precision": "bf16"}, drift_point(seeds))
    assert (row["n_seeds"], row["disagree_per_seed"], row["share_outside"]) == (3, 5.0, 90 / 300)
    # a seed without any disagreement token does not bar the cell: 5 per seed x 61 = 305 pooled
    assert drift.pooled_disagree(row, RULE) == 305.0
    assert drift.measurable(row, {**RULE, "min_pooled_disagree": 305})


# ------------------------------------------------------------------------------------------------- fig9


def _seed_frame(
    seeds: list[int],
    n_tokens: list[int],
    n_outside: list[int],
    n_disagree: list[int],
    u_pred: list[float | None],
    u_ratio: list[float | None],
    keep: list[tuple[int, int, int, int]],
) -> pl.DataFrame:
    """Per-seed rows with known counts; keep = (n_keep_pred, n_corrective_pred, n_keep_ratio, n_corrective_ratio)."""
    return pl.DataFrame(
        {
            "seed": seeds,
            "n_tokens": n_tokens,
            "n_outside": n_outside,
            "n_disagree": n_disagree,
            "unsafe_keep_predictive": u_pred,
            "unsafe_keep_ratio": u_ratio,
            "n_keep_predictive": [k[0] for k in keep],
            "n_corrective_predictive": [k[1] for k in keep],
            "n_keep_ratio": [k[2] for k in keep],
            "n_corrective_ratio": [k[3] for k in keep],
        },
        schema_overrides={"unsafe_keep_predictive": pl.Float64, "unsafe_keep_ratio": pl.Float64},
    )


def test_fig9_plots_each_statistic_against_the_measured_share_outside(tmp_path: Path) -> None:
    from analysis.token_level.summary.study_stats import PAPER_TOKEN_LEVEL
    from reports.artefact import ReportContext
    from reports.figures.token_level import fig9_drift_sensitivity

    # three cells: two bf16 (the second with more drift), one fp8_e2e with no outside token (off the log axis)
    frames = {
        "s_low": _seed_frame(
            [0, 1], [1000, 3000], [10, 30], [2, 4], [0.5, None], [0.25, 1.0], [(2, 1, 4, 3), (0, 0, 1, 0)]
        ),
        "s_high": _seed_frame(
            [0, 1], [1000, 1000], [200, 100], [20, 10], [0.2, 0.4], [0.6, 0.3], [(10, 8, 5, 2), (5, 3, 4, 1)]
        ),
        "s_none": _seed_frame([0], [500], [0], [0], [None], [None], [(0, 0, 0, 0)]),
    }
    db = tmp_path / "db.duckdb"
    con = connect(db)
    try:
        for sid, frame in frames.items():
            upsert_token_level(con, sid, {"lr": 1}, frame, None)
        cells = [("s_high", "bf16", 7), ("s_low", "bf16", 1), ("s_none", "fp8_e2e", 1)]
        upsert_grid(
            con,
            "g1",
            [
                {
                    "grid_name": "test",
                    "cell": i,
                    "study_id": sid,
                    "precision": prec,
                    "lr": 1e-4,
                    "staleness": st,
                    "minibatches": 8,
                    "sequences": 1024,
                    "params": {"staleness": st},
                }
                for i, (sid, prec, st) in enumerate(cells)
            ],
        )
        assert grid_cells(con)["study_id"].to_list() == ["s_high", "s_low", "s_none"]
    finally:
        con.close()

    con = duckdb.connect(str(db), read_only=True)
    try:
        ctx = ReportContext(con=con, out=tmp_path / "out", draw=False)
        result = fig9_drift_sensitivity(ctx)
    finally:
        con.close()
    assert result.has_data
    # x: outside / response tokens pooled over seeds, ascending; computed here from the frames
    x_low, x_high = 40 / 4000, 300 / 2000
    disagree = result.panel("disagreement").get("BF16")
    np.testing.assert_allclose(disagree.x, [x_low, x_high])
    np.testing.assert_allclose(disagree.y, [6 / 40, 30 / 300])
    unsafe = result.panel("unsafe-keep")
    np.testing.assert_allclose(
        unsafe.get("BF16: predictive").y, [0.5, 0.3]
    )  # s_low: seed 1 unpaired, left out
    np.testing.assert_allclose(unsafe.get("BF16: ratio").y, [0.25, 0.45])
    corrective = result.panel("corrective")
    np.testing.assert_allclose(corrective.get("BF16: predictive").y, [1 / 2, 11 / 15])
    np.testing.assert_allclose(corrective.get("BF16: ratio").y, [3 / 5, 3 / 9])
    # the fp8_e2e cell has no outside token: no point, and the panel says so
    assert unsafe.get("FP8 E2E: predictive").x.size == 0
    assert "FP8 E2E: 1 cell(s) with no outside token" in unsafe.note
    # the paper's reported values, over the band of share outside its counts imply for 1,024-8,192-token responses
    paper = unsafe.get("paper (Qwen3, 61 seeds): predictive")
    np.testing.assert_allclose(paper.x, [1435 / 1024 / 8192, 1435 / 1024 / 1024])
    np.testing.assert_allclose(paper.y, [PAPER_TOKEN_LEVEL["unsafe_keep_predictive"]] * 2)
    np.testing.assert_allclose(result.panel("disagreement").get("paper (Qwen3, 61 seeds)").y, [82 / 1435] * 2)

    con = duckdb.connect(str(db), read_only=True)
    try:
        drawn = fig9_drift_sensitivity(ReportContext(con=con, out=tmp_path / "out", formats=("png",)))
    finally:
        con.close()
    assert [p.name for p in drawn.files] == ["fig9_drift_sensitivity.png"]


def test_fig9_without_a_grid_says_so(tmp_path: Path) -> None:
    from reports.artefact import ReportContext
    from reports.figures.token_level import fig9_drift_sensitivity

    connect(tmp_path / "db.duckdb").close()
    con = duckdb.connect(str(tmp_path / "db.duckdb"), read_only=True)
    try:
        result = fig9_drift_sensitivity(ReportContext(con=con, out=tmp_path, draw=False))
    finally:
        con.close()
    assert not result.has_data and all("no drift grid" in p.note for p in result.panels)


def test_a_bad_database_path_is_refused_before_any_cell_runs(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The database path is checked before any cell is prepared: one line, exit 2, nothing written."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plain").write_text("x")
    db = tmp_path / "plain" / "db.duckdb"
    rc = drift.main(["--inline", "--db", str(db), "--out", str(tmp_path / "out"), *_tiny_grid(checkpoint, 1)])
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert rc == 2
    assert err == f"error: cannot create results database {db}: {tmp_path / 'plain'} is a file, not a folder"
    assert "to run" not in captured.out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain"]


# ------------------------------------------------------------------------------------------- the printed grid

#: the grid table, default line and benchmark line of a synthetic grid, printed before the table code was split
GRID_PRINTOUT = Path(__file__).with_name("drift_grid_printout.txt")


def _criteria(pred: float, ratio: float) -> pl.DataFrame:
    """criteria_table rows on the disagreement set against the own update, with a paired predictive - ratio row."""
    from analysis.token_level.summary.study_stats import DISAGREE_SET, OWN_UPDATE

    paired = {"mean": pred - ratio, "lo": -0.01, "hi": 0.2, "seeds": 2, "lower": 0, "tied": 1, "higher": 1,
              "sign_p": 0.5, "wilcoxon_p": 0.5}
    rows = [
        {"criterion": c, "balanced_accuracy": v, "balanced_accuracy_lo": v - 0.1, "balanced_accuracy_hi": v + 0.1,
         **{f"vs_ratio_balanced_{k}": (x if c == "predictive" else None) for k, x in paired.items()}}
        for c, v in (("predictive", pred), ("ratio", ratio))
    ]
    return pl.DataFrame(rows).with_columns(token_set=pl.lit(DISAGREE_SET), truth=pl.lit(OWN_UPDATE), n_tokens=12)


def test_the_printed_grid_keeps_its_table_default_and_benchmark_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rich.console import Console

    frames = {
        "s_high": _seed_frame([0, 1], [1000, 1000], [200, 100], [20, 10], [0.2, 0.4], [0.6, 0.3],
                              [(10, 8, 5, 2), (5, 3, 4, 1)]).with_columns(cpu_seconds=pl.Series([3.0, 4.0])),
        "s_low": _seed_frame([0, 1], [1000, 3000], [10, 30], [2, 4], [0.5, None], [0.25, 1.0],
                             [(2, 1, 4, 3), (0, 0, 1, 0)]).with_columns(cpu_seconds=pl.Series([1.0, 2.0])),
        "s_none": _seed_frame([0], [500], [0], [0], [None], [None], [(0, 0, 0, 0)]),
    }
    db = tmp_path / "db.duckdb"
    con = connect(db)
    try:
        for sid, frame in frames.items():
            upsert_token_level(con, sid, {"lr": 1}, frame, None)
    finally:
        con.close()
    cells = [
        drift.Cell(i, {"precision": prec, "staleness": st}, (), {"precision": {"name": prec}}, sid)
        for i, (sid, prec, st) in enumerate([("s_high", "bf16", 1), ("s_low", "bf16", 2), ("s_none", "fp8_e2e", 1)])
    ]
    criteria = {0: _criteria(0.75, 0.625), 1: None, 2: None}
    calls = iter(range(len(cells) * 2))
    monkeypatch.setattr(drift, "cell_criteria", lambda tokens: criteria[next(calls) % len(cells)])
    grid = {"name": "tiny", "fixed": {"sequences": 16, "minibatches": 2},
            "axes": {"precision": ["bf16", "fp8_e2e"], "staleness": [1, 2]},
            "rule": {"precision": "bf16", "pooled_over_seeds": 61, "min_pooled_disagree": 500}}
    console = Console(record=True, width=320, color_system=None)
    missing = drift._print_grid(db, grid, "g1", cells, [0, 1], console, 75.0)
    unmeasurable = {**grid, "rule": {**grid["rule"], "min_pooled_disagree": 10**6}}
    assert drift._print_grid(db, unmeasurable, "g1", cells, [0, 1], console, 75.0) == missing == 1
    printed = [line.rstrip() for line in console.export_text().splitlines()]
    assert printed == GRID_PRINTOUT.read_text().splitlines()
