"""verl file-logger files: parsing their ``{"step": N, "data": {...}}`` lines into finite numeric metric values.

What is not stored, each counted and reported with its line number: a line that is not such a record (corrupt);
a value that is not a number (null, text, lists: the trainer writes null for NaN); a non-finite number (a literal
NaN, Infinity or -Infinity, which Python's json reads): skipped, never stored as NULL or as the value; a line whose
step is smaller than an earlier line's (a step going backwards): the whole line is refused and the earlier values of
that step are kept. The same step on consecutive lines (verl logs validation, then training) is not going backwards.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


def _as_step(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _as_float(value: float) -> float:
    try:
        return float(value)
    except OverflowError:  # an integer beyond the float range
        return math.inf


def parse_metrics_file(path: Path) -> ParsedFile:
    """Read verl file-logger JSON lines; what is not stored is counted, with one warning per line (module docstring)."""
    rows: list[tuple[int, str, float]] = []
    notes: list[str] = []
    skipped_lines = skipped_values = nonfinite = backward = 0
    max_step: int | None = None
    raw = path.read_bytes().split(b"\n")
    last = max((i for i, line in enumerate(raw) if line.strip()), default=-1)
    n_lines = 0
    for i, line in enumerate(raw):
        if not line.strip():
            continue
        n_lines += 1
        where = f"{path}:{i + 1}"
        what = "truncated or corrupt last line" if i == last else "corrupt line"
        try:
            rec = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            skipped_lines += 1
            notes.append(f"{where}: {what} (not JSON), skipped")
            continue
        step = _as_step(rec.get("step")) if isinstance(rec, dict) else None
        data = rec.get("data") if isinstance(rec, dict) else None
        if step is None or not isinstance(data, dict):
            skipped_lines += 1
            notes.append(f'{where}: {what} (not {{"step": int, "data": {{...}}}}), skipped')
            continue
        if max_step is not None and step < max_step:
            backward += 1
            notes.append(f"{where}: step {step} after step {max_step} (steps go backwards), line refused, "
                         "the earlier values kept")
            continue
        max_step = step
        bad: list[str] = []
        for name, value in data.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                skipped_values += 1
            elif not math.isfinite(number := _as_float(value)):
                bad.append(f"{name}={value if isinstance(value, float) else 'an integer beyond float range'}")
            else:
                rows.append((step, str(name), number))
        if bad:
            nonfinite += len(bad)
            notes.append(f"{where}: step {step}: non-finite value(s) {', '.join(bad)} not stored")
    return ParsedFile(path, rows, n_lines, skipped_lines, skipped_values, notes, nonfinite, backward)
