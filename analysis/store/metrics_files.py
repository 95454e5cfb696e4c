"""verl file-logger files: their ``{"step": N, "data": {...}}`` records (read by ``predmask.rundir.iter_metrics``, the
one parser and step rule, shared with the trainer's resume) as the finite numeric metric values ingest stores.

What is not stored (docs/results.md, "What ingest stores") is counted and reported with its line number. A
value that is not a number (null, text, lists: the trainer writes null for NaN) is counted but not warned
about. A line whose step goes backwards is refused whole, the earlier values of that step kept; the same step
on consecutive lines (verl logs validation, then training) is not going backwards. A step beyond what the
store's step column holds (``schema.STEP_MAX``) refuses its line. Files stream, one line in memory at a time.
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


def iter_file_values(path: Path, counts: FileCounts) -> Iterator[tuple[int, str, float]]:
    """The (step, name, value) rows a file-logger file stores, in line order; what is not stored is counted in
    ``counts``, with one warning per line (module docstring)."""
    max_step: int | None = None
    for rec in iter_metrics(path):
        counts.lines += 1
        if isinstance(rec, BadLine):
            counts.skipped_lines += 1
            what = "truncated or corrupt last line" if rec.last else "corrupt line"
            counts.note(rec.line, f"{what} ({rec.reason}), skipped")
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
