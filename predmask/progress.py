"""The one progress display: a rich bar in an interactive terminal, else plain lines at a steady rate and at the end.

    with progress("pretraining base model", total=1000, log=log, unit="steps") as bar:
        for step in range(1000):
            bar.advance(status=f"loss {loss:.3f}")

Without a terminal on both stdout and stderr (a job log, a pipe, CI, a test) a line such as
``pretraining base model: 430/1000 steps (43%) loss 0.812 [elapsed 21s, eta 28s]`` is written every ``interval_s``
seconds whether or not anything advanced (a heartbeat thread covers long units of work), and once at the end.

A phase that keeps a run from its first step (pretraining the base model, waiting for another run to build it) is
made visible to a sweep: inside ``with report_phases(run_dir / PHASE_FILE)`` every progress display (and every
:func:`waiting` block) also writes its state to that file (:func:`read_phase`), removed when the phase ends.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from predmask.io import atomic_write_text

#: seconds between two plain progress lines
INTERVAL_S = 10.0
#: least seconds between two writes of the phase file (its reader polls about once a second)
PHASE_WRITE_S = 1.0
#: environment variable that replaces INTERVAL_S (a number of seconds >= 0) where ``interval_s`` is not given
INTERVAL_ENV = "PREDMASK_PROGRESS_INTERVAL_S"


def interval_from_env() -> float:
    """``$PREDMASK_PROGRESS_INTERVAL_S`` as seconds, else INTERVAL_S; a bad value is a one-line ValueError."""
    raw = os.environ.get(INTERVAL_ENV)
    if raw is None or not raw.strip():
        return INTERVAL_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"${INTERVAL_ENV}={raw!r} is not a number of seconds; allowed: a finite number >= 0")
    return value


def duration_text(seconds: float) -> str:
    """A duration as people read it: ``42s``, ``3m05s``, ``2h07m``."""
    s = round(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


_IMPORTED = time.time()


def seconds_since_start(proc_stat: str, uptime: str, ticks_per_s: float) -> float:
    """Wall seconds a process has run, from its ``/proc/<pid>/stat`` line (field 22: its start, in clock ticks after
    boot) and ``/proc/uptime`` (seconds since boot)."""
    fields = proc_stat.rsplit(")", 1)[1].split()  # the command name (field 2) may hold spaces
    return float(uptime.split()[0]) - int(fields[19]) / ticks_per_s


def process_seconds() -> float:
    """Wall seconds since this process started (imports included); where /proc is missing, since this module
    was imported."""
    try:
        return seconds_since_start(Path("/proc/self/stat").read_text(), Path("/proc/uptime").read_text(),
                                   os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time() - _IMPORTED


def eta_from_durations(
    completed: Mapping[str, Sequence[float]],
    running: Sequence[tuple[str, float]],
    pending: Sequence[str],
    parallel: int,
) -> float | None:
    """Seconds until every run has ended, each run expected to take its kind's mean ``completed`` duration (a
    running one at least 0 s more, a pending one started on the first of ``parallel`` slots to come free);
    None while any running or pending run's kind has no completed run yet."""
    if parallel < 1:
        raise ValueError(f"parallel must be >= 1, got {parallel}")
    mean = {kind: sum(times) / len(times) for kind, times in completed.items() if times}
    if any(kind not in mean for kind, _ in running) or any(kind not in mean for kind in pending):
        return None
    slots = sorted(max(0.0, mean[kind] - ran) for kind, ran in running)
    slots += [0.0] * max(0, parallel - len(slots))
    for kind in pending:
        slots.sort()
        slots[0] += mean[kind]
    return max(slots, default=0.0)


@dataclass(frozen=True)
class Phase:
    """What a phase file says: the phase, units done of ``total`` (None: unknown) and their unit."""

    description: str
    done: int
    total: int | None
    unit: str = ""

    def text(self) -> str:
        """``pretraining base model 430/1000`` (``waiting for ...`` alone when there is nothing to count)."""
        if self.total:
            return f"{self.description} {self.done}/{self.total}"
        return self.description


_PHASE_FILE: contextvars.ContextVar[Path | None] = contextvars.ContextVar("predmask_phase_file", default=None)


@contextmanager
def report_phases(path: str | os.PathLike[str]) -> Iterator[None]:
    """Inside the block, progress displays and :func:`waiting` blocks write their state to ``path`` (a run's
    phase file, read by the sweep following it); the file is removed when the block ends."""
    file = Path(path)
    token = _PHASE_FILE.set(file)
    try:
        yield
    finally:
        _PHASE_FILE.reset(token)
        file.unlink(missing_ok=True)


def _write_phase(file: Path, phase: Phase) -> None:
    payload = {"phase": phase.description, "done": phase.done, "total": phase.total, "unit": phase.unit}
    atomic_write_text(file, json.dumps(payload) + "\n")


def read_phase(path: Path) -> Phase | None:
    """The phase a run is in (its phase file), None when it is in none: no file, or one that is not what
    :func:`report_phases` writes (a reader racing a removal, a damaged file: the run's steps speak instead)."""
    try:
        data = json.loads(path.read_text())
        total = data["total"]
        phase = Phase(str(data["phase"]), int(data["done"]), None if total is None else int(total),
                      str(data.get("unit", "")))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return phase


@contextmanager
def waiting(description: str) -> Iterator[None]:
    """A phase with nothing to count (e.g. ``waiting for base model tiny (another run builds it)``): written to the
    phase file of the enclosing :func:`report_phases`, if any, for the block's duration."""
    file = _PHASE_FILE.get()
    if file is not None:
        _write_phase(file, Phase(description, 0, None))
    try:
        yield
    finally:
        if file is not None:
            file.unlink(missing_ok=True)


class Tracker:
    """Counts work done; ``advance`` moves the bar or, without a terminal, writes a line when one is due."""

    def __init__(self, description: str, total: int | None, *, unit: str, completed: int,
                 log: logging.Logger | None, interval_s: float, bar: Progress | None,
                 stream: TextIO | None = None, log_file: Path | None = None) -> None:
        self.description, self.total, self.unit, self.log = description, total, unit, log
        self.completed, self.status, self.partial = completed, "", 0.0
        self._first, self._interval, self._stream, self._log_file = completed, interval_s, stream, log_file
        self._bar = bar
        self._task = None if bar is None else bar.add_task(description, total=total, completed=completed,
                                                           status="")
        self._t0 = self._last = time.monotonic()
        self._lock = threading.Lock()
        self._phase_file, self._phase_written = _PHASE_FILE.get(), float("-inf")
        self._estimate: float | None = None
        self._rough = False

    def advance(self, n: int = 1, status: str = "") -> None:
        """``n`` more units done; ``status`` (e.g. a loss) is shown beside the count."""
        self.completed += n
        if n:
            self.partial = 0.0  # the finished unit's share of the work under way is now in the count
        self.status = status or self.status
        self._update()

    def advance_to(self, completed: int, status: str = "") -> None:
        """Move the count up to ``completed`` units done (a poller that reads a running total); a total at or
        below the current count changes nothing."""
        if completed > self.completed:
            self.advance(completed - self.completed, status)

    def working(self, partial: float, status: str = "") -> None:
        """``partial`` units' worth of the work under way is done (e.g. two runs at half their steps: 1.0); it counts
        towards the ETA (and the bar), not towards the count of units done."""
        self.partial = max(0.0, float(partial))
        self.status = status or self.status
        self._update()

    def estimate(self, seconds: float | None) -> None:
        """The seconds left as measured by the caller (e.g. :func:`eta_from_durations`); None: none yet, so
        the line's extrapolation from the work done so far is shown as rough (``eta ~5m (rough)``)."""
        self._estimate, self._rough = seconds, seconds is None

    def _update(self) -> None:
        if self._phase_file is not None and time.monotonic() - self._phase_written >= PHASE_WRITE_S:
            self.write_phase()
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, completed=self.completed + self.partial, status=self.status)
        if (self._bar is None or self._log_file is not None) and time.monotonic() - self._last >= self._interval:
            self.emit()

    def line(self) -> str:
        """The plain progress line of the current state."""
        elapsed = time.monotonic() - self._t0
        unit = f" {self.unit}" if self.unit else ""
        count = f"{self.completed}/{self.total}{unit}" if self.total else f"{self.completed}{unit}"
        pct = f" ({100 * self.completed / self.total:.0f}%)" if self.total else ""
        status = f" {self.status}" if self.status else ""
        done_here = self.completed + self.partial - self._first
        timing = f"elapsed {duration_text(elapsed)}"
        left = (self.total or 0) - self.completed - self.partial
        if self._estimate is not None:
            timing += f", eta {duration_text(self._estimate)}"
        elif self.total and done_here > 0 and left > 0:
            rough = elapsed / done_here * left
            timing += f", eta ~{duration_text(rough)} (rough)" if self._rough else f", eta {duration_text(rough)}"
        return f"{self.description}: {count}{pct}{status} [{timing}]"

    def emit(self) -> None:
        """Write the plain progress line now: to the stream and the logger (without a bar), and to the log file."""
        with self._lock:
            text = self.line()
            if self._bar is None:
                print(text, file=self._stream or sys.stderr, flush=True)
                if self.log is not None:
                    self.log.info(text)
            if self._log_file is not None:
                with self._log_file.open("a") as fh:
                    fh.write(text + "\n")
            self._last = time.monotonic()

    def write_phase(self) -> None:
        """Write this display's state to the phase file of the enclosing :func:`report_phases` (none: nothing)."""
        if self._phase_file is not None:
            _write_phase(self._phase_file, Phase(self.description, self.completed, self.total, self.unit))
            self._phase_written = time.monotonic()

    def heartbeat(self, stop: threading.Event) -> None:
        """Until ``stop`` is set: write the line whenever ``interval_s`` passed without one."""
        while not stop.wait(max(0.05, self._last + self._interval - time.monotonic())):
            if time.monotonic() - self._last >= self._interval:
                self.emit()


def interactive() -> bool:
    """Whether both stdout and stderr are terminals (a person watching; else output goes to a log or a pipe)."""
    return Console(stderr=True).is_terminal and Console().is_terminal


@contextmanager
def progress(
    description: str,
    total: int | None,
    *,
    log: logging.Logger | None = None,
    unit: str = "",
    completed: int = 0,
    bar: bool | None = None,
    interval_s: float | None = None,
    stream: TextIO | None = None,
    log_file: str | os.PathLike[str] | None = None,
) -> Iterator[Tracker]:
    """Show the progress of ``total`` units (None: unknown) of work, ``completed`` of them done already.

    ``bar``: None = a rich bar exactly when stdout and stderr are terminals, True / False = always / never a bar
    (plain lines). ``interval_s``: seconds between plain lines (None: ``$PREDMASK_PROGRESS_INTERVAL_S``, else
    INTERVAL_S; 0: a line at every advance). ``stream``: where plain lines go (None: stderr). ``log_file``: the
    plain lines are appended to this file as well, in both modes (its folder is created).
    """
    interval = interval_from_env() if interval_s is None else interval_s
    if bar is None:
        bar = interactive()
    file = None if log_file is None else Path(log_file)
    if file is not None:
        file.parent.mkdir(parents=True, exist_ok=True)
    with _bar(bar) as rich_bar:
        tracker = Tracker(description, total, unit=unit, completed=completed, log=log, interval_s=interval,
                          bar=rich_bar, stream=stream, log_file=file)
        tracker.write_phase()
        stop = threading.Event()
        beat = threading.Thread(target=tracker.heartbeat, args=(stop,), name="progress-heartbeat", daemon=True)
        if interval > 0 and (rich_bar is None or file is not None):
            beat.start()
        try:
            yield tracker
        finally:
            stop.set()
            if beat.is_alive():
                beat.join()
            if rich_bar is None or file is not None:
                tracker.emit()
            if tracker._phase_file is not None:
                tracker._phase_file.unlink(missing_ok=True)


@contextmanager
def _bar(show: bool) -> Iterator[Progress | None]:
    """A live rich bar on stderr (``show``), else None."""
    if not show:
        yield None
        return
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[status]}"), TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=False) as rich_bar:
        yield rich_bar
