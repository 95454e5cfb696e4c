"""The results store: DuckDB schema, connections, idempotent ingest of run directories and token-level rows.

One process writes the database (ingest, sweeps through this package, the token-level study's final write);
every reader opens it read-only. Opening waits a bounded time while another process holds the file (a writer for
readers and another writer, a reader for a writer; ``connect``'s ``wait_s``, $PREDMASK_DB_WAIT), then raises
StoreError naming the holder's pid: a caller that must not fail (a sweep) catches it and ingests later. Every write here is idempotent: ingesting the same files again, or
upserting the same rows again, leaves the database unchanged.

Run directory contract (runs/<sweep>/<run_id>/, owned by ``predmask.rundir``: its files, its one metrics parser and
step rule, its attempts): config.yaml (resolved run config), status.json, and the verl file-logger lines
``{"step": N, "data": {name: value}}``, earlier attempts kept as ``metrics.attempt-<n>.jsonl`` and merged by step,
the latest attempt winning. Ingest is the only builder of a run's `runs` row, and records in `run_sweeps` every
sweep whose folder holds the run (run ids are config hashes: two sweeps can share a run; ``run_sweeps`` answers
which sweeps hold a run, for every reader). Ingest stores nothing invalid silently (``ingest``): bad lines and
values are skipped, a run without config.yaml is refused, each with one warning line and a count; killed and empty
runs get the statuses ``dead`` and ``empty``. Ingest makes a run's stored metrics equal its files (rows of steps
gone from them are removed in the same transaction), streaming each file through DuckDB in batches. A storage
failure (disk full, read-only, DuckDB's IO and transaction errors) is one StoreError line naming the file and the
remedy (``storage_error``); the database keeps its last committed state.

The database is handed to DuckDB only after its first bytes say DuckDB (``check_duckdb_file``, readers and writers),
and every connection has DuckDB's extension autoloading and autoinstalling off: a file's contents never reach the
network.

A writer's path is checked before any work starts (``check_db_path``: not a folder, a DuckDB file if it exists,
a writable place), without opening the file.

Parts: ``schema`` (tables), ``connection`` (open, default path, path check, what to run next), ``runs`` (the `runs`
rows, the sweeps holding each run), ``metrics_files`` (file-logger records into the values stored), ``inputs``
(which inputs are run directories), ``ingest`` (run directories into `runs`, `run_sweeps` and `metrics`),
``token_level_tables`` (the token-level study's rows and the study-level results derived from them),
``vr_tables`` (`vr_traces` from a variational weights stage, the accuracy-weighting analysis's rows).
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
from analysis.store.schema import RUN_COLUMNS, STUDY_RESULT_KEYS, VR_TRACE_COLUMNS
from analysis.store.token_level_tables import stored_seeds, upsert_grid, upsert_token_level
from analysis.store.vr_tables import upsert_accuracy_weighting

#: the names the project's commands, reports and tests take from the store (each module keeps its others)
__all__ = [
    "EMPTY",
    "RUN_COLUMNS",
    "STUDY_RESULT_KEYS",
    "VR_TRACE_COLUMNS",
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
]
