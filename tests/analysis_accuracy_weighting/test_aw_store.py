"""The accuracy-weighting and vr_traces tables on real DuckDB files: round trip, idempotent upserts, and ingest of a
variational weights-stage run directory (a weights.parquet written here with the columns of COMMON's contract)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from analysis.store import connect, ingest_run_dir, upsert_accuracy_weighting, vr_trace_columns
from predmask.vr_weights import weights_columns


def _rows() -> list[dict]:
    return [
        {"source": "model", "method": "grpo", "question": 0, "accuracy": 0.25, "measured_weight": 0.5,
         "predicted_weight": 0.55, "n_samples": 16, "group_size": 16, "model": "cpu_s"},
        {"source": "model", "method": "vr", "question": 1, "accuracy": 0.0, "measured_weight": None,
         "predicted_weight": 0.0, "n_samples": 16, "group_size": 16, "model": "cpu_s"},
        {"source": "bandit", "method": "rft", "question": 0, "accuracy": 0.3, "measured_weight": 0.3,
         "predicted_weight": 0.3, "n_samples": 2, "group_size": 2, "model": "bandit"},
    ]


def test_upsert_round_trip_and_idempotence(tmp_path: Path) -> None:
    db = tmp_path / "aw.duckdb"
    con = connect(db)
    try:
        first = upsert_accuracy_weighting(con, "a1", {"questions": 2}, _rows())
        again = upsert_accuracy_weighting(con, "a1", {"questions": 2}, _rows())
    finally:
        con.close()
    assert (first.analysis, first.changed, first.rows) == ("inserted", True, 3)
    assert (again.analysis, again.changed) == ("unchanged", False)
    con = connect(db, read_only=True)
    try:
        got = con.execute("SELECT source, method, question, accuracy, measured_weight, predicted_weight, n_samples, "
                          "group_size, model FROM accuracy_weighting WHERE analysis_id = 'a1' "
                          "ORDER BY source, method, question").fetchall()
        cfg = con.execute("SELECT config FROM accuracy_weighting_analyses WHERE analysis_id = 'a1'").fetchone()[0]
    finally:
        con.close()
    want = sorted(tuple(r.values()) for r in _rows())
    assert got == want  # NULL measured weight round-trips as None
    assert json.loads(cfg) == {"questions": 2}
    # a changed row replaces the analysis's rows; a duplicate key writes nothing
    con = connect(db)
    try:
        rows = _rows()
        rows[0] = {**rows[0], "measured_weight": 0.75}
        assert upsert_accuracy_weighting(con, "a1", {"questions": 2}, rows[:2]).changed
        assert con.execute("SELECT count(*) FROM accuracy_weighting").fetchone()[0] == 2
        with pytest.raises(ValueError, match="repeat"):
            upsert_accuracy_weighting(con, "a1", None, [rows[0], rows[0]])
        with pytest.raises(ValueError, match="source 'other'"):
            upsert_accuracy_weighting(con, "a1", None, [{**rows[0], "source": "other"}])
        assert con.execute("SELECT measured_weight FROM accuracy_weighting WHERE method = 'grpo'").fetchone()[0] == 0.75
    finally:
        con.close()


WEIGHT_COLUMNS = {
    "question": pa.int64(), "trace": pa.int64(), "trace_tokens": pa.int64(), "answer_tokens": pa.int64(),
    "log_prior": pa.float64(), "log_posterior": pa.float64(), "log_ratio": pa.float64(), "answer_logp": pa.float64(),
    "acc": pa.float64(), "posterior_correct": pa.bool_(), "weight_acc": pa.float64(), "weight_gml": pa.float64(),
    "weight_likelihood": pa.float64(),
}


def test_vr_traces_columns_are_the_weights_stage_columns() -> None:
    assert [c for c in vr_trace_columns() if c not in ("run_id", "seed")] == list(weights_columns())
    assert set(WEIGHT_COLUMNS) == set(weights_columns())


def _weights_table(drop: str | None = None) -> pa.Table:
    data = {
        "question": [0, 0, 1, 1], "trace": [0, 1, 0, 1], "trace_tokens": [3, 0, 5, 2], "answer_tokens": [4, 4, 3, 3],
        "log_prior": [-3.0, 0.0, -6.5, -1.0], "log_posterior": [-1.5, 0.0, -2.0, -0.5],
        "log_ratio": [-0.5, 0.0, -0.9, -0.25], "answer_logp": [-0.1, -2.0, -0.3, -0.2],
        "acc": [0.75, 0.0, 1.0, 0.5], "posterior_correct": [True, False, True, True],
        "weight_acc": [1.0, 0.0, 0.6, 0.4], "weight_gml": [0.7, 0.3, 0.5, 0.5], "weight_likelihood": [0.8, 0.2, 0.45, 0.55],
    }
    cols = {k: pa.array(v, WEIGHT_COLUMNS[k]) for k, v in data.items() if k != drop}
    return pa.table(cols)


def _weights_run(root: Path, name: str, table: pa.Table, stage: str = "weights") -> Path:
    d = root / "runs" / "vr" / name
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump({"family": "variational", "stage": stage, "seed": 2,
                                                   "method": {"name": stage}, "model": {"name": "cpu_s"}}))
    (d / "status.json").write_text(json.dumps({"status": "completed"}))
    (d / "metrics.jsonl").write_text(json.dumps({"step": 0, "data": {"weights/traces": 4}}) + "\n")
    pq.write_table(table, d / "weights.parquet")
    return d


def test_ingest_weights_stage_lands_in_vr_traces_and_reingest_changes_nothing(tmp_path: Path) -> None:
    run = _weights_run(tmp_path, "w0", _weights_table())
    db = tmp_path / "r.duckdb"
    con = connect(db)
    try:
        first = ingest_run_dir(con, run)
        rows = con.execute("SELECT * FROM vr_traces ORDER BY question, trace").fetchall()
        second = ingest_run_dir(con, run)
        rows_again = con.execute("SELECT * FROM vr_traces ORDER BY question, trace").fetchall()
        cols = [d[0] for d in con.execute("SELECT * FROM vr_traces LIMIT 0").description]
    finally:
        con.close()
    assert (first.vr_traces, first.vr_traces_changed) == (4, True)
    assert (second.vr_traces, second.vr_traces_changed) == (4, False)
    assert rows == rows_again and len(rows) == 4
    got = [dict(zip(cols, r)) for r in rows]
    assert {r["run_id"] for r in got} == {"w0"} and {r["seed"] for r in got} == {2}
    table = _weights_table().to_pylist()
    for row, want in zip(got, table):
        for key, value in want.items():
            assert row[key] == value or (isinstance(value, float) and math.isclose(row[key], value)), key


def test_ingest_of_a_bad_weights_file_warns_and_writes_no_trace(tmp_path: Path) -> None:
    run = _weights_run(tmp_path, "w1", _weights_table(drop="weight_gml"))
    other = _weights_run(tmp_path, "p0", _weights_table(), stage="prior")  # not a weights stage: file ignored
    con = connect(tmp_path / "r.duckdb")
    try:
        bad = ingest_run_dir(con, run)
        prior = ingest_run_dir(con, other)
        count = con.execute("SELECT count(*) FROM vr_traces").fetchone()[0]
        registered = con.execute("SELECT count(*) FROM runs").fetchone()[0]
    finally:
        con.close()
    assert count == 0 and registered == 2 and prior.vr_traces == 0
    assert any("weight_gml" in w and "traces not stored" in w for w in bad.warnings)
