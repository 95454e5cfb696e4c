"""Ingest of run directories and standalone metrics files into `runs` and `metrics` (idempotent, one run per transaction)."""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from analysis.store.attempts import attempt_files, is_attempt_file, is_run_dir, merge_attempts
from analysis.store.connection import StoreError, fetch_one
from analysis.store.metrics_files import parse_metrics_file
from analysis.store.runs import run_row_from_dir, upsert_runs

__all__ = [
    "IngestSummary",
    "RunIngest",
    "find_run_dirs",
    "ingest_metrics_file",
    "ingest_paths",
    "ingest_run_dir",
]


@dataclass
class RunIngest:
    """What ingesting one run directory (or one standalone metrics file) did."""

    run_id: str
    run_dir: Path
    files: list[Path]
    lines: int = 0
    metric_rows: int = 0  # distinct (step, name) after merging attempts
    rows_added: int = 0
    rows_changed: int = 0
    skipped_lines: int = 0
    skipped_values: int = 0
    run_registered: str = "unchanged"  # inserted | updated | unchanged
    warnings: list[str] = field(default_factory=list)


@dataclass
class IngestSummary:
    """The result of ingest_paths: one RunIngest per run, and the inputs that matched nothing."""

    runs: list[RunIngest] = field(default_factory=list)
    unmatched: list[str] = field(default_factory=list)

    @property
    def rows_added(self) -> int:
        return sum(r.rows_added for r in self.runs)

    @property
    def rows_changed(self) -> int:
        return sum(r.rows_changed for r in self.runs)

    @property
    def skipped_lines(self) -> int:
        return sum(r.skipped_lines for r in self.runs)

    @property
    def skipped_values(self) -> int:
        return sum(r.skipped_values for r in self.runs)

    @property
    def warnings(self) -> list[str]:
        return [w for r in self.runs for w in r.warnings]


def _write_metrics(
    con: duckdb.DuckDBPyConnection, run_id: str, merged: Mapping[tuple[int, str], float]
) -> tuple[int, int]:
    if not merged:
        return 0, 0
    keys = list(merged)
    table = pa.table(
        {
            "run_id": pa.array([run_id] * len(keys), pa.string()),
            "step": pa.array([k[0] for k in keys], pa.int32()),
            "name": pa.array([k[1] for k in keys], pa.string()),
            "value": pa.array(list(merged.values()), pa.float64()),
        }
    )
    con.register("_predmask_incoming", table)
    try:
        added, changed = fetch_one(
            con,
            "SELECT count(*) FILTER (WHERE m.run_id IS NULL), "
            "count(*) FILTER (WHERE m.run_id IS NOT NULL AND m.value IS DISTINCT FROM i.value) "
            "FROM _predmask_incoming i LEFT JOIN metrics m USING (run_id, step, name)",
        )
        if added or changed:
            con.execute(
                "INSERT INTO metrics (run_id, step, name, value) "
                "SELECT i.run_id, i.step, i.name, i.value FROM _predmask_incoming i "
                "LEFT JOIN metrics m USING (run_id, step, name) "
                "WHERE m.run_id IS NULL OR m.value IS DISTINCT FROM i.value "
                "ON CONFLICT (run_id, step, name) DO UPDATE SET value = excluded.value"
            )
    finally:
        con.unregister("_predmask_incoming")
    return int(added), int(changed)


def _ingest(
    con: duckdb.DuckDBPyConnection, run_row: dict[str, Any], run_dir: Path, files: list[Path]
) -> RunIngest:
    result = RunIngest(run_id=run_row["run_id"], run_dir=run_dir, files=files)
    parsed = [parse_metrics_file(p) for p in files]
    for pf in parsed:
        result.lines += pf.lines
        result.skipped_lines += pf.skipped_lines
        result.skipped_values += pf.skipped_values
        result.warnings.extend(pf.warnings)
    merged = merge_attempts(parsed)
    result.metric_rows = len(merged)
    con.execute("BEGIN TRANSACTION")
    try:
        counts = upsert_runs(con, [run_row])
        result.rows_added, result.rows_changed = _write_metrics(con, result.run_id, merged)
        con.execute("COMMIT")
    except BaseException:
        con.execute("ROLLBACK")
        raise
    result.run_registered = "inserted" if counts.inserted else "updated" if counts.updated else "unchanged"
    return result


def ingest_run_dir(con: duckdb.DuckDBPyConnection, run_dir: str | os.PathLike[str]) -> RunIngest:
    """Register one run directory in `runs` and merge all its metrics attempts into `metrics` (idempotent)."""
    path = Path(run_dir)
    if not path.is_dir():
        raise StoreError(f"run directory {path} does not exist")
    notes: list[str] = []
    row = run_row_from_dir(path, notes)
    result = _ingest(con, row, path, attempt_files(path))
    result.warnings[:0] = notes
    if not result.files:
        result.warnings.append(f"{path}: no metrics.jsonl yet (run registered, no metrics)")
    return result


def ingest_metrics_file(con: duckdb.DuckDBPyConnection, path: str | os.PathLike[str]) -> RunIngest:
    """Ingest a standalone verl file-logger file (outside the run-dir contract): run_id = the file's stem."""
    p = Path(path)
    row = {"run_id": p.stem, "run_dir": str(p.parent.resolve()), "sweep": p.parent.name}
    return _ingest(con, row, p.parent, [p])


_GLOB_CHARS = re.compile(r"[*?\[]")


def find_run_dirs(
    paths_or_globs: Iterable[str | os.PathLike[str]],
) -> tuple[list[Path], list[Path], list[str]]:
    """Resolve inputs to (run directories, standalone .jsonl files, inputs that matched nothing).

    A run directory is one holding config.yaml, status.json or metrics*.jsonl; a metrics*.jsonl path means
    its run directory; another .jsonl file is a standalone file-logger file; any other directory is
    searched for run directories below it.
    """
    run_dirs: dict[Path, None] = {}
    files: dict[Path, None] = {}
    unmatched: list[str] = []
    for item in paths_or_globs:
        text = os.fspath(item)
        matches = sorted(glob.glob(text, recursive=True)) if _GLOB_CHARS.search(text) else [text]
        found = False
        for m in matches:
            p = Path(m)
            if p.is_file():
                if is_attempt_file(p.name):
                    run_dirs[p.parent.resolve()] = None
                    found = True
                elif p.suffix == ".jsonl":
                    files[p.resolve()] = None
                    found = True
            elif is_run_dir(p):
                run_dirs[p.resolve()] = None
                found = True
            elif p.is_dir():
                for root, dirs, _ in os.walk(p):
                    dirs.sort()
                    here = Path(root)
                    if is_run_dir(here):
                        run_dirs[here.resolve()] = None
                        found = True
                        dirs.clear()  # a run's own folders (checkpoints/) hold no runs
        if not found:
            unmatched.append(text)
    return list(run_dirs), list(files), unmatched


def ingest_paths(
    con: duckdb.DuckDBPyConnection, paths_or_globs: Iterable[str | os.PathLike[str]]
) -> IngestSummary:
    """Ingest every run directory (and standalone metrics file) the inputs name; see find_run_dirs."""
    if isinstance(paths_or_globs, (str, os.PathLike)):
        paths_or_globs = [paths_or_globs]
    run_dirs, files, unmatched = find_run_dirs(paths_or_globs)
    summary = IngestSummary(unmatched=unmatched)
    for d in run_dirs:
        summary.runs.append(ingest_run_dir(con, d))
    for f in files:
        summary.runs.append(ingest_metrics_file(con, f))
    return summary
