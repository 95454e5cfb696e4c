"""verl file-logger files: their ``{"step": N, "data": {...}}`` records (read by ``predmask.rundir.parse_metrics``, the
one parser and step rule, shared with the trainer's resume) as the finite numeric metric values ingest stores.

What is not stored, each counted and reported with its line number: a line that is not such a record (corrupt);
a value that is not a number (null, text, lists: the trainer writes null for NaN); a non-finite number (a literal
NaN, Infinity or -Infinity, which Python's json reads): skipped, never stored as NULL or as the value; a line whose
step is smaller than an earlier line's (a step going backwards): the whole line is refused and the earlier values of
that step are kept. The same step on consecutive lines (verl logs validation, then training) is not going backwards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from predmask.rundir import parse_metrics

__all__ = ["ParsedFile", "parse_metrics_file"]


@dataclass
class ParsedFile:
    """The numeric metric values of one verl file-logger file, in line order."""

    path: Path
    rows: list[tuple[int, str, float]]
    lines: int
    skipped_lines: int
    skipped_values: int
    warnings: list[str]
    nonfinite_values: int = 0
    backward_lines: int = 0


def _as_float(value: float) -> float:
    try:
        return float(value)
    except OverflowError:  # an integer beyond the float range
        return math.inf


def parse_metrics_file(path: Path) -> ParsedFile:
    """Read verl file-logger JSON lines; what is not stored is counted, with one warning per line (module docstring)."""
    parsed = parse_metrics(path)
    rows: list[tuple[int, str, float]] = []
    notes: list[tuple[int, str]] = []  # (line number, what happened there)
    for b in parsed.bad:
        notes.append((b.line, f"{'truncated or corrupt last line' if b.last else 'corrupt line'} ({b.reason}), skipped"))
    skipped_values = nonfinite = backward = 0
    max_step: int | None = None
    for rec in parsed.records:
        if max_step is not None and rec.step < max_step:
            backward += 1
            why = f"step {rec.step} after step {max_step} (steps go backwards), line refused, the earlier values kept"
            notes.append((rec.line, why))
            continue
        max_step = rec.step
        bad: list[str] = []
        for name, value in rec.data.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                skipped_values += 1
            elif not math.isfinite(number := _as_float(value)):
                bad.append(f"{name}={value if isinstance(value, float) else 'an integer beyond float range'}")
            else:
                rows.append((rec.step, str(name), number))
        if bad:
            nonfinite += len(bad)
            notes.append((rec.line, f"step {rec.step}: non-finite value(s) {', '.join(bad)} not stored"))
    warnings = [f"{path}:{line}: {text}" for line, text in sorted(notes, key=lambda n: n[0])]  # in line order
    return ParsedFile(path, rows, parsed.lines, len(parsed.bad), skipped_values, warnings, nonfinite, backward)
