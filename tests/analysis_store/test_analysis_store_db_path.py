"""The database path check (analysis.store.check_db_path) on real paths and real DuckDB files: each bad path is one
line naming it and what to do, nothing is written, a good path (even one another process holds) passes; a missing
database names the commands that create one; `python -m analysis ingest` ends by naming the next command and,
piped, prints one progress line per run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

from analysis.store import StoreError, check_db_path, connect, missing_db_hint, paper_command


def _tree(root: Path) -> list[tuple[str, int]]:
    """Every path below ``root`` with its size (folders 0): what a refused check must leave unchanged."""
    return sorted((str(p.relative_to(root)), p.stat().st_size if p.is_file() else 0) for p in root.rglob("*"))


def _not_duckdb(path: Path, content: bytes) -> Path:
    path.write_bytes(content)
    return path


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda d: (d / "a_dir").mkdir() or d / "a_dir", "is a directory; give a file path such as "),
        (lambda d: _not_duckdb(d / "notes.duckdb", b"these are my notes, not a database\n"), "is not a DuckDB database"),
        (lambda d: _not_duckdb(d / "empty.duckdb", b""), "is not a DuckDB database"),
        (lambda d: _not_duckdb(d / "file", b"x") / "sub" / "db.duckdb", "is a file, not a folder"),
        (lambda d: os.mkfifo(d / "fifo") or d / "fifo", "is not a regular file"),
    ],
    ids=["directory", "text-file", "empty-file", "parent-is-a-file", "fifo"],
)
def test_a_bad_path_is_one_line_naming_it_and_nothing_is_written(tmp_path: Path, make, needle: str) -> None:
    bad = make(tmp_path)
    before = _tree(tmp_path)
    with pytest.raises(StoreError) as err:
        check_db_path(bad)
    message = str(err.value)
    assert needle in message and str(bad) in message and "\n" not in message, message
    with pytest.raises(StoreError) as again:  # a writer's connect refuses with the same line, writing nothing
        connect(bad, wait_s=0)
    assert str(again.value) == message
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("where", ["/proc", "/proc/1", "locked"])
def test_an_unwritable_folder_is_refused(tmp_path: Path, where: str) -> None:
    """Folders nobody may create a file in, root included (/proc: its permission bits say writable to root), and
    a folder without write permission (refused for an ordinary user; root may write there, so it passes)."""
    folder = Path(where) if where.startswith("/") else tmp_path / where
    if where == "locked":
        folder.mkdir(mode=0o500)
        if os.geteuid() == 0:
            check_db_path(folder / "db.duckdb")
            assert list(folder.iterdir()) == []
            return
    with pytest.raises(StoreError, match=f"folder {re.escape(str(folder))} is not writable \\("):
        check_db_path(folder / "sub" / "db.duckdb")


def test_an_existing_database_that_cannot_be_written_is_refused(tmp_path: Path) -> None:
    """A DuckDB file without write permission: refused for an ordinary user; root may write it (DuckDB would open
    it), so there it passes."""
    db = tmp_path / "ro.duckdb"
    duckdb.connect(str(db)).close()
    db.chmod(0o400)
    if os.geteuid() == 0:
        check_db_path(db)  # root may write a read-only file: DuckDB would open it, so it passes
    else:
        with pytest.raises(StoreError, match="is not writable"):
            check_db_path(db)


def test_good_paths_pass_without_writing(tmp_path: Path) -> None:
    nested = tmp_path / "not" / "yet" / "db.duckdb"
    check_db_path(nested)  # folders that do not exist yet: created by the writer later
    assert list(tmp_path.iterdir()) == []
    real = tmp_path / "real.duckdb"
    duckdb.connect(str(real)).close()
    before = _tree(tmp_path)
    check_db_path(real)
    assert _tree(tmp_path) == before


def test_a_database_another_process_holds_passes_the_check(tmp_path: Path) -> None:
    """The check opens nothing, so a sweep may run it while a reader or writer holds the file."""
    db = tmp_path / "held.duckdb"
    connect(db).close()
    hold = f"import duckdb, time; c = duckdb.connect({str(db)!r}); print('ok', flush=True); time.sleep(60)"
    holder = subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ok"
        check_db_path(db)
        with pytest.raises(StoreError, match="in use by"):  # while opening it does wait and give up
            connect(db, wait_s=0)
    finally:
        holder.kill()
        holder.wait()


def test_a_missing_database_names_the_commands_that_create_one(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PREDMASK_RUNS", str(tmp_path / "runs"))  # nothing has run: no run directories
    missing = tmp_path / "none.duckdb"
    with pytest.raises(StoreError) as err:
        connect(missing, read_only=True)
    hint = missing_db_hint(missing)
    assert str(err.value) == f"results database {missing} does not exist: {hint}"
    for command in ("python -m sweeps smoke", "python -m analysis token_level --seeds 61", "python -m reports paper"):
        assert f"{command} --db {missing}" in hint
    assert "ingest" not in hint  # nothing to ingest yet
    with pytest.raises(StoreError, match="is a directory"):  # a directory is named as one, not as missing
        connect(tmp_path, read_only=True)
    assert not missing.exists()


def test_the_paper_command_quotes_what_it_is_given() -> None:
    assert paper_command() == "python -m reports paper"
    assert paper_command(Path("/a b/x.duckdb"), "abc123") == "python -m reports paper --study abc123 --db '/a b/x.duckdb'"


def test_ingest_piped_prints_one_progress_line_per_run_and_names_the_next_command(tmp_path: Path, helpers) -> None:
    metrics = [{"metrics.jsonl": helpers.jsonl([(1, {"a": float(i)})])} for i in range(3)]
    runs = [helpers.make_run(tmp_path, "s", f"r{i}", helpers.cpu_config(), m) for i, m in enumerate(metrics)]
    db = tmp_path / "db with space.duckdb"
    env = {**os.environ, "PREDMASK_PROGRESS_INTERVAL_S": "0"}  # a line at every run instead of every 10 s
    proc = subprocess.run([sys.executable, "-m", "analysis", "ingest", str(tmp_path / "runs"), "--db", str(db)],
                          capture_output=True, text=True, env=env, check=False, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    shape = re.compile(r"^ingest: (\d)/3 runs \(\d+%\) (r\d) \[elapsed [0-9hms]+(, eta [0-9hms]+)?\]$")
    progress = [m for m in map(shape.match, lines) if m]
    assert [m.group(1) for m in progress] == ["1", "2", "3", "3"]  # each run, then the final line
    assert [m.group(2) for m in progress[:3]] == [r.name for r in runs]
    assert lines[-1] == f"next: python -m reports paper --db '{db}'"
    quiet = subprocess.run([sys.executable, "-m", "analysis", "ingest", str(tmp_path / "runs"), "--db", str(db), "-q"],
                           capture_output=True, text=True, env=env, check=False, timeout=300)
    assert quiet.returncode == 0 and not any(map(shape.match, quiet.stdout.splitlines())), quiet.stdout


def test_ingest_into_a_directory_is_one_line_exit_2(tmp_path: Path, helpers) -> None:
    helpers.make_run(tmp_path, "s", "r", helpers.cpu_config(), {"metrics.jsonl": helpers.jsonl([(1, {"a": 1.0})])})
    before = _tree(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "analysis", "ingest", str(tmp_path / "runs"), "--db", str(tmp_path)],
                          capture_output=True, text=True, check=False, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"error: results database path {tmp_path} is a directory; give a file path such "
                                   f"as {tmp_path / 'predmask.duckdb'}")
    assert _tree(tmp_path) == before
