"""What the database holds, as the reports and ``analysis.results`` read it: stored JSON objects, a study's rows,
and a run's curves (metric series, the AIME validation scores and their mean, by seed).

The one place that says which logged metrics make a run's validation accuracy (``val-core/<aime24 or 25>/acc/
mean@N``, N = 16 preferred) and how runs of one method are keyed for pairing (by seed, or by run id where seeds do
not identify them). The reports' figures and tables and ``analysis.results`` read curves through these functions.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from functools import cache
from typing import Any, Protocol, TypeVar

import duckdb
import numpy as np
import polars as pl

from analysis.store import table_exists
from analysis.training import stats as training_stats
from predmask import config, metrics

Series = tuple[np.ndarray, np.ndarray]  # (steps, values), sorted by step

AIME_RE = {
    "aime24": re.compile(r"aime[_-]?(?:20)?24", re.IGNORECASE),
    "aime25": re.compile(r"aime[_-]?(?:20)?25", re.IGNORECASE),
}
PREFERRED_AT_N = 16  # the paper's avg@16
T = TypeVar("T")


class RunKey(Protocol):
    """What pairing needs of a run (a reports ``RunInfo`` or a row of ``Results.runs``)."""

    @property
    def run_id(self) -> str: ...
    @property
    def method(self) -> str | None: ...
    @property
    def seed(self) -> int | None: ...


def json_object(text: Any) -> dict[str, Any]:
    """A stored JSON object (text, or already parsed); {} for anything else or unparsable text."""
    try:
        parsed = json.loads(text) if isinstance(text, str) else (text or {})
    except (TypeError, json.JSONDecodeError):
        return {}
    return parsed if isinstance(parsed, dict) else {}


def study_rows(con: duckdb.DuckDBPyConnection, table: str, study_id: str, order: str = "") -> pl.DataFrame:
    """One study's rows of a table keyed by ``study_id`` (ordered by the ``order`` columns), as stored; empty when
    the database has no such table yet."""
    if not table_exists(con, table):
        return pl.DataFrame()
    sql = f"SELECT * FROM {table} WHERE study_id = ?" + (f" ORDER BY {order}" if order else "")
    return con.sql(sql, params=[study_id]).pl()


def paper_model(model: str | None, run_config: Mapping[str, Any] | None = None) -> str | None:
    """The paper model a run's model stands for: the run config's ``model.stands_in_for``, else the
    ``stands_in_for`` of a ``backend: cpu`` model of conf/model; None for any other model."""
    model_cfg = run_config.get("model") if isinstance(run_config, Mapping) else None
    if isinstance(model_cfg, Mapping) and isinstance(model_cfg.get("stands_in_for"), str):
        return model_cfg["stands_in_for"]
    return _conf_stands_in_for(model) if model else None


@cache
def _conf_stands_in_for(model: str) -> str | None:
    if model not in config.group_options("model"):
        return None
    entry = config.group_entry("model", model)
    return entry.get("stands_in_for") if entry.get("backend") == "cpu" else None


def metric_series(
    con: duckdb.DuckDBPyConnection, run_ids: Sequence[str], names: Sequence[str]
) -> dict[tuple[str, str], Series]:
    """(run_id, name) -> (steps, values) for the given runs and metric names, steps ascending."""
    if not run_ids or not names or not table_exists(con, "metrics"):
        return {}
    cols = con.execute(
        "SELECT run_id, name, step, value FROM metrics WHERE run_id IN (SELECT unnest(?::VARCHAR[])) "
        "AND name IN (SELECT unnest(?::VARCHAR[])) ORDER BY run_id, name, step",
        [list(run_ids), list(names)],
    ).fetchnumpy()
    run_col, name_col = np.asarray(cols["run_id"], dtype=object), np.asarray(cols["name"], dtype=object)
    steps = np.asarray(cols["step"], dtype=np.int64)
    values = np.asarray(cols["value"], dtype=np.float64)
    out: dict[tuple[str, str], Series] = {}
    if len(steps) == 0:
        return out
    key = np.char.add(np.char.add(run_col.astype(str), "\x00"), name_col.astype(str))
    bounds = np.flatnonzero(key[1:] != key[:-1]) + 1
    for lo, hi in zip(np.r_[0, bounds], np.r_[bounds, len(key)]):
        out[(str(run_col[lo]), str(name_col[lo]))] = (steps[lo:hi], values[lo:hi])
    return out


def last_values(
    con: duckdb.DuckDBPyConnection, run_ids: Sequence[str], prefix: str
) -> dict[str, dict[str, float | None]]:
    """run_id -> {metric name: its value at the last step that logged it} for the names starting with prefix, in
    name order (runs without any are absent)."""
    if not run_ids or not table_exists(con, "metrics"):
        return {}
    rows = con.execute(
        "SELECT run_id, name, arg_max(value, step) FROM metrics WHERE run_id IN (SELECT unnest(?::VARCHAR[])) "
        "AND starts_with(name, ?) GROUP BY run_id, name ORDER BY run_id, name",
        [list(run_ids), prefix],
    ).fetchall()
    out: dict[str, dict[str, float | None]] = {}
    for run_id, name, value in rows:
        out.setdefault(run_id, {})[name] = value
    return out


def metric_names_by_run(
    con: duckdb.DuckDBPyConnection, run_ids: Sequence[str], prefix: str
) -> dict[str, list[str]]:
    """run_id -> distinct metric names starting with prefix (runs without any are absent)."""
    return {run_id: list(values) for run_id, values in last_values(con, run_ids, prefix).items()}


def aime_metric_names(names: Iterable[str]) -> dict[str, str]:
    """{'aime24': name, 'aime25': name} from val-core/<src>/acc/mean@N names; prefers N = 16, else the largest."""
    best: dict[str, tuple[int, str]] = {}
    for name in names:
        m = metrics.VAL_ACC_RE.match(name)  # a data source may contain "/"
        if not m:
            continue
        n = int(m.group("n"))
        rank = 10**6 if n == PREFERRED_AT_N else n
        for bench, pat in AIME_RE.items():
            if pat.search(m.group("source")) and (bench not in best or rank > best[bench][0]):
                best[bench] = (rank, name)
    return {bench: name for bench, (_, name) in best.items()}


def aime_series(con: duckdb.DuckDBPyConnection, run_ids: Sequence[str]) -> dict[str, dict[str, Series]]:
    """run_id -> {'aime24': series, 'aime25': series} for the benchmarks each run logged (names as
    ``aime_metric_names`` picks them)."""
    by_run = metric_names_by_run(con, run_ids, metrics.VAL_CORE_PREFIX)
    chosen = {rid: aime_metric_names(names) for rid, names in by_run.items()}
    raw = metric_series(con, run_ids, sorted({n for m in chosen.values() for n in m.values()}))
    return {
        rid: {bench: raw[(rid, name)] for bench, name in m.items() if (rid, name) in raw}
        for rid, m in chosen.items()
    }


def validation_series(aime: Mapping[str, Series]) -> Series | None:
    """A run's validation accuracy: the mean of its AIME24 and AIME25 scores on the steps where both were
    evaluated (None unless it logged both)."""
    if not {"aime24", "aime25"} <= set(aime):
        return None
    return training_stats.mean_on_common_steps(aime["aime24"], aime["aime25"])


def validation_by_run(con: duckdb.DuckDBPyConnection, run_ids: Sequence[str]) -> dict[str, Series]:
    """run_id -> validation accuracy (``validation_series``) for the runs with one on at least one step."""
    aime = aime_series(con, run_ids)
    return {rid: s for rid, a in aime.items() if (s := validation_series(a)) is not None and len(s[0])}


def by_method_and_seed(
    runs: Iterable[RunKey],
    series: Mapping[str, Series],
    rank: Callable[[str | None], Any] = lambda _method: 0,
) -> dict[str | None, dict[Hashable, Series]]:
    """method -> {seed: series} for the runs that have a series (by run_id), methods ordered by ``rank`` then name;
    a method's runs keyed as ``by_seed`` keys them (by run id where seeds do not identify them: runs of several
    sweeps), so nothing pairs by accident."""
    by_method: dict[str | None, list[RunKey]] = {}
    for run in sorted(runs, key=lambda r: (rank(r.method), r.method or "", r.seed or 0, r.run_id)):
        if run.run_id in series:
            by_method.setdefault(run.method, []).append(run)
    return {method: by_seed(members, series) for method, members in by_method.items()}


def by_seed(runs: Sequence[RunKey], values: Mapping[str, T]) -> dict[Hashable, T]:
    """seed -> the run's value (by run_id), in the runs' order; keyed by run id instead where a run has no seed or
    two runs share one, so nothing is merged."""
    seeds = [r.seed for r in runs]
    seeded = None not in seeds and len(set(seeds)) == len(seeds)
    return {(r.seed if seeded else r.run_id): values[r.run_id] for r in runs}
