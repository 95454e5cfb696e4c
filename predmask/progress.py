"""The one progress display: a rich bar on a terminal, else plain lines (stderr and a logger) every ~10 s and at the end.

    with progress("pretraining base model", total=1000, log=log, unit="steps") as bar:
        for step in range(1000):
            ...
            bar.advance(status=f"loss {loss:.3f}")

When stderr is not a terminal (a job log, a pipe, a test), a line such as
``pretraining base model: 430/1000 steps (43%) loss 0.812 [elapsed 21s, eta 28s]`` is written at most every
``interval_s`` seconds and once at the end, to stderr and to ``log`` when given.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

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

__all__ = ["INTERVAL_S", "Tracker", "progress"]

#: seconds between two plain progress lines
INTERVAL_S = 10.0


def _duration(seconds: float) -> str:
    s = round(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class Tracker:
    """Counts work done; ``advance`` moves the bar or, without a terminal, writes a line when one is due."""

    def __init__(self, description: str, total: int | None, *, unit: str, completed: int,
                 log: logging.Logger | None, interval_s: float, bar: Progress | None) -> None:
        self.description, self.total, self.unit, self.log = description, total, unit, log
        self.completed, self.status = completed, ""
        self._first, self._interval = completed, interval_s
        self._bar, self._task = bar, (None if bar is None else self._add_task(bar))
        self._t0 = self._last = time.monotonic()

    def _add_task(self, bar: Progress) -> TaskID:
        return bar.add_task(self.description, total=self.total, completed=self.completed, status="")

    def advance(self, n: int = 1, status: str = "") -> None:
        """``n`` more units done; ``status`` (e.g. a loss) is shown beside the count."""
        self.completed += n
        self.status = status or self.status
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, advance=n, status=self.status)
        elif time.monotonic() - self._last >= self._interval:
            self._emit()

    def advance_to(self, completed: int, status: str = "") -> None:
        """Move the count up to ``completed`` units done (a poller that reads a running total, e.g. finished files
        on disk); a total at or below the current count changes nothing."""
        if completed > self.completed:
            self.advance(completed - self.completed, status)

    def line(self) -> str:
        """The plain progress line of the current state."""
        elapsed = time.monotonic() - self._t0
        unit = f" {self.unit}" if self.unit else ""
        count = f"{self.completed}/{self.total}{unit}" if self.total else f"{self.completed}{unit}"
        pct = f" ({100 * self.completed / self.total:.0f}%)" if self.total else ""
        status = f" {self.status}" if self.status else ""
        done_here = self.completed - self._first
        timing = f"elapsed {_duration(elapsed)}"
        if self.total and 0 < done_here and self.completed < self.total:
            timing += f", eta {_duration(elapsed / done_here * (self.total - self.completed))}"
        return f"{self.description}: {count}{pct}{status} [{timing}]"

    def _emit(self) -> None:
        text = self.line()
        print(text, file=sys.stderr, flush=True)
        if self.log is not None:
            self.log.info(text)
        self._last = time.monotonic()


@contextmanager
def progress(
    description: str,
    total: int | None,
    *,
    log: logging.Logger | None = None,
    unit: str = "",
    completed: int = 0,
    bar: bool | None = None,
    interval_s: float = INTERVAL_S,
) -> Iterator[Tracker]:
    """Show the progress of ``total`` units (None: unknown) of work, ``completed`` of them done already.

    ``bar``: None = a rich bar exactly when stderr is a terminal, True / False = always / never a bar (plain lines).
    """
    console = Console(stderr=True)
    if bar is None:
        bar = console.is_terminal
    if not bar:
        tracker = Tracker(description, total, unit=unit, completed=completed, log=log, interval_s=interval_s,
                          bar=None)
        try:
            yield tracker
        finally:
            tracker._emit()
        return
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[status]}"), TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=False) as rich_bar:
        yield Tracker(description, total, unit=unit, completed=completed, log=log, interval_s=interval_s,
                      bar=rich_bar)
