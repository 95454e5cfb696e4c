"""Run directories of a sweep: where each run lives, its state on disk, why it failed, and the per-sweep lock (the
run directory's files themselves: ``predmask.rundir``)."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from predmask.rundir import (
    EXIT_STATUS_FILE,
    JOB_LOG_FILE,
    PLANNED_CONFIG_FILE,
    RUNS_DIRNAME,
    STATUS_FILE,
    DamagedFileError,
    LinkedLockError,
    StatusError,
    hold_lock,
    read_job_record,
    read_json_object,
    read_status,
    run_path,
    run_status,
    write_config,
)
from sweeps.compose import RunSpec, SweepError


def run_dir(spec: RunSpec, root: Path | None = None) -> Path:
    return run_path(spec.sweep, spec.run_id, root)


#: the status of a run whose status.json cannot be read (its error says which file and what is wrong)
DAMAGED = "damaged"


@dataclass(frozen=True)
class RunState:
    """What the run directory says: status new, running, completed, failed, dead (running without a writer:
    its trainer was killed) or damaged (``error``: ``damaged: status.json, <what>``)."""

    status: str
    step: int = 0
    total_steps: int = 0
    error: str | None = None


def damaged_line(file: str, what: str) -> str:
    return f"damaged: {file}, {what}"


def _count(data: dict[str, Any], key: str) -> int:
    """A whole-number field of status.json (0 when absent); a DamagedFileError naming it otherwise."""
    value = data.get(key) or 0
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
        raise DamagedFileError(Path(STATUS_FILE), f"{key} {value!r} is not a whole number")
    return int(value)


def read_state(path: Path) -> RunState:
    """The run's state from its status.json and writer lock; a status.json that cannot be read is ``damaged`` (never
    running: ``write_status`` replaces the file atomically, so it stays damaged until rewritten)."""
    try:
        data = read_status(path)
        step, total = _count(data, "step"), _count(data, "total_steps")
    except DamagedFileError as err:
        return RunState(DAMAGED, error=damaged_line(STATUS_FILE, err.what))
    except OSError as err:
        return RunState(DAMAGED, error=damaged_line(STATUS_FILE, f"unreadable ({err.strerror or err})"))
    if not data:
        return RunState("new")
    error = data.get("error")
    return RunState(run_status(path, str(data.get("status", "running"))), step, total,
                    None if error is None else str(error))


def finished_elsewhere(specs: list[RunSpec], root: Path, others: list[Path]) -> tuple[Path, int] | None:
    """The project root among ``others`` whose ``runs/`` holds the most of ``specs``' runs completed there and not
    under the runs root ``root`` (a sweep here would run them again), with how many; None when none holds any."""
    todo = [spec for spec in specs if read_state(run_dir(spec, root)).status != "completed"]
    done = {other: sum(read_state(run_dir(spec, other / RUNS_DIRNAME)).status == "completed" for spec in todo)
            for other in others}
    best = max(done, key=lambda other: done[other], default=None)
    return (best, done[best]) if best is not None and done[best] else None


def check_inside_root(root: Path, paths: list[Path]) -> None:
    """Every path the sweep writes or deletes stays under the runs root once symlinks are followed (else one
    SweepError line)."""
    real_root = root.resolve()
    for path in paths:
        real = path.resolve()
        if real != real_root and real_root not in real.parents:
            raise SweepError(f"{path} leads out of the runs root {root} (to {real}); nothing written or deleted: "
                             "remove that link, or choose another --runs-root")


#: a Python exception line at the start of a line (the last line of a traceback), e.g. ``RuntimeError: boom``
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b.*")


def log_size(path: Path) -> int:
    """The size of a run's ``job.log`` now: where the next attempt's lines begin."""
    try:
        return (path / JOB_LOG_FILE).stat().st_size
    except OSError:
        return 0


def _log_lines(path: Path, offset: int) -> list[str]:
    """The lines of ``job.log`` from byte ``offset`` (the whole file when it is shorter: it was replaced)."""
    try:
        data = (path / JOB_LOG_FILE).read_bytes()
    except OSError:
        return []
    return data[offset if offset <= len(data) else 0:].decode(errors="replace").splitlines()


def exit_text(returncode: int) -> str:
    """A command's exit status in words: ``killed by signal 9 (SIGKILL)`` or ``exit status 2``."""
    if returncode < 0:
        try:
            name = f" ({signal.Signals(-returncode).name})"
        except ValueError:
            name = ""
        return f"killed by signal {-returncode}{name}"
    return f"exit status {returncode}"


def failure_cause(path: Path) -> str | None:
    """Why the latest attempt of a run failed (None when nothing says): the trainer's ``error: ...`` line in
    the attempt's part of ``job.log``, else ``status.json``'s error, else the last exception line of a
    traceback, each followed by how the command ended; or that alone, with the step it reached (a SIGKILL
    leaves no line)."""
    record = read_job_record(path)
    since = float(record.get("submitted") or 0)
    lines = [ln.strip() for ln in _log_lines(path, int(record.get("log_offset") or 0))]
    try:
        status = read_status(path)
    except (StatusError, OSError):
        status = {}
    exit_record = read_json_object(path / EXIT_STATUS_FILE)
    if float(exit_record.get("started") or 0) < since:
        exit_record = {}  # an earlier attempt's
    errors = [ln.removeprefix("error: ") for ln in lines if ln.startswith("error: ")]
    if not errors and status.get("status") == "failed" and float(status.get("updated") or 0) >= since:
        errors = [str(status.get("error"))] if status.get("error") else []
    if not errors:
        errors = [ln for ln in lines if _EXCEPTION_LINE.match(ln)]
    returncode = exit_record.get("returncode")
    ended = exit_text(int(returncode)) if isinstance(returncode, int) else exit_record.get("error")
    if errors:
        return f"{errors[-1]} ({ended})" if ended else errors[-1]
    if not ended:
        return None
    step = read_state(path)
    return f"{ended} at step {step.step}/{step.total_steps}" if step.total_steps else str(ended)


def write_planned_config(path: Path, spec: RunSpec) -> None:
    """The resolved config the sweep composed, written before submission (the CPU trainer writes config.yaml)."""
    write_config(path, spec.config, PLANNED_CONFIG_FILE)


@contextmanager
def sweep_lock(directory: Path) -> Iterator[None]:
    """An exclusive lock on a sweep directory for the with-block: one ``python -m sweeps`` per sweep at a time."""
    path = directory / ".sweep.lock"

    def busy(holder: str) -> RuntimeError:
        return RuntimeError(f"sweep directory {directory} is in use by {holder or 'another process'}; wait for it or "
                            "stop it first")

    with ExitStack() as held:
        try:
            held.enter_context(hold_lock(path, f"pid {os.getpid()} since {time.strftime('%Y-%m-%d %H:%M:%S')}", busy))
        except LinkedLockError as exc:  # the sweep's own refusal type, with hold_lock's line
            raise SweepError(exc.strerror) from None
        yield
