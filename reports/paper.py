"""Build the whole report from a database: every registered figure and table, then the index page."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from analysis.store import StoreError, connect, missing_db_hint
from predmask.rundir import first_line
from reports import artefact_registry, queries
from reports.artefact import Artefact, ArtefactResult, ReportContext
from reports.html import render_index
from reports.summary import page_summary

KEPT_SUFFIXES: tuple[str, ...] = (".png", ".pdf", ".md", ".tex")


class EmptyDatabase(StoreError):
    """The database is missing or holds neither runs nor token-level studies: nothing to draw."""


@dataclass
class PaperResult:
    """What `paper` produced: each artefact's result, the page, and the artefacts that failed."""

    results: list[ArtefactResult] = field(default_factory=list)
    index: Path | None = None
    failures: dict[str, str] = field(default_factory=dict)


@contextmanager
def _context(
    db: Path, out: Path, sweeps: Sequence[str] | None, study_id: str | None, **options: Any
) -> Iterator[ReportContext]:
    """A report context on the database read-only (EmptyDatabase when the file does not exist)."""
    if not db.is_file():
        raise EmptyDatabase(f"results database {db} does not exist: {missing_db_hint(db)}")
    with connect(db, read_only=True) as con:
        yield ReportContext(con, out, tuple(sweeps) if sweeps else None, study_id, **options)


def build_paper(
    db: Path,
    out: Path,
    *,
    sweeps: Sequence[str] | None = None,
    study_id: str | None = None,
    raw: bool = False,
    only: Sequence[str] | None = None,
    formats: Sequence[str] = ("png", "pdf"),
    debug: bool = False,
    draw: Sequence[str] | None = None,
) -> PaperResult:
    """Draw every (or the `only`) artefact into `out` and write out/index.html. `draw`: draw only these artefacts
    and keep the files the others already have in `out` (their data still read, so the page lists them all).
    Raises StoreError (one line) for a missing, locked or empty database and ValueError for an unknown study or
    artefact name."""
    with _context(db, out, sweeps, study_id, raw=raw, formats=tuple(formats)) as ctx:
        if queries.count_rows(ctx.con, "runs") == 0 and queries.count_rows(ctx.con, "token_level_seeds") == 0:
            raise EmptyDatabase(
                f"results database {db} is empty (no runs, no token-level studies): {missing_db_hint(db)}"
            )
        _ = ctx.study  # an unknown --study fails here, before anything is drawn
        chosen = artefact_registry.artefacts() if not only else [artefact_registry.get(n) for n in only]
        drawn = None if draw is None else {artefact_registry.get(n).name for n in draw}
        data_only = replace(ctx, draw=False)
        paper = PaperResult()
        for art in chosen:
            try:
                if drawn is None or art.name in drawn:
                    paper.results.append(art(ctx))
                else:  # data only, with the files an earlier report left in `out` under its name
                    kept = art(data_only)
                    kept.files = [p for p in (out / f"{kept.name}{s}" for s in KEPT_SUFFIXES) if p.is_file()]
                    paper.results.append(kept)
            except Exception as exc:
                if debug:
                    raise
                paper.failures[art.name] = first_line(exc, typed=True)
        out.mkdir(parents=True, exist_ok=True)
        summary = page_summary(ctx, paper.results)
        paper.index = render_index(paper.results, out, db, ctx.con, summary)
        return paper


def availability(
    db: Path,
    sweeps: Sequence[str] | None = None,
    study_id: str | None = None,
    names: Sequence[str] | None = None,
) -> list[tuple[Artefact, str, bool]]:
    """For `list`: each artefact (or the named ones), a short description of the data it would draw, and whether
    there is any."""
    with _context(db, Path("."), sweeps, study_id, draw=False) as ctx:
        rows = []
        for art in artefact_registry.artefacts() if names is None else [artefact_registry.get(n) for n in names]:
            res = art(ctx)
            if art.source == "study":
                what = (
                    f"study {res.study.study_id} ({res.study.n_seeds} seeds)"
                    if res.study
                    else res.selection_rule or "no token-level study"
                )
            else:
                what = f"{len(res.runs)} run(s); {res.selection_rule}"
            if not res.has_data and res.command:
                what += f"; filled by {res.command}"
            rows.append((art, what, res.has_data))
        return rows
