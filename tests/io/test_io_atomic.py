"""Atomic writes: a failed write leaves the old file whole and no temporary file behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from predmask.io import atomic_write, atomic_write_text


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
