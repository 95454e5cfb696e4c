"""A sweep's ETA from completed runs of the same kind (hand-computed schedules), the rough label before any
completed, and the wall clock a command's end line reports (a real subprocess that sleeps before its imports)."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import textwrap

import pytest

from predmask.progress import eta_from_durations, progress, seconds_since_start


def test_eta_schedules_pending_runs_on_the_first_free_slot() -> None:
    """Kind a takes (100 + 200) / 2 = 150 s. Two slots: the running run has 150 - 50 = 100 s left, the other is
    free; the first pending run fills the free slot (0 + 150), the second the running run's (100 + 150 = 250)."""
    assert eta_from_durations({"a": [100.0, 200.0]}, [("a", 50.0)], ["a", "a"], parallel=2) == pytest.approx(250.0)


def test_eta_uses_each_kinds_own_duration_and_never_a_negative_remainder() -> None:
    """One slot; the running big run has overrun its 600 s (0 s left), then 60 + 600 + 60 s in a row."""
    eta = eta_from_durations({"small": [60.0], "big": [600.0]}, [("big", 700.0)], ["small", "big", "small"],
                             parallel=1)
    assert eta == pytest.approx(720.0)


def test_eta_of_parallel_running_runs_is_the_longest_remainder() -> None:
    """Three runs at once, nothing pending: the last to end decides (300 - 10 = 290 s)."""
    eta = eta_from_durations({"s": [100.0], "b": [300.0]}, [("s", 10.0), ("b", 10.0), ("s", 90.0)], [], parallel=4)
    assert eta == pytest.approx(290.0)


def test_no_eta_while_a_kind_has_no_completed_run() -> None:
    """A pending (or running) run of a kind never completed: no measured estimate (None), not a guess."""
    assert eta_from_durations({"a": [100.0]}, [("a", 1.0)], ["b"], parallel=2) is None
    assert eta_from_durations({}, [("a", 1.0)], [], parallel=2) is None
    assert eta_from_durations({}, [], [], parallel=1) == 0.0


def test_parallel_below_one_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"^parallel must be >= 1, got 0$"):
        eta_from_durations({}, [], [], parallel=0)


def _lines(estimate: float | None) -> list[str]:
    out = io.StringIO()
    with progress("sweep s", total=4, unit="runs", bar=False, interval_s=0, stream=out) as bar:
        bar.estimate(estimate)
        bar.working(0.5)
        bar.advance(1)
    return out.getvalue().splitlines()


def test_measured_eta_is_printed_as_given_and_an_extrapolation_as_rough() -> None:
    assert _lines(250.0)[-1].endswith("[elapsed 0s, eta 4m10s]")
    rough = _lines(None)[-1]
    assert re.fullmatch(r"sweep s: 1/4 runs \(25%\) \[elapsed 0s, eta ~\d+s \(rough\)\]", rough), rough


def test_seconds_since_start_reads_the_start_tick_after_a_command_name_with_spaces() -> None:
    """Field 22 of /proc/<pid>/stat is the start in ticks (500 at 100/s = 5 s after boot); uptime 20 s: 15 s."""
    stat = "1234 (my (odd) prog) S 1 1234 1234 0 -1 4194560 " + " ".join(["0"] * 12) + " 500 1000 2000"
    assert seconds_since_start(stat, "20.00 35.50\n", 100) == pytest.approx(15.0)


def test_process_seconds_counts_what_ran_before_the_import() -> None:
    """A real process sleeps 1.5 s before it imports the clock: the reported wall time includes that sleep."""
    code = textwrap.dedent("""
        import time
        time.sleep(1.5)
        from predmask.progress import process_seconds
        print(process_seconds())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert 1.5 <= float(out.stdout) < 30, out.stdout
