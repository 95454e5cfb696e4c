"""Ingest of run directories and standalone metrics files into `runs`, `run_sweeps` (the sweep whose folder holds
the run: a run two sweeps share belongs to both) and `metrics` (idempotent, one run per transaction).

What is stored and refused, each problem one warning line and a count: docs/results.md ("What ingest stores").
A run's stored metrics are made equal to its files (rows no longer in them are deleted in the same
transaction); files stream through DuckDB in batches, so memory does not grow with a file. A verl run's
policy-loss metrics are replaced by the exact values of its loss statistics (``exact_metrics``); a variational
`weights` stage run also stores its weights.parquet in `vr_traces` (``vr_tables``).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from analysis.store.connection import StoreError, fetch_one, registered, storage_error, transaction
from analysis.store.exact_metrics import exact_step_metrics
from analysis.store.inputs import find_run_dirs
from analysis.store.metrics_files import FileCounts, iter_file_values
from analysis.store.runs import EMPTY, RunRefusedError, record_sweep, run_row_from_dir, upsert_runs
from analysis.store.vr_tables import ingest_vr_traces, is_weights_stage
from predmask.progress import progress
from predmask.rundir import DEAD, METRICS_FILE, attempt_files, first_line


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
    rows_removed: int = 0  # stored rows no longer in the run's files (fewer steps, non-finite values of an older ingest)
    skipped_lines: int = 0  # corrupt lines
    skipped_values: int = 0  # non-numeric values (null, text, ...)
    nonfinite_values: int = 0  # NaN, Infinity, -Infinity: not stored
    backward_lines: int = 0  # lines whose step goes backwards: refused
    status: str | None = None  # the status stored (dead / empty when corrected)
    run_registered: str = "unchanged"  # inserted | updated | unchanged | refused
    refused: str | None = None  # why the run was refused (not registered, nothing stored)
    vr_traces: int = 0  # rows of a variational weights stage's weights.parquet (in `vr_traces`)
    vr_traces_changed: bool = False
    warnings: list[str] = field(default_factory=list)

    @property
    def flagged_status(self) -> bool:
        """Whether the stored status corrects the run's status.json (dead or empty)."""
        return self.status in (DEAD, EMPTY)


def _total(counter: str) -> Any:
    """A property of IngestSummary: the runs' ``counter`` summed."""
    return property(lambda self: sum(getattr(r, counter) for r in self.runs), doc=f"{counter}, summed over the runs")


@dataclass
class IngestSummary:
    """The result of ingest_paths: one RunIngest per run, and the inputs that matched nothing."""

    runs: list[RunIngest] = field(default_factory=list)
    unmatched: list[str] = field(default_factory=list)
    rows_added = _total("rows_added")
    rows_changed = _total("rows_changed")
    rows_removed = _total("rows_removed")
    skipped_lines = _total("skipped_lines")
    skipped_values = _total("skipped_values")
    nonfinite_values = _total("nonfinite_values")
    backward_lines = _total("backward_lines")

    @property
    def refused(self) -> list[RunIngest]:
        return [r for r in self.runs if r.refused is not None]

    @property
    def flagged_runs(self) -> list[RunIngest]:
        """Runs stored with a corrected status (dead, empty)."""
        return [r for r in self.runs if r.flagged_status]

    @property
    def problems(self) -> int:
        """Everything not stored as written: corrupt lines, non-finite values, backward lines, refused runs and
        corrected statuses (non-numeric values such as null are the file-logger's own way to say "no value")."""
        return (self.skipped_lines + self.nonfinite_values + self.backward_lines + len(self.refused)
                + len(self.flagged_runs))

    @property
    def warnings(self) -> list[str]:
        return [w for r in self.runs for w in r.warnings]

    def totals_line(self) -> str:
        """The one-line summary of an ingest: runs, rows, and a count of each kind of problem."""
        return (
            f"{len(self.runs) - len(self.refused)} run(s) ingested, {len(self.refused)} refused; "
            f"{self.rows_added} metric rows added, {self.rows_changed} changed; {self.skipped_lines} corrupt "
            f"line(s) and {self.backward_lines} line(s) with a step going backwards skipped; "
            f"{self.nonfinite_values} non-finite and {self.skipped_values} non-numeric value(s) not stored; "
            f"{len(self.flagged_runs)} run(s) stored as dead or empty"
            + (f"; {self.rows_removed} stored row(s) no longer in the runs' files (or non-finite) removed"
               if self.rows_removed else "")
        )


#: rows per batch moved from the parser into DuckDB: the Python side holds one batch, never a whole file
BATCH_ROWS = 50_000
_STAGED = "_predmask_staged"  # temp table: every stored row of every source, (step, name, value, source)
_FINAL = "_predmask_final"  # temp table: one row per (step, name), the latest source winning
_BATCH = "_predmask_batch"
#: DuckDB's memory while a run is ingested: beyond it the staged rows and joins spill to the database's .tmp folder
INGEST_MEMORY_LIMIT = "512MB"


@contextlib.contextmanager
def _memory_bound(con: duckdb.DuckDBPyConnection) -> Iterator[None]:
    """INGEST_MEMORY_LIMIT for the block, the instance's own limit after it (kept when it cannot be lowered)."""
    row = fetch_one(con, "SELECT current_setting('memory_limit')")
    try:
        con.execute(f"SET memory_limit = '{INGEST_MEMORY_LIMIT}'")
    except duckdb.Error:  # the instance holds more than the bound now: it keeps its limit
        row = None
    try:
        yield
    finally:
        if row:
            with contextlib.suppress(duckdb.Error):
                con.execute(f"SET memory_limit = '{row[0]}'")


def _step_groups(rows: Iterable[tuple[int, str, float]]) -> Iterator[tuple[int, dict[str, float]]]:
    """A file's rows merged per step, the last write winning: a file's steps never go backwards (``metrics_files``
    refuses such lines), so one step's rows are consecutive and one step is held at a time."""
    step: int | None = None
    values: dict[str, float] = {}
    for s, name, value in rows:
        if s != step:
            if step is not None:
                yield step, values
            step, values = s, {}
        values[name] = value
    if step is not None:
        yield step, values


def _insert_batch(con: duckdb.DuckDBPyConnection, rows: list[tuple[int, str, float]], source: int) -> None:
    if not rows:
        return
    steps, names, values = zip(*rows)
    batch = pa.table({"step": pa.array(steps, pa.int64()), "name": pa.array(names, pa.string()),
                      "value": pa.array(values, pa.float64())})
    with registered(con, _BATCH, batch):
        con.execute(f"INSERT INTO {_STAGED} SELECT step, name, value, {int(source)} FROM {_BATCH}")


def _stage_source(con: duckdb.DuckDBPyConnection, rows: Iterable[tuple[int, str, float]], source: int) -> None:
    """One source's rows into the staged table, in batches of BATCH_ROWS."""
    batch: list[tuple[int, str, float]] = []
    for step, by_name in _step_groups(rows):
        batch += [(step, name, value) for name, value in by_name.items()]
        if len(batch) >= BATCH_ROWS:
            _insert_batch(con, batch, source)
            batch = []
    _insert_batch(con, batch, source)


def _stage(con: duckdb.DuckDBPyConnection, result: RunIngest, exact: bool) -> int:
    """Stream the run's files (oldest attempt first) into the staged table and merge them by (step, name), the latest
    attempt winning, then the exact loss statistics over verl's values; returns the number of rows to store."""
    con.execute(f"CREATE OR REPLACE TEMP TABLE {_STAGED} (step BIGINT, name VARCHAR, value DOUBLE, source INTEGER)")
    for source, path in enumerate(result.files):
        counts = FileCounts(path)
        _stage_source(con, iter_file_values(path, counts), source)
        for counter in ("lines", "skipped_lines", "skipped_values", "nonfinite_values", "backward_lines"):
            setattr(result, counter, getattr(result, counter) + getattr(counts, counter))
        result.warnings.extend(f"run {result.run_id}: {w}" for w in counts.warnings)
    sources = len(result.files)
    if exact and _overlay_exact(con, result, sources):
        sources += 1
    if sources > 1:  # one file has one row per (step, name) already
        con.execute(f"CREATE OR REPLACE TEMP TABLE {_FINAL} AS SELECT step, name, arg_max(value, source) AS value "
                    f"FROM {_STAGED} GROUP BY step, name")
        con.execute(f"DROP TABLE {_STAGED}")
    else:
        con.execute(f"ALTER TABLE {_STAGED} RENAME TO {_FINAL}")
    row = fetch_one(con, f"SELECT count(*) FROM {_FINAL}")
    return int(row[0]) if row else 0


def _overlay_exact(con: duckdb.DuckDBPyConnection, result: RunIngest, source: int) -> bool:
    """Stage the exact values of the run's loss statistics as the last source, for the steps verl logged (a step verl
    never logged, a crash mid-step, is not added); whether any was staged."""
    try:
        exact = exact_step_metrics(result.run_dir)
    except ValueError as exc:  # a corrupt statistics line: verl's values stay, the run is warned about
        result.skipped_lines += 1
        result.warnings.append(f"run {result.run_id}: {exc}; the exact loss statistics are not used")
        return False
    if not exact:
        return False
    wanted = pa.table({"step": pa.array(sorted(exact), pa.int64())})
    with registered(con, _BATCH, wanted):
        logged = {r[0] for r in con.execute(f"SELECT DISTINCT s.step FROM {_STAGED} s JOIN {_BATCH} w USING (step)")
                  .fetchall()}
    rows: list[tuple[int, str, float]] = []
    for step in sorted(logged):
        values = exact[step]
        bad = [f"{name}={value}" for name, value in values.items() if not math.isfinite(value)]
        if bad:
            result.nonfinite_values += len(bad)
            result.warnings.append(f"run {result.run_id}: loss statistics of step {step}: non-finite value(s) "
                                   f"{', '.join(bad)} not stored")
        rows += [(step, name, value) for name, value in values.items() if math.isfinite(value)]
    _stage_source(con, rows, source)
    return bool(rows)


def _write_metrics(con: duckdb.DuckDBPyConnection, run_id: str) -> tuple[int, int, int]:
    """Make the run's `metrics` rows equal the final staged rows: (added, changed, removed); changed rows are
    deleted, then inserted with the rest."""
    mine = "(SELECT step, name, value FROM metrics WHERE run_id = ?)"
    added, changed = fetch_one(
        con,
        "SELECT count(*) FILTER (WHERE m.step IS NULL), "
        "count(*) FILTER (WHERE m.step IS NOT NULL AND m.value IS DISTINCT FROM i.value) "
        f"FROM {_FINAL} i LEFT JOIN {mine} m ON m.step = i.step AND m.name = i.name",
        [run_id],
    ) or (0, 0)
    row = fetch_one(con, f"SELECT count(*) FROM {mine} m ANTI JOIN {_FINAL} i ON i.step = m.step AND i.name = m.name",
                    [run_id])
    removed = int(row[0]) if row else 0
    if removed or changed:  # every row not stored as the files say now: gone from them, or another value
        con.execute(
            f"DELETE FROM metrics WHERE run_id = ? AND NOT EXISTS (SELECT 1 FROM {_FINAL} i WHERE i.step = "
            "metrics.step AND i.name = metrics.name AND i.value IS NOT DISTINCT FROM metrics.value)",
            [run_id],
        )
    if added or changed:
        con.execute(
            f"INSERT INTO metrics (run_id, step, name, value) SELECT ?, i.step, i.name, i.value FROM {_FINAL} i "
            f"ANTI JOIN {mine} m ON m.step = i.step AND m.name = i.name",
            [run_id, run_id],
        )
    return int(added), int(changed), removed


def _db_file(con: duckdb.DuckDBPyConnection) -> str:
    """The file of the connection's database, for messages."""
    try:
        row = fetch_one(con, "SELECT path FROM duckdb_databases() WHERE database_name = current_database()")
    except duckdb.Error:
        row = None
    return str(row[0]) if row and row[0] else "the results database"


def _ingest(
    con: duckdb.DuckDBPyConnection, run_row: dict[str, Any], run_dir: Path, files: list[Path], exact: bool = False
) -> RunIngest:
    """Store one run's row and make its metrics equal its files, in one transaction; ``exact``: overlay its loss
    statistics (run dirs). A storage failure rolls the run back and raises StoreError (``storage_error``)."""
    run_id = run_row["run_id"]
    result = RunIngest(run_id=run_id, run_dir=run_dir, files=files)
    db = _db_file(con)
    try:
        with _memory_bound(con):
            result.metric_rows = _stage(con, result, exact)
            if run_row.get("status") == "completed" and not result.metric_rows:
                run_row = {**run_row, "status": EMPTY}
                result.warnings.append(f"run {run_id}: status.json says completed but no metrics file holds a valid "
                                       f"line: stored as status '{EMPTY}'")
            result.status = run_row.get("status")
            with transaction(con):
                record_sweep(con, run_row)
                counts = upsert_runs(con, [run_row])
                result.rows_added, result.rows_changed, result.rows_removed = _write_metrics(con, run_id)
    except (OSError, duckdb.Error) as exc:
        if isinstance(exc, OSError) and exc.filename is not None and Path(exc.filename) != Path(db):
            raise  # a run file that cannot be read: the caller's
        raise storage_error(exc, db) from exc
    finally:
        for table in (_STAGED, _FINAL):
            with contextlib.suppress(duckdb.Error):
                con.execute(f"DROP TABLE IF EXISTS {table}")
    result.run_registered = "inserted" if counts.inserted else "updated" if counts.updated else "unchanged"
    return result


def _ingest_traces(con: duckdb.DuckDBPyConnection, result: RunIngest, run_dir: Path, seed: int | None) -> None:
    """The weights stage's traces into `vr_traces`; a missing or malformed file is a warning (nothing written)."""
    try:
        result.vr_traces, result.vr_traces_changed = ingest_vr_traces(con, run_dir, result.run_id, seed)
    except FileNotFoundError as exc:
        result.warnings.append(f"run {result.run_id}: {exc}; no traces stored (rerun the weights stage, then ingest)")
    except (ValueError, OSError, duckdb.Error) as exc:
        result.skipped_lines += 1
        result.warnings.append(f"run {result.run_id}: traces not stored: {first_line(exc)}")


def ingest_run_dir(con: duckdb.DuckDBPyConnection, run_dir: str | os.PathLike[str]) -> RunIngest:
    """Register one run directory in `runs` and merge all its metrics attempts into `metrics` (idempotent);
    one without a readable config.yaml is refused (``run_registered == "refused"``, ``refused``: one line),
    nothing stored."""
    path = Path(run_dir)
    if not path.is_dir():
        raise StoreError(f"run directory {path} does not exist")
    notes: list[str] = []
    try:
        row = run_row_from_dir(path, notes)
    except RunRefusedError as exc:
        why = str(exc)
        return RunIngest(run_id=path.name, run_dir=path, files=attempt_files(path), run_registered="refused",
                         refused=why, warnings=[why])
    result = _ingest(con, row, path, attempt_files(path), exact=True)
    result.warnings[:0] = notes
    if isinstance(row.get("config"), dict) and is_weights_stage(row["config"]):
        _ingest_traces(con, result, path, row.get("seed"))
    if not result.files:
        result.warnings.append(f"run {path.name}: {path} has no {METRICS_FILE} yet (run registered, no metrics)")
    return result


def ingest_metrics_file(con: duckdb.DuckDBPyConnection, path: str | os.PathLike[str]) -> RunIngest:
    """Ingest a standalone verl file-logger file (outside the run-dir contract): run_id = the file's stem."""
    p = Path(path)
    row = {"run_id": p.stem, "run_dir": str(p.parent.resolve()), "sweep": p.parent.name}
    return _ingest(con, row, p.parent, [p])


def ingest_paths(
    con: duckdb.DuckDBPyConnection,
    paths_or_globs: Iterable[str | os.PathLike[str]],
    *,
    show_progress: bool = False,
) -> IngestSummary:
    """Ingest every run directory (and standalone metrics file) the inputs name (``find_run_dirs``);
    ``show_progress``: follow the runs with ``predmask.progress``."""
    if isinstance(paths_or_globs, (str, os.PathLike)):
        paths_or_globs = [paths_or_globs]
    run_dirs, files, unmatched = find_run_dirs(paths_or_globs)
    summary = IngestSummary(unmatched=unmatched)
    work = [(d, ingest_run_dir) for d in run_dirs] + [(f, ingest_metrics_file) for f in files]
    if not show_progress or not work:
        summary.runs += [ingest_one(con, path) for path, ingest_one in work]
        return summary
    with progress("ingest", len(work), unit="runs", stream=sys.stdout) as bar:
        for path, ingest_one in work:
            summary.runs.append(ingest_one(con, path))
            bar.advance(status=summary.runs[-1].run_id)
    return summary
