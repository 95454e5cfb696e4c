"""The fast subset, ``scripts/test.sh -m "not slow and not slurm"``: every name of tests/conftest.py's SLOW is a test
file or a test in one, and the subset keeps tests of every test folder (a real collection in a subprocess)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _slow_names() -> frozenset[str]:
    spec = importlib.util.spec_from_file_location("tests_conftest", REPO / "tests" / "conftest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SLOW


def test_every_slow_name_is_a_test_file_or_a_test_in_it() -> None:
    stale = []
    for name in sorted(_slow_names()):
        file, _, test = name.partition("::")
        path = REPO / file
        if not (path.name.startswith("test_") and path.is_file()) or (
            test and not re.search(rf"^\s*def {re.escape(test)}\(", path.read_text(), re.MULTILINE)
        ):
            stale.append(name)
    assert stale == []


def test_the_fast_subset_keeps_tests_of_every_folder() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m",
         "not slow and not slurm"],
        cwd=REPO, capture_output=True, text=True, timeout=600, check=True,
    ).stdout
    covered = {Path(line.split("::")[0]).parent for line in out.splitlines() if "::" in line}
    folders = {p.parent.relative_to(REPO) for p in REPO.glob("tests/**/test_*.py")}
    assert sorted(map(str, folders - covered)) == []
