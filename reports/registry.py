"""The registry of report artefacts: one decorator per figure or table, the context they read, what they return."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import duckdb
import numpy as np

from reports import data


@dataclass
class ReportContext:
    """Everything an artefact needs: a read-only connection, where to write, and the user's filters."""

    con: duckdb.DuckDBPyConnection
    out: Path
    sweeps: tuple[str, ...] | None = None
    study_id: str | None = None
    smooth: int = 0  # trailing-mean window in logged points; 0/1 = raw values
    formats: tuple[str, ...] = ("png", "pdf")
    draw: bool = True  # False: compute the data only (`list`)

    @cached_property
    def runs(self) -> list[data.RunInfo]:
        return data.load_runs(self.con)

    @cached_property
    def studies(self) -> list[data.StudyInfo]:
        return data.load_studies(self.con)

    @cached_property
    def study(self) -> data.StudyInfo | None:
        return data.pick_study(self.studies, self.study_id)


@dataclass
class Series:
    """One plotted line or point set: its label, the run or criterion it stands for, and the arrays."""

    label: str
    x: np.ndarray
    y: np.ndarray
    run_id: str | None = None
    method: str | None = None
    yerr: np.ndarray | None = None


@dataclass
class Panel:
    """One axes: title, optional row label (for multi-metric figures), its series; empty panels keep a note."""

    title: str
    series: list[Series] = field(default_factory=list)
    row: str | None = None
    note: str | None = None

    def get(self, label: str) -> Series:
        for s in self.series:
            if s.label == label:
                return s
        raise KeyError(f"no series {label!r} in panel {self.title!r}; have {[s.label for s in self.series]}")


@dataclass
class ArtefactResult:
    """What an artefact drew or rendered: data (for tests), files written, provenance (for the page)."""

    name: str
    title: str
    caption: str
    panels: list[Panel] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)
    runs: list[data.RunInfo] = field(default_factory=list)
    selection_rule: str = ""
    study: data.StudyInfo | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    tables: dict[str, Any] = field(default_factory=dict)  # tables: rendered text / rows
    has_data: bool = False

    def panel(self, title_start: str, row: str | None = None) -> Panel:
        for p in self.panels:
            if p.title.startswith(title_start) and (row is None or p.row == row):
                return p
        raise KeyError(f"no panel starting with {title_start!r} (row {row!r}) in {self.name}")


@dataclass(frozen=True)
class Artefact:
    """A registered figure or table."""

    name: str
    kind: str  # "figure" | "table"
    title: str
    source: str  # "runs" | "study"
    fn: Callable[[ReportContext], ArtefactResult]


ARTEFACTS: dict[str, Artefact] = {}


def _register(kind: str, name: str, title: str, source: str) -> Callable:
    if source not in ("runs", "study"):
        raise ValueError(f"source must be 'runs' or 'study', got {source!r}")

    def deco(fn: Callable[[ReportContext], ArtefactResult]) -> Callable[[ReportContext], ArtefactResult]:
        if name in ARTEFACTS:
            raise ValueError(f"artefact {name!r} registered twice")
        ARTEFACTS[name] = Artefact(name, kind, title, source, fn)
        return fn

    return deco


def figure(name: str, title: str, source: str = "runs") -> Callable:
    """Register a figure function `fn(ctx) -> ArtefactResult` under its file name."""
    return _register("figure", name, title, source)


def table(name: str, title: str, source: str = "runs") -> Callable:
    """Register a table function `fn(ctx) -> ArtefactResult` under its file name."""
    return _register("table", name, title, source)


def artefacts(kind: str | None = None) -> list[Artefact]:
    """Registered artefacts in the paper's order (by name: fig1..fig8, table1, ...), optionally of one kind."""
    import reports.figures
    import reports.tables  # noqa: F401

    return sorted(
        (a for a in ARTEFACTS.values() if kind is None or a.kind == kind), key=lambda a: (a.kind, a.name)
    )


def get(name: str) -> Artefact:
    """The artefact registered under name (KeyError naming the valid names)."""
    names = [a.name for a in artefacts()]
    if name not in ARTEFACTS:
        raise KeyError(f"unknown artefact {name!r}; valid: {', '.join(names)}")
    return ARTEFACTS[name]


def run_all(ctx: ReportContext, names: Sequence[str] | None = None) -> list[ArtefactResult]:
    """Call every (or the named) artefact's function in order."""
    chosen = artefacts() if names is None else [get(n) for n in names]
    return [a.fn(ctx) for a in chosen]
