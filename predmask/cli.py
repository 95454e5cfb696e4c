"""How the project's commands are spelled when a message prints one: with the interpreter that is running now."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

__all__ = ["command", "python_command"]


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
