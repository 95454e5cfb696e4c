"""The results store: DuckDB schema, connections, idempotent ingest of run directories and token-level rows.

One process writes the database (ingest, sweeps through this package, the token-level study's final write);
every reader opens it read-only. Opening waits a bounded time while another process holds the file
(``connect``'s ``wait_s``, $PREDMASK_DB_WAIT), then raises StoreError naming the holder's pid: a caller that
must not fail (a sweep) catches it and ingests later. Every write here is idempotent. What ingest stores and
refuses: docs/results.md ("What ingest stores"); the run directory's files: ``predmask.rundir``. A file
reaches DuckDB only after its first bytes say DuckDB (``check_duckdb_file``), on a connection with extension
autoloading and autoinstalling off: a file's contents never reach the network.
"""

from analysis.store.connection import (
    StoreError,
    check_db_path,
    connect,
    default_db_path,
    ensure_schema,
    missing_db_hint,
    paper_command,
    table_exists,
)
from analysis.store.ingest import IngestSummary, ingest_paths, ingest_run_dir
from analysis.store.runs import EMPTY, run_sweeps, upsert_runs
from analysis.store.schema import RUN_COLUMNS, STUDY_RESULT_KEYS, vr_trace_columns
from analysis.store.token_level_tables import stored_seeds, upsert_grid, upsert_token_level
from analysis.store.vr_tables import upsert_accuracy_weighting

#: the names the project's commands, reports and tests take from the store (each module keeps its others)
__all__ = [
    "EMPTY",
    "RUN_COLUMNS",
    "STUDY_RESULT_KEYS",
    "IngestSummary",
    "StoreError",
    "check_db_path",
    "connect",
    "default_db_path",
    "ensure_schema",
    "ingest_paths",
    "ingest_run_dir",
    "missing_db_hint",
    "paper_command",
    "run_sweeps",
    "stored_seeds",
    "table_exists",
    "upsert_accuracy_weighting",
    "upsert_grid",
    "upsert_runs",
    "upsert_token_level",
    "vr_trace_columns",
]
