"""`python -m reports paper|variational|list`: draw the report's figures and tables from the results database, or list them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from rich.table import Table

from analysis.store import StoreError
from predmask.console import error, make_console
from predmask.rundir import add_db_option, db_or_default
from reports import artefact_registry
from reports.artefact import ArtefactResult
from reports.artefact_registry import is_variational
from reports.figures.variational import MISSING_HINT
from reports.paper import PaperResult, availability, build_paper

DEFAULT_OUT = Path("reports") / "out"


def _sweeps(values: Sequence[str] | None) -> list[str] | None:
    if not values:
        return None
    return [s for v in values for s in v.split(",") if s]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m reports", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        add_db_option(sp, resolved=True)
        sp.add_argument(
            "--sweep",
            action="append",
            default=None,
            metavar="NAME",
            help="draw runs of these sweeps only (repeat or comma-separate); default per figure: main_comparison "
            "for figures 1 and 5-8, tight_threshold for figure 2, falling back to every sweep",
        )
        sp.add_argument(
            "--study", default=None, metavar="ID", help="token-level study id (default: the one with the most seeds, the newest among equals)"
        )

    for name, what in (
        ("paper", "draw every figure and table and write the index page"),
        (
            "variational",
            "draw only the variational-reasoning family's figures and table and update the index page",
        ),
    ):
        sp = sub.add_parser(name, help=what)
        common(sp)
        sp.add_argument(
            "--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default: {DEFAULT_OUT})"
        )
        if name == "paper":
            sp.add_argument(
                "--raw",
                action="store_true",
                help="training curves without smoothing (default: an EMA per seed, its half-life stated on "
                "each figure)",
            )
            sp.add_argument(
                "--only", action="append", default=None, metavar="NAME", help="draw only these artefacts"
            )
        sp.add_argument("--debug", action="store_true", help="show the traceback when an artefact fails")
    lst = sub.add_parser(
        "list", help="list the figures and tables and whether the database has data for them"
    )
    common(lst)
    return p


def cmd_paper(args: argparse.Namespace) -> int:
    try:
        paper = build_paper(
            args.db,
            args.out,
            sweeps=_sweeps(args.sweep),
            study_id=args.study,
            raw=args.raw,
            only=_sweeps(args.only),
            debug=args.debug,
        )
    except (StoreError, ValueError, KeyError) as exc:
        error(str(exc.args[0] if exc.args else exc))
        return 1
    family = [r for r in paper.results if is_variational(r.name)]
    if family and not any(r.has_data for r in family):
        make_console(stderr=True).print(f"note: {MISSING_HINT}")
    return _print_paper(paper, args.db)


def variational_names() -> list[str]:
    """The variational family's artefacts, in the registry's order."""
    return [a.name for a in artefact_registry.artefacts() if is_variational(a.name)]


def cmd_variational(args: argparse.Namespace) -> int:
    """Draw the family's artefacts into --out and rewrite the page with them (the other sections keep the files
    an earlier `paper` left there); without any of the family's data: the one-line hint, nothing written."""
    err = make_console(stderr=True)
    names = variational_names()
    try:
        rows = availability(args.db, sweeps=_sweeps(args.sweep), study_id=args.study, names=names)
        if not any(ok for _, _, ok in rows):
            error(f"{MISSING_HINT} ({args.db})")
            return 2
        paper = build_paper(
            args.db, args.out, sweeps=_sweeps(args.sweep), study_id=args.study, draw=names, debug=args.debug
        )
    except (StoreError, ValueError, KeyError) as exc:
        error(str(exc.args[0] if exc.args else exc))
        return 1
    for art, what, ok in rows:
        if not ok:
            err.print(f"note: {art.name} has no data yet ({what})")
    return _print_paper(paper, args.db, only=names)


def _print_paper(paper: PaperResult, db: Path, only: Sequence[str] | None = None) -> int:
    out = make_console()
    table = Table(title=f"report from {db}")
    for col in ("artefact", "data", "files"):
        table.add_column(col)
    for r in paper.results:
        if only is None or r.name in only:
            table.add_row(r.name, "yes" if r.has_data else "[red]none[/red]", ", ".join(f.name for f in r.files))
    out.print(table)
    for name, why in paper.failures.items():
        error(f"{name} failed: {why} (rerun with --debug for the traceback)")
    out.print(f"report page: {paper.index}")
    for line in next_lines(paper.results if only is None else [r for r in paper.results if r.name in only]):
        out.print(line)
    return 1 if paper.failures else 0


def next_lines(results: Sequence[ArtefactResult]) -> list[str]:
    """One ``next:`` line per command that would fill the artefacts still without data, naming them."""
    empty: dict[str, list[str]] = {}
    for r in results:
        if not r.has_data:
            empty.setdefault(r.command or "(no command produces it yet)", []).append(r.name)
    return [f"next: {cmd}   (fills {', '.join(names)})" for cmd, names in empty.items()]


def cmd_list(args: argparse.Namespace) -> int:
    try:
        rows = availability(args.db, sweeps=_sweeps(args.sweep), study_id=args.study)
    except (StoreError, ValueError) as exc:
        # no database: still list what exists, saying there is no data
        make_console(stderr=True).print(f"note: {exc.args[0] if exc.args else exc}")
        rows = [(a, "no database", False) for a in artefact_registry.artefacts()]
    table = Table(title=f"report artefacts ({args.db})")
    for col in ("name", "kind", "title", "data", "draws from"):
        table.add_column(col)
    for art, what, ok in rows:
        table.add_row(art.name, art.kind, art.title, "yes" if ok else "no", what)
    make_console().print(table)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.db = db_or_default(args.db)
    if args.command == "paper":
        return cmd_paper(args)
    return cmd_variational(args) if args.command == "variational" else cmd_list(args)


if __name__ == "__main__":
    sys.exit(main())
