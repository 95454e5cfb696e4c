"""The `runs` table: idempotent upserts of run rows, and the row a run directory describes (read through
``predmask.rundir``; its status corrected to ``dead`` or ``empty`` as docs/results.md says). `run_sweeps`: the
sweeps whose folders hold a run (``record_sweep``, ``run_sweeps``); a run's `runs` row keeps the newest
ingest's sweep.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import duckdb

from analysis.store.connection import StoreError, fetch_one, table_exists, utcnow
from analysis.store.schema import RUN_COLUMNS
from predmask.rundir import (
    CONFIG_FILE,
    DEAD,
    JOB_LOG_FILE,
    LOG_FILE,
    StatusError,
    first_line,
    read_config,
    read_job_record,
    read_status,
    run_status,
)

#: the stored status of a run whose status.json says "completed" but whose metrics files hold no valid line
EMPTY = "empty"


class RunRefusedError(StoreError):
    """A run directory that ingest does not register (no readable config.yaml): one line, naming the run."""


@dataclass(frozen=True)
class UpsertCounts:
    """How many rows an upsert inserted, changed, and found already identical."""

    inserted: int = 0
    updated: int = 0
    unchanged: int = 0


def canonical_config(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"runs.config must be a mapping or JSON text, got invalid JSON: {exc}") from exc
    return json.dumps(value, sort_keys=True, default=str)


def upsert_config_row(con: duckdb.DuckDBPyConnection, table: str, key_column: str, key: str,
                      config: Any) -> str:
    """Insert or update the ``(key, config, created_at)`` row of an analysis's parent table (a token-level study,
    an accuracy-weighting analysis) inside the caller's transaction: ``inserted``, ``updated`` (the stored config
    differed) or ``unchanged``. A None config never replaces a stored one."""
    cfg_text = canonical_config(config)
    stored = fetch_one(con, f"SELECT config FROM {table} WHERE {key_column} = ?", [key])
    if stored is None:
        con.execute(f"INSERT INTO {table} ({key_column}, config, created_at) VALUES (?, ?, ?)", [key, cfg_text, utcnow()])
        return "inserted"
    if cfg_text is not None and cfg_text != stored[0]:
        con.execute(f"UPDATE {table} SET config = ? WHERE {key_column} = ?", [cfg_text, key])
        return "updated"
    return "unchanged"


def _normalise_run_row(row: Mapping[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(row) - set(RUN_COLUMNS))
    if unknown:
        raise ValueError(f"unknown runs column(s) {unknown}; allowed: {list(RUN_COLUMNS)}")
    run_id = row.get("run_id")
    if not isinstance(run_id, str) or not run_id:
        raise ValueError(f"every runs row needs a non-empty string run_id, got {run_id!r}")
    out = dict(row)
    if "config" in out:
        out["config"] = canonical_config(out["config"])
    if out.get("delta") is not None:
        out["delta"] = float(out["delta"])
    if out.get("seed") is not None:
        out["seed"] = int(out["seed"])
    for key in ("job_id", "log_path", "run_dir"):
        if out.get(key) is not None:
            out[key] = str(out[key])
    for key in ("created_at", "updated_at"):
        value = out.get(key)
        if isinstance(value, (int, float)):
            out[key] = datetime.fromtimestamp(value, timezone.utc).replace(tzinfo=None)
    return out


def upsert_runs(con: duckdb.DuckDBPyConnection, rows: Iterable[Mapping[str, Any]]) -> UpsertCounts:
    """Insert or update `runs` rows by run_id; a None/absent field keeps the stored value. created_at is kept
    once set; updated_at changes only when another field changed (given value, else now). Rows of one run_id
    merge in order (later fields win)."""
    merged: dict[str, dict[str, Any]] = {}
    for row in rows:
        norm = _normalise_run_row(row)
        merged.setdefault(norm["run_id"], {}).update({k: v for k, v in norm.items() if v is not None})
    if not merged:
        return UpsertCounts()
    cols = list(RUN_COLUMNS)
    inserted = updated = unchanged = 0
    now = utcnow()
    for run_id, new in merged.items():
        found = fetch_one(con, f"SELECT {', '.join(cols)} FROM runs WHERE run_id = ?", [run_id])
        if found is None:
            rec = {c: new.get(c) for c in cols}
            rec["created_at"] = rec["created_at"] or now
            rec["updated_at"] = rec["updated_at"] or rec["created_at"]
            con.execute(
                f"INSERT INTO runs ({', '.join(cols)}) VALUES ({', '.join('?' for _ in cols)})",
                [rec[c] for c in cols],
            )
            inserted += 1
            continue
        old = dict(zip(cols, found))
        changes = {
            c: v
            for c, v in new.items()
            if c not in ("run_id", "created_at", "updated_at") and v is not None and v != old[c]
        }
        if old["created_at"] is None and new.get("created_at") is not None:
            changes["created_at"] = new["created_at"]
        if not changes:
            unchanged += 1
            continue
        changes["updated_at"] = new.get("updated_at") or now
        assignments = ", ".join(f"{c} = ?" for c in changes)
        con.execute(f"UPDATE runs SET {assignments} WHERE run_id = ?", [*changes.values(), run_id])
        updated += 1
    return UpsertCounts(inserted, updated, unchanged)


def record_sweep(con: duckdb.DuckDBPyConnection, row: Mapping[str, Any]) -> None:
    """Record in `run_sweeps` that the sweep of the run row ``row`` (``run_row_from_dir``'s) holds the run, in the
    caller's transaction, before ``upsert_runs`` writes the row: idempotent, the run's other sweeps kept, the sweep
    its stored `runs` row names too (a database written before `run_sweeps` has only that one)."""
    con.execute(
        "INSERT INTO run_sweeps (run_id, sweep, run_dir) SELECT run_id, sweep, run_dir FROM runs "
        "WHERE run_id = ? AND sweep IS NOT NULL ON CONFLICT DO NOTHING",
        [row["run_id"]],
    )
    if row.get("sweep") is not None:
        con.execute(
            "INSERT INTO run_sweeps (run_id, sweep, run_dir) VALUES (?, ?, ?) "
            "ON CONFLICT (run_id, sweep) DO UPDATE SET run_dir = excluded.run_dir",
            [row["run_id"], row["sweep"], None if row.get("run_dir") is None else str(row["run_dir"])],
        )


def run_sweeps(con: duckdb.DuckDBPyConnection) -> dict[str, tuple[str, ...]]:
    """run_id -> the sweeps that hold the run, sorted: each sweep whose folder ingest found it in (`run_sweeps`) and
    its `runs` row's sweep (all that a database written before `run_sweeps` says). The one answer to "which sweeps
    hold this run" and "the runs of sweep S" (a run shared by two sweeps is a run of each)."""
    if not table_exists(con, "runs"):
        return {}
    held = "SELECT run_id, sweep FROM run_sweeps UNION " if table_exists(con, "run_sweeps") else ""
    rows = con.execute(
        f"SELECT run_id, sweep FROM ({held}SELECT run_id, sweep FROM runs) "
        "WHERE sweep IS NOT NULL AND run_id IN (SELECT run_id FROM runs) ORDER BY run_id, sweep"
    ).fetchall()
    out: dict[str, tuple[str, ...]] = {}
    for run_id, sweep in rows:
        out[run_id] = (*out.get(run_id, ()), sweep)
    return out


def _name_of(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("name"), str):
        return value["name"]
    return None


def _backend_of(cfg: Mapping[str, Any]) -> str | None:
    cluster = cfg.get("cluster")
    if isinstance(cluster, Mapping) and isinstance(cluster.get("backend"), str):
        return cluster["backend"]
    name = _name_of(cluster)
    if name is not None:
        return "local" if name == "local" else "slurm"
    model = cfg.get("model")
    if isinstance(model, Mapping) and model.get("stands_in_for"):
        return "local"
    return None


def run_row_from_dir(run_dir: Path, notes: list[str] | None = None) -> dict[str, Any]:
    """The `runs` row that a run directory describes (docs/results.md, "What ingest stores"). Raises
    RunRefusedError when config.yaml is missing or unreadable; a broken status.json or a dead writer is
    reported in ``notes``."""
    notes = notes if notes is not None else []
    row: dict[str, Any] = {"run_id": run_dir.name, "run_dir": str(run_dir.resolve())}
    cfg_path = run_dir / CONFIG_FILE
    if not cfg_path.is_file():
        raise RunRefusedError(f"run {run_dir.name}: {run_dir} has no {CONFIG_FILE}, run refused (not registered)")
    try:
        cfg = read_config(cfg_path)
    except Exception as exc:  # noqa: BLE001 - any unreadable config refuses the run, in one line
        raise RunRefusedError(
            f"run {run_dir.name}: {cfg_path} is unreadable ({first_line(exc)}), run refused (not registered)"
        ) from None
    method = cfg.get("method")
    delta = method.get("delta") if isinstance(method, Mapping) else None
    delta = delta if isinstance(delta, (int, float)) and not isinstance(delta, bool) else cfg.get("delta")
    row.update(
        sweep=_name_of(cfg.get("sweep")) or run_dir.parent.name,
        method=_name_of(method),
        delta=delta if isinstance(delta, (int, float)) and not isinstance(delta, bool) else None,
        model=_name_of(cfg.get("model")),
        precision=_name_of(cfg.get("precision")),
        seed=cfg.get("seed") if isinstance(cfg.get("seed"), int) else None,
        backend=_backend_of(cfg),
        config=cfg,
    )
    try:
        status = read_status(run_dir)
    except StatusError as exc:
        notes.append(f"{exc}, not used")
        status = {}
    if isinstance(status.get("status"), str):
        row["status"] = run_status(run_dir, status["status"])
        if row["status"] == DEAD:
            notes.append(f"run {run_dir.name}: status.json says running but no process holds its lock "
                         f"(the trainer was killed): stored as status '{DEAD}'")
    job_id = status.get("job_id")
    if job_id is None:
        job_id = read_job_record(run_dir).get("job_id")
    if job_id is not None:
        row["job_id"] = str(job_id)
    if isinstance(status.get("updated"), (int, float)):
        row["updated_at"] = float(status["updated"])
    log = next((p for p in (run_dir / JOB_LOG_FILE, run_dir / LOG_FILE) if p.is_file()), None)
    if log is not None:
        row["log_path"] = str(log.resolve())
    return row
