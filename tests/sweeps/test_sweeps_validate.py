"""`python -m sweeps` refuses a bad grid before anything is written: every run is checked as its trainer checks it
(the schema sections, top_k within the vocabulary, the method's parameters), then the database path; one line naming
the run's cell, the bad value and what is allowed; exit 2; no run directory, no database."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sweeps.__main__ import main

CELL = r"run [0-9a-f]{12} \(method=\S+ model=cpu_s precision=bf16 delta=\S+ seed=0\): "


#: a grid that trains for seconds, should a check be missing (the database path is checked only when running)
TINY = ["method=dppo_topk_kl", "trainer.steps=1", "trainer.val_n=2", "base.steps=20", "base.eval_problems=16",
        "task.eval_size=8", "trainer.train_batch_size=4", "trainer.ppo_mini_batch_size=2", "rollout.n=4"]


def _refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """Run the command in this process; assert exit 2, one stderr line, nothing written; return the line.

    A dry run validates every run as a real one does (and would write its dry-run folder, never train)."""
    runs, db = tmp_path / "runs", tmp_path / "out" / "db.duckdb"
    code = main(["smoke", *args, "--runs-root", str(runs), *([] if "--db" in args else ["--db", str(db)])])
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and len(err) == 1, err
    assert not runs.exists() and not db.exists() and not db.parent.exists()
    return err[0]


@pytest.mark.parametrize(("override", "message"), [
    ("top_k=1000", r"top_k must lie in \[1, vocab_size=\d+\], got 1000"),
    ("top_k=0", r"top_k must lie in \[1, vocab_size=\d+\], got 0"),
    ("trainer.steps=0", r"trainer\.steps must be >= 1, got 0"),
    ("trainer.ppo_mini_batch_size=32",
     r"trainer\.train_batch_size \(16\) must be a multiple of trainer\.ppo_mini_batch_size \(32\)"),
    ("rollout.temperature=0", r"rollout\.temperature must be > 0, got 0\.0"),
])
def test_a_run_its_trainer_would_refuse_is_refused_before_anything_is_written(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], override: str, message: str) -> None:
    import re

    line = _refused(tmp_path, capsys, override, "--dry-run")
    assert re.fullmatch(f"error: {CELL}{message}; nothing submitted", line), line


@pytest.mark.parametrize(("override", "message"), [
    ("delta=inf", "delta must be a finite number > 0"),
    ("rollout.n=1", "rollout.n must be >= 2"),
])
def test_edge_values_that_would_learn_nothing_or_bind_nothing_are_errors(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], override: str, message: str) -> None:
    """delta=inf: the trust region never binds; rollout.n=1: every GRPO advantage is 0. Both are refused with the
    value and what is allowed (the error text explains why)."""
    line = _refused(tmp_path, capsys, override, "--dry-run")
    assert message in line and ("inf" in line or "got 1" in line), line


def test_a_value_of_the_wrong_type_names_the_key_the_value_and_what_is_allowed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _refused(tmp_path, capsys, "delta=abc", "--dry-run") == (
        "error: delta must be a finite number > 0 (the trust-region threshold, e.g. delta=0.15), got 'abc'")


def test_a_bad_database_path_is_refused_before_the_first_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "a folder"
    folder.mkdir()
    not_duckdb = tmp_path / "notes.txt"
    not_duckdb.write_text("not a database\n")
    for db, expected in ((folder, "is a directory"), (not_duckdb, "is not a DuckDB database"),
                         (not_duckdb / "db.duckdb", "is a file, not a folder")):
        line = _refused(tmp_path, capsys, *TINY, "--db", str(db))
        assert line.startswith("error: ") and expected in line and str(db) in line, line
    assert not_duckdb.read_text() == "not a database\n"


def test_from_the_command_line_it_exits_2_with_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "PREDMASK_RUNS": str(tmp_path / "runs"), "PREDMASK_DB": str(tmp_path / "db.duckdb")}
    proc = subprocess.run([sys.executable, "-m", "sweeps", "smoke", "trainer.steps=0"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 2
    assert len(proc.stderr.splitlines()) == 1 and "trainer.steps must be >= 1, got 0" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == []
