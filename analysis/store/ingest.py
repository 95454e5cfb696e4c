"""Ingest of run directories and standalone metrics files into `runs` and `metrics` (idempotent, one run per transaction).

Nothing invalid is stored silently: each problem is one warning line naming the run (and the file and line), and a
count in the run's RunIngest and the IngestSummary. Corrupt lines, non-numeric and non-finite values and lines whose
step goes backwards are not stored (``metrics_files``); a run directory without a readable config.yaml is refused
(not registered); a "completed" run without any stored metric gets status ``empty``, a killed one ``dead``
(``runs``); a non-finite value stored by an older ingest is deleted when its run is ingested again. A verl run's
policy-loss metrics are replaced, step by step, by the exact values of its loss statistics (``exact_metrics``).
A variational-reasoning `weights` stage run (config ``family: variational``, ``stage: weights``) also stores its
weights.parquet in `vr_traces` (``vr_tables``); a missing or malformed file is one warning, the run stays registered.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from analysis.store.connection import StoreError, fetch_one
from analysis.store.exact_metrics import exact_step_metrics
from analysis.store.inputs import find_run_dirs
from analysis.store.metrics_files import parse_metrics_file
from analysis.store.runs import EMPTY, RunRefusedError, run_row_from_dir, upsert_runs
from analysis.store.vr_tables import ingest_vr_traces, is_weights_stage
from predmask.progress import progress
from predmask.rundir import DEAD, METRICS_FILE, attempt_files, merge_attempts

__all__ = [
    "IngestSummary",
    "RunIngest",
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
    rows_removed: int = 0  # non-finite values an older ingest stored
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
    def rows_removed(self) -> int:
        return sum(r.rows_removed for r in self.runs)

    @property
    def nonfinite_values(self) -> int:
        return sum(r.nonfinite_values for r in self.runs)

    @property
    def backward_lines(self) -> int:
        return sum(r.backward_lines for r in self.runs)

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
            + (f"; {self.rows_removed} non-finite value(s) of an earlier ingest removed" if self.rows_removed else "")
        )


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


def _remove_nonfinite(con: duckdb.DuckDBPyConnection, run_id: str) -> int:
    row = fetch_one(con, "SELECT count(*) FROM metrics WHERE run_id = ? AND NOT isfinite(value)", [run_id])
    if row and row[0]:
        con.execute("DELETE FROM metrics WHERE run_id = ? AND NOT isfinite(value)", [run_id])
    return int(row[0]) if row else 0


def _overlay_exact(result: RunIngest, merged: dict[tuple[int, str], float]) -> None:
    """Replace verl's policy-loss values by the exact ones of the run's loss statistics, for the steps verl logged."""
    try:
        exact = exact_step_metrics(result.run_dir)
    except ValueError as exc:  # a corrupt statistics line: verl's values stay, the run is warned about
        result.skipped_lines += 1
        result.warnings.append(f"run {result.run_id}: {exc}; the exact loss statistics are not used")
        return
    logged = {step for step, _ in merged}
    for step, values in exact.items():
        if step not in logged:  # verl never logged the step (a crash mid-step): not added
            continue
        bad = [f"{name}={value}" for name, value in values.items() if not math.isfinite(value)]
        if bad:
            result.nonfinite_values += len(bad)
            result.warnings.append(f"run {result.run_id}: loss statistics of step {step}: non-finite value(s) "
                                   f"{', '.join(bad)} not stored")
        merged.update({(step, name): value for name, value in values.items() if math.isfinite(value)})


def _ingest(
    con: duckdb.DuckDBPyConnection, run_row: dict[str, Any], run_dir: Path, files: list[Path], exact: bool = False
) -> RunIngest:
    """Store one run's row and metrics in one transaction; ``exact``: overlay its loss statistics (run dirs)."""
    run_id = run_row["run_id"]
    result = RunIngest(run_id=run_id, run_dir=run_dir, files=files)
    parsed = [parse_metrics_file(p) for p in files]
    for pf in parsed:
        result.lines += pf.lines
        result.skipped_lines += pf.skipped_lines
        result.skipped_values += pf.skipped_values
        result.nonfinite_values += pf.nonfinite_values
        result.backward_lines += pf.backward_lines
        result.warnings.extend(f"run {run_id}: {w}" for w in pf.warnings)
    merged = merge_attempts(pf.rows for pf in parsed)
    if exact:
        _overlay_exact(result, merged)
    result.metric_rows = len(merged)
    if run_row.get("status") == "completed" and not merged:
        run_row = {**run_row, "status": EMPTY}
        result.warnings.append(f"run {run_id}: status.json says completed but no metrics file holds a valid line: "
                               f"stored as status '{EMPTY}'")
    result.status = run_row.get("status")
    con.execute("BEGIN TRANSACTION")
    try:
        counts = upsert_runs(con, [run_row])
        result.rows_added, result.rows_changed = _write_metrics(con, run_id, merged)
        result.rows_removed = _remove_nonfinite(con, run_id)
        con.execute("COMMIT")
    except BaseException:
        con.execute("ROLLBACK")
        raise
    result.run_registered = "inserted" if counts.inserted else "updated" if counts.updated else "unchanged"
    return result


def _ingest_traces(con: duckdb.DuckDBPyConnection, result: RunIngest, run_dir: Path, seed: int | None) -> None:
    """The weights stage's traces into `vr_traces`; a missing or malformed file is a warning (nothing written)."""
    try:
        written = ingest_vr_traces(con, run_dir, result.run_id, seed)
    except FileNotFoundError as exc:
        result.warnings.append(f"run {result.run_id}: {exc}; no traces stored (rerun the weights stage, then ingest)")
        return
    except (ValueError, OSError, duckdb.Error) as exc:
        result.skipped_lines += 1
        result.warnings.append(f"run {result.run_id}: traces not stored: {str(exc).splitlines()[0]}")
        return
    result.vr_traces, result.vr_traces_changed = written.rows, written.changed


def ingest_run_dir(con: duckdb.DuckDBPyConnection, run_dir: str | os.PathLike[str]) -> RunIngest:
    """Register one run directory in `runs` and merge all its metrics attempts into `metrics` (idempotent).

    A run directory without a readable config.yaml is refused: the result has ``run_registered == "refused"`` and
    ``refused`` (one line, also the only warning), and nothing is stored.
    """
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
    """Ingest every run directory (and standalone metrics file) the inputs name; see find_run_dirs.

    ``show_progress``: follow the runs with ``predmask.progress`` (a bar in a terminal, else plain lines on stdout).
    """
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
