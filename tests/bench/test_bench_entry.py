"""scripts/benchmark.py, the one benchmark entry: its help lists every sub-command, bad options exit 2 naming the
option, and the PASS/FAIL rows and the shared stopwatch measure what they say."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from predmask.bench import stopwatch, target

ROOT = Path(__file__).resolve().parents[2]
SUBCOMMANDS = ("loss", "engine", "study", "reports")


def bench(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "benchmark.py"), *argv], capture_output=True,
                          text=True, timeout=120, check=False)


def test_help_lists_each_sub_command_on_one_line() -> None:
    proc = bench("--help")
    assert proc.returncode == 0, proc.stderr
    listed = [line.split()[0] for line in proc.stdout.splitlines() if line.startswith("    ") and line.split()]
    assert [n for n in listed if n in SUBCOMMANDS] == list(SUBCOMMANDS)
    for name in SUBCOMMANDS:  # each sub-command's help shows the account of the module that measures
        sub = bench(name, "--help")
        assert sub.returncode == 0 and "bench.py:" in sub.stdout, sub.stderr


@pytest.mark.parametrize(("argv", "named"), [(["engine", "--steps", "0"], "--steps"),
                                             (["study", "--sequences", "256,x"], "--sequences"),
                                             (["study", "--seeds", "2,3"], "--seeds"),
                                             (["reports", "--steps", "-1"], "--steps"), (["speed"], "speed")])
def test_bad_options_exit_2_naming_the_option(argv: list[str], named: str) -> None:
    proc = bench(*argv)
    assert proc.returncode == 2
    assert named in proc.stderr.strip().splitlines()[-1]


def test_a_target_passes_at_its_limit_and_fails_above_it() -> None:
    assert target("t", 1.02, 1.02)["pass"] and not target("t", 1.0200001, 1.02)["pass"]
    assert target("t", 0.5, 1.5) == {"target": "t", "value": 0.5, "limit": 1.5, "pass": True}


def test_stopwatch_measures_wall_and_cpu_of_its_block() -> None:
    with stopwatch() as idle:
        time.sleep(0.05)
    with stopwatch() as busy:
        end = time.process_time() + 0.05
        while time.process_time() < end:
            pass
    assert idle["wall"] >= 0.05 and idle["cpu"] < 0.04
    assert busy["cpu"] >= 0.05 and busy["wall"] >= busy["cpu"] * 0.9
