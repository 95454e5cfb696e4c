"""No module borrows another project module's private names: read with ``ast`` from every module's source.

A name with one leading underscore is its module's own. Another module that needs it gets a public name (or the
helper moves to where both use it), so a module's private helpers can change without reading the whole tree. The
check covers ``from X import _name`` anywhere in a module (lazy imports in function bodies included, relative ones
resolved) and ``X._name`` on a project module bound by an import; it runs on the real tree and, so that it cannot
pass vacuously, on a made-up tree that breaks the rule in each of those ways.
"""

from __future__ import annotations

import ast
from importlib.util import resolve_name
from pathlib import Path

from test_architecture import PACKAGES, ROOT, module_name


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _within_project(module: str) -> bool:
    return module.split(".")[0] in PACKAGES


def _dotted(node: ast.expr) -> list[str] | None:
    """``a.b.c`` as ``["a", "b", "c"]``; None for anything but names and attributes."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute) and (head := _dotted(node.value)) is not None:
        return [*head, node.attr]
    return None


def private_imports(path: Path, root: Path, known: set[str]) -> list[str]:
    """``<file>:<line>: <module> uses <other module>.<name>`` for each private name of another project module that
    the file imports or reads off an imported project module; ``known`` is the set of the tree's module names."""
    module = module_name(path, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    rel = path.relative_to(root).as_posix()
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[int, str]] = []
    bound: dict[str, str] = {}  # a local name -> the project module an import bound it to
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = resolve_name("." * node.level + (node.module or ""), package) if node.level else node.module or ""
            if not _within_project(source):
                continue
            for alias in node.names:
                if f"{source}.{alias.name}" in known:
                    bound[alias.asname or alias.name] = f"{source}.{alias.name}"
                elif is_private(alias.name) and source != module:
                    found.append((node.lineno, f"{source}.{alias.name}"))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _within_project(alias.name):
                    head = alias.name.split(".")[0]  # "import a.b" binds a, "import a.b as c" binds c to a.b
                    bound[alias.asname or head] = alias.name if alias.asname else head
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_private(node.attr) and (chain := _dotted(node.value)):
            owner = ".".join([bound[chain[0]], *chain[1:]]) if chain[0] in bound else None
            if owner in known and owner != module:
                found.append((node.lineno, f"{owner}.{node.attr}"))
    return [f"{rel}:{line}: {module} uses {name}" for line, name in sorted(found)]


def scan(root: Path) -> list[str]:
    files = [p for pkg in PACKAGES if (root / pkg).is_dir() for p in sorted((root / pkg).rglob("*.py"))]
    files = [p for p in files if "__pycache__" not in p.parts]
    known = {module_name(p, root) for p in files}
    return [line for p in files for line in private_imports(p, root, known)]


def test_no_module_imports_another_modules_private_names() -> None:
    found = scan(ROOT)
    assert not found, "private names used across modules (give them a public name):\n" + "\n".join(found)


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_the_checker_finds_every_way_of_borrowing_a_private_name(tmp_path: Path) -> None:
    _write(tmp_path, {
        "sweeps/__init__.py": "",
        "sweeps/compose.py": "def _parse(x):\n    return x\n\n\ndef public(x):\n    return _parse(x)\n",
        "sweeps/top.py": "from sweeps.compose import _parse, public\n",
        "sweeps/lazy.py": "def f():\n    from sweeps.compose import _parse as p\n    return p\n",
        "sweeps/relative.py": "from .compose import _parse\n",
        "sweeps/attr.py": "import sweeps.compose as c\n\n\ndef f():\n    return c._parse(1)\n",
        "sweeps/attr_from.py": "from sweeps import compose\n\nx = compose._parse\n",
        "sweeps/dotted.py": "import sweeps.compose\n\nx = sweeps.compose.public\ny = sweeps.compose._parse\n",
        "analysis/__init__.py": "from sweeps import _version\n",
        # allowed: its own private names, dunders, public names, private names of third-party modules
        "sweeps/fine.py": ("import os\nfrom os import _exit\nfrom sweeps import __doc__\nfrom sweeps.compose import public\n"
                           "x = os._exit\n\n\ndef _own():\n    return _own\n"),
    })
    assert sorted(scan(tmp_path)) == [
        "analysis/__init__.py:1: analysis uses sweeps._version",
        "sweeps/attr.py:5: sweeps.attr uses sweeps.compose._parse",
        "sweeps/attr_from.py:3: sweeps.attr_from uses sweeps.compose._parse",
        "sweeps/dotted.py:4: sweeps.dotted uses sweeps.compose._parse",
        "sweeps/lazy.py:2: sweeps.lazy uses sweeps.compose._parse",
        "sweeps/relative.py:1: sweeps.relative uses sweeps.compose._parse",
        "sweeps/top.py:1: sweeps.top uses sweeps.compose._parse",
    ]
