"""The results database under contention, with real processes and real DuckDB files: a writer waits for a reader
(and a reader for a writer) a bounded time, then gives up with one line naming the holder's pid."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from analysis.store import StoreError, connect

REPO = Path(__file__).resolve().parents[2]


def _holder(db: Path, read_only: bool, hold_s: float) -> subprocess.Popen[str]:
    """A process that opens ``db``, says "ok" once it holds the file, and keeps it for ``hold_s`` seconds."""
    code = (f"import duckdb, time; c = duckdb.connect({str(db)!r}, read_only={read_only}); "
            f"print('ok', flush=True); time.sleep({hold_s}); c.close()")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ok"
    return proc


def _run_dir(root: Path, run_id: str) -> Path:
    d = root / "runs" / "s" / run_id
    d.mkdir(parents=True)
    (d / "config.yaml").write_text("seed: 0\nmethod: {name: grpo_clip_higher}\n")
    (d / "metrics.jsonl").write_text(json.dumps({"step": 1, "data": {"a": 1.0}}) + "\n")
    return d


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "results" / "wait.duckdb"
    connect(path).close()
    return path


def test_a_writer_waits_for_a_reader_then_succeeds(db: Path) -> None:
    reader = _holder(db, read_only=True, hold_s=1.5)
    try:
        with pytest.raises(StoreError, match=f"in use by pid {reader.pid} "):
            connect(db, wait_s=0)  # the reader holds it right now
        con = connect(db, wait_s=120)  # ... and the writer gets it once the reader lets go
        con.execute("INSERT INTO runs (run_id) VALUES ('after_the_reader')")
        con.close()
    finally:
        reader.kill()
        reader.wait()
    check = connect(db, read_only=True)
    assert check.execute("SELECT run_id FROM runs").fetchall() == [("after_the_reader",)]
    check.close()


def test_a_reader_waits_for_a_writer_then_succeeds(db: Path) -> None:
    writer = _holder(db, read_only=False, hold_s=1.5)
    try:
        with pytest.raises(StoreError, match=f"in use by pid {writer.pid} "):
            connect(db, read_only=True, wait_s=0)
        con = connect(db, read_only=True, wait_s=120)
        assert con.execute("SELECT count(*) FROM runs").fetchall() == [(0,)]
        con.close()
    finally:
        writer.kill()
        writer.wait()


def test_the_wait_is_bounded_and_ends_in_one_line(db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reader = _holder(db, read_only=True, hold_s=600)
    try:
        monkeypatch.setenv("PREDMASK_DB_WAIT", "0.3")
        with pytest.raises(StoreError) as err:
            connect(db)
        msg = str(err.value)
        assert "\n" not in msg and f"pid {reader.pid} " in msg and "gave up after 0.3 s" in msg
        monkeypatch.setenv("PREDMASK_DB_WAIT", "soon")
        with pytest.raises(StoreError, match="PREDMASK_DB_WAIT='soon' is not a number"):
            connect(db)
        with pytest.raises(StoreError, match="seconds >= 0"):
            connect(db, wait_s=-1)
    finally:
        reader.kill()
        reader.wait()


def test_ingest_cli_waits_for_a_reader_and_gives_up_in_one_line(tmp_path: Path, db: Path) -> None:
    """`python -m analysis ingest` as a real process while `reports`-like readers hold the file."""
    _run_dir(tmp_path, "r1")
    argv = [sys.executable, "-m", "analysis", "ingest", str(tmp_path / "runs"), "--db", str(db), "-q"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    reader = _holder(db, read_only=True, hold_s=4)  # likely still held when ingest opens the file
    try:
        done = subprocess.run(argv, check=False, env={**env, "PREDMASK_DB_WAIT": "120"}, cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)
    finally:
        reader.kill()
        reader.wait()
    assert done.returncode == 0, done.stderr
    check = connect(db, read_only=True)
    assert check.execute("SELECT run_id, step, value FROM metrics").fetchall() == [("r1", 1, 1.0)]
    check.close()

    reader = _holder(db, read_only=True, hold_s=600)
    try:
        failed = subprocess.run(argv, check=False, env={**env, "PREDMASK_DB_WAIT": "0.5"}, cwd=tmp_path,
                                capture_output=True, text=True, timeout=300)
    finally:
        reader.kill()
        reader.wait()
    assert failed.returncode == 2
    lines = failed.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: results database") and f"pid {reader.pid} " in lines[0]
    assert "Traceback" not in failed.stderr
