"""How the project's commands are spelled when a message prints one (with the interpreter that is running now).
Standard library only: a linked interpreter outside the project's environment can load it from its file."""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path

#: the commands (after ``python -m``) that produce the data of the token-level figures and tables
STUDY = "analysis token_level --seeds 61"
DRIFT = "analysis drift"
#: the commands (after ``python -m``) that produce the data of the training and variational artefacts, and the report
MAIN_COMPARISON = "sweeps main_comparison"
TIGHT_THRESHOLD = "sweeps tight_threshold"
VARIATIONAL = "sweeps variational_reasoning"
ACCURACY_WEIGHTING = "analysis accuracy_weighting"
PAPER = "reports paper"
REPORT_VARIATIONAL = "reports variational"
#: ingest run directories into the results database (followed by the folder of a run or a sweep)
INGEST = "analysis ingest"
#: everything the paper's report shows, in the order ``python -m sweeps paper`` runs it (each step skips finished work)
PAPER_STEPS = (MAIN_COMPARISON, TIGHT_THRESHOLD, STUDY, DRIFT, VARIATIONAL, ACCURACY_WEIGHTING, PAPER)


def python_command() -> str:
    """``python`` when that name on PATH is this interpreter, else this interpreter's path (relative to the current
    directory when it lies under it, e.g. ``.venv/bin/python``), so a printed command works when pasted."""
    exe = Path(sys.executable)
    on_path = shutil.which("python")
    if on_path and Path(on_path).resolve() == exe.resolve():
        return "python"
    try:
        return os.fspath(exe.relative_to(Path.cwd()))
    except ValueError:
        return os.fspath(exe)


def command(args: str) -> str:
    """``<python> -m <args>``: a project command as a user should type it here (``command("reports paper")``)."""
    return f"{python_command()} -m {args}"


def sweep_command(sweep: str) -> str:
    """The command that runs a sweep of conf/sweep/ (its runs are ingested as they end)."""
    return command(f"sweeps {sweep}")


def with_db(cmd: str, db: str | os.PathLike[str] | None) -> str:
    """``cmd`` reading or writing the database ``db`` (``--db`` only when one is given: None = the default one)."""
    return cmd if db is None else f"{cmd} --db {shlex.quote(os.fspath(db))}"

