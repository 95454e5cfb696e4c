"""verl file-logger files: their ``{"step": N, "data": {...}}`` records (read by ``predmask.rundir.iter_metrics``, the
one parser and step rule, shared with the trainer's resume) as the finite numeric metric values ingest stores.

What is not stored, each counted and reported with its line number: a line that is not such a record (corrupt);
a value that is not a number (null, text, lists: the trainer writes null for NaN); a non-finite number (a literal
NaN, Infinity or -Infinity, which Python's json reads): skipped, never stored as NULL or as the value; a line whose
step is smaller than an earlier line's (a step going backwards): the whole line is refused and the earlier values of
that step are kept. The same step on consecutive lines (verl logs validation, then training) is not going backwards.
A step beyond what the store's step column holds (``schema.STEP_MAX``) refuses its line. Files stream, one line in
memory at a time (``iter_file_values``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from analysis.store.schema import STEP_MAX
from predmask.rundir import BadLine, iter_metrics

_STEP_MIN = -STEP_MAX - 1


@dataclass
class FileCounts:
    """What reading one verl file-logger file found, counted while its values stream (``iter_file_values``)."""

    path: Path
    lines: int = 0
    skipped_lines: int = 0
    skipped_values: int = 0
    nonfinite_values: int = 0
    backward_lines: int = 0
    warnings: list[str] = field(default_factory=list)  # in line order

    def note(self, line: int, text: str) -> None:
        self.warnings.append(f"{self.path}:{line}: {text}")


def _as_float(value: float) -> float:
    try:
        return float(value)
    except OverflowError:  # an integer beyond the float range
        return math.inf


def _bad_line(counts: FileCounts, b: BadLine) -> None:
    counts.skipped_lines += 1
    counts.note(b.line, f"{'truncated or corrupt last line' if b.last else 'corrupt line'} ({b.reason}), skipped")


def iter_file_values(path: Path, counts: FileCounts) -> Iterator[tuple[int, str, float]]:
    """The (step, name, value) rows a file-logger file stores, in line order, read one line at a time; what is not
    stored is counted in ``counts``, with one warning per line (module docstring). A step outside the range the
    store's step column holds refuses its line (one warning naming the file and line)."""
    max_step: int | None = None
    for rec in iter_metrics(path):
        counts.lines += 1
        if isinstance(rec, BadLine):
            _bad_line(counts, rec)
            continue
        if not _STEP_MIN <= rec.step <= STEP_MAX:
            counts.skipped_lines += 1
            counts.note(rec.line, f"step {rec.step} is outside the steps the results store holds ({_STEP_MIN} to "
                                  f"{STEP_MAX}), line refused")
            continue
        if max_step is not None and rec.step < max_step:
            counts.backward_lines += 1
            counts.note(rec.line, f"step {rec.step} after step {max_step} (steps go backwards), line refused, the "
                                  "earlier values kept")
            continue
        max_step = rec.step
        bad: list[str] = []
        for name, value in rec.data.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                counts.skipped_values += 1
            elif not math.isfinite(number := _as_float(value)):
                bad.append(f"{name}={value if isinstance(value, float) else 'an integer beyond float range'}")
            else:
                yield rec.step, str(name), number
        if bad:
            counts.nonfinite_values += len(bad)
            counts.note(rec.line, f"step {rec.step}: non-finite value(s) {', '.join(bad)} not stored")
