"""The run directory ``runs/<sweep>/<run_id>/``: its file names, config.yaml, status.json, metrics.jsonl (its line
writer and its one parser), the attempt files, the writer lock and the dead-writer rule. Every writer and reader of a
run directory (trainers, stages, launchers, sweeps, calibration, ingest) goes through this module.

- ``config.yaml``: the resolved run config, plain safe YAML (``write_config`` / ``read_config``); reading never
  builds a Python object, so a config file cannot run code.
- ``status.json``: ``{"status", "step", "total_steps", "updated", "error"}``, replaced atomically (``write_status``).
- ``metrics.jsonl``: verl's file-logger lines ``{"step": N, "data": {name: value}}`` (``metrics_line``,
  ``MetricsWriter``); earlier attempts kept as ``metrics.attempt-<n>.jsonl`` (``keep_previous_attempt``),
  merged by ingest by step with the latest attempt winning.
- ``.run.lock``: held by the one process writing the run directory for its whole life (``hold_run_lock``);
  ``status.json`` saying "running" while the lock is free means the writer died (``DEAD``).

The step rule (``as_step``, the one rule of the trainer's resume and of ingest): a line's ``step`` is a JSON integer
(verl's file logger writes its ``global_steps``, an int), or a JSON number with an integral value such as ``4.0``
(a writer that logs every number as a float), read as that integer. Anything else (a non-integral number such as
``4.5``, ``true``, a string, null, a missing step) makes the line not a record: it is reported, never read as a step.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import json
import logging
import math
import os
import re
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from predmask.io import atomic_write_text, write_synced

# ----------------------------------------------------------------------------------------------- file names
CONFIG_FILE = "config.yaml"
PLANNED_CONFIG_FILE = "planned_config.yaml"
STATUS_FILE = "status.json"
METRICS_FILE = "metrics.jsonl"
#: where the trainer's resume moves a run's unparseable metrics lines when it rewrites the file: kept, never lost
CORRUPT_METRICS_FILE = "metrics.corrupt.jsonl"
RUN_LOCK_FILE = ".run.lock"
LOG_FILE = "train.log"
JOB_LOG_FILE = "job.log"
JOB_RECORD_FILE = "job.json"
EXIT_STATUS_FILE = "exit_status.json"
#: the phase that keeps a run from its first step (pretraining its base model), while it lasts (predmask.progress)
PHASE_FILE = "phase.json"
#: a verl run's rollout or weight sync in progress, and since when (predmask.verl.stages, watched by its launcher)
STAGE_FILE = "stage.json"
CHECKPOINT_DIR = "checkpoints"

#: the status of a run whose status.json still says "running" while no process holds its lock (killed)
DEAD = "dead"


# ----------------------------------------------------------------------------------------------- paths
#: the variable naming the root of all run directories (default ``runs/`` under the project root)
RUNS_ENV = "PREDMASK_RUNS"
#: the variable naming the project root (the folder of ``runs/`` and ``results/``) when it is not found
ROOT_ENV = "PREDMASK_ROOT"
#: the folder of run directories under the project root
RUNS_DIRNAME = "runs"
#: the variable naming the results database (default ``DEFAULT_DB_RELPATH`` under the project root)
DB_ENV = "PREDMASK_DB"
DEFAULT_DB_RELPATH = Path("results") / "predmask.duckdb"


def _names_this_project(pyproject: Path) -> bool:
    """``pyproject`` is a file whose ``[project]`` table says ``name = "predmask"`` (read as text: no toml needed)."""
    try:
        text = pyproject.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    section = ""
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("["):
            section = line
        elif section == "[project]" and re.fullmatch(r"name\s*=\s*[\"']predmask[\"']", line):
            return True
    return False


def _holds_runs(folder: Path) -> bool:
    """``folder/runs/<sweep>/<run>`` is a run directory, or a planned one, for at least one sweep and run."""
    runs = folder / RUNS_DIRNAME
    if not runs.is_dir():
        return False
    try:
        return any(is_run_dir(d) or (d / PLANNED_CONFIG_FILE).is_file() for d in runs.glob("*/*"))
    except OSError:
        return False


def is_project_root(folder: Path) -> bool:
    """``folder`` holds the project's runs (``runs/<sweep>/<run>/``) or the repository's pyproject.toml."""
    return _holds_runs(folder) or _names_this_project(folder / "pyproject.toml")


def project_root(start: Path | None = None) -> Path:
    """The folder of the project's ``runs/`` and ``results/``, absolute: ``$PREDMASK_ROOT`` when set, else the
    nearest of ``start`` (default: the working directory) and its ancestors that ``is_project_root``, else
    ``start`` itself (a new project there)."""
    if configured := os.environ.get(ROOT_ENV):
        return Path(configured).expanduser().absolute()
    here = (start or Path.cwd()).absolute()
    return next((d for d in (here, *here.parents) if is_project_root(d)), here)


def _subfolders(folder: Path) -> list[Path]:
    try:
        return sorted(d for d in folder.iterdir() if d.is_dir())
    except OSError:
        return []


def other_roots(start: Path | None = None) -> list[Path]:
    """The folders besides ``project_root(start)`` that hold the project's runs, each once, resolved, nearest
    kinds first: where a sweep's finished runs may be when it would start over."""
    here = (start or Path.cwd()).absolute()
    configured = [Path(c).expanduser()] if (c := os.environ.get(ROOT_ENV)) else []
    found = [*configured, Path(__file__).parents[1], here, *here.parents, *_subfolders(here), *_subfolders(here.parent)]
    current = project_root(here).resolve()
    return [d for d in dict.fromkeys(p.resolve() for p in found) if d != current and _holds_runs(d)]


def runs_root() -> Path:
    """Root of all run directories: ``$PREDMASK_RUNS``, else ``runs/`` under ``project_root()`` (written ``runs``
    when that is the working directory, an absolute path otherwise)."""
    if configured := os.environ.get(RUNS_ENV):
        return Path(configured)
    root = project_root()
    return Path(RUNS_DIRNAME) if root == Path.cwd().absolute() else root / RUNS_DIRNAME


def default_db_path() -> Path:
    """$PREDMASK_DB if set, else results/predmask.duckdb under ``project_root()``."""
    env = os.environ.get(DB_ENV)
    return Path(env) if env else project_root() / DEFAULT_DB_RELPATH


def db_or_default(db: str | os.PathLike[str] | None) -> Path:
    """The database a command's ``--db`` names, else ``default_db_path()``."""
    return default_db_path() if db is None else Path(db)


def add_db_option(parser: argparse.ArgumentParser, what: str = "results database", *, resolved: bool = False) -> None:
    """The ``--db`` option of every command that opens the results database (None: the default one, see
    :func:`db_or_default`); its help names the default as written, or as ``resolved`` now."""
    shown = default_db_path() if resolved else DEFAULT_DB_RELPATH
    parser.add_argument("--db", type=Path, default=None, help=f"{what} (default: ${DB_ENV} or {shown})")


def sweep_path(sweep: str, root: Path | None = None) -> Path:
    """``<root>/<sweep>``: the folder of a sweep's run directories (root: ``runs_root()``)."""
    return (root or runs_root()) / sweep


def run_path(sweep: str, run_id: str, root: Path | None = None) -> Path:
    """``<root>/<sweep>/<run_id>``: a run's directory (root: ``runs_root()``)."""
    return sweep_path(sweep, root) / run_id


# ----------------------------------------------------------------------------------------------- write errors
#: what to do when a write fails with this errno
_REMEDIES = {
    errno.ENOSPC: "free space on its file system",
    errno.EDQUOT: "free space within your disk quota",
    errno.EFBIG: "free space or raise the file-size limit",
    errno.EROFS: "make its file system writable (or point the run elsewhere, e.g. PREDMASK_RUNS)",
    errno.EACCES: "make it writable by this user",
    errno.EPERM: "make it writable by this user",
}


def storage_problem(exc: OSError, where: Path) -> str | None:
    """One line for a write that failed for lack of space or permission: the file (``where`` when the error
    names none), why, and the remedy; None for any other OSError."""
    remedy = _REMEDIES.get(exc.errno or 0)
    if remedy is None:
        return None
    why = exc.strerror or os.strerror(exc.errno or 0)
    return f"cannot write {exc.filename or where}: {why}; {remedy}, then rerun the same command to resume"


@contextmanager
def _writing(path: Path) -> Iterator[None]:
    """An OSError raised in the block names ``path`` (a failed write to an open file or to a temporary file names
    no file, or the wrong one)."""
    try:
        yield
    except OSError as exc:
        if exc.filename == str(path):
            raise
        raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from None


# ----------------------------------------------------------------------------------------------- config.yaml
def _plain(value: Any, where: str) -> Any:
    """``value`` as plain YAML data (mappings with string keys, lists, str, int, float, bool, None)."""
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"config key {where}{key!r} is a {type(key).__name__}; allowed: a string key")
            out[key] = _plain(item, f"{where}{key}.")
        return out
    if isinstance(value, (list, tuple)):
        return [_plain(item, f"{where}{i}.") for i, item in enumerate(value)]
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    raise TypeError(f"config value {where.rstrip('.') or '(root)'} is a {type(value).__name__}; allowed: a mapping, "
                    "a list, a string, a number, a bool or null")


def write_config(run_dir: Path, config: Mapping[str, Any], name: str = CONFIG_FILE) -> Path:
    """Write ``config`` as ``run_dir/name`` (plain safe YAML, keys in their order, atomically); returns the
    path. A value that is not plain data (an object, a tensor) raises TypeError naming its key."""
    path = run_dir / name
    text = yaml.safe_dump(_plain(config, ""), sort_keys=False, allow_unicode=True)
    with _writing(path):
        atomic_write_text(path, text)
    return path


#: PyYAML's C safe loader when libyaml is built in (``python -m sweeps status`` reads thousands of configs),
#: else its pure-Python safe loader; both build plain data only
YAML_LOADER: type[Any] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class DamagedFileError(ValueError):
    """A run-directory file that exists but cannot be read as what it should be: one line, ``damaged: <file>,
    <what>``, for every reader."""

    def __init__(self, path: Path, what: str) -> None:
        super().__init__(f"damaged: {path}, {what}")
        self.path = path
        self.what = what


def first_line(exc: BaseException, *, typed: bool = False) -> str:
    """An error in one line: the first non-blank line of its message, stripped, else its type's name;
    ``typed``: ``<type>: <line>`` (the type alone when the message is blank)."""
    line = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")
    if typed:
        return f"{type(exc).__name__}: {line}" if line else type(exc).__name__
    return line or type(exc).__name__


def read_config(path: Path) -> dict[str, Any]:
    """A config file as a dict: safe YAML, with its ``${...}`` interpolations resolved when they resolve (else
    kept as written). FileNotFoundError when it is missing; DamagedFileError when it is not YAML (a
    ``!!python`` tag included: nothing is ever constructed), empty, not a mapping, or truncated."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DamagedFileError(path, f"not YAML ({first_line(exc)})") from None
    if not text.strip():
        raise DamagedFileError(path, "empty; allowed: a config mapping")
    if not text.endswith("\n"):
        raise DamagedFileError(path, "truncated (no final newline: written by predmask.rundir.write_config, "
                                     "it was cut short)")
    try:
        loaded = yaml.load(text, Loader=YAML_LOADER)
    except yaml.YAMLError as exc:
        raise DamagedFileError(path, f"not YAML ({first_line(exc)})") from None
    if not isinstance(loaded, dict):
        raise DamagedFileError(path, f"a YAML {type(loaded).__name__}, not a config mapping")
    if "${" not in text:
        return loaded  # nothing to resolve (the common case: OmegaConf is skipped, it costs more than the parse)
    from omegaconf import OmegaConf

    try:
        resolved = OmegaConf.to_container(OmegaConf.create(loaded), resolve=True)
    except Exception:  # noqa: BLE001 - an unresolvable interpolation, a key OmegaConf refuses: the literal YAML
        return loaded
    return resolved if isinstance(resolved, dict) else loaded


# ----------------------------------------------------------------------------------------------- status.json
class StatusError(DamagedFileError):
    """A status.json that is not a JSON object (``damaged: <file>, <what>``)."""


def write_status(run_dir: Path, status: str, step: int, total_steps: int, error: str | None = None,
                 *, updated: float | None = None) -> None:
    """Replace ``status.json`` atomically; ``updated`` defaults to now."""
    payload = {"status": status, "step": step, "total_steps": total_steps,
               "updated": time.time() if updated is None else updated, "error": error}
    with _writing(run_dir / STATUS_FILE):
        atomic_write_text(run_dir / STATUS_FILE, json.dumps(payload) + "\n")


def read_status(run_dir: Path) -> dict[str, Any]:
    """``status.json`` of a run directory as written by ``write_status``; ``{}`` when there is none (yet).
    StatusError when the file is empty, not JSON or not a JSON object: the file is replaced atomically, so a
    damaged one stays damaged until the run's writer replaces it."""
    path = run_dir / STATUS_FILE
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return {}
    if not text.strip():
        raise StatusError(path, "empty; allowed: a JSON object written by predmask.rundir.write_status")
    try:
        status = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise StatusError(path, f"not JSON ({first_line(exc)})") from None
    if not isinstance(status, dict):
        raise StatusError(path, f"a JSON {type(status).__name__}, not an object")
    return status


# ----------------------------------------------------------------------------------------------- job records
def write_job_record(run_dir: Path, record: Mapping[str, Any]) -> None:
    """``job.json``: the sweep's note of how a run was submitted (job id, backend, command), atomically."""
    atomic_write_text(run_dir / JOB_RECORD_FILE, json.dumps(dict(record), indent=2, sort_keys=True) + "\n")


def read_json_object(file: Path) -> dict[str, Any]:
    """A small JSON file as a dict; ``{}`` when it is missing, unreadable or not a JSON object."""
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def read_job_record(run_dir: Path) -> dict[str, Any]:
    """``job.json`` as a dict; ``{}`` when there is none or it is not a JSON object."""
    return read_json_object(run_dir / JOB_RECORD_FILE)


# ----------------------------------------------------------------------------------------------- metrics lines
#: the shape of a metrics line, as reports name it
RECORD_SHAPE = '{"step": int, "data": {...}}'


def as_step(value: Any) -> int:
    """A line's ``step`` by the step rule (module docstring); ValueError (one line) for anything else."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    shown = json.dumps(value) if isinstance(value, (bool, str, float)) or value is None else repr(value)
    raise ValueError(f"step {shown} is not a whole number; allowed: a JSON integer or an integral number such as 4.0")


def _clean(value: Any) -> Any:
    """A non-finite float as null (the file logger's "no value"), anything else as it is."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def metrics_line(step: int, data: Mapping[str, Any]) -> str:
    """One metrics line, newline included: ``{"step": step, "data": {...}}`` with non-finite floats as null."""
    return json.dumps({"step": as_step(step), "data": {str(k): _clean(v) for k, v in data.items()}}) + "\n"


class MetricsWriter:
    """verl's file logger: one JSON line per step, flushed and synced before the step counts as done. A failed write
    raises an OSError naming the file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.failed = False
        with _writing(path):
            self.fh = open(path, "a")  # noqa: SIM115 - held open for the whole run, closed by close()

    def log(self, data: Mapping[str, Any], step: int) -> None:
        line = metrics_line(step, data)
        with _writing(self.path):
            try:
                self.fh.write(line)
                self.fh.flush()
                os.fsync(self.fh.fileno())
            except OSError:
                self.failed = True
                raise

    def close(self) -> None:
        """Close the file; after a failed write (already raised) the unwritten rest is dropped, not raised again."""
        try:
            self.fh.close()
        except OSError:
            if not self.failed:
                raise


@dataclass(frozen=True)
class Record:
    """One valid metrics line: its 1-based line number, its step (by the step rule) and its data as written."""

    line: int
    step: int
    data: dict[str, Any]


@dataclass(frozen=True)
class BadLine:
    """One line that is not a record: its 1-based number, its bytes (no newline), why, and whether it is the
    file's last non-blank line (a torn last write)."""

    line: int
    text: bytes
    reason: str
    last: bool


@dataclass(frozen=True)
class MetricsFile:
    """A metrics file read line by line: its records and its bad lines, in file order; ``lines`` counts the
    non-blank ones."""

    path: Path
    records: list[Record]
    bad: list[BadLine]
    lines: int


def _parse_line(line: bytes) -> tuple[int, dict[str, Any]] | str:
    """(step, data) of one line, or why it is not a record."""
    try:
        rec = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return "not JSON"
    if not isinstance(rec, dict) or "step" not in rec or not isinstance(rec.get("data"), dict):
        return f"not {RECORD_SHAPE}"
    try:
        return as_step(rec["step"]), rec["data"]
    except ValueError as exc:
        return str(exc)


def iter_metrics(path: Path) -> Iterator[Record | BadLine]:
    """The one parser of a metrics file (any attempt), streaming: every non-blank line as a Record or a
    BadLine, in file order; a missing file has none. A bad line is yielded once the next non-blank line (or
    the end of the file) says whether it is the last one."""
    try:
        fh = path.open("rb")
    except FileNotFoundError:
        return
    pending: tuple[int, bytes, str] | None = None
    with fh:
        for number, raw in enumerate(fh, start=1):
            line = raw[:-1] if raw.endswith(b"\n") else raw
            if not line.strip():
                continue
            if pending is not None:
                yield BadLine(*pending, last=False)
                pending = None
            parsed = _parse_line(line)
            if isinstance(parsed, str):
                pending = (number, line, parsed)
            else:
                yield Record(number, *parsed)
    if pending is not None:
        yield BadLine(*pending, last=True)


def parse_metrics(path: Path) -> MetricsFile:
    """A metrics file read whole by ``iter_metrics``: its records and its bad lines, in file order."""
    records: list[Record] = []
    bad: list[BadLine] = []
    for item in iter_metrics(path):
        (records if isinstance(item, Record) else bad).append(item)  # type: ignore[arg-type]
    return MetricsFile(path, records, bad, len(records) + len(bad))


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics file as ``{"step": int, "data": {...}}`` dicts, in file order; a line that is
    not a record is skipped, and the valid lines after it are read."""
    return [{"step": r.step, "data": r.data} for r in parse_metrics(path).records]


def last_step(run_dir: Path) -> int:
    """The step of the last record of ``run_dir/metrics.jsonl``; 0 when it has none."""
    records = parse_metrics(run_dir / METRICS_FILE).records
    return records[-1].step if records else 0


@dataclass(frozen=True)
class Truncation:
    """What ``truncate_metrics`` did: records dropped past the step, bad lines moved to the quarantine file."""

    dropped: int
    quarantined: int


def truncate_metrics(path: Path, max_step: int) -> Truncation:
    """Keep only the records with ``step <= max_step`` (atomic rewrite). Lines that are not records are first
    appended to ``metrics.corrupt.jsonl`` beside it (synced), so a rewrite never loses a line it could not read."""
    parsed = parse_metrics(path)
    kept = [r for r in parsed.records if r.step <= max_step]
    if parsed.bad:
        write_synced(path.with_name(CORRUPT_METRICS_FILE), b"".join(b.text + b"\n" for b in parsed.bad), "ab")
    result = Truncation(len(parsed.records) - len(kept), len(parsed.bad))
    if result.dropped or result.quarantined:
        atomic_write_text(path, "".join(json.dumps({"step": r.step, "data": r.data}) + "\n" for r in kept))
    return result


def cut_metrics(run_dir: Path, step: int | None, log: logging.Logger) -> Truncation:
    """Cut ``run_dir``'s metrics.jsonl back to ``step`` before a run writes it again (None: a fresh start keeps no
    line; :func:`truncate_metrics`), and say in ``log`` what went: the lines past it, unparseable lines quarantined."""
    cut = truncate_metrics(run_dir / METRICS_FILE, -1 if step is None else step)
    if cut.dropped and step is None:
        log.info("no checkpoint: starting from step 0, dropped %d metrics lines of an earlier attempt", cut.dropped)
    elif cut.dropped:
        log.info("dropped %d metrics lines past step %d", cut.dropped, step)
    if cut.quarantined:
        log.warning("%d unparseable line(s) of %s moved to %s%s", cut.quarantined, METRICS_FILE, CORRUPT_METRICS_FILE,
                    "" if step is None else f"; every valid line up to step {step} is kept")
    return cut


# ----------------------------------------------------------------------------------------------- attempts
def attempt_name(metrics_file: Path, n: int) -> Path:
    """The file attempt ``n`` of a metrics file is kept as: ``metrics.jsonl`` -> ``metrics.attempt-<n>.jsonl``."""
    return metrics_file.with_name(f"{metrics_file.stem}.attempt-{n}{metrics_file.suffix}")


def _attempt_number(metrics_file: Path, name: str) -> int | None:
    """n when ``name`` is ``attempt_name(metrics_file, n)``, else None."""
    stem, suffix = re.escape(metrics_file.stem), re.escape(metrics_file.suffix)
    m = re.match(rf"^{stem}\.attempt-(\d+){suffix}$", name)
    return int(m.group(1)) if m else None


def keep_previous_attempt(metrics_file: Path) -> Path | None:
    """verl's file logger truncates its file on start: move a previous attempt's lines aside first, as
    ``metrics.attempt-<n>.jsonl`` (n one above the highest present). Returns the new name, or None when there
    was nothing."""
    if not metrics_file.is_file() or metrics_file.stat().st_size == 0:
        return None
    taken = [n for p in metrics_file.parent.iterdir() if (n := _attempt_number(metrics_file, p.name)) is not None]
    target = attempt_name(metrics_file, max(taken, default=0) + 1)
    os.replace(metrics_file, target)
    return target


def attempt_files(run_dir: Path) -> list[Path]:
    """The metrics files of a run directory, oldest attempt first (attempt-1, attempt-2, ..., metrics.jsonl)."""
    current = run_dir / METRICS_FILE
    numbered: list[tuple[int, Path]] = []
    for p in run_dir.iterdir() if run_dir.is_dir() else ():
        n = _attempt_number(current, p.name)
        if n is not None and p.is_file():
            numbered.append((n, p))
    files = [p for _, p in sorted(numbered)]
    if current.is_file():
        files.append(current)
    return files


def is_attempt_file(name: str) -> bool:
    """Whether a file name is one of a run's metrics attempts (metrics.jsonl or metrics.attempt-<n>.jsonl)."""
    return name == METRICS_FILE or _attempt_number(Path(METRICS_FILE), name) is not None


def is_run_dir(path: Path) -> bool:
    """A folder holding config.yaml, status.json or a metrics attempt."""
    return path.is_dir() and (
        (path / CONFIG_FILE).is_file() or (path / STATUS_FILE).is_file() or bool(attempt_files(path))
    )


# ----------------------------------------------------------------------------------------------- writer lock
class RunDirBusyError(RuntimeError):
    """Another live process holds the run directory's writer lock (one line, naming its pid)."""


class LinkedLockError(OSError, ValueError):
    """A lock file that is a symbolic link (errno ELOOP): refused in one line, the link and its target untouched."""

    def __str__(self) -> str:  # the line itself, without OSError's "[Errno 40]"
        return str(self.strerror)


def _holder(text: str) -> str:
    """``pid N`` (``pid N on HOST`` from another host) as the lock's holder wrote it, or ``pid unknown``."""
    words = text.split()
    if len(words) >= 2 and words[0] == "pid":
        host = words[2] if len(words) >= 3 else None
        return f"pid {words[1]}" + (f" on {host}" if host and host != socket.gethostname() else "")
    return "pid unknown"


@contextmanager
def hold_lock(path: Path, stamp: str,
              busy: Callable[[str], Exception | AbstractContextManager[Any]]) -> Iterator[None]:
    """Hold an exclusive flock on the file ``path`` for the with-block, ``stamp`` (who holds it) written in it
    while held: the one lock of the project. When another process holds it, ``busy(what that holder wrote)``:
    an exception is raised, a context manager (a progress phase) is entered while this waits for the lock.
    Never through a link (the file is truncated, and a link could name a file elsewhere): LinkedLockError. The
    lock goes with the process: a SIGKILLed holder leaves it free."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        if exc.errno != errno.ELOOP or not path.is_symlink():
            raise
        raise LinkedLockError(errno.ELOOP, f"{path} is a symlink (to {os.readlink(path)}); nothing written or "
                                           "deleted: remove that link") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            answer = busy(os.pread(fd, 200, 0).decode(errors="replace").strip())
            if isinstance(answer, BaseException):
                raise answer from None
            with answer:
                fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, stamp.encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)


def hold_run_lock(run_dir: Path) -> AbstractContextManager[None]:
    """Hold ``run_dir/.run.lock`` for the with-block (the run's writer, for its whole life), ``pid N HOST`` of
    the holder written in it; RunDirBusyError when another process holds it."""
    def busy(holder: str) -> RunDirBusyError:
        return RunDirBusyError(f"run_dir {run_dir} is being written by another trainer ({_holder(holder)})")

    return hold_lock(run_dir / RUN_LOCK_FILE, holder_stamp(), busy)


def holder_stamp() -> str:
    """``pid N HOST``: what a lock's holder writes in it (``_holder`` reads it back)."""
    return f"pid {os.getpid()} {socket.gethostname()}\n"


def run_writer_alive(run_dir: Path) -> bool:
    """Whether some process holds ``run_dir``'s writer lock now (False when there is no lock file)."""
    try:
        fd = os.open(run_dir / RUN_LOCK_FILE, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def run_status(run_dir: Path, status: str) -> str:
    """``status`` corrected for a dead writer: "running" with the writer lock free is ``"dead"``."""
    if status == "running" and not run_writer_alive(run_dir):
        return DEAD
    return status
