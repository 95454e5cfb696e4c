"""Which inputs of an ingest are run directories: paths, globs and folders resolved to run directories and
standalone metrics files (what a run directory holds, its attempt files and their merge: ``predmask.rundir``)."""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Iterable
from pathlib import Path

from predmask.rundir import is_attempt_file, is_run_dir

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
