"""verl file-logger files: parsing their ``{"step": N, "data": {...}}`` lines into numeric metric values."""

from __future__ import annotations

import json
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


def _as_step(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def parse_metrics_file(path: Path) -> ParsedFile:
    """Read verl file-logger JSON lines; bad lines are skipped with a warning, non-numeric values counted."""
    rows: list[tuple[int, str, float]] = []
    notes: list[str] = []
    skipped_lines = skipped_values = 0
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
        for name, value in data.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                rows.append((step, str(name), float(value)))
            else:
                skipped_values += 1
    return ParsedFile(path, rows, n_lines, skipped_lines, skipped_values, notes)
