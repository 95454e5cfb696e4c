"""The results store: DuckDB schema, connections, idempotent ingest of run directories and token-level rows.

One process writes the database (ingest, sweeps through this module, the token-level study's final write);
every reader opens it read-only. Every write here is idempotent: ingesting the same files again, or
upserting the same rows again, leaves the database unchanged.

Run directory contract (runs/<sweep>/<run_id>/): config.yaml (resolved run config), status.json, and the
verl file-logger lines ``{"step": N, "data": {name: value}}``. verl opens its file with "wb", so a restarted
run would overwrite it; the launcher keeps earlier attempts as ``metrics.attempt-<n>.jsonl``. Attempt order:
``metrics.attempt-1.jsonl`` < ``metrics.attempt-2.jsonl`` < ... < ``metrics.jsonl`` (the current attempt).
Files are merged by step in that order, so for a step logged by several attempts the latest attempt wins.
"""

from __future__ import annotations

import glob
import json
import os
import re
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

__all__ = [
    "DB_ENV",
    "DEFAULT_DB_RELPATH",
    "RUN_COLUMNS",
    "SEED_COLUMNS",
    "TOKEN_COLUMNS",
    "IngestSummary",
    "RunIngest",
    "StoreError",
    "TokenLevelWrite",
    "UpsertCounts",
    "attempt_files",
    "connect",
    "default_db_path",
    "ensure_schema",
    "find_run_dirs",
    "ingest_metrics_file",
    "ingest_paths",
    "ingest_run_dir",
    "parse_metrics_file",
    "run_row_from_dir",
    "stored_seeds",
    "upsert_runs",
    "upsert_token_level",
]

DB_ENV = "PREDMASK_DB"
DEFAULT_DB_RELPATH = Path("results") / "predmask.duckdb"

Frame = Any  # a pyarrow Table or a polars DataFrame (anything with .to_arrow())


class StoreError(RuntimeError):
    """A one-line, user-facing problem with the results store (missing file, lock held, bad input)."""


# --------------------------------------------------------------------------------------------- schema

RUN_COLUMNS: dict[str, str] = {
    "run_id": "VARCHAR PRIMARY KEY",
    "sweep": "VARCHAR",
    "method": "VARCHAR",
    "delta": "DOUBLE",
    "model": "VARCHAR",
    "precision": "VARCHAR",
    "seed": "INTEGER",
    "backend": "VARCHAR",  # "local" (CPU engine) | "slurm" (VeRL on a cluster)
    "status": "VARCHAR",
    "config": "JSON",
    "job_id": "VARCHAR",
    "log_path": "VARCHAR",
    "run_dir": "VARCHAR",
    "created_at": "TIMESTAMP",
    "updated_at": "TIMESTAMP",
}

# Per-seed summary of a token-level study (math.md §5). "ratio" and "predictive" (aggregated tail) are
# compared on their disagreement set (n_disagree); the uniform and exact predictive criteria are each
# compared with the ratio criterion on their own disagreement set (n_disagree_uniform, n_disagree_exact).
# For criterion c: n_keep_c = disagreement tokens c keeps, n_unsafe_c = those with dD_c > 0,
# n_corrective_c = those with dD_c < 0, unsafe_keep_c = n_unsafe_c / n_keep_c (NULL when n_keep_c = 0).
# Extra columns in the frames written by upsert_token_level are added to the table.
SEED_COLUMNS: dict[str, str] = {
    "study_id": "VARCHAR NOT NULL",
    "seed": "INTEGER NOT NULL",
    "n_tokens": "BIGINT",
    "n_outside": "BIGINT",
    "n_disagree": "BIGINT",
    "n_disagree_uniform": "BIGINT",
    "n_disagree_exact": "BIGINT",
    "unsafe_keep_ratio": "DOUBLE",
    "unsafe_keep_predictive": "DOUBLE",
    "unsafe_keep_predictive_uniform": "DOUBLE",
    "unsafe_keep_predictive_exact": "DOUBLE",
    "n_keep_ratio": "BIGINT",
    "n_unsafe_ratio": "BIGINT",
    "n_corrective_ratio": "BIGINT",
    "n_keep_predictive": "BIGINT",
    "n_unsafe_predictive": "BIGINT",
    "n_corrective_predictive": "BIGINT",
    "n_keep_predictive_uniform": "BIGINT",
    "n_unsafe_predictive_uniform": "BIGINT",
    "n_corrective_predictive_uniform": "BIGINT",
    "n_keep_predictive_exact": "BIGINT",
    "n_unsafe_predictive_exact": "BIGINT",
    "n_corrective_predictive_exact": "BIGINT",
    # context of the seed: batch statistics and where the time went
    "reward_mean": "DOUBLE",
    "d_pre_mean": "DOUBLE",
    "nonzero_adv_frac": "DOUBLE",
    "seconds_rollout": "DOUBLE",
    "seconds_stale": "DOUBLE",
    "seconds_masks": "DOUBLE",
    "seconds": "DOUBLE",
    "cpu_seconds": "DOUBLE",
    "host": "VARCHAR",
}

# One row per studied token (D_pre > delta). position: the token's index in the seed's flattened batch,
# or, when `sequence` is given, its position inside that sequence's response. (study_id, seed,
# sequence, position) is unique; upsert_token_level checks it.
TOKEN_COLUMNS: dict[str, str] = {
    "study_id": "VARCHAR NOT NULL",
    "seed": "INTEGER NOT NULL",
    "sequence": "INTEGER",
    "position": "BIGINT NOT NULL",
    "d_pre": "DOUBLE",
    "r": "DOUBLE",
    "a": "DOUBLE",
    "ddot_agg": "DOUBLE",
    "ddot_uniform": "DOUBLE",
    "ddot_exact": "DOUBLE",
    "keep_ratio": "BOOLEAN",
    "keep_pred_agg": "BOOLEAN",
    "keep_pred_uniform": "BOOLEAN",
    "keep_pred_exact": "BOOLEAN",
    "dd_ratio": "DOUBLE",
    "dd_pred_agg": "DOUBLE",
    "dd_pred_uniform": "DOUBLE",
    "dd_pred_exact": "DOUBLE",
    "dd_all": "DOUBLE",  # optional: dD after the unmasked reference step (sign-accuracy / first-order checks)
}


def _columns_ddl(columns: Mapping[str, str]) -> str:
    return ",\n  ".join(f"{name} {kind}" for name, kind in columns.items())


SCHEMA_DDL: tuple[str, ...] = (
    f"CREATE TABLE IF NOT EXISTS runs (\n  {_columns_ddl(RUN_COLUMNS)}\n)",
    (
        "CREATE TABLE IF NOT EXISTS metrics (\n  run_id VARCHAR NOT NULL,\n  step INTEGER NOT NULL,\n"
        "  name VARCHAR NOT NULL,\n  value DOUBLE,\n  PRIMARY KEY (run_id, step, name)\n)"
    ),
    (
        "CREATE TABLE IF NOT EXISTS token_level_studies (\n  study_id VARCHAR PRIMARY KEY,\n  config JSON,\n"
        "  created_at TIMESTAMP\n)"
    ),
    (
        f"CREATE TABLE IF NOT EXISTS token_level_seeds (\n  {_columns_ddl(SEED_COLUMNS)},\n"
        "  PRIMARY KEY (study_id, seed)\n)"
    ),
    f"CREATE TABLE IF NOT EXISTS token_level_tokens (\n  {_columns_ddl(TOKEN_COLUMNS)}\n)",
)


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


def _utcnow() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None, microsecond=0)


def _one(con: duckdb.DuckDBPyConnection, sql: str, params: Sequence[Any] = ()) -> tuple[Any, ...] | None:
    """The first row of a query (or None), with the result fully consumed (DuckDB 2 refuses new work otherwise)."""
    rows = con.execute(sql, list(params)).fetchall()
    return rows[0] if rows else None


def _table_columns(con: duckdb.DuckDBPyConnection, table: str) -> list[str]:
    rows = con.execute(
        "SELECT column_name FROM information_schema.columns WHERE table_name = ? ORDER BY ordinal_position",
        [table],
    ).fetchall()
    return [r[0] for r in rows]


# ----------------------------------------------------------------------------------------------- runs


@dataclass(frozen=True)
class UpsertCounts:
    """How many rows an upsert inserted, changed, and found already identical."""

    inserted: int = 0
    updated: int = 0
    unchanged: int = 0


def _canonical_config(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"runs.config must be a mapping or JSON text, got invalid JSON: {exc}") from exc
    return json.dumps(value, sort_keys=True, default=str)


def _normalise_run_row(row: Mapping[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(row) - set(RUN_COLUMNS))
    if unknown:
        raise ValueError(f"unknown runs column(s) {unknown}; allowed: {list(RUN_COLUMNS)}")
    run_id = row.get("run_id")
    if not isinstance(run_id, str) or not run_id:
        raise ValueError(f"every runs row needs a non-empty string run_id, got {run_id!r}")
    out = dict(row)
    if "config" in out:
        out["config"] = _canonical_config(out["config"])
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
    """Insert or update `runs` rows by run_id; a None/absent field keeps the stored value.

    created_at is kept once set; updated_at changes only when some other field changed (given value, else
    now). Rows with the same run_id within one call are merged in order (later fields win).
    """
    merged: dict[str, dict[str, Any]] = {}
    for row in rows:
        norm = _normalise_run_row(row)
        merged.setdefault(norm["run_id"], {}).update({k: v for k, v in norm.items() if v is not None})
    if not merged:
        return UpsertCounts()
    cols = list(RUN_COLUMNS)
    inserted = updated = unchanged = 0
    now = _utcnow()
    for run_id, new in merged.items():
        found = _one(con, f"SELECT {', '.join(cols)} FROM runs WHERE run_id = ?", [run_id])
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


# ------------------------------------------------------------------------------------ run directories

_ATTEMPT_RE = re.compile(r"^metrics\.attempt-(\d+)\.jsonl$")
_CURRENT = "metrics.jsonl"


def attempt_files(run_dir: Path) -> list[Path]:
    """The metrics files of a run directory, oldest attempt first (attempt-1, attempt-2, ..., metrics.jsonl)."""
    numbered: list[tuple[int, Path]] = []
    for p in run_dir.iterdir() if run_dir.is_dir() else ():
        m = _ATTEMPT_RE.match(p.name)
        if m and p.is_file():
            numbered.append((int(m.group(1)), p))
    files = [p for _, p in sorted(numbered)]
    current = run_dir / _CURRENT
    if current.is_file():
        files.append(current)
    return files


def _is_run_dir(path: Path) -> bool:
    return path.is_dir() and (
        (path / "config.yaml").is_file() or (path / "status.json").is_file() or bool(attempt_files(path))
    )


@dataclass
class ParsedFile:
    """The numeric metric values of one verl file-logger file, in line order."""

    path: Path
    rows: list[tuple[int, str, float]]
    lines: int
    skipped_lines: int
    skipped_values: int
    warnings: list[str]


def _as_step(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def parse_metrics_file(path: Path) -> ParsedFile:
    """Read verl file-logger JSON lines; bad lines are skipped with a warning, non-numeric values counted."""
    rows: list[tuple[int, str, float]] = []
    notes: list[str] = []
    skipped_lines = skipped_values = 0
    raw = path.read_bytes().split(b"\n")
    last = max((i for i, line in enumerate(raw) if line.strip()), default=-1)
    n_lines = 0
    for i, line in enumerate(raw):
        if not line.strip():
            continue
        n_lines += 1
        where = f"{path}:{i + 1}"
        what = "truncated or corrupt last line" if i == last else "corrupt line"
        try:
            rec = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            skipped_lines += 1
            notes.append(f"{where}: {what} (not JSON), skipped")
            continue
        step = _as_step(rec.get("step")) if isinstance(rec, dict) else None
        data = rec.get("data") if isinstance(rec, dict) else None
        if step is None or not isinstance(data, dict):
            skipped_lines += 1
            notes.append(f'{where}: {what} (not {{"step": int, "data": {{...}}}}), skipped')
            continue
        for name, value in data.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                rows.append((step, str(name), float(value)))
            else:
                skipped_values += 1
    return ParsedFile(path, rows, n_lines, skipped_lines, skipped_values, notes)


def _load_config(path: Path) -> dict[str, Any]:
    from omegaconf import OmegaConf

    try:
        loaded = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except Exception:  # noqa: BLE001 - unresolvable interpolation etc.: fall back to the literal YAML
        import yaml

        loaded = yaml.safe_load(path.read_text())
    if not isinstance(loaded, dict):
        raise TypeError(f"{path} is not a mapping")
    return loaded


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
    """The `runs` row that a run directory describes (config.yaml, status.json), as far as they exist."""
    notes = notes if notes is not None else []
    row: dict[str, Any] = {"run_id": run_dir.name, "run_dir": str(run_dir.resolve())}
    cfg_path, status_path = run_dir / "config.yaml", run_dir / "status.json"
    cfg: dict[str, Any] = {}
    if cfg_path.is_file():
        try:
            cfg = _load_config(cfg_path)
        except Exception as exc:  # noqa: BLE001 - a broken config must not stop the metrics
            notes.append(
                f"{cfg_path}: unreadable config ({str(exc).splitlines()[0]}), run registered without it"
            )
    if cfg:
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
    else:
        row["sweep"] = run_dir.parent.name
    if status_path.is_file():
        try:
            status = json.loads(status_path.read_text())
        except (ValueError, UnicodeDecodeError) as exc:
            status = f"unreadable ({str(exc).splitlines()[0]})"
        if not isinstance(status, dict):
            notes.append(
                f"{status_path}: status is {status if isinstance(status, str) else 'not an object'}, not used"
            )
        else:
            if isinstance(status.get("status"), str):
                row["status"] = status["status"]
            if status.get("job_id") is not None:
                row["job_id"] = str(status["job_id"])
            if isinstance(status.get("updated"), (int, float)):
                row["updated_at"] = float(status["updated"])
    log = run_dir / "train.log"
    if log.is_file():
        row["log_path"] = str(log.resolve())
    return row


# --------------------------------------------------------------------------------------------- ingest


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
    skipped_lines: int = 0
    skipped_values: int = 0
    run_registered: str = "unchanged"  # inserted | updated | unchanged
    warnings: list[str] = field(default_factory=list)


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
    def warnings(self) -> list[str]:
        return [w for r in self.runs for w in r.warnings]


def _merge_attempts(parsed: Sequence[ParsedFile]) -> dict[tuple[int, str], float]:
    merged: dict[tuple[int, str], float] = {}
    for pf in parsed:  # oldest attempt first, line order within a file: the last write wins
        for step, name, value in pf.rows:
            merged[(step, name)] = value
    return merged


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
        added, changed = _one(
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


def _ingest(
    con: duckdb.DuckDBPyConnection, run_row: dict[str, Any], run_dir: Path, files: list[Path]
) -> RunIngest:
    result = RunIngest(run_id=run_row["run_id"], run_dir=run_dir, files=files)
    parsed = [parse_metrics_file(p) for p in files]
    for pf in parsed:
        result.lines += pf.lines
        result.skipped_lines += pf.skipped_lines
        result.skipped_values += pf.skipped_values
        result.warnings.extend(pf.warnings)
    merged = _merge_attempts(parsed)
    result.metric_rows = len(merged)
    con.execute("BEGIN TRANSACTION")
    try:
        counts = upsert_runs(con, [run_row])
        result.rows_added, result.rows_changed = _write_metrics(con, result.run_id, merged)
        con.execute("COMMIT")
    except BaseException:
        con.execute("ROLLBACK")
        raise
    result.run_registered = "inserted" if counts.inserted else "updated" if counts.updated else "unchanged"
    return result


def ingest_run_dir(con: duckdb.DuckDBPyConnection, run_dir: str | os.PathLike[str]) -> RunIngest:
    """Register one run directory in `runs` and merge all its metrics attempts into `metrics` (idempotent)."""
    path = Path(run_dir)
    if not path.is_dir():
        raise StoreError(f"run directory {path} does not exist")
    notes: list[str] = []
    row = run_row_from_dir(path, notes)
    result = _ingest(con, row, path, attempt_files(path))
    result.warnings[:0] = notes
    if not result.files:
        result.warnings.append(f"{path}: no metrics.jsonl yet (run registered, no metrics)")
    return result


def ingest_metrics_file(con: duckdb.DuckDBPyConnection, path: str | os.PathLike[str]) -> RunIngest:
    """Ingest a standalone verl file-logger file (outside the run-dir contract): run_id = the file's stem."""
    p = Path(path)
    row = {"run_id": p.stem, "run_dir": str(p.parent.resolve()), "sweep": p.parent.name}
    return _ingest(con, row, p.parent, [p])


_GLOB_CHARS = re.compile(r"[*?\[]")


def find_run_dirs(
    paths_or_globs: Iterable[str | os.PathLike[str]],
) -> tuple[list[Path], list[Path], list[str]]:
    """Resolve inputs to (run directories, standalone .jsonl files, inputs that matched nothing).

    A run directory is one holding config.yaml, status.json or metrics*.jsonl; a metrics*.jsonl path means
    its run directory; another .jsonl file is a standalone file-logger file; any other directory is
    searched for run directories below it.
    """
    run_dirs: dict[Path, None] = {}
    files: dict[Path, None] = {}
    unmatched: list[str] = []
    for item in paths_or_globs:
        text = os.fspath(item)
        matches = sorted(glob.glob(text, recursive=True)) if _GLOB_CHARS.search(text) else [text]
        found = False
        for m in matches:
            p = Path(m)
            if p.is_file():
                if p.name == _CURRENT or _ATTEMPT_RE.match(p.name):
                    run_dirs[p.parent.resolve()] = None
                    found = True
                elif p.suffix == ".jsonl":
                    files[p.resolve()] = None
                    found = True
            elif _is_run_dir(p):
                run_dirs[p.resolve()] = None
                found = True
            elif p.is_dir():
                for root, dirs, _ in os.walk(p):
                    dirs.sort()
                    here = Path(root)
                    if _is_run_dir(here):
                        run_dirs[here.resolve()] = None
                        found = True
                        dirs.clear()  # a run's own folders (checkpoints/) hold no runs
        if not found:
            unmatched.append(text)
    return list(run_dirs), list(files), unmatched


def ingest_paths(
    con: duckdb.DuckDBPyConnection, paths_or_globs: Iterable[str | os.PathLike[str]]
) -> IngestSummary:
    """Ingest every run directory (and standalone metrics file) the inputs name; see find_run_dirs."""
    if isinstance(paths_or_globs, (str, os.PathLike)):
        paths_or_globs = [paths_or_globs]
    run_dirs, files, unmatched = find_run_dirs(paths_or_globs)
    summary = IngestSummary(unmatched=unmatched)
    for d in run_dirs:
        summary.runs.append(ingest_run_dir(con, d))
    for f in files:
        summary.runs.append(ingest_metrics_file(con, f))
    return summary


# ---------------------------------------------------------------------------------------- token level


@dataclass(frozen=True)
class TokenLevelWrite:
    """What upsert_token_level wrote: the study row, seed rows and token rows (after replacing those seeds)."""

    study: str  # inserted | updated | unchanged
    seeds: int
    tokens: int
    added_columns: tuple[str, ...] = ()


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


def _replace_seeds(
    con: duckdb.DuckDBPyConnection, table_name: str, study_id: str, table: pa.Table
) -> tuple[str, ...]:
    """Add columns the frame has and the table lacks, delete the frame's seeds, insert the frame by name."""
    bad = [c for c in table.column_names if not _IDENT_RE.match(c)]
    if bad:
        raise ValueError(
            f"{table_name}: column names must be identifiers ([A-Za-z_][A-Za-z0-9_]*), got {bad}"
        )
    con.register("_predmask_frame", table)
    try:
        have = set(_table_columns(con, table_name))
        added: list[str] = []
        for name, kind, *_ in con.execute("DESCRIBE SELECT * FROM _predmask_frame").fetchall():
            if name not in have:
                con.execute(f'ALTER TABLE {table_name} ADD COLUMN "{name}" {kind}')
                added.append(name)
        con.execute(
            f"DELETE FROM {table_name} WHERE study_id = ? AND seed IN (SELECT DISTINCT seed FROM _predmask_frame)",
            [study_id],
        )
        con.execute(f"INSERT INTO {table_name} BY NAME SELECT * FROM _predmask_frame")
    finally:
        con.unregister("_predmask_frame")
    return tuple(added)


def upsert_token_level(
    con: duckdb.DuckDBPyConnection,
    study_id: str,
    config: Mapping[str, Any] | str | None,
    seed_rows: Frame | None,
    token_rows: Frame | None,
) -> TokenLevelWrite:
    """Store one token-level study's config and the rows of some of its seeds (idempotent, one transaction).

    seed_rows / token_rows: polars DataFrames or pyarrow Tables with SEED_COLUMNS / TOKEN_COLUMNS names
    (study_id optional; columns not in the schema are added). Every seed present in a frame replaces that
    seed's stored rows, so writing the same frames again changes nothing. Duplicate (seed) or
    (seed, sequence, position) keys inside a frame raise ValueError.
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
    cfg_text = _canonical_config(config)
    added: tuple[str, ...] = ()
    con.execute("BEGIN TRANSACTION")
    try:
        old = _one(con, "SELECT config FROM token_level_studies WHERE study_id = ?", [study_id])
        if old is None:
            con.execute(
                "INSERT INTO token_level_studies (study_id, config, created_at) VALUES (?, ?, ?)",
                [study_id, cfg_text, _utcnow()],
            )
            study = "inserted"
        elif cfg_text is not None and cfg_text != old[0]:
            con.execute("UPDATE token_level_studies SET config = ? WHERE study_id = ?", [cfg_text, study_id])
            study = "updated"
        else:
            study = "unchanged"
        if seeds is not None and seeds.num_rows:
            added += _replace_seeds(con, "token_level_seeds", study_id, seeds)
        if tokens is not None and tokens.num_rows:
            added += _replace_seeds(con, "token_level_tokens", study_id, tokens)
        con.execute("COMMIT")
    except BaseException:
        con.execute("ROLLBACK")
        raise
    if added:
        warnings.warn(f"token-level tables gained columns {list(added)}", stacklevel=2)
    return TokenLevelWrite(
        study=study,
        seeds=seeds.num_rows if seeds is not None else 0,
        tokens=tokens.num_rows if tokens is not None else 0,
        added_columns=added,
    )


def stored_seeds(con: duckdb.DuckDBPyConnection, study_id: str) -> set[int]:
    """The seeds of a study already in token_level_seeds (a rerun skips them)."""
    rows = con.execute("SELECT seed FROM token_level_seeds WHERE study_id = ?", [study_id]).fetchall()
    return {int(r[0]) for r in rows}
