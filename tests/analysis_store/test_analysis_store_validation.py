"""Ingest stores nothing invalid silently: non-finite values, steps going backwards, empty "completed" runs, run
directories without config.yaml and killed runs each give one warning line and a count; real DuckDB files."""

from __future__ import annotations

import json
import math

from analysis.store import EMPTY, connect, ingest_paths, ingest_run_dir


def _values(con, run_id: str) -> dict[tuple[int, str], float]:
    rows = con.execute("SELECT step, name, value FROM metrics WHERE run_id = ?", [run_id]).fetchall()
    return {(s, n): v for s, n, v in rows}


def test_nan_and_infinities_are_not_stored_and_each_line_is_reported(tmp_path, db_path, helpers):
    # Python's json writes (and reads) the literals NaN, Infinity and -Infinity; 1e999 reads as inf too
    lines = [
        json.dumps({"step": 1, "data": {"a": 1.0, "b": math.nan}}),
        json.dumps({"step": 2, "data": {"a": math.inf, "b": -math.inf, "c": 3.0}}),
        '{"step": 3, "data": {"a": 1e999, "b": 4.0}}',
        json.dumps({"step": 4, "data": {"a": 10**400, "b": 5.0}}),
    ]
    d = helpers.make_run(tmp_path, "s", "nan_run", helpers.cpu_config(), {"metrics.jsonl": "\n".join(lines) + "\n"})
    con = connect(db_path)
    res = ingest_run_dir(con, d)
    assert _values(con, "nan_run") == {(1, "a"): 1.0, (2, "c"): 3.0, (3, "b"): 4.0, (4, "b"): 5.0}
    assert con.execute("SELECT count(*) FROM metrics WHERE NOT isfinite(value) OR value IS NULL").fetchall() == [(0,)]
    assert res.nonfinite_values == 5
    flagged = [w for w in res.warnings if "non-finite" in w]
    assert len(flagged) == 4  # one line per metrics line with a problem
    for lineno, w in enumerate(flagged, start=1):
        assert w.startswith("run nan_run: ") and f"metrics.jsonl:{lineno}:" in w
    assert "a=inf" in flagged[1] and "b=-inf" in flagged[1]
    summary = ingest_paths(con, [d])
    assert summary.nonfinite_values == 5 and summary.problems == 5
    assert "5 non-finite" in summary.totals_line()


def test_a_nonfinite_value_stored_by_an_older_ingest_is_removed(tmp_path, db_path, helpers):
    d = helpers.make_run(tmp_path, "s", "old", helpers.cpu_config(), {"metrics.jsonl": helpers.jsonl([(1, {"a": 1.0})])})
    con = connect(db_path)
    con.execute("INSERT INTO metrics VALUES ('old', 2, 'a', 'NaN'::DOUBLE), ('old', 3, 'a', 'inf'::DOUBLE)")
    summary = ingest_paths(con, [d])
    assert summary.runs[0].rows_removed == 2
    assert "2 stored row(s) no longer in the runs' files (or non-finite) removed" in summary.totals_line()
    assert _values(con, "old") == {(1, "a"): 1.0}


def test_a_step_going_backwards_is_refused_and_the_earlier_value_kept(tmp_path, db_path, helpers):
    records = [
        (1, {"a": 1.0}),
        (2, {"a": 2.0}),
        (2, {"val": 0.5}),  # the same step again (validation, then training): not backwards
        (3, {"a": 3.0}),
        (2, {"a": 666.0, "new": 1.0}),  # backwards: refused whole, step 2 keeps 2.0
        (4, {"a": 4.0}),
        (1, {"a": 777.0}),  # backwards again
    ]
    d = helpers.make_run(tmp_path, "s", "back", helpers.cpu_config(), {"metrics.jsonl": helpers.jsonl(records)})
    con = connect(db_path)
    res = ingest_run_dir(con, d)
    assert _values(con, "back") == {(1, "a"): 1.0, (2, "a"): 2.0, (2, "val"): 0.5, (3, "a"): 3.0, (4, "a"): 4.0}
    assert res.backward_lines == 2
    back = [w for w in res.warnings if "backwards" in w]
    assert len(back) == 2
    assert "metrics.jsonl:5: step 2 after step 3" in back[0] and "metrics.jsonl:7: step 1 after step 4" in back[1]
    assert all(w.startswith("run back: ") for w in back)


def test_attempts_starting_again_from_a_checkpoint_are_not_backwards(tmp_path, db_path, helpers):
    """Each attempt file is checked on its own: a later attempt may restart at a lower step (its checkpoint)."""
    files = {
        "metrics.attempt-1.jsonl": helpers.jsonl([(s, {"a": 100.0 + s}) for s in range(1, 6)]),
        "metrics.jsonl": helpers.jsonl([(s, {"a": 200.0 + s}) for s in range(4, 7)]),
    }
    d = helpers.make_run(tmp_path, "s", "att", helpers.cpu_config(), files)
    con = connect(db_path)
    res = ingest_run_dir(con, d)
    assert res.backward_lines == 0
    assert _values(con, "att") == {(s, "a"): (100.0 if s < 4 else 200.0) + s for s in range(1, 7)}


def test_a_completed_run_with_an_empty_metrics_file_is_stored_as_empty(tmp_path, db_path, helpers):
    status = {"status": "completed", "step": 5, "total_steps": 5, "updated": 1_700_000_000, "error": None}
    d = helpers.make_run(tmp_path, "s", "hollow", helpers.cpu_config(), {"metrics.jsonl": ""}, status)
    d2 = helpers.make_run(tmp_path, "s", "garbage", helpers.cpu_config(), {"metrics.jsonl": "not json\n"}, status)
    con = connect(db_path)
    summary = ingest_paths(con, [d, d2])
    assert dict(con.execute("SELECT run_id, status FROM runs").fetchall()) == {"hollow": EMPTY, "garbage": EMPTY}
    assert [r.status for r in summary.runs] == [EMPTY, EMPTY]
    assert len(summary.flagged_runs) == 2 and summary.problems == 3  # two empty runs, one corrupt line
    (w,) = [w for w in summary.runs[0].warnings if EMPTY in w]
    assert w.startswith("run hollow: ") and "completed" in w
    assert "2 run(s) stored as dead or empty" in summary.totals_line()


def test_a_run_dir_without_config_is_refused_and_not_registered(tmp_path, db_path, helpers):
    status = {"status": "completed", "step": 1, "total_steps": 1, "updated": 1_700_000_000, "error": None}
    bare = helpers.make_run(tmp_path, "s", "bare", None, {"metrics.jsonl": helpers.jsonl([(1, {"a": 1.0})])}, status)
    good = helpers.make_run(tmp_path, "s", "good", helpers.cpu_config(), {"metrics.jsonl": helpers.jsonl([(1, {"a": 1.0})])})
    con = connect(db_path)
    summary = ingest_paths(con, [tmp_path / "runs"])
    assert con.execute("SELECT run_id, method FROM runs").fetchall() == [("good", "predmask_kl_agg")]
    assert con.execute("SELECT DISTINCT run_id FROM metrics").fetchall() == [("good",)]
    (refused,) = summary.refused
    assert refused.run_id == "bare" and refused.run_registered == "refused"
    assert refused.warnings == [refused.refused]
    assert refused.refused == f"run bare: {bare} has no config.yaml, run refused (not registered)"
    assert "1 refused" in summary.totals_line() and summary.problems == 1
    assert good.is_dir()


def test_a_running_status_without_a_live_writer_is_dead(tmp_path, db_path, helpers):
    """No process holds the run lock (a leftover lock file included): the writer is gone, the run is dead."""
    status = {"status": "running", "step": 3, "total_steps": 9, "updated": 1_700_000_000, "error": None}
    d = helpers.make_run(tmp_path, "s", "gone", helpers.cpu_config(), {"metrics.jsonl": helpers.jsonl([(1, {"a": 1.0})])}, status)
    (d / ".run.lock").write_text("pid 1 somewhere\n")
    con = connect(db_path)
    res = ingest_run_dir(con, d)
    assert res.status == "dead" and res.flagged_status
    assert con.execute("SELECT status FROM runs").fetchall() == [("dead",)]
    assert any(w.startswith("run gone: ") and "killed" in w for w in res.warnings)


def _stats_line(step: int, micro: int, metrics: dict) -> str:
    return json.dumps({"session": "1", "step": step, "mini_batch": 0, "rank": 0, "micro_batch": micro,
                       "metrics": metrics}) + "\n"


def test_a_verl_runs_exact_loss_statistics_replace_verls_values_for_logged_steps(tmp_path, db_path, helpers):
    """verl averaged the token count of two micro-batches (3 + 4 -> 3.5); the statistics give the exact sum 7.
    Step 2 is in the statistics only (verl never logged it): not added."""
    d = helpers.make_run(tmp_path, "s", "verl_run", helpers.cpu_config(),
                         {"metrics.jsonl": helpers.jsonl([(1, {"actor/mask/tokens": 3.5, "critic/score/mean": 0.5})])})
    (d / "loss_stats").mkdir()
    (d / "loss_stats" / "1.rank0.jsonl").write_text(
        _stats_line(1, 0, {"actor/mask/tokens": 3}) + _stats_line(1, 1, {"actor/mask/tokens": 4})
        + _stats_line(2, 0, {"actor/mask/tokens": 9}))
    con = connect(db_path)
    ingest_run_dir(con, d)
    assert _values(con, "verl_run") == {(1, "actor/mask/tokens"): 7.0, (1, "critic/score/mean"): 0.5}

    (d / "loss_stats" / "1.rank0.jsonl").write_text("garbage\n" + _stats_line(1, 0, {"actor/mask/tokens": 3}))
    res = ingest_run_dir(con, d)
    (w,) = [w for w in res.warnings if "loss_stats" in w]
    assert w.startswith("run verl_run: ") and "1.rank0.jsonl:1" in w and "not used" in w
    assert res.skipped_lines == 1
    assert _values(con, "verl_run")[(1, "actor/mask/tokens")] == 3.5  # verl's own value, as logged
