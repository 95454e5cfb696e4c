"""Run directories and their metrics attempts: which inputs are run directories, which files one holds (oldest
first), and their merge by step.

verl opens its file with "wb", so a restarted run would overwrite it; the launcher keeps earlier attempts as
``metrics.attempt-<n>.jsonl``. Attempt order: ``metrics.attempt-1.jsonl`` < ``metrics.attempt-2.jsonl`` < ... <
``metrics.jsonl`` (the current attempt); for a step logged by several attempts the latest attempt wins.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from analysis.store.metrics_files import ParsedFile

__all__ = ["CURRENT", "attempt_files", "find_run_dirs", "is_attempt_file", "is_run_dir", "merge_attempts"]

_ATTEMPT_RE = re.compile(r"^metrics\.attempt-(\d+)\.jsonl$")
CURRENT = "metrics.jsonl"


def attempt_files(run_dir: Path) -> list[Path]:
    """The metrics files of a run directory, oldest attempt first (attempt-1, attempt-2, ..., metrics.jsonl)."""
    numbered: list[tuple[int, Path]] = []
    for p in run_dir.iterdir() if run_dir.is_dir() else ():
        m = _ATTEMPT_RE.match(p.name)
        if m and p.is_file():
            numbered.append((int(m.group(1)), p))
    files = [p for _, p in sorted(numbered)]
    current = run_dir / CURRENT
    if current.is_file():
        files.append(current)
    return files


def is_attempt_file(name: str) -> bool:
    """Whether a file name is one of a run's metrics attempts (metrics.jsonl or metrics.attempt-<n>.jsonl)."""
    return name == CURRENT or _ATTEMPT_RE.match(name) is not None


def is_run_dir(path: Path) -> bool:
    """A folder holding config.yaml, status.json or a metrics attempt."""
    return path.is_dir() and (
        (path / "config.yaml").is_file() or (path / "status.json").is_file() or bool(attempt_files(path))
    )


def merge_attempts(parsed: Sequence[ParsedFile]) -> dict[tuple[int, str], float]:
    """(step, name) -> value over the parsed attempts, oldest first: the latest attempt wins."""
    merged: dict[tuple[int, str], float] = {}
    for pf in parsed:  # oldest attempt first, line order within a file: the last write wins
        for step, name, value in pf.rows:
            merged[(step, name)] = value
    return merged


_GLOB_CHARS = re.compile(r"[*?\[]")


def find_run_dirs(
    paths_or_globs: Iterable[str | os.PathLike[str]],
) -> tuple[list[Path], list[Path], list[str]]:
    """Resolve inputs to (run directories, standalone .jsonl files, inputs that matched nothing).

    A run directory is one holding config.yaml, status.json or metrics*.jsonl; a metrics*.jsonl path means
    its run directory; another .jsonl file is a standalone file-logger file; any other directory is
    searched for run directories below it.
    """
    run_dirs: dict[Path, None] = {}
    files: dict[Path, None] = {}
    unmatched: list[str] = []
    for item in paths_or_globs:
        text = os.fspath(item)
        matches = sorted(glob.glob(text, recursive=True)) if _GLOB_CHARS.search(text) else [text]
        found = False
        for m in matches:
            p = Path(m)
            if p.is_file():
                if is_attempt_file(p.name):
                    run_dirs[p.parent.resolve()] = None
                    found = True
                elif p.suffix == ".jsonl":
                    files[p.resolve()] = None
                    found = True
            elif is_run_dir(p):
                run_dirs[p.resolve()] = None
                found = True
            elif p.is_dir():
                for root, dirs, _ in os.walk(p):
                    dirs.sort()
                    here = Path(root)
                    if is_run_dir(here):
                        run_dirs[here.resolve()] = None
                        found = True
                        dirs.clear()  # a run's own folders (checkpoints/) hold no runs
        if not found:
            unmatched.append(text)
    return list(run_dirs), list(files), unmatched
