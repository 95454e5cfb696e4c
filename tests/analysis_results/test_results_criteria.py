"""open_results() exposes the study-level tables of the criteria judgement as ingest stored them: the same rows as
direct SQL, pandas and polars alike, and for a study without per-token ground truths an empty frame that still has
every column."""

from __future__ import annotations

import sys
from pathlib import Path

import polars as pl
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "token_level"))

from known_study import SEEDS, study

from analysis.results import UnknownNameError, open_results
from analysis.store import STUDY_RESULT_KEYS, connect, upsert_token_level
from analysis.token_level.summary.study_tables import STUDY_TABLES, study_tables

#: each table is exposed by the method of its name
METHODS = tuple(STUDY_TABLES)


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One study with the ground truths, one stored before them, through the store's one writer."""
    path = tmp_path_factory.mktemp("criteria") / "db.duckdb"
    con = connect(path)
    try:
        for study_id, truths in (("known", True), ("old", False)):
            rows, tokens = study(truths=truths)
            upsert_token_level(con, study_id, {"truths": truths}, rows, tokens, derive=study_tables)
    finally:
        con.close()
    return path


@pytest.mark.parametrize("table", METHODS)
def test_each_table_is_the_stored_rows(db: Path, table: str) -> None:
    res = open_results(db, backend="polars")
    frame = getattr(res, table)("known")
    keys = list(STUDY_RESULT_KEYS[table])
    con = connect(db, read_only=True)
    try:
        want = con.sql(f"SELECT * FROM {table} WHERE study_id = 'known'").pl()
    finally:
        con.close()
    assert frame.height == want.height > 0
    assert frame.columns == ["study_id", *STUDY_TABLES[table]]
    assert frame.sort(keys).equals(want.select(frame.columns).sort(keys))
    pandas = getattr(open_results(db), table)("known")
    assert list(pandas.columns) == frame.columns and len(pandas) == frame.height


def test_the_criteria_rows_span_the_studys_seeds(db: Path) -> None:
    crit = open_results(db, backend="polars").token_level_criteria("known")
    assert set(crit["n_seeds"].to_list()) == {len(SEEDS)}
    row = crit.filter(
        (pl.col("token_set") == "disagree")
        & (pl.col("truth") == "ddot_net")
        & (pl.col("criterion") == "predictive")
    )
    assert row["balanced_accuracy"].to_list() == [1.0] and row["vs_ratio_balanced_higher"].to_list() == [
        len(SEEDS)
    ]


@pytest.mark.parametrize("table", METHODS)
def test_a_study_without_ground_truths_gives_an_empty_frame_with_every_column(db: Path, table: str) -> None:
    frame = getattr(open_results(db, backend="polars"), table)("old")
    assert frame.height == 0 and frame.columns == ["study_id", *STUDY_TABLES[table]]


def test_an_unknown_study_names_the_stored_ones(db: Path) -> None:
    with pytest.raises(UnknownNameError, match="unknown study 'nope'; this database has: known, old"):
        open_results(db).token_level_criteria("nope")
