"""One owner for the run directory: no module but predmask/rundir.py spells a run directory's file names in its code
(docstrings and help texts may name them); every other module takes the names from it. Read with ``ast``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from predmask import rundir

ROOT = Path(__file__).resolve().parents[2]
OWNER = "predmask/rundir.py"
PACKAGES = ("predmask", "analysis", "sweeps", "reports", "launch", "scripts")
#: the run directory's files, as predmask.rundir names them
NAMES = tuple(value for key, value in vars(rundir).items() if key.endswith("_FILE") and isinstance(value, str))
SPELLED = re.compile(r"(^|/)(" + "|".join(map(re.escape, NAMES)) + r")$")


def _docstrings(tree: ast.Module) -> set[int]:
    nodes = [n for n in ast.walk(tree) if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)]
    return {id(n.body[0].value) for n in nodes
            if n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}


def spelled_names(source: str) -> list[tuple[int, str]]:
    """(line, literal) of each string in ``source``'s code (not a docstring) that is a run directory file's name,
    alone or as the end of a path."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    return sorted((n.lineno, n.value) for n in ast.walk(tree) if isinstance(n, ast.Constant)
                  and isinstance(n.value, str) and id(n) not in docs and SPELLED.search(n.value))


def test_the_names_are_the_run_directorys_files() -> None:
    assert {"config.yaml", "status.json", "metrics.jsonl", ".run.lock", "train.log"} <= set(NAMES)


def test_only_the_owner_spells_a_run_directorys_file_names() -> None:
    found = [f"{path.relative_to(ROOT)}:{line}: {text!r}"
             for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))
             if path.relative_to(ROOT).as_posix() != OWNER
             for line, text in spelled_names(path.read_text(encoding="utf-8"))]
    assert not found, "spell these with predmask.rundir's names:\n" + "\n".join(found)


def test_the_check_finds_a_spelled_name_and_passes_prose() -> None:
    source = ('"""Writes status.json."""\n'
              'def f(d):\n    """Reads metrics.jsonl."""\n    help = "a run dir holds config.yaml and status.json"\n'
              '    return d / "status.json", f"{d}/metrics.jsonl", "train.log"\n')
    assert spelled_names(source) == [(5, "/metrics.jsonl"), (5, "status.json"), (5, "train.log")]
