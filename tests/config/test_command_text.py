"""predmask.command_text: printed commands name the interpreter that runs them, in real subprocesses with their own PATH."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

#: predmask/command_text.py loaded from its file: it needs only the standard library, so the linked interpreter
#: below need not find the project's environment (a link to a venv's python outside the venv does not)
MODULE = Path(__file__).resolve().parents[2] / "predmask" / "command_text.py"
SCRIPT = ("import importlib.util, sys\n"
          f"spec = importlib.util.spec_from_file_location('command_text', {str(MODULE)!r})\n"
          "mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)\n"
          "print(mod.command('reports paper'))")


def _printed(interpreter: Path, cwd: Path, path_dirs: list[Path]) -> str:
    env = {**os.environ, "PATH": os.pathsep.join(str(d) for d in path_dirs)}
    proc = subprocess.run([str(interpreter), "-c", SCRIPT], cwd=cwd, env=env, capture_output=True, text=True,
                          check=True, timeout=60)
    return proc.stdout.strip()


def _interpreter_link(directory: Path, name: str) -> Path:
    directory.mkdir(parents=True)
    link = directory / name
    link.symlink_to(sys.executable)
    return link


def test_python_on_path_that_is_this_interpreter_is_spelled_python(tmp_path: Path) -> None:
    link = _interpreter_link(tmp_path / "bin", "python")
    assert _printed(link, tmp_path, [tmp_path / "bin"]) == "python -m reports paper"


def test_an_interpreter_under_the_current_directory_is_spelled_relative(tmp_path: Path) -> None:
    """A project-local virtual environment and no ``python`` on PATH (Debian's externally managed Python)."""
    link = _interpreter_link(tmp_path / ".venv" / "bin", "python3")
    assert _printed(link, tmp_path, [Path("/usr/bin"), Path("/bin")]) == ".venv/bin/python3 -m reports paper"


def test_an_interpreter_elsewhere_is_spelled_absolute(tmp_path: Path) -> None:
    link = _interpreter_link(tmp_path / "env" / "bin", "python3")
    (tmp_path / "work").mkdir()
    other = tmp_path / "other"
    other.mkdir()
    (other / "python").symlink_to("/bin/true")  # a different `python` on PATH is not this interpreter
    assert _printed(link, tmp_path / "work", [other]) == f"{link} -m reports paper"
