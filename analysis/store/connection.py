"""Opening the results database (one writer, any number of readers), its default path, and small query helpers."""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import duckdb

from analysis.store.schema import SCHEMA_DDL

__all__ = [
    "DB_ENV",
    "DEFAULT_DB_RELPATH",
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


def connect(path: str | os.PathLike[str] | None = None, read_only: bool = False) -> duckdb.DuckDBPyConnection:
    """Open the results database; a writer creates the parent folder and the schema, a reader needs the file.

    Raises StoreError (one line) when a read-only database is missing or another process holds the lock.
    """
    db = Path(path) if path is not None else default_db_path()
    if read_only:
        if not db.is_file():
            raise StoreError(
                f"results database {db} does not exist: ingest runs first (python -m analysis ingest runs)"
            )
    else:
        db.parent.mkdir(parents=True, exist_ok=True)
    try:
        con = duckdb.connect(str(db), read_only=read_only)
    except duckdb.IOException as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if "lock" in first.lower():
            raise StoreError(
                f"results database {db} is in use by another process (only one writer at a time): {first}"
            ) from exc
        raise StoreError(f"cannot open results database {db}: {first}") from exc
    except duckdb.Error as exc:
        raise StoreError(f"cannot open results database {db}: {str(exc).splitlines()[0]}") from exc
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
