"""`python -m sweeps status` and the sweep's view of a run directory: a run whose status.json says running is
running only while a process holds its writer lock (a real process holding it, then gone), else dead."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from sweeps.families import expand
from sweeps.run_dirs import read_state, run_dir, write_planned_config

HOLD = ("import sys\nfrom pathlib import Path\nfrom predmask.rundir import hold_run_lock\n"
        "with hold_run_lock(Path(sys.argv[1])):\n    print('held', flush=True)\n    sys.stdin.read()")


def _status(tmp: Path) -> str:
    out = subprocess.run([sys.executable, "-m", "sweeps", "status", "smoke"], cwd=tmp, capture_output=True,
                         text=True, timeout=120, check=True, env={**os.environ, "PREDMASK_RUNS": str(tmp / "runs")})
    return out.stdout


def test_a_running_run_without_its_writer_is_dead(tmp_path: Path) -> None:
    spec = expand("smoke", ["method=dppo_topk_kl"])[0]
    path = run_dir(spec, tmp_path / "runs")
    path.mkdir(parents=True)
    write_planned_config(path, spec)
    (path / "status.json").write_text(json.dumps({"status": "running", "step": 3, "total_steps": 6}))
    assert yaml.safe_load((path / "planned_config.yaml").read_text())["seed"] == 0
    writer = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "held"
        assert read_state(path).status == "running"
        assert " running " in _status(tmp_path).replace("│", " ")
    finally:
        writer.communicate("", timeout=60)
    assert read_state(path).status == "dead"
    assert (read_state(path).step, read_state(path).total_steps) == (3, 6)
    table = _status(tmp_path).replace("│", " ")
    assert f" {spec.run_id} " in table and " dead " in table and " running " not in table
    assert table.splitlines()[-1].startswith("smoke: 1 not completed (1 dead); next: rerun the sweep's own command")


def test_status_names_what_to_run_next(tmp_path: Path) -> None:
    assert _status(tmp_path).splitlines()[-1] == (
        f"no runs under {tmp_path / 'runs'} yet; next: python -m sweeps smoke (a few minutes), then python -m "
        "reports paper")
    spec = expand("smoke", ["method=dppo_topk_kl"])[0]
    path = run_dir(spec, tmp_path / "runs")
    path.mkdir(parents=True)
    write_planned_config(path, spec)
    (path / "status.json").write_text(json.dumps({"status": "completed", "step": 6, "total_steps": 6}))
    assert _status(tmp_path).splitlines()[-1] == "every run completed; next: python -m reports paper"


def test_the_next_commands_after_completed_sweeps_are_the_owners_spelling(tmp_path: Path) -> None:
    from collections import Counter

    from predmask.command_text import ACCURACY_WEIGHTING, PAPER, REPORT_VARIATIONAL, command
    from sweeps.__main__ import status_next

    done = Counter(completed=3)
    variational = f"{command(ACCURACY_WEIGHTING)} and {command(REPORT_VARIATIONAL)}"
    assert status_next({"variational_reasoning": done}, tmp_path) == [f"every run completed; next: {variational}"]
    assert status_next({"main_comparison": done, "variational_reasoning": done}, tmp_path) == [
        f"every run completed; next: {command(PAPER)} and {variational}"]


def test_the_status_benchmark_shows_every_synthetic_run_in_its_state(tmp_path: Path) -> None:
    """scripts/benchmark.py status: its synthetic runs are real run directories that status reads as written."""
    from sweeps import status_bench

    record = status_bench.measure(tmp_path, 7)
    assert (record["returncode"], record["rows"]) == (0, 7)
    states = [read_state(p).status for p in sorted((tmp_path / status_bench.SWEEP).iterdir())]
    assert states == ["completed", "failed", "dead"] * 2 + ["completed"]  # running with no writer: dead
    assert record["target"]["value"] == record["cpu_s"] > 0
