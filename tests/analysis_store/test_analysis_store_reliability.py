"""The results store under hostile or unlucky input: a file of another kind as the database, a full or
read-only disk, a run without config.yaml, a step beyond the store's range, a run resumed with fewer steps, a file
streamed in batches. Real files, a real DuckDB, real processes, and real size-limited file systems (a tmpfs mounted
as root; skipped with the reason otherwise, required under CI=true). Nothing here may touch the network: the
``no_network`` fixture fails the test on any socket connection, in this process and in the child processes."""

from __future__ import annotations

import json
import os
import random
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import duckdb
import pytest

from analysis.store import StoreError, connect, ingest_paths
from analysis.store import ingest as ingest_module
from analysis.store.schema import STEP_MAX

ROOT = Path(__file__).resolve().parents[2]

#: imported by every child Python process through PYTHONPATH: a socket connection writes where it went and fails
_SITECUSTOMIZE = '''
import os, socket
def _refuse(self, address, *args):
    with open(os.environ["PREDMASK_TEST_SOCKET_LOG"], "a") as fh:
        fh.write(repr(address) + "\\n")
    raise OSError("network access attempted in a test")
socket.socket.connect = _refuse
socket.socket.connect_ex = _refuse
'''


@pytest.fixture
def no_network(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """Fail on any socket connection: this process's are refused and recorded; child processes get the same through
    a sitecustomize module (the returned environment), and a HOME of their own in which DuckDB would have to put any
    extension it downloaded. The test fails at teardown when anything tried."""
    attempts: list[object] = []

    def refuse(self: object, address: object, *args: object) -> None:
        attempts.append(address)
        raise OSError("network access attempted in a test")

    import socket

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    site = tmp_path / "no-network-site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    log = tmp_path / "socket-attempts.log"
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]), "PREDMASK_TEST_SOCKET_LOG": str(log),
           "HOME": str(home), "PREDMASK_DB_WAIT": "0"}
    env.pop("PREDMASK_DB", None)
    yield env
    assert not attempts, f"socket connections attempted in the test process: {attempts}"
    assert not log.exists(), f"socket connections attempted by a child process: {log.read_text()}"
    assert not (home / ".duckdb").exists(), "DuckDB wrote an extension folder: it tried to install an extension"


def _run(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=300,
                          check=False)


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def _sqlite_file(path: Path) -> Path:
    with sqlite3.connect(path) as con:
        con.execute("CREATE TABLE metrics (run_id TEXT, step INTEGER, name TEXT, value REAL)")
    assert path.read_bytes().startswith(b"SQLite format 3\x00")
    return path


def _jsonl(records: list[tuple[int, dict[str, float]]]) -> str:
    return "".join(json.dumps({"step": s, "data": d}) + "\n" for s, d in records)


def _expected_rows(files: list[Path]) -> set[tuple[int, str, float]]:
    """An independent reading of a run's files: every line's values, later lines and later files winning."""
    last: dict[tuple[int, str], float] = {}
    for path in files:
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            last.update({(rec["step"], k): float(v) for k, v in rec["data"].items()})
    return {(s, n, v) for (s, n), v in last.items()}


def _stored(db: Path, run_id: str) -> list[tuple[int, str, float]]:
    with duckdb.connect(str(db), read_only=True) as con:
        return con.execute("SELECT step, name, value FROM metrics WHERE run_id = ? ORDER BY ALL", [run_id]).fetchall()


# ------------------------------------------------------------------------------- a file of another kind


def test_a_sqlite_file_is_refused_by_every_reader_and_writer_in_process(tmp_path, no_network):
    from analysis.results import open_results

    db = _sqlite_file(tmp_path / "results.duckdb")
    for open_it in (lambda: open_results(db), lambda: connect(db, read_only=True), lambda: connect(db)):
        with pytest.raises(StoreError) as err:
            open_it()
        message = str(err.value)
        assert "\n" not in message
        assert str(db) in message and "a SQLite database" in message and "not a DuckDB database" in message
    assert db.read_bytes().startswith(b"SQLite format 3\x00")  # left as it was


def test_a_sqlite_file_as_the_database_of_reports_paper_is_one_line_and_exit_1(tmp_path, no_network):
    db = _sqlite_file(tmp_path / "results.duckdb")
    done = _run(["-m", "reports", "paper", "--db", str(db), "--out", str(tmp_path / "out")], no_network, tmp_path)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr and "extension" not in done.stderr.lower()
    errors = _lines(done.stderr)
    assert len(errors) == 1, done.stderr
    assert str(db) in errors[0].replace("\n", "") and "not a DuckDB database" in errors[0]


def test_a_sqlite_file_as_the_database_of_ingest_is_one_line(tmp_path, no_network, helpers):
    db = _sqlite_file(tmp_path / "results.duckdb")
    helpers.make_run(tmp_path, "s", "r1", helpers.cpu_config(), {"metrics.jsonl": _jsonl([(1, {"a": 1.0})])})
    done = _run(["-m", "analysis", "ingest", str(tmp_path / "runs"), "--db", str(db), "-q"], no_network, tmp_path)
    assert done.returncode != 0
    assert _lines(done.stderr) == [(f"error: {db} exists but is not a DuckDB database (it is a SQLite database; "
                                   "expected a *.duckdb file the store wrote); move it away or choose another --db path")]


def test_every_connection_has_extension_autoloading_and_autoinstalling_off(tmp_path, db_path, no_network):
    settings = "SELECT current_setting('autoload_known_extensions'), current_setting('autoinstall_known_extensions')"
    con = connect(db_path)
    assert con.execute(settings).fetchall() == [(False, False)]
    con.close()
    reader = connect(db_path, read_only=True)
    assert reader.execute(settings).fetchall() == [(False, False)]
    reader.close()
    plain = duckdb.connect(str(db_path), read_only=True)  # DuckDB's own defaults, for contrast: the test can fail
    assert plain.execute(settings).fetchall() != [(False, False)]
    plain.close()


# ------------------------------------------------------------------------------- full and read-only disks


@pytest.fixture
def small_tmpfs(tmpfs) -> Path:
    """A real 3 MiB tmpfs (tests/conftest.py's ``tmpfs``: skipped without root, required under CI=true)."""
    return tmpfs(3)


def _big_run(helpers, tmp_path: Path, run_id: str, lines: int) -> Path:
    rng = random.Random(lines)  # values that do not compress: the file outgrows the small disk
    records = [(s, {f"metric_{k}": rng.random() for k in range(30)}) for s in range(1, lines + 1)]
    return helpers.make_run(tmp_path, "s", run_id, helpers.cpu_config(), {"metrics.jsonl": _jsonl(records)},
                            {"status": "completed", "step": lines, "total_steps": lines})


def test_a_full_disk_under_the_database_is_one_line_and_keeps_what_was_stored(tmp_path, helpers, small_tmpfs,
                                                                              no_network):
    small = helpers.make_run(tmp_path, "s", "a_small", helpers.cpu_config(), {"metrics.jsonl": _jsonl(
        [(1, {"a": 1.0}), (2, {"a": 2.0})])}, {"status": "completed", "step": 2, "total_steps": 2})
    _big_run(helpers, tmp_path, "b_big", 20000)
    db = small_tmpfs / "results.duckdb"
    done = _run(["-m", "analysis", "ingest", str(tmp_path / "runs"), "--db", str(db), "-q"], no_network, tmp_path)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr and "cannot rollback" not in done.stderr
    errors = [line for line in _lines(done.stderr) if line.startswith("error:")]
    assert len(errors) == 1 and len(_lines(done.stderr)) == 1, done.stderr
    assert str(db) in errors[0] and "is full" in errors[0] and "free space" in errors[0]
    # the run stored before the disk filled is intact; nothing of the failed run is stored
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_tmpfs)], check=True)
    assert _stored(db, "a_small") == sorted(_expected_rows([small / "metrics.jsonl"]))
    assert _stored(db, "b_big") == []


def test_a_full_disk_in_process_raises_store_error_not_a_duckdb_error(tmp_path, helpers, small_tmpfs, no_network):
    run = _big_run(helpers, tmp_path, "big", 20000)
    con = connect(small_tmpfs / "results.duckdb")
    try:
        with pytest.raises(StoreError, match="is full"):
            ingest_paths(con, [run])
    finally:
        try:
            con.close()
        except duckdb.Error:
            pass


def _make_read_only(db: Path, mnt: Path | None) -> None:
    if mnt is not None:
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
    else:
        db.chmod(0o444)
        db.parent.chmod(0o555)


def test_a_read_only_database_is_one_line_and_exit_non_zero(tmp_path, helpers, no_network, tmpfs):
    """Runs everywhere: as root (whom permission bits do not stop) on a tmpfs remounted read-only, else by
    permission bits; skipped only as root where no tmpfs can be mounted."""
    mnt: Path | None = tmpfs(8) if os.geteuid() == 0 else None  # as root only a read-only mount stops a write
    folder = (mnt or tmp_path) / "results"
    folder.mkdir()
    db = folder / "results.duckdb"
    helpers.make_run(tmp_path, "s", "r1", helpers.cpu_config(), {"metrics.jsonl": _jsonl([(1, {"a": 1.0})])})
    try:
        first = _run(["-m", "analysis", "ingest", str(tmp_path / "runs"), "--db", str(db), "-q"], no_network, tmp_path)
        assert first.returncode == 0, first.stderr
        _make_read_only(db, mnt)
        done = _run(["-m", "analysis", "ingest", str(tmp_path / "runs"), "--db", str(db), "-q"], no_network, tmp_path)
        assert done.returncode != 0
        assert len(_lines(done.stderr)) == 1, done.stderr
        assert str(db) in done.stderr and "not writable" in done.stderr and "Traceback" not in done.stderr
        assert _stored(db, "r1") == [(1, "a", 1.0)]  # still readable, as it was
    finally:
        if mnt is None:
            folder.chmod(0o755)


# ------------------------------------------------------------------------------- bad runs and lines


def test_a_run_without_config_is_named_in_one_line_and_the_good_runs_are_stored(tmp_path, helpers, db_path,
                                                                                no_network):
    good = helpers.make_run(tmp_path, "s", "good", helpers.cpu_config(), {"metrics.jsonl": _jsonl([(1, {"a": 1.0})])})
    helpers.make_run(tmp_path, "s", "noconfig", None, {"metrics.jsonl": _jsonl([(1, {"a": 5.0})])},
                     {"status": "completed", "step": 1, "total_steps": 1})
    done = _run(["-m", "analysis", "ingest", str(tmp_path / "runs"), "--db", str(db_path), "-q"], no_network,
                tmp_path)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert _lines(done.stderr) == [(f"error: 1 run director(ies) refused, the others stored: run noconfig: "
                                   f"{tmp_path / 'runs' / 's' / 'noconfig'} has no config.yaml, run refused (not "
                                   "registered)")]
    assert _stored(db_path, "good") == sorted(_expected_rows([good / "metrics.jsonl"]))
    assert _stored(db_path, "noconfig") == []


def test_a_step_beyond_the_store_is_refused_in_one_line_naming_file_and_line(tmp_path, helpers, db_path, no_network):
    text = _jsonl([(1, {"a": 1.0}), (3_000_000_000, {"a": 2.0}), (2, {"a": 3.0})])
    run = helpers.make_run(tmp_path, "s", "huge", helpers.cpu_config(), {"metrics.jsonl": text})
    done = _run(["-m", "analysis", "ingest", str(run), "--db", str(db_path), "-q"], no_network, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    warnings = [line for line in _lines(done.stderr) if line.startswith("warning:")]
    assert warnings == [(f"warning: run huge: {run / 'metrics.jsonl'}:2: step 3000000000 is outside the steps the "
                        f"results store holds ({-STEP_MAX - 1} to {STEP_MAX}), line refused")]
    assert _stored(db_path, "huge") == [(1, "a", 1.0), (2, "a", 3.0)]


# ------------------------------------------------------------------------------- the database equals the files


def test_ingest_removes_the_rows_of_steps_gone_from_the_file(tmp_path, helpers, db_path):
    records = [(s, {"loss": s / 3, "acc": s / 10}) for s in range(1, 11)]
    run = helpers.make_run(tmp_path, "s", "shrunk", helpers.cpu_config(), {"metrics.jsonl": _jsonl(records)})
    con = connect(db_path)
    first = ingest_paths(con, [run]).runs[0]
    assert (first.rows_added, first.rows_removed) == (20, 0)
    # resumed from step 6 with fewer steps, a value of step 6 written anew and a metric no longer logged at step 5
    shrunk = [*records[:4], (5, {"loss": 5 / 3}), (6, {"loss": 99.0, "acc": 0.6})]
    (run / "metrics.jsonl").write_text(_jsonl(shrunk))
    second = ingest_paths(con, [run]).runs[0]
    con.close()
    assert set(_stored(db_path, "shrunk")) == _expected_rows([run / "metrics.jsonl"])
    assert (second.rows_added, second.rows_changed, second.rows_removed) == (0, 1, 20 - 11)
    assert len(_stored(db_path, "shrunk")) == 11


def test_ingest_keeps_one_row_per_step_and_name_also_in_a_database_with_the_old_primary_key(tmp_path, helpers):
    """An older database's `metrics` has a PRIMARY KEY (run_id, step, name): the same statements write it, a value
    replaced inside one transaction included."""
    db = tmp_path / "old.duckdb"
    with duckdb.connect(str(db)) as old:
        old.execute("CREATE TABLE metrics (run_id VARCHAR NOT NULL, step INTEGER NOT NULL, name VARCHAR NOT NULL, "
                    "value DOUBLE, PRIMARY KEY (run_id, step, name))")
    run = helpers.make_run(tmp_path, "s", "r", helpers.cpu_config(), {"metrics.jsonl": _jsonl([(1, {"a": 1.0})])})
    for text in (_jsonl([(1, {"a": 1.0}), (2, {"a": 2.0})]), _jsonl([(1, {"a": 7.0})]), _jsonl([(1, {"a": 7.0})])):
        (run / "metrics.jsonl").write_text(text)
        for path in (db, tmp_path / "new.duckdb"):
            con = connect(path)
            ingest_paths(con, [run])
            dupes = con.execute("SELECT count(*) - count(DISTINCT (run_id, step, name)) FROM metrics").fetchone()
            con.close()
            assert dupes == (0,)
            assert set(_stored(path, "r")) == _expected_rows([run / "metrics.jsonl"])


def test_streaming_in_small_batches_stores_what_an_independent_reading_of_the_files_says(
    tmp_path, helpers, db_path, monkeypatch
):
    """Batches of 7 rows: steps logged on two consecutive lines, attempts overriding each other and a changed
    value cross the batch boundaries; what is stored equals the files read whole by the test."""
    monkeypatch.setattr(ingest_module, "BATCH_ROWS", 7)
    attempt1 = [(s, {"a": s * 1.0, "b": -s * 1.0}) for s in range(1, 21)]
    current = [(s, {"a": s * 2.0}) for s in range(10, 15)] + [(14, {"val": 0.5, "a": 3.0}), (15, {"b": 1.5})]
    run = helpers.make_run(tmp_path, "s", "batched", helpers.cpu_config(), {
        "metrics.attempt-1.jsonl": _jsonl(attempt1), "metrics.jsonl": _jsonl(current)})
    con = connect(db_path)
    result = ingest_paths(con, [run]).runs[0]
    again = ingest_paths(con, [run]).runs[0]
    con.close()
    expected = _expected_rows([run / "metrics.attempt-1.jsonl", run / "metrics.jsonl"])
    assert set(_stored(db_path, "batched")) == expected
    assert result.metric_rows == len(expected) == result.rows_added
    assert (again.rows_added, again.rows_changed, again.rows_removed) == (0, 0, 0)
