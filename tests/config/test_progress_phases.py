"""A run's phase before its first step (pretraining the base model, waiting for another run to build it) reaches the
sweep's progress line through the run's phase file: written while the phase lasts, gone after it, ignored once the
run has ended; real files and a real run lock."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from predmask import progress as progress_module
from predmask.progress import Phase, progress, read_phase, report_phases, waiting
from predmask.rundir import PHASE_FILE, hold_run_lock, write_status
from sweeps.run_dirs import read_state
from sweeps.submit import run_progress_text


def test_a_progress_display_inside_report_phases_writes_its_count(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress_module, "PHASE_WRITE_S", 0.0)  # every advance rewrites the file
    file = tmp_path / PHASE_FILE
    seen = []
    with report_phases(file):
        with progress("pretraining base model", total=1000, unit="steps", bar=False, interval_s=0,
                      stream=io.StringIO()) as bar:
            seen.append(read_phase(file))
            bar.advance(430)
            seen.append(read_phase(file))
        seen.append(read_phase(file))
    assert seen == [Phase("pretraining base model", 0, 1000, "steps"), Phase("pretraining base model", 430, 1000,
                                                                            "steps"), None]
    assert seen[1] is not None and seen[1].text() == "pretraining base model 430/1000"
    assert not file.exists()


def test_outside_report_phases_nothing_is_written(tmp_path: Path) -> None:
    with progress("pretraining base model", total=3, bar=False, interval_s=0, stream=io.StringIO()) as bar:
        bar.advance(3)
    assert list(tmp_path.iterdir()) == []


def test_waiting_is_a_phase_without_a_count(tmp_path: Path) -> None:
    file = tmp_path / PHASE_FILE
    with report_phases(file), waiting("waiting for base model tiny (another run builds it)"):
        phase = read_phase(file)
    assert phase == Phase("waiting for base model tiny (another run builds it)", 0, None)
    assert phase.text() == "waiting for base model tiny (another run builds it)"
    assert read_phase(file) is None


@pytest.mark.parametrize("text", ["", "{", "[]", '{"phase": "x"}', '{"phase": "x", "done": "many", "total": 3}'])
def test_a_damaged_phase_file_reads_as_no_phase(tmp_path: Path, text: str) -> None:
    (tmp_path / PHASE_FILE).write_text(text)
    assert read_phase(tmp_path / PHASE_FILE) is None


def test_the_sweep_line_names_the_phase_while_the_run_has_not_reached_its_steps(tmp_path: Path,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A running run (its trainer holds the run lock) pretraining shows the phase; with no phase, its steps; once it
    has completed, a phase file left behind (a killed writer) is ignored."""
    monkeypatch.setattr(progress_module, "PHASE_WRITE_S", 0.0)
    with hold_run_lock(tmp_path):
        write_status(tmp_path, "running", 0, 60)
        assert run_progress_text(tmp_path, read_state(tmp_path)) == "step 0/60"
        with report_phases(tmp_path / PHASE_FILE), progress("pretraining base model", total=1000, bar=False,
                                                            interval_s=0, stream=io.StringIO()) as bar:
            bar.advance(430)
            assert run_progress_text(tmp_path, read_state(tmp_path)) == "pretraining base model 430/1000"
        write_status(tmp_path, "running", 3, 60)
        assert run_progress_text(tmp_path, read_state(tmp_path)) == "step 3/60"
        (tmp_path / PHASE_FILE).write_text('{"phase": "pretraining base model", "done": 5, "total": 9}')
        write_status(tmp_path, "completed", 60, 60)
        assert run_progress_text(tmp_path, read_state(tmp_path)) == "step 60/60"
