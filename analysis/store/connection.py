"""Opening the results database (one writer, any number of readers; waiting a bounded time for the file's lock),
what to run when it is missing, and small query helpers (its default path: ``predmask.rundir.default_db_path``)."""

from __future__ import annotations

import contextlib
import errno
import os
import random
import re
import shlex
import tempfile
import time
from collections.abc import Iterator, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import duckdb

from analysis.store.inputs import find_run_dirs
from analysis.store.schema import schema_ddl
from predmask.command_text import STUDY, command, sweep_command, with_db
from predmask.rundir import db_or_default, default_db_path, first_line, runs_root

#: seconds to wait for the database's lock (a writer waits for readers and for another writer, a reader for a
#: writer); $PREDMASK_DB_WAIT replaces both defaults, the ``wait_s`` argument of ``connect`` replaces that
DB_WAIT_ENV = "PREDMASK_DB_WAIT"
WRITE_WAIT_S = 30.0
READ_WAIT_S = 10.0
_FIRST_SLEEP_S, _MAX_SLEEP_S = 0.05, 1.0
_HOLDER_RE = re.compile(r"Conflicting lock is held in (.+?) \(PID (\d+)\)")
#: bytes 8..11 of every DuckDB database file (after the header's checksum)
_DUCKDB_MAGIC, _MAGIC_AT = b"DUCK", 8
#: every connection's settings: a file's contents never make DuckDB load or download an extension (no network, no
#: code from data); the store needs none
DUCKDB_CONFIG: dict[str, str | bool | int | float | list[str]] = {
    "autoload_known_extensions": False,
    "autoinstall_known_extensions": False,
}
_KNOWN_HEADS = ((b"SQLite format 3\x00", "a SQLite database"), (b"PK\x03\x04", "a zip file"),
                (b"PAR1", "a Parquet file"))


def _given(db: str | os.PathLike[str] | None) -> Path | None:
    """``db`` when it is not the default database (commands then need ``--db``), else None."""
    if db is None:
        return None
    return None if Path(db).resolve() == default_db_path().resolve() else Path(db)


def paper_command(db: str | os.PathLike[str] | None = None, study_id: str | None = None) -> str:
    """The command that draws the figures and tables from the database: the next step after storing results
    (``--db`` only for a database other than the default one, ``--study`` only when given)."""
    study = "" if study_id is None else f" --study {shlex.quote(study_id)}"
    return with_db(command(f"reports paper{study}"), _given(db))


def missing_db_hint(db: str | os.PathLike[str] | None = None, root: Path | None = None) -> str:
    """What to run when the database ``db`` has nothing yet: ingest the run directories under ``root``
    (default: the runs root) if any, else a sweep or the token-level study first; then the report."""
    root = runs_root() if root is None else root
    given = _given(db)
    run_dirs = find_run_dirs([root])[0] if root.is_dir() else []
    report = paper_command(db)
    if run_dirs:
        ingest = with_db(command(f"analysis ingest {shlex.quote(str(root))}"), given)
        many = "y" if len(run_dirs) == 1 else "ies"
        return f"{root} holds {len(run_dirs)} run director{many} not in the database: {ingest}, then {report}"
    return (
        f"nothing has run yet: first {with_db(sweep_command('smoke'), given)} (a few minutes on CPU) or "
        f"{with_db(sweep_command('main_comparison'), given)} (the main comparison), or the token-level study "
        f"{with_db(command(STUDY), given)}; then {report}"
    )


class StoreError(RuntimeError):
    """A one-line, user-facing problem with the results store (missing file, lock held, bad input)."""


def _what_file(head: bytes) -> str:
    """What a file that is not DuckDB looks like, from its first bytes."""
    if not head:
        return "an empty file"
    return next((what for magic, what in _KNOWN_HEADS if head.startswith(magic)), "a file of another kind")


def check_duckdb_file(db: Path) -> None:
    """Raise StoreError (one line) unless the existing file ``db`` starts as a DuckDB database file does:
    checked before DuckDB opens any results database, which would guess another file's format and reach for an
    extension."""
    try:
        with db.open("rb") as f:
            head = f.read(max(_MAGIC_AT + len(_DUCKDB_MAGIC), 16))
    except OSError as exc:
        raise StoreError(f"cannot read results database {db}: {exc.strerror or exc}") from None
    if head[_MAGIC_AT:_MAGIC_AT + len(_DUCKDB_MAGIC)] != _DUCKDB_MAGIC:
        raise StoreError(
            f"{db} exists but is not a DuckDB database (it is {_what_file(head)}; expected a *.duckdb file the store "
            "wrote); move it away or choose another --db path"
        )


_DISK_FULL = ("no space left", "disk is full", "disk full", "quota exceeded")
_READ_ONLY = ("read-only file system", "read only file system", "permission denied", "cannot open file")


def storage_error(exc: BaseException, db: str | os.PathLike[str] | Path) -> StoreError:
    """A storage failure (an OSError, a DuckDB IO, transaction or rollback error) while writing ``db``, as one
    line naming the file and the remedy; the database keeps what its last committed transaction holds."""
    text = (exc.strerror or str(exc)) if isinstance(exc, OSError) else first_line(exc)
    low = str(exc).lower()
    code = exc.errno if isinstance(exc, OSError) else None
    if code in (errno.ENOSPC, errno.EDQUOT) or any(k in low for k in _DISK_FULL):
        remedy = (f"the disk holding {db} is full: free space there (or choose another --db path), then rerun the "
                  "same command")
    elif code in (errno.EROFS, errno.EACCES, errno.EPERM) or any(k in low for k in _READ_ONLY):
        remedy = (f"{db} or its folder is not writable: fix its permissions or mount (or choose another --db path), "
                  "then rerun the same command")
    else:
        remedy = (f"check the disk and the file {db} (or choose another --db path), then rerun the same command")
    return StoreError(f"cannot write results database {db} ({type(exc).__name__}: {text}); {remedy}; what was "
                      "stored before stays")


def check_db_path(path: str | os.PathLike[str]) -> None:
    """Raise StoreError (one line) unless a writer could use ``path`` as the results database: not a
    directory; if it exists, a writable DuckDB file; else its nearest existing ancestor is a writable folder.
    Takes no DuckDB lock and leaves nothing behind, so it can run before any work starts and beside a process
    holding the database.
    """
    db = Path(path)
    if db.is_dir():
        raise StoreError(
            f"results database path {db} is a directory; give a file path such as {db / 'predmask.duckdb'}"
        )
    if db.exists():
        if not db.is_file():
            raise StoreError(f"results database path {db} is not a regular file; give a *.duckdb file path")
        check_duckdb_file(db)
        try:  # opened for writing and closed at once: changes nothing, takes no DuckDB lock
            with db.open("r+b"):
                pass
        except OSError as exc:
            raise StoreError(
                f"results database {db} is not writable ({exc.strerror or exc}); fix its permissions or choose "
                "another --db path"
            ) from None
        return
    parent = db.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise StoreError(f"cannot create results database {db}: {parent} is a file, not a folder")
    try:  # a real probe (permission bits say nothing to root, nor of read-only or virtual file systems)
        os.rmdir(tempfile.mkdtemp(prefix=".predmask-probe-", dir=parent))
    except OSError as exc:
        raise StoreError(
            f"cannot create results database {db}: folder {parent} is not writable ({exc.strerror or exc}); "
            "choose another --db path"
        ) from None


def ensure_schema(con: duckdb.DuckDBPyConnection) -> None:
    """Create every table of the results store that does not exist yet and add the weight columns an older
    `vr_traces` lacks (never drops)."""
    for ddl in schema_ddl():
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


def _connect_once(db: Path, read_only: bool) -> duckdb.DuckDBPyConnection:
    """duckdb.connect with DUCKDB_CONFIG; when this process already holds the file through a connection opened
    without it (DuckDB refuses a second configuration for one open file), a plain connection to that instance."""
    try:
        return duckdb.connect(str(db), read_only=read_only, config=DUCKDB_CONFIG)
    except duckdb.ConnectionException as exc:
        if "different configuration" not in str(exc):
            raise
        return duckdb.connect(str(db), read_only=read_only)


def _no_extensions(con: duckdb.DuckDBPyConnection) -> duckdb.DuckDBPyConnection:
    """DUCKDB_CONFIG set on the database instance too, before any statement runs (a no-op when it was opened with
    it; otherwise it covers the instance another connection of this process opened)."""
    for key, value in DUCKDB_CONFIG.items():
        con.execute(f"SET {key} = {str(value).lower()}")
    return con


def _open(db: Path, read_only: bool, wait_s: float) -> duckdb.DuckDBPyConnection:
    """duckdb.connect, retried with jittered exponential backoff for up to wait_s seconds while the lock is held."""
    deadline = time.monotonic() + wait_s
    sleep = _FIRST_SLEEP_S
    while True:
        try:
            return _no_extensions(_connect_once(db, read_only))
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

    While another process holds the file it retries for up to ``wait_s`` seconds (DB_WAIT_ENV). Raises
    StoreError (one line) when a read-only database is missing, when a writer's path fails ``check_db_path``,
    or when the lock is still held after the wait (naming the holder's pid when DuckDB says it).
    """
    db = db_or_default(path)
    bound = _wait_bound(read_only, wait_s)
    if read_only:
        if not db.exists():
            raise StoreError(f"results database {db} does not exist: {missing_db_hint(db)}")
        if not db.is_file():
            check_db_path(db)  # names what the path is instead
        check_duckdb_file(db)
    else:
        check_db_path(db)
        try:
            db.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise storage_error(exc, db) from exc
    try:
        con = _open(db, read_only, bound)
    except duckdb.Error as exc:
        if _is_lock_error(exc):
            raise StoreError(
                f"results database {db} is in use by {_holder(exc)} (only one writer at a time, no reader "
                f"beside a writer); gave up after {bound:g} s (${DB_WAIT_ENV} sets the wait)"
            ) from exc
        if not read_only:
            raise storage_error(exc, db) from exc
        raise StoreError(f"cannot open results database {db}: {first_line(exc)}") from exc
    if not read_only:
        try:
            ensure_schema(con)
        except (OSError, duckdb.Error) as exc:
            con.close()
            raise storage_error(exc, db) from exc
    return con


def utcnow() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None, microsecond=0)


@contextlib.contextmanager
def transaction(con: duckdb.DuckDBPyConnection) -> Iterator[None]:
    """The block in one transaction: committed at its end, rolled back when anything in it (the commit
    included) raises; the block's error is the one raised (DuckDB invalidates a connection after a failed
    write to a full disk: it cannot roll back, and has nothing to keep)."""
    con.execute("BEGIN TRANSACTION")
    try:
        yield
        con.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(duckdb.Error):
            con.execute("ROLLBACK")
        raise


@contextlib.contextmanager
def registered(con: duckdb.DuckDBPyConnection, name: str, table: Any) -> Iterator[None]:
    """``table`` (an Arrow table) visible to the block's SQL as ``name``."""
    con.register(name, table)
    try:
        yield
    finally:
        con.unregister(name)


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
