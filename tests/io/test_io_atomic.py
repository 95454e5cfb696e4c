"""Atomic writes: a failed write leaves the old file (or folder) whole and no temporary file behind."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from predmask.io import atomic_write, atomic_write_dir, atomic_write_text


def test_write_replaces_whole_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "status.json"
    atomic_write_text(target, "one")
    atomic_write_text(target, "two")
    assert target.read_text() == "two"
    assert [p.name for p in target.parent.iterdir()] == ["status.json"]


def test_a_failing_writer_keeps_the_previous_file(tmp_path: Path) -> None:
    target = tmp_path / "seed.parquet"
    atomic_write_text(target, "previous")

    def half_then_fail(tmp: Path) -> None:
        tmp.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(target, half_then_fail)
    assert target.read_text() == "previous"
    assert [p.name for p in tmp_path.iterdir()] == ["seed.parquet"]


def test_text_is_utf8_whatever_the_locale(tmp_path: Path) -> None:
    """In an ASCII locale (C, no UTF-8 mode) the platform default would fail on δ; the helper writes UTF-8."""
    target = tmp_path / "table.md"
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    code = "import sys; from pathlib import Path; from predmask.io import atomic_write_text; " \
           "atomic_write_text(Path(sys.argv[1]), '\\u03b4 = 0.15 \\u00b1 0.02')"
    subprocess.run([sys.executable, "-c", code, str(target)], env=env, check=True)
    assert target.read_bytes() == "δ = 0.15 ± 0.02".encode()


def test_a_folder_is_written_whole_replaces_the_old_one_and_a_failure_keeps_it(tmp_path: Path) -> None:
    target = tmp_path / "cache" / "model.hf"

    def fill(text: str) -> Callable[[Path], None]:
        def write(tmp: Path) -> None:
            assert tmp.is_dir() and not any(tmp.iterdir()) and tmp.parent == target.parent
            (tmp / "a.txt").write_text(text)
            (tmp / "sub").mkdir()
            (tmp / "sub" / "b.txt").write_text(text)
        return write

    atomic_write_dir(target, fill("one"))
    atomic_write_dir(target, fill("two"))
    assert sorted(str(p.relative_to(target)) for p in target.rglob("*")) == ["a.txt", "sub", "sub/b.txt"]
    assert (target / "sub" / "b.txt").read_text() == "two"

    def half_then_fail(tmp: Path) -> None:
        (tmp / "a.txt").write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write_dir(target, half_then_fail)
    assert (target / "a.txt").read_text() == "two"
    assert [p.name for p in target.parent.iterdir()] == ["model.hf"]
