"""What every report artefact shares: the context it reads, the data it returns, and the decorator declaring
it (``declare``, behind ``figure`` in reports/figures/draw.py and ``table`` in reports/tables/render.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import duckdb
import numpy as np

from analysis.token_level.summary import study_stats as stats
from predmask.command_text import DRIFT, STUDY, command
from reports import queries

Kind = Literal["figure", "table"]
Source = Literal["runs", "study"]
SOURCES: tuple[str, ...] = ("runs", "study")

#: The commands that produce the data artefacts draw: every empty artefact, panel and message names one of these.
STUDY_COMMAND = command(STUDY)
DRIFT_COMMAND = command(DRIFT)


@dataclass
class ReportContext:
    """Everything an artefact needs: a read-only connection, where to write, and the user's filters."""

    con: duckdb.DuckDBPyConnection
    out: Path
    sweeps: tuple[str, ...] | None = None
    study_id: str | None = None
    raw: bool = False  # True: training curves unsmoothed (default: each figure row's labelled EMA)
    formats: tuple[str, ...] = ("png", "pdf")
    draw: bool = True  # False: compute the data only (`list`)

    @cached_property
    def runs(self) -> list[queries.RunInfo]:
        return queries.load_runs(self.con)

    @cached_property
    def studies(self) -> list[queries.StudyInfo]:
        return queries.load_studies(self.con)

    @cached_property
    def study(self) -> queries.StudyInfo | None:
        return queries.pick_study(self.studies, self.study_id)

    @cached_property
    def summary(self) -> stats.StudySummary | None:
        """The chosen study's numbers as the study's statistics define them (None without a study)."""
        return (
            None if self.study is None else stats.study_summary(queries.seed_rows(self.con, self.study.study_id))
        )


@dataclass
class Series:
    """One plotted line or point set: its label, the run, method or criterion it stands for, and the arrays.

    A training line is a mean over seeds: ``seeds`` holds the per-seed values it is the mean of (seeds × x, in the
    order of ``seed_keys``), ``band`` the interval drawn around it (None: one seed, no band), ``identical_to`` the
    method whose line it coincides with (drawn over it, named in the label)."""

    label: str
    x: np.ndarray
    y: np.ndarray
    run_id: str | None = None
    method: str | None = None
    yerr: np.ndarray | None = None
    band: tuple[np.ndarray, np.ndarray] | None = None
    seeds: np.ndarray | None = None
    seed_keys: tuple[object, ...] = ()
    identical_to: str | None = None


@dataclass
class Panel:
    """One axes: title, optional row label (for multi-metric figures), its series; empty panels keep a note."""

    title: str
    series: list[Series] = field(default_factory=list)
    row: str | None = None
    note: str | None = None
    text: str | None = None  # a line the figure prints about this panel in its subtitle (Figure 1)

    def get(self, label: str) -> Series:
        for s in self.series:
            if s.label == label:
                return s
        raise KeyError(f"no series {label!r} in panel {self.title!r}; have {[s.label for s in self.series]}")


@dataclass
class ArtefactResult:
    """What an artefact drew or rendered: data (for tests), files written, provenance (for the page). Its name is
    the declared artefact's, filled in by calling the artefact."""

    title: str
    caption: str
    name: str = ""
    panels: list[Panel] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)
    runs: list[queries.RunInfo] = field(default_factory=list)
    selection_rule: str = ""
    study: queries.StudyInfo | None = None
    stats: Any = None  # the statistics behind a token-level artefact, as analysis returned them
    tables: dict[str, Any] = field(default_factory=dict)  # tables: rendered text / rows
    has_data: bool = False
    command: str = ""  # the command that produces the data it draws (named when it has none)
    drawn: Any = None  # what its files hold: a figure's matplotlib Figure, a table's TextTables in file order

    def series_labels(self) -> list[str]:
        """Every series label of its panels, once each, in the order drawn."""
        return list(dict.fromkeys(s.label for p in self.panels for s in p.series))

    def panel(self, title_start: str, row: str | None = None) -> Panel:
        for p in self.panels:
            if p.title.startswith(title_start) and (row is None or p.row == row):
                return p
        raise KeyError(f"no panel starting with {title_start!r} (row {row!r}) in {self.name}")


@dataclass(frozen=True)
class Artefact:
    """A declared figure or table; calling it with a context draws or renders it, and writes its files when
    the context draws."""

    name: str
    kind: Kind
    title: str
    source: Source
    fn: Callable[[ReportContext], ArtefactResult]
    write: Callable[[ArtefactResult, ReportContext], list[Path]]

    def __call__(self, ctx: ReportContext) -> ArtefactResult:
        result = self.fn(ctx)
        if result.name and result.name != self.name:
            raise ValueError(f"artefact {self.name!r} returned a result named {result.name!r}; leave it unset")
        result.name = self.name
        if ctx.draw:
            result.files = self.write(result, ctx)
        return result


def declare(
    kind: Kind, title: str, source: Source, write: Callable[[ArtefactResult, ReportContext], list[Path]]
) -> Callable[[Callable[[ReportContext], ArtefactResult]], Artefact]:
    """A decorator declaring `fn(ctx) -> ArtefactResult` as an artefact named as the function is."""
    if source not in SOURCES:
        raise ValueError(f"source must be one of {', '.join(SOURCES)}, got {source!r}")

    def deco(fn: Callable[[ReportContext], ArtefactResult]) -> Artefact:
        return Artefact(fn.__name__, kind, title, source, fn, write)

    return deco
