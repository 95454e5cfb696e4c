"""A results database on a full disk during a sweep, with a real size-limited filesystem (a tmpfs of 4 MiB, mounted
as root) and a real DuckDB: each finished run's ingest is deferred with one line naming the database and the command
that catches it up, the sweep's ingester never raises (so the sweep goes on with its other runs), and once space is
freed the catch-up stores every run whole."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from analysis.store import connect
from sweeps.__main__ import Ingester
from sweeps.compose import RunSpec

METRICS, STEPS = 40, 300  # a metrics file of about 0.4 MB per run: more than the full disk can take


@pytest.fixture
def small_disk(tmpfs) -> Path:
    """A 4 MiB tmpfs (tests/conftest.py's ``tmpfs``: skipped without root, required under CI=true)."""
    return tmpfs(4)


def _run_dir(root: Path, run_id: str) -> Path:
    path = root / "s" / run_id
    path.mkdir(parents=True)
    (path / "config.yaml").write_text("seed: 0\nmethod: {name: grpo_clip_higher}\n")
    lines = (json.dumps({"step": step, "data": {f"m{j}": step + j / 100 for j in range(METRICS)}})
             for step in range(1, STEPS + 1))
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return path


def _fill(disk: Path) -> Path:
    filler = disk / "filler"
    with open(filler, "wb") as fh:
        try:
            while True:
                fh.write(b"\0" * 65536)
                fh.flush()
        except OSError:
            pass
    return filler


def test_ingest_on_a_full_disk_is_deferred_in_one_line_and_caught_up_once_space_is_free(
        small_disk: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = small_disk / "results.duckdb"
    connect(db).close()  # the database exists (schema written) before the disk fills up
    runs = [_run_dir(tmp_path / "runs", run_id) for run_id in ("r1", "r2")]
    filler = _fill(small_disk)
    hint = f"python -m analysis ingest {tmp_path / 'runs' / 's'} --db {db}"
    ingest = Ingester(db, hint)

    capsys.readouterr()
    for path in runs:  # the sweep calls this as each run ends: it must return, for the next runs to go on
        ingest(RunSpec(path.name, "s", (), {}), path)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and sorted(ingest.deferred) == ["r1", "r2"]
    for run_id, line in zip(("r1", "r2"), lines, strict=True):
        assert line.startswith(f"ingest of {run_id} ") and line.endswith(f"`{hint}` catches it up")
        assert " deferred: " in line and "No space left on device" in line and str(db) in line

    filler.unlink()
    assert ingest.catch_up() == {}
    con = connect(db, read_only=True)
    try:
        stored = con.execute("SELECT run_id, count(*), max(step) FROM metrics GROUP BY run_id ORDER BY run_id")
        assert stored.fetchall() == [("r1", STEPS * METRICS, STEPS), ("r2", STEPS * METRICS, STEPS)]
    finally:
        con.close()
