"""Ingest of run directories: values land as written, re-ingest changes nothing, attempts merge, bad lines skip."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from analysis import store
from analysis.store import StoreError, connect, ingest_paths, ingest_run_dir
from predmask.rundir import attempt_files, hold_run_lock


def _metrics(con) -> dict[tuple[str, int, str], float]:
    return {
        (r, s, n): v for r, s, n, v in con.execute("SELECT run_id, step, name, value FROM metrics").fetchall()
    }


def _snapshot(con) -> tuple[list, list]:
    runs = con.execute("SELECT * FROM runs ORDER BY run_id").fetchall()
    metrics = con.execute("SELECT * FROM metrics ORDER BY run_id, step, name").fetchall()
    return runs, metrics


def test_values_and_run_row_match_the_files(tmp_path, db_path, helpers):
    records = [(1, {"critic/score/mean": 0.25, "actor/ppo_kl": 1e-3}), (2, {"critic/score/mean": 0.5})]
    d = helpers.make_run(
        tmp_path,
        "main_comparison",
        "run_a",
        helpers.cpu_config(seed=7),
        {"metrics.jsonl": helpers.jsonl(records)},
        {"status": "completed", "step": 2, "total_steps": 2, "updated": 1_700_000_000, "error": None},
    )
    (d / "train.log").write_text("log\n")
    con = connect(db_path)
    res = ingest_run_dir(con, d)
    assert (res.rows_added, res.rows_changed, res.skipped_lines, res.skipped_values) == (3, 0, 0, 0)
    assert _metrics(con) == {
        ("run_a", 1, "critic/score/mean"): 0.25,
        ("run_a", 1, "actor/ppo_kl"): 1e-3,
        ("run_a", 2, "critic/score/mean"): 0.5,
    }
    row = con.execute(
        "SELECT sweep, method, delta, model, precision, seed, backend, status, log_path, run_dir, config FROM runs"
    ).fetchall()
    assert len(row) == 1
    sweep, method, delta, model, precision, seed, backend, status, log_path, run_dir, cfg = row[0]
    assert (sweep, method, delta, model, precision, seed, backend, status) == (
        "main_comparison",
        "predmask_kl_agg",
        0.15,
        "cpu_s",
        "bf16",
        7,
        "local",
        "completed",
    )
    assert log_path == str((d / "train.log").resolve()) and run_dir == str(d.resolve())
    parsed = json.loads(cfg)
    assert parsed["method"]["delta"] == 0.15  # the ${delta} interpolation was resolved
    assert parsed["model"]["stands_in_for"] == "qwen3_4b_base"


def test_reingest_changes_nothing(tmp_path, db_path, helpers):
    d = helpers.make_run(
        tmp_path,
        "s",
        "r1",
        helpers.cpu_config(),
        {"metrics.jsonl": helpers.jsonl([(i, {"a": i * 0.5, "b": -i}) for i in range(1, 6)])},
        {"status": "completed", "step": 5, "total_steps": 5, "updated": 1_700_000_000, "error": None},
    )
    con = connect(db_path)
    first = ingest_paths(con, [d])
    before = _snapshot(con)
    time.sleep(1.1)  # a timestamp written "now" would differ
    second = ingest_paths(con, [d, d / "metrics.jsonl"])  # the same run named twice is ingested once
    assert first.rows_added == 10 and len(second.runs) == 1
    assert (second.rows_added, second.rows_changed) == (0, 0)
    assert second.runs[0].run_registered == "unchanged"
    assert _snapshot(con) == before


def test_changed_value_is_updated_not_duplicated(tmp_path, db_path, helpers):
    d = helpers.make_run(
        tmp_path, "s", "r1", helpers.cpu_config(), {"metrics.jsonl": helpers.jsonl([(1, {"a": 1.0}), (2, {"a": 2.0})])}
    )
    con = connect(db_path)
    ingest_run_dir(con, d)
    (d / "metrics.jsonl").write_text(helpers.jsonl([(1, {"a": 1.0}), (2, {"a": 9.0}), (3, {"a": 3.0})]))
    res = ingest_run_dir(con, d)
    assert (res.rows_added, res.rows_changed) == (1, 1)
    assert _metrics(con) == {("r1", 1, "a"): 1.0, ("r1", 2, "a"): 9.0, ("r1", 3, "a"): 3.0}


def test_attempts_merge_by_step_latest_attempt_wins(tmp_path, db_path, helpers):
    """attempt-1 < attempt-2 < attempt-10 (numeric, not lexicographic) < metrics.jsonl (the current attempt)."""
    files = {
        "metrics.attempt-1.jsonl": helpers.jsonl([(s, {"a": 100 + s, "only1": 1.0}) for s in range(1, 6)]),
        "metrics.attempt-2.jsonl": helpers.jsonl([(s, {"a": 200 + s}) for s in range(4, 9)]),
        "metrics.attempt-10.jsonl": helpers.jsonl([(s, {"a": 1000 + s}) for s in range(7, 11)]),
        "metrics.jsonl": helpers.jsonl([(s, {"a": 5000 + s}) for s in range(10, 13)]),
    }
    d = helpers.make_run(tmp_path, "s", "restarted", helpers.cpu_config(), files)
    assert [p.name for p in attempt_files(d)] == [
        "metrics.attempt-1.jsonl",
        "metrics.attempt-2.jsonl",
        "metrics.attempt-10.jsonl",
        "metrics.jsonl",
    ]
    con = connect(db_path)
    res = ingest_run_dir(con, d)
    a = {s: v for (_, s, n), v in _metrics(con).items() if n == "a"}
    expected = {
        1: 101,
        2: 102,
        3: 103,
        4: 204,
        5: 205,
        6: 206,
        7: 1007,
        8: 1008,
        9: 1009,
        10: 5010,
        11: 5011,
        12: 5012,
    }
    assert a == expected
    only1 = sorted(s for (_, s, n) in _metrics(con) if n == "only1")
    assert only1 == [1, 2, 3, 4, 5]  # values only an earlier attempt logged are kept
    assert res.metric_rows == 12 + 5 and len(res.files) == 4


def test_truncated_last_line_is_reported_and_skipped(tmp_path, db_path, helpers):
    text = helpers.jsonl([(1, {"a": 1.0}), (2, {"a": 2.0})]) + '{"step": 3, "data": {"a": 3.'
    d = helpers.make_run(tmp_path, "s", "cut", helpers.cpu_config(), {"metrics.jsonl": text})
    con = connect(db_path)
    res = ingest_run_dir(con, d)
    assert res.skipped_lines == 1
    assert _metrics(con) == {("cut", 1, "a"): 1.0, ("cut", 2, "a"): 2.0}
    (warning,) = [w for w in res.warnings if "metrics.jsonl" in w]
    assert f"{d / 'metrics.jsonl'}:3" in warning and "last line" in warning


def test_bad_lines_and_non_numeric_values_are_counted(tmp_path, db_path, helpers):
    lines = [
        json.dumps(
            {"step": 1, "data": {"a": 1, "s": "text", "l": [1, 2], "n": None, "b": True, "d": {"x": 1}}}
        ),
        "not json at all",
        json.dumps({"step": "two", "data": {"a": 2.0}}),  # step not an integer
        json.dumps([1, 2, 3]),  # not an object
        "",  # blank lines are not errors
        json.dumps({"step": 4.0, "data": {"a": 4.5}}),  # integral float step is fine
    ]
    d = helpers.make_run(tmp_path, "s", "bad", helpers.cpu_config(), {"metrics.jsonl": "\n".join(lines) + "\n"})
    con = connect(db_path)
    res = ingest_run_dir(con, d)
    assert res.skipped_lines == 3 and res.skipped_values == 5
    assert _metrics(con) == {("bad", 1, "a"): 1.0, ("bad", 4, "a"): 4.5}
    assert any(":2: corrupt line" in w for w in res.warnings)


def test_repeated_step_in_one_file_keeps_the_last_value(tmp_path, db_path, helpers):
    """verl may log the same step twice (validation then training): one statement, no duplicate-key error."""
    text = helpers.jsonl([(5, {"a": 1.0, "val": 0.1}), (5, {"a": 2.0}), (6, {"a": 3.0})])
    d = helpers.make_run(tmp_path, "s", "dup", helpers.cpu_config(), {"metrics.jsonl": text})
    con = connect(db_path)
    ingest_run_dir(con, d)
    assert _metrics(con) == {("dup", 5, "a"): 2.0, ("dup", 5, "val"): 0.1, ("dup", 6, "a"): 3.0}


def test_paths_globs_folders_and_unmatched(tmp_path, db_path, helpers):
    for sweep, rid in (("main_comparison", "r1"), ("main_comparison", "r2"), ("smoke", "r3")):
        helpers.make_run(
            tmp_path, sweep, rid, helpers.cpu_config(), {"metrics.jsonl": helpers.jsonl([(1, {"a": 1.0})])}
        )
    (tmp_path / "runs" / "smoke" / "r3" / "checkpoints" / "step_1").mkdir(parents=True)
    standalone = tmp_path / "verl_logs" / "exp7.jsonl"
    standalone.parent.mkdir()
    standalone.write_text(helpers.jsonl([(1, {"x": 7.0})]))
    con = connect(db_path)
    summary = ingest_paths(
        con, [tmp_path / "runs", str(tmp_path / "runs" / "*" / "r1"), standalone, "nowhere/*"]
    )
    assert sorted(r.run_id for r in summary.runs) == ["exp7", "r1", "r2", "r3"]
    assert summary.unmatched == ["nowhere/*"]
    assert dict(con.execute("SELECT run_id, sweep FROM runs").fetchall()) == {
        "r1": "main_comparison",
        "r2": "main_comparison",
        "r3": "smoke",
        "exp7": "verl_logs",
    }


def test_live_run_without_metrics_is_registered_as_running(tmp_path, db_path, helpers):
    """A run whose writer holds the run lock (here this process) is live: its status.json "running" is stored."""
    d = helpers.make_run(
        tmp_path, "s", "queued", helpers.cpu_config(), None, {"status": "running", "step": 0}
    )
    con = connect(db_path)
    with hold_run_lock(d):
        res = ingest_run_dir(con, d)
    assert res.rows_added == 0 and any("no metrics.jsonl" in w for w in res.warnings)
    assert res.status == "running" and not res.flagged_status
    assert con.execute("SELECT status FROM runs WHERE run_id = 'queued'").fetchall() == [("running",)]


def test_broken_status_does_not_stop_metrics_and_a_broken_config_refuses_the_run(tmp_path, db_path, helpers):
    d = helpers.make_run(
        tmp_path, "s", "odd", helpers.cpu_config(), {"metrics.jsonl": helpers.jsonl([(1, {"a": 1.0})])}
    )
    (d / "status.json").write_text("{not json")
    con = connect(db_path)
    res = ingest_run_dir(con, d)
    assert res.rows_added == 1 and any("status" in w for w in res.warnings)
    d2 = helpers.make_run(tmp_path, "s", "odd2", None, {"metrics.jsonl": helpers.jsonl([(1, {"a": 1.0})])})
    (d2 / "config.yaml").write_text("[unclosed")
    res = ingest_run_dir(con, d2)
    assert res.run_registered == "refused" and res.warnings == [res.refused]
    assert "odd2" in res.refused and "unreadable" in res.refused and "\n" not in res.refused
    assert con.execute("SELECT run_id FROM runs").fetchall() == [("odd",)]
    assert con.execute("SELECT count(*) FROM metrics WHERE run_id = 'odd2'").fetchall() == [(0,)]


def test_upsert_runs_merges_and_keeps_created_at(db_path):
    con = connect(db_path)
    c = store.upsert_runs(con, [{"run_id": "x", "status": "queued", "method": "dppo_topk_kl"}])
    assert (c.inserted, c.updated) == (1, 0)
    created, updated = con.execute("SELECT created_at, updated_at FROM runs").fetchall()[0]
    again = store.upsert_runs(con, [{"run_id": "x", "status": "queued"}])
    assert (again.inserted, again.updated, again.unchanged) == (0, 0, 1)
    time.sleep(1.1)
    c = store.upsert_runs(
        con, [{"run_id": "x", "status": "running", "method": None}, {"run_id": "x", "job_id": 42}]
    )
    assert (c.inserted, c.updated) == (0, 1)  # two rows of one run in one call: merged
    row = con.execute("SELECT status, method, job_id, created_at, updated_at FROM runs").fetchall()[0]
    assert row[:4] == ("running", "dppo_topk_kl", "42", created)  # None kept the stored method
    assert row[4] > updated
    with pytest.raises(ValueError, match="unknown runs column"):
        store.upsert_runs(con, [{"run_id": "y", "colour": "red"}])
    with pytest.raises(ValueError, match="run_id"):
        store.upsert_runs(con, [{"status": "queued"}])


def test_connect_errors_are_one_line(tmp_path, monkeypatch):
    missing = tmp_path / "none.duckdb"
    with pytest.raises(StoreError, match="does not exist") as err:
        connect(missing, read_only=True)
    assert "\n" not in str(err.value) and not missing.exists()
    monkeypatch.setenv("PREDMASK_DB", str(tmp_path / "env.duckdb"))
    assert store.default_db_path() == tmp_path / "env.duckdb"
    monkeypatch.delenv("PREDMASK_DB")
    monkeypatch.chdir(tmp_path)
    assert store.default_db_path() == tmp_path / "results" / "predmask.duckdb"


def test_second_writer_gets_a_clear_error(tmp_path):
    db = tmp_path / "locked.duckdb"
    connect(db).close()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import duckdb, time; c = duckdb.connect({str(db)!r}); print('ok', flush=True); time.sleep(30)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "ok"
        with pytest.raises(StoreError, match=f"in use by pid {holder.pid} ") as err:
            connect(db, wait_s=0)
        assert "\n" not in str(err.value)
    finally:
        holder.kill()
        holder.wait()


def test_schema_has_the_contract_columns(db_path):
    con = connect(db_path)
    cols = lambda t: {
        r[0]
        for r in con.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_name = ?", [t]
        ).fetchall()
    }
    assert cols("runs") == set(store.RUN_COLUMNS)
    assert cols("metrics") == {"run_id", "step", "name", "value"}
    assert {"study_id", "config", "created_at"} <= cols("token_level_studies")
    assert {
        "study_id",
        "seed",
        "n_tokens",
        "n_outside",
        "n_disagree",
        "unsafe_keep_ratio",
        "unsafe_keep_predictive",
        "unsafe_keep_predictive_uniform",
        "n_keep_ratio",
        "n_unsafe_ratio",
    } <= cols("token_level_seeds")
    assert {
        "study_id",
        "seed",
        "position",
        "d_pre",
        "r",
        "a",
        "ddot_agg",
        "ddot_uniform",
        "ddot_exact",
        "keep_ratio",
        "keep_pred_agg",
        "keep_pred_uniform",
        "keep_pred_exact",
        "dd_ratio",
        "dd_pred_agg",
        "dd_pred_uniform",
        "dd_pred_exact",
    } <= cols("token_level_tokens")
    store.ensure_schema(con)  # idempotent
    pk = con.execute(
        "SELECT constraint_column_names FROM duckdb_constraints() WHERE table_name = 'metrics' "
        "AND constraint_type = 'PRIMARY KEY'"
    ).fetchall()
    assert pk == []  # one row per (run_id, step, name) is kept by ingest (schema.py says why), tested there
