"""`python -m analysis <subcommand>`: ingest run directories into the results DB, and dispatch the analyses.

Subcommands:
  ingest <paths or globs> [--db PATH]   load run directories / verl file-logger JSONL into `runs` and `metrics`
  token_level [options]                 the token-level study (its own package, analysis/token_level/)
  drift [options]                       the token-level study over a grid of drift (analysis/token_level/drift.py)
  calibrate [options]                   the training regime per setting of the main comparison (analysis/calibrate.py)
  accuracy_weighting [options]          measured vs predicted accuracy weights of RFT, REINFORCE, GRPO, VR (analysis/accuracy_weighting/)
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from analysis.store import IngestSummary, StoreError, connect, ingest_paths, paper_command
from analysis.store.ingest import RunIngest
from predmask.console import error, make_console
from predmask.rundir import add_db_option, db_or_default

#: name -> (module, one-line help); each module's ``main(argv) -> int`` parses its own arguments. It is
#: imported only when called, so a missing or broken analysis never stops `ingest`.
DELEGATED: dict[str, tuple[str, str]] = {
    "token_level": (
        "analysis.token_level.cli",
        "the token-level study of the direction criteria (docs/math.md §5)",
    ),
    "drift": (
        "analysis.token_level.drift",
        "the token-level study over a grid of drift (lr x staleness x precision), beyond the paper",
    ),
    "calibrate": (
        "analysis.calibrate",
        "measure the training regime per main-comparison setting: share outside, clip fraction, disagreement, gain",
    ),
    "accuracy_weighting": (
        "analysis.accuracy_weighting.cli",
        "the weight RFT, REINFORCE, GRPO and the variational objective put on ∇ log p per accuracy (docs/math.md §9)",
    ),
}

_err = make_console(stderr=True)


def _ingest_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m analysis ingest",
        description=(
            "Load run directories (runs/<sweep>/<run_id>/ with config.yaml, status.json, metrics*.jsonl) or "
            "standalone verl file-logger .jsonl files into the results database. Idempotent: ingesting the "
            "same files again changes nothing. Earlier attempts (metrics.attempt-<n>.jsonl) are merged with "
            "metrics.jsonl by step, the latest attempt winning. Corrupt lines, non-finite values and steps going backwards are reported and not stored; a run directory without config.yaml is refused."
        ),
    )
    p.add_argument(
        "paths", nargs="+", help="run directories, folders holding run directories, files, or globs"
    )
    add_db_option(p, "database file", resolved=True)
    p.add_argument("-q", "--quiet", action="store_true", help="print only the totals line and warnings")
    return p


#: the ingest table's columns: header, and what it shows of a run's RunIngest
INGEST_COLUMNS: tuple[tuple[str, Callable[[RunIngest], object]], ...] = (
    ("run", lambda r: r.run_id),
    ("files", lambda r: len(r.files)),
    ("lines", lambda r: r.lines),
    ("rows", lambda r: r.metric_rows),
    ("added", lambda r: r.rows_added),
    ("changed", lambda r: r.rows_changed),
    ("bad lines", lambda r: r.skipped_lines),
    ("non-numeric", lambda r: r.skipped_values),
    ("non-finite", lambda r: r.nonfinite_values),
    ("backwards", lambda r: r.backward_lines),
    ("status", lambda r: r.status or "—"),
    ("runs row", lambda r: r.run_registered),
)


def print_summary(summary: IngestSummary, db: Path, console: Console, quiet: bool = False) -> None:
    """A per-run table (unless quiet) and one totals line."""
    if not quiet and summary.runs:
        table = Table(title=f"ingest → {db}", show_lines=False)
        for header, _value in INGEST_COLUMNS:
            table.add_column(header, justify="left" if header == "run" else "right")
        for r in summary.runs:
            table.add_row(*(str(value(r)) for _header, value in INGEST_COLUMNS))
        console.print(table)
    console.print(summary.totals_line())


def cmd_ingest(argv: Sequence[str]) -> int:
    args = _ingest_parser().parse_args(list(argv))
    db = db_or_default(args.db)
    try:
        con = connect(db)
    except StoreError as exc:
        error(str(exc))
        return 2
    try:
        summary = ingest_paths(con, args.paths, show_progress=not args.quiet)
    except StoreError as exc:  # disk full, read-only, a failed transaction: runs stored before it stay stored
        error(str(exc))
        return 2
    finally:
        with contextlib.suppress(Exception):  # a connection DuckDB invalidated may fail to close; nothing to keep
            con.close()
    refusals = {r.refused for r in summary.refused}
    for w in summary.warnings:
        if w not in refusals:  # a refused run is named once, in the error line below
            _err.print(f"warning: {w}", markup=False)
    for u in summary.unmatched:
        _err.print(f"warning: {u}: no run directory or metrics file matched")
    print_summary(summary, db, make_console(), quiet=args.quiet)
    if summary.unmatched:
        error(
            f"{len(summary.unmatched)} input(s) matched nothing: {', '.join(summary.unmatched)}; give run "
            "directories (runs/<sweep>/<run_id>) or folders holding them, which a sweep writes "
            "(python -m sweeps smoke)"
        )
        return 1
    if summary.refused:
        why = "; ".join(r.refused for r in summary.refused if r.refused)
        error(f"{len(summary.refused)} run director(ies) refused, the others stored: {why}")
        return 1
    make_console().print(f"next: {paper_command(args.db)}", markup=False)
    return 0


def run_delegated(name: str, argv: Sequence[str]) -> int:
    """Import DELEGATED[name]'s module now and call its main(argv)."""
    module_name, _ = DELEGATED[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            error(f"`{name}` is not available: module {module_name} is not installed")
            return 2
        raise
    return int(module.main(list(argv)) or 0)


def _usage() -> str:
    entries = {"ingest": "load run directories / verl file-logger JSONL into the results database"}
    entries.update({name: help_ for name, (_, help_) in DELEGATED.items()})
    width = max(len(n) for n in entries)
    lines = [f"  {n.ljust(width)}  {h}" for n, h in entries.items()]
    return (
        "usage: python -m analysis <command> [args]\n\ncommands:\n"
        + "\n".join(lines)
        + "\n\n`python -m analysis <command> --help` explains each."
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name == "ingest":
        return cmd_ingest(rest)
    if name in DELEGATED:
        return run_delegated(name, rest)
    error(f"unknown command {name!r}; valid: {', '.join(['ingest', *DELEGATED])}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
