"""Opening the results database (one writer, any number of readers; waiting a bounded time for the file's lock),
its default path, and small query helpers."""

from __future__ import annotations

import os
import random
import re
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import duckdb

from analysis.store.schema import SCHEMA_DDL

__all__ = [
    "DB_ENV",
    "DB_WAIT_ENV",
    "DEFAULT_DB_RELPATH",
    "READ_WAIT_S",
    "WRITE_WAIT_S",
    "StoreError",
    "connect",
    "default_db_path",
    "ensure_schema",
    "fetch_one",
    "table_columns",
    "table_exists",
    "utcnow",
]

DB_ENV = "PREDMASK_DB"
DEFAULT_DB_RELPATH = Path("results") / "predmask.duckdb"
#: seconds to wait for the database's lock (a writer waits for readers and for another writer, a reader for a
#: writer); $PREDMASK_DB_WAIT replaces both defaults, the ``wait_s`` argument of ``connect`` replaces that
DB_WAIT_ENV = "PREDMASK_DB_WAIT"
WRITE_WAIT_S = 30.0
READ_WAIT_S = 10.0
_FIRST_SLEEP_S, _MAX_SLEEP_S = 0.05, 1.0
_HOLDER_RE = re.compile(r"Conflicting lock is held in (.+?) \(PID (\d+)\)")


class StoreError(RuntimeError):
    """A one-line, user-facing problem with the results store (missing file, lock held, bad input)."""


def default_db_path() -> Path:
    """$PREDMASK_DB if set, else results/predmask.duckdb under the current directory."""
    env = os.environ.get(DB_ENV)
    return Path(env) if env else Path.cwd() / DEFAULT_DB_RELPATH


def ensure_schema(con: duckdb.DuckDBPyConnection) -> None:
    """Create every table of the results store that does not exist yet (never drops or alters)."""
    for ddl in SCHEMA_DDL:
        con.execute(ddl)


def _wait_bound(read_only: bool, wait_s: float | None) -> float:
    if wait_s is None:
        env = os.environ.get(DB_WAIT_ENV)
        if env is None:
            return READ_WAIT_S if read_only else WRITE_WAIT_S
        try:
            wait_s = float(env)
        except ValueError:
            raise StoreError(f"${DB_WAIT_ENV}={env!r} is not a number of seconds (>= 0)") from None
    if not wait_s >= 0:  # also NaN
        raise StoreError(f"the database wait must be a number of seconds >= 0, got {wait_s!r}")
    return wait_s


def _is_lock_error(exc: duckdb.Error) -> bool:
    return isinstance(exc, duckdb.IOException) and "could not set lock" in str(exc).lower()


def _holder(exc: duckdb.Error) -> str:
    m = _HOLDER_RE.search(str(exc))
    return f"pid {m.group(2)} ({m.group(1)})" if m else "another process"


def _open(db: Path, read_only: bool, wait_s: float) -> duckdb.DuckDBPyConnection:
    """duckdb.connect, retried with jittered exponential backoff for up to wait_s seconds while the lock is held."""
    deadline = time.monotonic() + wait_s
    sleep = _FIRST_SLEEP_S
    while True:
        try:
            return duckdb.connect(str(db), read_only=read_only)
        except duckdb.Error as exc:
            left = deadline - time.monotonic()
            if not _is_lock_error(exc) or left <= 0:
                raise
            time.sleep(min(left, random.uniform(sleep / 2, sleep)))
            sleep = min(2 * sleep, _MAX_SLEEP_S)


def connect(
    path: str | os.PathLike[str] | None = None, read_only: bool = False, wait_s: float | None = None
) -> duckdb.DuckDBPyConnection:
    """Open the results database; a writer creates the parent folder and the schema, a reader needs the file.

    While another process holds the file (a reader blocks writers, a writer blocks everyone) it retries with a
    jittered backoff for up to ``wait_s`` seconds (default: $PREDMASK_DB_WAIT, else WRITE_WAIT_S for a writer and
    READ_WAIT_S for a reader). Raises StoreError (one line) when a read-only database is missing, or when the lock
    is still held after the wait (naming the holder's pid when DuckDB says it).
    """
    db = Path(path) if path is not None else default_db_path()
    bound = _wait_bound(read_only, wait_s)
    if read_only:
        if not db.is_file():
            raise StoreError(
                f"results database {db} does not exist: ingest runs first (python -m analysis ingest runs)"
            )
    else:
        db.parent.mkdir(parents=True, exist_ok=True)
    try:
        con = _open(db, read_only, bound)
    except duckdb.Error as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if _is_lock_error(exc):
            raise StoreError(
                f"results database {db} is in use by {_holder(exc)} (only one writer at a time, no reader "
                f"beside a writer); gave up after {bound:g} s (${DB_WAIT_ENV} sets the wait)"
            ) from exc
        raise StoreError(f"cannot open results database {db}: {first}") from exc
    if not read_only:
        ensure_schema(con)
    return con


def utcnow() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None, microsecond=0)


def fetch_one(con: duckdb.DuckDBPyConnection, sql: str, params: Sequence[Any] = ()) -> tuple[Any, ...] | None:
    """The first row of a query (or None), with the result fully consumed (DuckDB 2 refuses new work otherwise)."""
    rows = con.execute(sql, list(params)).fetchall()
    return rows[0] if rows else None


def table_exists(con: duckdb.DuckDBPyConnection, name: str) -> bool:
    """Whether the database has table ``name`` (a read-only connection to an older file may lack one)."""
    row = fetch_one(con, "SELECT count(*) FROM information_schema.tables WHERE table_name = ?", [name])
    return bool(row and row[0])


def table_columns(con: duckdb.DuckDBPyConnection, table: str) -> list[str]:
    rows = con.execute(
        "SELECT column_name FROM information_schema.columns WHERE table_name = ? ORDER BY ordinal_position",
        [table],
    ).fetchall()
    return [r[0] for r in rows]
