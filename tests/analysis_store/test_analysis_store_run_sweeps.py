"""A run two sweeps hold (run ids are config hashes: runs/<a>/<id> and runs/<b>/<id> are one run) belongs to both in
`run_sweeps`, whichever sweep is ingested first; ingesting again adds no membership; a database written before
the table opens, read-only and for writing, and still answers each run's sweep."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

from analysis.store import connect, ingest_paths, run_sweeps, table_exists
from analysis.store.schema import schema_ddl

A, B = "variational_reasoning", "vr_hint_use"


def _two_sweeps(tmp_path: Path, helpers) -> dict[str, Path]:
    """runs/A holds `shared` and `only_a`, runs/B holds `shared` (the same config and files) and `only_b`."""
    status = {"status": "completed", "step": 2, "total_steps": 2, "updated": 1_700_000_000, "error": None}
    lines = {"metrics.jsonl": helpers.jsonl([(1, {"critic/score/mean": 0.25}), (2, {"critic/score/mean": 0.5})])}
    made = {}
    for sweep, run_id, seed in ((A, "shared", 0), (A, "only_a", 1), (B, "shared", 0), (B, "only_b", 2)):
        made[f"{sweep}/{run_id}"] = helpers.make_run(tmp_path, sweep, run_id, helpers.cpu_config(seed=seed), lines,
                                                     status)
    return made


def _memberships(con) -> list[tuple[str, str, str]]:
    return con.execute("SELECT run_id, sweep, run_dir FROM run_sweeps ORDER BY run_id, sweep").fetchall()


@pytest.mark.parametrize("order", [(A, B), (B, A)], ids=["a-then-b", "b-then-a"])
def test_a_run_two_sweeps_hold_belongs_to_both_in_either_order(tmp_path, db_path, helpers, order):
    made = _two_sweeps(tmp_path, helpers)
    with connect(db_path) as con:
        for sweep in order:
            summary = ingest_paths(con, [tmp_path / "runs" / sweep])
            assert len(summary.runs) == 2 and not summary.refused
        assert run_sweeps(con) == {"only_a": (A,), "only_b": (B,), "shared": (A, B)}
        assert _memberships(con) == [
            ("only_a", A, str(made[f"{A}/only_a"].resolve())),
            ("only_b", B, str(made[f"{B}/only_b"].resolve())),
            ("shared", A, str(made[f"{A}/shared"].resolve())),
            ("shared", B, str(made[f"{B}/shared"].resolve())),
        ]
        # one `runs` row per run; its sweep and run_dir are the newest ingest's
        assert con.execute("SELECT run_id, sweep FROM runs ORDER BY run_id").fetchall() == [
            ("only_a", A), ("only_b", B), ("shared", order[-1])]
        assert con.execute("SELECT count(*) FROM metrics WHERE run_id = 'shared'").fetchall() == [(2,)]


def test_ingesting_again_adds_no_membership(tmp_path, db_path, helpers):
    _two_sweeps(tmp_path, helpers)
    with connect(db_path) as con:
        ingest_paths(con, [tmp_path / "runs"])
        first = (_memberships(con), con.execute("SELECT * FROM runs ORDER BY run_id").fetchall())
        for sweep in (B, A, B):
            again = ingest_paths(con, [tmp_path / "runs" / sweep])
            assert len(again.runs) == 2 and all(r.rows_added == r.rows_changed == 0 for r in again.runs)
        assert len(_memberships(con)) == 4
        assert _memberships(con) == first[0]
        # the runs rows change only in the sweep and run_dir of the newest ingest (B here, as the first ingest had it)
        assert con.execute("SELECT * FROM runs ORDER BY run_id").fetchall() == first[1]


def test_the_ingest_command_records_both_sweeps(tmp_path, db_path, helpers):
    """The real command, both sweep folders in one call: the database file a second process reads lists both."""
    _two_sweeps(tmp_path, helpers)
    out = subprocess.run(
        [sys.executable, "-m", "analysis", "ingest", str(tmp_path / "runs" / B), str(tmp_path / "runs" / A),
         "--db", str(db_path), "-q"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    con = duckdb.connect(str(db_path), read_only=True)
    try:
        assert con.execute("SELECT sweep FROM run_sweeps WHERE run_id = 'shared' ORDER BY sweep").fetchall() == [
            (A,), (B,)]
    finally:
        con.close()


def _old_database(path: Path) -> None:
    """A database as the store wrote it before `run_sweeps`: every other table, and one run row."""
    path.parent.mkdir(parents=True, exist_ok=True)
    con = duckdb.connect(str(path))
    try:
        for ddl in schema_ddl():
            if "run_sweeps" not in ddl:
                con.execute(ddl)
        con.execute("INSERT INTO runs (run_id, sweep, method) VALUES ('shared', ?, 'vr_acc')", [A])
    finally:
        con.close()


def test_a_database_without_the_table_opens_and_answers_each_runs_sweep(tmp_path, db_path, helpers):
    _old_database(db_path)
    with connect(db_path, read_only=True) as con:
        assert not table_exists(con, "run_sweeps")
        assert run_sweeps(con) == {"shared": (A,)}  # the runs row's own sweep
    made = _two_sweeps(tmp_path, helpers)
    with connect(db_path) as con:  # a writer creates the table
        assert table_exists(con, "run_sweeps") and _memberships(con) == []
        assert run_sweeps(con) == {"shared": (A,)}
        ingest_paths(con, [made[f"{B}/shared"]])
        assert run_sweeps(con) == {"shared": (A, B)}  # the old row's sweep is kept beside the new folder's
        ingest_paths(con, [made[f"{A}/shared"]])
        assert _memberships(con) == [("shared", A, str(made[f"{A}/shared"].resolve())),
                                     ("shared", B, str(made[f"{B}/shared"].resolve()))]


def test_the_old_rows_own_sweep_ingested_again_is_one_membership(tmp_path, db_path, helpers):
    _old_database(db_path)
    made = _two_sweeps(tmp_path, helpers)
    with connect(db_path) as con:
        ingest_paths(con, [made[f"{A}/shared"]])  # its stored row's sweep, then the same from the folder
        assert _memberships(con) == [("shared", A, str(made[f"{A}/shared"].resolve()))]
