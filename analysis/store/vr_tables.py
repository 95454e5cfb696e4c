"""The variational family's tables: ingest of a `weights` stage run's traces into `vr_traces`, and idempotent upserts
of the accuracy-weighting analysis (``accuracy_weighting``, ``accuracy_weighting_analyses``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from analysis.store.connection import registered, transaction
from analysis.store.runs import upsert_config_row
from analysis.store.schema import ACCURACY_WEIGHTING_COLUMNS, vr_trace_columns

_AW_KEY = ("source", "method", "question")


@dataclass(frozen=True)
class AccuracyWeightingWrite:
    """What upsert_accuracy_weighting wrote: the analysis row (inserted | updated | unchanged) and its rows."""

    analysis: str
    rows: int
    changed: bool


def is_weights_stage(config: Mapping[str, Any]) -> bool:
    """Whether a run config is a variational-reasoning `weights` stage (``family: variational``, ``stage: weights``)."""
    return config.get("family") == "variational" and config.get("stage") == "weights"


def _sorted_rows(table: pa.Table, columns: Sequence[str], key: Sequence[str]) -> list[tuple[Any, ...]]:
    rows = list(zip(*(table.column(c).to_pylist() for c in columns))) if table.num_rows else []
    index = [columns.index(k) for k in key]
    return sorted(rows, key=lambda r: tuple(r[i] for i in index))


def _same(old: list[tuple[Any, ...]], new: list[tuple[Any, ...]]) -> bool:
    """Whether two row lists are equal, NaN equal to NaN."""
    if len(old) != len(new):
        return False
    for a, b in zip(old, new):
        for x, y in zip(a, b):
            if isinstance(x, float) and isinstance(y, float):
                if not (x == y or (math.isnan(x) and math.isnan(y))):
                    return False
            elif x != y:
                return False
    return True


def _replace_if_changed(
    con: duckdb.DuckDBPyConnection,
    table: str,
    where: tuple[str, str],
    columns: Sequence[str],
    key: Sequence[str],
    new: list[tuple[Any, ...]],
    insert: Callable[[], None],
) -> bool:
    """Replace the rows of ``table`` whose column ``where[0]`` is ``where[1]`` (``insert`` writes the new
    ones) unless they equal ``new`` (sorted by ``key``) already; whether they changed."""
    column, value = where
    select = f"SELECT {', '.join(columns)} FROM {table} WHERE {column} = ? ORDER BY {', '.join(key)}"
    old = con.execute(select, [value]).fetchall()
    if _same([tuple(r) for r in old], new):
        return False
    con.execute(f"DELETE FROM {table} WHERE {column} = ?", [value])
    insert()
    return True


def _vr_table(path: Path, run_id: str, seed: int | None) -> pa.Table:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    wanted = [c for c in vr_trace_columns() if c not in ("run_id", "seed")]
    missing = [c for c in wanted if c not in table.column_names]
    if missing:
        raise ValueError(f"{path} lacks the column(s) {', '.join(missing)}; a weights stage writes {', '.join(wanted)}")
    arrays = {
        "run_id": pa.array([run_id] * table.num_rows, pa.string()),
        "seed": pa.array([seed] * table.num_rows, pa.int32()),
    }
    for c in wanted:
        arrays[c] = table.column(c)
    out = pa.table(arrays)
    keys = list(zip(out.column("question").to_pylist(), out.column("trace").to_pylist()))
    if len(set(keys)) != len(keys):
        raise ValueError(f"{path}: a (question, trace) pair appears more than once; each trace is one row")
    return out


def ingest_vr_traces(
    con: duckdb.DuckDBPyConnection, run_dir: Path, run_id: str, seed: int | None
) -> tuple[int, bool]:
    """Replace the `vr_traces` rows of ``run_id`` by the run's weights.parquet (one transaction; idempotent):
    the file's rows and whether the table changed.

    Raises FileNotFoundError when the file is missing and ValueError when it lacks a column; nothing is written then.
    The file's name is the stage's own (``predmask.rl.vr_runner.WEIGHTS_FILE``; imported here, as it loads torch)."""
    from predmask.rl.vr_runner import WEIGHTS_FILE

    path = Path(run_dir) / WEIGHTS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist (the weights stage has not written it yet)")
    table = _vr_table(path, run_id, seed)
    columns = list(vr_trace_columns())
    key = ("question", "trace")

    def insert() -> None:
        with registered(con, "_predmask_vr", table):
            names = ", ".join(columns)
            con.execute(f"INSERT INTO vr_traces ({names}) SELECT {names} FROM _predmask_vr")

    with transaction(con):
        changed = _replace_if_changed(con, "vr_traces", ("run_id", run_id), columns, key,
                                      _sorted_rows(table, columns, key), insert)
    return table.num_rows, changed


def upsert_accuracy_weighting(
    con: duckdb.DuckDBPyConnection,
    analysis_id: str,
    config: Mapping[str, Any] | str | None,
    rows: Sequence[Mapping[str, Any]],
) -> AccuracyWeightingWrite:
    """Store one accuracy-weighting analysis: its config row and all its rows, replacing what the id held (idempotent).

    ``rows``: mappings with the ACCURACY_WEIGHTING_COLUMNS keys but ``analysis_id`` (measured_weight may be None);
    a duplicate (source, method, question) raises ValueError and nothing is written."""
    if not isinstance(analysis_id, str) or not analysis_id:
        raise ValueError(f"analysis_id must be a non-empty string, got {analysis_id!r}")
    columns = [c for c in ACCURACY_WEIGHTING_COLUMNS if c != "analysis_id"]
    for row in rows:
        missing = [c for c in columns if c not in row]
        if missing:
            raise ValueError(f"accuracy_weighting row {dict(row)} lacks {missing}")
        if row["source"] not in ("model", "bandit"):
            raise ValueError(f"accuracy_weighting source {row['source']!r} is not allowed; allowed: model, bandit")
    keys = [tuple(r[k] for k in _AW_KEY) for r in rows]
    if len(set(keys)) != len(keys):
        dup = next(k for k in keys if keys.count(k) > 1)
        raise ValueError(f"accuracy_weighting rows repeat (source, method, question) = {dup}")
    new = sorted(
        (tuple(None if v is None else (float(v) if isinstance(v, float) else v) for v in (r[c] for c in columns))
         for r in rows),
        key=lambda r: tuple(r[columns.index(k)] for k in _AW_KEY),
    )
    insert = (f"INSERT INTO accuracy_weighting (analysis_id, {', '.join(columns)}) "
              f"VALUES ({', '.join('?' * (len(columns) + 1))})")
    with transaction(con):
        analysis = upsert_config_row(con, "accuracy_weighting_analyses", "analysis_id", analysis_id, config)
        changed = _replace_if_changed(
            con, "accuracy_weighting", ("analysis_id", analysis_id), columns, _AW_KEY, new,
            lambda: con.executemany(insert, [[analysis_id, *r] for r in new]),
        )
    return AccuracyWeightingWrite(analysis=analysis, rows=len(rows), changed=changed)
