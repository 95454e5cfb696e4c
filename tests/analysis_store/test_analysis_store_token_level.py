"""upsert_token_level: frames land as given, rewriting is idempotent, bad frames write nothing."""

from __future__ import annotations

import json

import polars as pl
import pyarrow as pa
import pytest

from analysis.store import connect, stored_seeds, upsert_token_level


def _seeds(seeds, rate=0.25) -> pl.DataFrame:
    return pl.DataFrame(
        {
            "seed": seeds,
            "n_tokens": [100] * len(seeds),
            "n_outside": [10 + s for s in seeds],
            "n_disagree": [4] * len(seeds),
            "unsafe_keep_ratio": [0.5] * len(seeds),
            "unsafe_keep_predictive": [rate] * len(seeds),
            "n_keep_ratio": [2] * len(seeds),
            "n_unsafe_ratio": [1] * len(seeds),
        }
    )


def _tokens(seed: int, n: int = 3) -> pa.Table:
    return pa.table(
        {
            "seed": pa.array([seed] * n, pa.int32()),
            "position": pa.array(range(n), pa.int64()),
            "d_pre": [0.2 + i for i in range(n)],
            "keep_ratio": [True, False, True][:n],
            "keep_pred_agg": [False, False, True][:n],
            "dd_ratio": [0.1, -0.1, 0.0][:n],
        }
    )


def _all(con, table):
    return con.execute(f"SELECT * FROM {table} ORDER BY ALL").fetchall()


def test_rows_land_and_rewrite_is_idempotent(tmp_path):
    con = connect(tmp_path / "t.duckdb")
    cfg = {"model": {"name": "cpu_s"}, "delta": 0.15}
    w = upsert_token_level(con, "study1", cfg, _seeds([0, 1]), pa.concat_tables([_tokens(0), _tokens(1)]))
    assert (w.study, w.seeds, w.tokens) == ("inserted", 2, 6)
    got = con.execute(
        "SELECT seed, n_outside, unsafe_keep_predictive FROM token_level_seeds ORDER BY seed"
    ).fetchall()
    assert got == [(0, 10, 0.25), (1, 11, 0.25)]
    tok = con.execute(
        "SELECT seed, position, d_pre, keep_ratio, dd_ratio FROM token_level_tokens "
        "WHERE study_id = 'study1' ORDER BY seed, position"
    ).fetchall()
    assert tok[:3] == [(0, 0, 0.2, True, 0.1), (0, 1, 1.2, False, -0.1), (0, 2, 2.2, True, 0.0)]
    assert json.loads(con.execute("SELECT config FROM token_level_studies").fetchall()[0][0]) == cfg
    before = (
        _all(con, "token_level_seeds"),
        _all(con, "token_level_tokens"),
        _all(con, "token_level_studies"),
    )
    w2 = upsert_token_level(con, "study1", cfg, _seeds([0, 1]), pa.concat_tables([_tokens(0), _tokens(1)]))
    assert w2.study == "unchanged"
    assert (
        _all(con, "token_level_seeds"),
        _all(con, "token_level_tokens"),
        _all(con, "token_level_studies"),
    ) == before
    assert stored_seeds(con, "study1") == {0, 1} and stored_seeds(con, "other") == set()


def test_a_rewritten_seed_replaces_only_that_seed(tmp_path):
    con = connect(tmp_path / "t.duckdb")
    upsert_token_level(con, "s", None, _seeds([0, 1]), pa.concat_tables([_tokens(0, 3), _tokens(1, 3)]))
    upsert_token_level(con, "s", None, _seeds([1], rate=0.75), _tokens(1, 2))
    rates = con.execute("SELECT seed, unsafe_keep_predictive FROM token_level_seeds ORDER BY seed").fetchall()
    assert rates == [(0, 0.25), (1, 0.75)]
    counts = con.execute(
        "SELECT seed, count(*) FROM token_level_tokens GROUP BY seed ORDER BY seed"
    ).fetchall()
    assert counts == [(0, 3), (1, 2)]


def test_extra_columns_are_added(tmp_path):
    con = connect(tmp_path / "t.duckdb")
    extra = _seeds([0]).with_columns(pl.lit(0.9).alias("sign_accuracy_ratio"))
    with pytest.warns(UserWarning, match="sign_accuracy_ratio"):
        w = upsert_token_level(con, "s", {}, extra, None)
    assert w.added_columns == ("sign_accuracy_ratio",)
    assert con.execute("SELECT sign_accuracy_ratio FROM token_level_seeds").fetchall() == [(0.9,)]


def test_bad_frames_write_nothing(tmp_path):
    con = connect(tmp_path / "t.duckdb")
    with pytest.raises(ValueError, match="duplicate"):
        upsert_token_level(con, "s", {}, _seeds([0, 0]), None)
    with pytest.raises(ValueError, match="duplicate"):
        upsert_token_level(con, "s", {}, _seeds([0]), pa.concat_tables([_tokens(0), _tokens(0)]))
    with pytest.raises(ValueError, match="expected only 's'"):
        upsert_token_level(con, "s", {}, _seeds([0]).with_columns(pl.lit("t").alias("study_id")), None)
    with pytest.raises(ValueError, match="position"):
        upsert_token_level(con, "s", {}, None, pa.table({"seed": [0]}))
    with pytest.raises(TypeError, match="polars DataFrame"):
        upsert_token_level(con, "s", {}, [{"seed": 0}], None)
    # a failure inside the transaction (a column that cannot be cast) rolls everything back
    bad = pa.table({"seed": [0], "position": [0], "d_pre": ["not a number"]})
    with pytest.raises(Exception):  # noqa: B017 - DuckDB's conversion error
        upsert_token_level(con, "s", {}, _seeds([0]), bad)
    for t in ("token_level_studies", "token_level_seeds", "token_level_tokens"):
        assert _all(con, t) == []


def test_sequence_position_keys(tmp_path):
    """With a sequence column, (seed, sequence, position) is the key: the same position in two sequences is fine."""
    con = connect(tmp_path / "t.duckdb")
    tok = pa.table({"seed": [0, 0], "sequence": [0, 1], "position": [5, 5], "d_pre": [0.3, 0.4]})
    assert upsert_token_level(con, "s", {}, None, tok).tokens == 2
    dup = pa.table({"seed": [0, 0], "sequence": [1, 1], "position": [5, 5]})
    with pytest.raises(ValueError, match="duplicate"):
        upsert_token_level(con, "s", {}, None, dup)


def _grid_row(cell: int, study: str) -> dict:
    return {
        "grid_name": "g",
        "cell": cell,
        "study_id": study,
        "precision": "bf16",
        "lr": 3e-4,
        "staleness": cell,
        "minibatches": 8,
        "sequences": 1024,
        "params": {"staleness": cell},
    }


def test_grid_rows_are_replaced_idempotently_and_bad_rows_write_nothing(tmp_path) -> None:
    from analysis.store.token_level_tables import grid_cells, upsert_grid

    con = connect(tmp_path / "db.duckdb")
    try:
        assert grid_cells(con).height == 0  # no grid stored yet
        assert upsert_grid(con, "g1", [_grid_row(0, "a"), _grid_row(1, "b")]) == 2
        first = con.execute("SELECT * FROM token_level_grid ORDER BY cell").fetchall()
        upsert_grid(con, "g1", [_grid_row(0, "a"), _grid_row(1, "b")])
        assert con.execute("SELECT * FROM token_level_grid ORDER BY cell").fetchall() == first
        cells = grid_cells(con, "g1")
        assert cells["study_id"].to_list() == ["a", "b"] and cells["n_seeds"].to_list() == [0, 0]
        assert json.loads(cells["params"][1]) == {"staleness": 1}
        with pytest.raises(ValueError, match="appears in more than one cell"):
            upsert_grid(con, "g2", [_grid_row(0, "a"), _grid_row(1, "a")])
        with pytest.raises(ValueError, match=r"lacks \['lr'\]"):
            upsert_grid(con, "g2", [{k: v for k, v in _grid_row(0, "a").items() if k != "lr"}])
        with pytest.raises(ValueError, match="unknown grid 'g9'; stored: g1"):
            grid_cells(con, "g9")
        assert con.execute("SELECT DISTINCT grid_id FROM token_level_grid").fetchall() == [("g1",)]
    finally:
        con.close()
