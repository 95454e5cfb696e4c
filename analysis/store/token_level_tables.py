"""The token-level study's tables: idempotent upserts of a study's config, per-seed rows and token rows with the
study-level results derived from all its stored tokens (``STUDY_RESULT_KEYS``), and the drift grid's table
(``token_level_grid``: which study each cell of a grid is)."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import duckdb
import pyarrow as pa

from analysis.store.connection import registered, table_columns, table_exists, transaction, utcnow
from analysis.store.runs import canonical_config, upsert_config_row
from analysis.store.schema import GRID_COLUMNS, STUDY_RESULT_KEYS

Frame = Any  # a pyarrow Table or a polars DataFrame (anything with .to_arrow())
#: a study's stored token rows (all its seeds) -> its study-level result tables (names of STUDY_RESULT_KEYS)
Derive = Callable[[pa.Table], Mapping[str, Frame]]


@dataclass(frozen=True)
class TokenLevelWrite:
    """What upsert_token_level wrote: the study row, seed rows, token rows, and the rows of each study-level
    table."""

    study: str  # inserted | updated | unchanged
    seeds: int
    tokens: int
    added_columns: tuple[str, ...] = ()
    derived: Mapping[str, int] = field(default_factory=dict)


_IDENT_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _to_arrow(frame: Frame | None) -> pa.Table | None:
    if frame is None:
        return None
    if isinstance(frame, pa.Table):
        return frame
    if hasattr(frame, "to_arrow"):
        return frame.to_arrow()
    raise TypeError(f"expected a pyarrow Table or a polars DataFrame, got {type(frame).__name__}")


def _with_study_id(table: pa.Table, study_id: str, what: str) -> pa.Table:
    if "study_id" in table.column_names:
        values = set(table.column("study_id").to_pylist())
        if values - {study_id}:
            raise ValueError(
                f"{what}: study_id column holds {sorted(map(str, values))}, expected only {study_id!r}"
            )
        return table
    return table.append_column("study_id", pa.array([study_id] * table.num_rows, pa.string()))


def _check_unique(table: pa.Table, keys: Sequence[str], what: str) -> None:
    cols = [table.column(k).to_pylist() for k in keys]
    seen: set[tuple[Any, ...]] = set()
    for key in zip(*cols):
        if key in seen:
            raise ValueError(f"{what}: duplicate rows for {dict(zip(keys, key))}")
        seen.add(key)


def _replace_rows(
    con: duckdb.DuckDBPyConnection, table_name: str, study_id: str, table: pa.Table, *, by_seed: bool
) -> tuple[str, ...]:
    """Add columns the frame has and the table lacks, delete the frame's seeds (``by_seed``) or every row of the
    study, insert the frame by name; returns the columns added."""
    bad = [c for c in table.column_names if not _IDENT_RE.match(c)]
    if bad:
        raise ValueError(
            f"{table_name}: column names must be identifiers ([A-Za-z_][A-Za-z0-9_]*), got {bad}"
        )
    added: list[str] = []
    with registered(con, "_predmask_frame", table):
        have = set(table_columns(con, table_name))
        for name, kind, *_ in con.execute("DESCRIBE SELECT * FROM _predmask_frame").fetchall():
            if name not in have:
                con.execute(f'ALTER TABLE {table_name} ADD COLUMN "{name}" {kind}')
                added.append(name)
        which = " AND seed IN (SELECT DISTINCT seed FROM _predmask_frame)" if by_seed else ""
        con.execute(f"DELETE FROM {table_name} WHERE study_id = ?{which}", [study_id])
        con.execute(f"INSERT INTO {table_name} BY NAME SELECT * FROM _predmask_frame")
    return tuple(added)


def _derive(con: duckdb.DuckDBPyConnection, study_id: str, derive: Derive) -> dict[str, int]:
    """Rewrite the study's rows of every table ``derive`` returns from the study's stored tokens (all its seeds)."""
    tokens = con.sql(
        "SELECT * FROM token_level_tokens WHERE study_id = ? ORDER BY seed, sequence, position",
        params=[study_id],
    ).to_arrow_table()
    written: dict[str, int] = {}
    for name, frame in derive(tokens).items():
        if name not in STUDY_RESULT_KEYS:
            raise ValueError(f"unknown study-level table {name!r}; valid: {', '.join(STUDY_RESULT_KEYS)}")
        table = _with_study_id(_to_arrow(frame), study_id, name)
        keys = list(STUDY_RESULT_KEYS[name])
        missing = [k for k in keys if k not in table.column_names]
        if missing:
            raise ValueError(f"{name}: the derived rows lack the key columns {missing}")
        _check_unique(table, keys, name)
        _replace_rows(con, name, study_id, table, by_seed=False)
        written[name] = table.num_rows
    return written


def upsert_token_level(
    con: duckdb.DuckDBPyConnection,
    study_id: str,
    config: Mapping[str, Any] | str | None,
    seed_rows: Frame | None,
    token_rows: Frame | None,
    derive: Derive | None = None,
) -> TokenLevelWrite:
    """Store one token-level study's config and the rows of some of its seeds (idempotent, one transaction).

    seed_rows / token_rows: frames with SEED_COLUMNS / TOKEN_COLUMNS names (study_id optional; columns not in
    the schema are added). Every seed present in a frame replaces that seed's stored rows; duplicate (seed) or
    (seed, sequence, position) keys inside a frame raise ValueError. ``derive``: when rows of some seed were
    written, it is given the study's stored token rows (all its seeds) and returns the study-level result
    tables (``STUDY_RESULT_KEYS``) whose rows of this study it replaces, in the same transaction.
    """
    if not isinstance(study_id, str) or not study_id:
        raise ValueError(f"study_id must be a non-empty string, got {study_id!r}")
    seeds = _to_arrow(seed_rows)
    tokens = _to_arrow(token_rows)
    if seeds is not None:
        if "seed" not in seeds.column_names:
            raise ValueError("seed_rows needs a 'seed' column")
        seeds = _with_study_id(seeds, study_id, "seed_rows")
        _check_unique(seeds, ["seed"], "seed_rows")
    if tokens is not None:
        missing = [c for c in ("seed", "position") if c not in tokens.column_names]
        if missing:
            raise ValueError(f"token_rows needs columns {missing}")
        tokens = _with_study_id(tokens, study_id, "token_rows")
        keys = ["seed", "sequence", "position"] if "sequence" in tokens.column_names else ["seed", "position"]
        _check_unique(tokens, keys, "token_rows")
    added: tuple[str, ...] = ()
    given = (("token_level_seeds", seeds), ("token_level_tokens", tokens))
    frames = {name: frame for name, frame in given if frame is not None and frame.num_rows}
    with transaction(con):
        study = upsert_config_row(con, "token_level_studies", "study_id", study_id, config)
        for name, frame in frames.items():
            added += _replace_rows(con, name, study_id, frame, by_seed=True)
        derived = _derive(con, study_id, derive) if derive is not None and frames else {}
    if added:
        warnings.warn(f"token-level tables gained columns {list(added)}", stacklevel=2)
    return TokenLevelWrite(
        study=study,
        seeds=seeds.num_rows if seeds is not None else 0,
        tokens=tokens.num_rows if tokens is not None else 0,
        added_columns=added,
        derived=derived,
    )


def stored_seeds(con: duckdb.DuckDBPyConnection, study_id: str) -> set[int]:
    """The seeds of a study already in token_level_seeds (a rerun skips them)."""
    rows = con.execute("SELECT seed FROM token_level_seeds WHERE study_id = ?", [study_id]).fetchall()
    return {int(r[0]) for r in rows}


def upsert_grid(con: duckdb.DuckDBPyConnection, grid_id: str, rows: Sequence[Mapping[str, Any]]) -> int:
    """Store the cells of one drift grid, replacing its rows (idempotent: a stored cell keeps its
    ``created_at``). ``rows``: mappings with the GRID_COLUMNS keys but ``grid_id`` and ``created_at``."""
    if not isinstance(grid_id, str) or not grid_id:
        raise ValueError(f"grid_id must be a non-empty string, got {grid_id!r}")
    keys = [k for k in GRID_COLUMNS if k not in ("grid_id", "created_at")]
    for row in rows:
        missing = [k for k in keys if k not in row]
        if missing:
            raise ValueError(f"grid row {dict(row)} lacks {missing}")
    studies = [str(r["study_id"]) for r in rows]
    if len(set(studies)) != len(studies):
        raise ValueError(f"grid {grid_id}: a study id appears in more than one cell ({sorted(studies)})")
    with transaction(con):
        created = dict(
            con.execute(
                "SELECT study_id, created_at FROM token_level_grid WHERE grid_id = ?", [grid_id]
            ).fetchall()
        )
        con.execute("DELETE FROM token_level_grid WHERE grid_id = ?", [grid_id])
        now = utcnow()
        insert = f"INSERT INTO token_level_grid ({', '.join(GRID_COLUMNS)}) VALUES ({', '.join('?' * len(GRID_COLUMNS))})"
        for row in rows:
            cell = {**row, "params": canonical_config(row["params"])}
            con.execute(insert, [grid_id, *(cell[k] for k in keys), created.get(str(row["study_id"]), now)])
    return len(rows)


def grid_cells(con: duckdb.DuckDBPyConnection, grid_id: str | None = None) -> Any:
    """The cells of ``grid_id`` (default: the grid stored last) as a polars frame ordered by cell, with each cell's
    stored seed count (``n_seeds``); empty when no grid is stored. Raises ValueError for an unknown id."""
    import polars as pl

    if not table_exists(con, "token_level_grid"):  # a database written before the grid existed
        if grid_id is not None:
            raise ValueError(f"unknown grid {grid_id!r}; no grid is stored")
        return pl.DataFrame()
    grids = [
        r[0]
        for r in con.execute(
            "SELECT grid_id FROM token_level_grid GROUP BY grid_id ORDER BY max(created_at) DESC, grid_id"
        ).fetchall()
    ]
    if grid_id is None:
        if not grids:
            return pl.DataFrame()
        grid_id = grids[0]
    elif grid_id not in grids:
        raise ValueError(f"unknown grid {grid_id!r}; stored: {', '.join(grids) or 'none'}")
    count = (
        "(SELECT count(*) FROM token_level_seeds s WHERE s.study_id = g.study_id)"
        if table_exists(con, "token_level_seeds")
        else "0"
    )
    return con.sql(
        f"SELECT g.*, {count} AS n_seeds FROM token_level_grid g WHERE grid_id = ? ORDER BY cell",
        params=[grid_id],
    ).pl()
