"""`python -m sweeps paper`: the printed plan and its estimates, running the steps in order, stopping at the first
failure, resuming, and Ctrl-C, all through real subprocesses. The real steps take an hour, so the runs use tiny
stand-in steps (the test-only PREDMASK_PAPER_STANDINS); the plan they print still names the real commands."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from predmask.command_text import PAPER_STEPS
from sweeps.paper_plan import ESTIMATES, STANDINS_ENV

#: a stand-in step i: fails with status 3 while fail-<i> exists; else records "skip i" when done-<i> exists (a
#: finished step's rerun), otherwise "run i" and marks itself done. Appends to log.txt in its working directory.
STEP = """import pathlib, sys
i, here = sys.argv[1], pathlib.Path.cwd()
if (here / f"fail-{i}").exists():
    sys.exit(3)
done = here / f"done-{i}"
with open(here / "log.txt", "a") as log:
    log.write(("skip" if done.exists() else "run") + f" {i}\\n")
done.touch()
"""

#: a stand-in step that waits for Ctrl-C: announces itself, counts the SIGINTs it gets, exits 130 on the first.
SLEEPER = """import pathlib, signal, sys, time
here = pathlib.Path.cwd()
def stop(*_):
    with open(here / "sigints.txt", "a") as f:
        f.write("SIGINT\\n")
    time.sleep(0.5)  # a second SIGINT during the step's own shutdown would be counted
    sys.exit(130)
signal.signal(signal.SIGINT, stop)
(here / "started").touch()
time.sleep(60)
"""


def _paper(tmp: Path, standins: list[list[str]] | None, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PREDMASK_RUNS": str(tmp / "runs"), "PREDMASK_DB": str(tmp / "db.duckdb")}
    if standins is not None:
        env[STANDINS_ENV] = json.dumps(standins)
    return subprocess.run([sys.executable, "-m", "sweeps", "paper", *args], cwd=tmp, env=env, check=False,
                          capture_output=True, text=True, timeout=120)


def _standins() -> list[list[str]]:
    return [[sys.executable, "-c", STEP, str(i)] for i in range(1, len(PAPER_STEPS) + 1)]


def test_dry_run_lists_every_step_in_order_with_an_estimate_and_the_total(tmp_path: Path) -> None:
    out = _paper(tmp_path, _standins(), "--dry-run")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    rows = [line for line in lines if re.match(r"\s+\d+\. ", line)]
    assert len(rows) == len(PAPER_STEPS) == 7
    for n, (row, step) in enumerate(zip(rows, PAPER_STEPS, strict=True), 1):
        assert row.lstrip().startswith(f"{n}. ") and f" -m {step} " in row, row
        assert re.search(r" (measured|estimate): ", row), row
    minutes = [float(re.search(r"([\d.]+) min", row).group(1)) for row in rows]
    total = next(line for line in lines if line.lstrip().startswith("total"))
    assert float(re.search(r"([\d.]+) min", total).group(1)) == round(sum(minutes), 1)
    guessed = sum(" estimate: " in row for row in rows)
    assert f"{guessed} of 7 steps estimated" in total and guessed == sum(not e.measured for e in ESTIMATES.values())
    assert "2 cores, 2026-12-02" in lines[0]
    assert not (tmp_path / "log.txt").exists() and not (tmp_path / "runs").exists()  # nothing ran


def test_steps_run_in_order_stop_at_the_first_failure_and_resume(tmp_path: Path) -> None:
    (tmp_path / "fail-4").touch()
    first = _paper(tmp_path, _standins())
    assert first.returncode == 3
    assert (tmp_path / "log.txt").read_text().split("\n")[:-1] == ["run 1", "run 2", "run 3"]
    assert first.stderr.splitlines() == [first.stderr.strip()]  # one line
    assert first.stderr.startswith("step 4/7 failed (exit 3): ") and f"-m {PAPER_STEPS[3]};" in first.stderr
    assert first.stdout.count("=== step") == 4

    (tmp_path / "fail-4").unlink()
    second = _paper(tmp_path, _standins())
    assert second.returncode == 0, second.stderr
    assert (tmp_path / "log.txt").read_text().split("\n")[3:-1] == [
        "skip 1", "skip 2", "skip 3", "run 4", "run 5", "run 6", "run 7"]
    headers = [line for line in second.stdout.splitlines() if line.startswith("=== step")]
    assert [h.split()[2] for h in headers] == [f"{i}/7:" for i in range(1, 8)]
    assert all(f"-m {step} (about " in h for h, step in zip(headers, PAPER_STEPS, strict=True))


@pytest.mark.parametrize("to_group", [False, True], ids=["to-the-process", "to-its-process-group"])
def test_ctrl_c_passes_one_sigint_to_the_step_and_exits_130_with_one_line(tmp_path: Path, to_group: bool) -> None:
    """SIGINT to the plan's process, or to its whole process group as a terminal's Ctrl-C sends it: the step gets
    exactly one SIGINT either way."""
    standins = _standins()
    standins[1] = [sys.executable, "-c", SLEEPER]
    env = {**os.environ, STANDINS_ENV: json.dumps(standins), "PREDMASK_RUNS": str(tmp_path / "runs")}
    proc = subprocess.Popen([sys.executable, "-m", "sweeps", "paper"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "started").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the sleeping step never started"
        time.sleep(0.05)
    if to_group:  # the plan leads its own process group here, as a shell's foreground job does
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert len(stderr.splitlines()) == 1 and stderr.startswith("interrupted in step 2/7 ("), stderr
    assert f"-m {PAPER_STEPS[1]})" in stderr and "-m sweeps paper to resume" in stderr
    assert (tmp_path / "sigints.txt").read_text() == "SIGINT\n"  # exactly one, passed on by the plan
    assert (tmp_path / "log.txt").read_text() == "run 1\n"  # step 3 never started
    assert "=== step 3/7" not in stdout
