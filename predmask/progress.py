"""The one progress display: a rich bar in an interactive terminal, else plain lines at a steady rate and at the end.

    with progress("pretraining base model", total=1000, log=log, unit="steps") as bar:
        for step in range(1000):
            ...
            bar.advance(status=f"loss {loss:.3f}")

A bar is drawn only when both stdout and stderr are terminals. Otherwise (a job log, a pipe such as ``cmd | tee log``,
nohup, CI, a test) a line such as
``pretraining base model: 430/1000 steps (43%) loss 0.812 [elapsed 21s, eta 28s]`` is written every ``interval_s``
seconds (default ``INTERVAL_S``, or ``$PREDMASK_PROGRESS_INTERVAL_S``) whether or not anything advanced (a
heartbeat thread covers long units of work), and once at the end, to ``stream`` (default stderr) and to ``log`` when
given; with ``log_file`` the same lines (and, beside a bar, the lines a piped run would write) are appended to
that file too. ``Tracker.working`` tells the tracker how much of the units under way is done (e.g. the running runs' steps),
so the ETA moves before the first unit is complete.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

__all__ = ["INTERVAL_ENV", "INTERVAL_S", "Tracker", "interactive", "interval_from_env", "progress"]

#: seconds between two plain progress lines
INTERVAL_S = 10.0
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


def _duration(seconds: float) -> str:
    s = round(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class Tracker:
    """Counts work done; ``advance`` moves the bar or, without a terminal, writes a line when one is due."""

    def __init__(self, description: str, total: int | None, *, unit: str, completed: int,
                 log: logging.Logger | None, interval_s: float, bar: Progress | None,
                 stream: TextIO | None = None, log_file: Path | None = None) -> None:
        self.description, self.total, self.unit, self.log = description, total, unit, log
        self.completed, self.status, self.partial = completed, "", 0.0
        self._first, self._interval, self._stream, self._log_file = completed, interval_s, stream, log_file
        self._bar, self._task = bar, (None if bar is None else self._add_task(bar))
        self._t0 = self._last = time.monotonic()
        self._lock = threading.Lock()

    def _add_task(self, bar: Progress) -> TaskID:
        return bar.add_task(self.description, total=self.total, completed=self.completed, status="")

    def advance(self, n: int = 1, status: str = "") -> None:
        """``n`` more units done; ``status`` (e.g. a loss) is shown beside the count."""
        self.completed += n
        if n:
            self.partial = 0.0  # the finished unit's share of the work under way is now in the count
        self.status = status or self.status
        self._update()

    def advance_to(self, completed: int, status: str = "") -> None:
        """Move the count up to ``completed`` units done (a poller that reads a running total, e.g. finished files
        on disk); a total at or below the current count changes nothing."""
        if completed > self.completed:
            self.advance(completed - self.completed, status)

    def working(self, partial: float, status: str = "") -> None:
        """``partial`` units' worth of the work under way is done (e.g. two runs at half their steps: 1.0); it counts
        towards the ETA (and the bar), not towards the count of units done."""
        self.partial = max(0.0, float(partial))
        self.status = status or self.status
        self._update()

    def _update(self) -> None:
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
        timing = f"elapsed {_duration(elapsed)}"
        left = (self.total or 0) - self.completed - self.partial
        if self.total and done_here > 0 and left > 0:
            timing += f", eta {_duration(elapsed / done_here * left)}"
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
