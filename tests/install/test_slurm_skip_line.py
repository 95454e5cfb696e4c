"""The test command as an ordinary user: the Slurm tests skip with one line saying why and how to run them.

Real pytest subprocesses on the project's own Slurm tests, against an empty cluster state directory (so the
cluster is "not running" whatever this machine runs). Faked: the user id (``os.geteuid``, patched by a
one-line pytest plugin), because the suite itself may run as root (CI) or not, and switching users needs an
account this machine may not have.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SLURM_TEST = "tests/slurm/test_slurm_job_names.py"
OTHER_TEST = "tests/slurm/test_slurm_executor.py::test_shell_join_round_trips_through_a_shell"

pytestmark = pytest.mark.slow  # each test is a pytest subprocess importing the sweeps


def pytest_as(uid: int, tmp_path: Path, *, ci: bool = False) -> subprocess.CompletedProcess[str]:
    plugin_dir = tmp_path / "plugin"
    plugin_dir.mkdir(exist_ok=True)
    (plugin_dir / "fake_euid.py").write_text(f"import os\nos.geteuid = lambda: {uid}\n")
    env = {k: v for k, v in os.environ.items() if k not in ("SLURM_CONF", "CI", "PYTEST_ADDOPTS")}
    env.update(PYTHONPATH=str(plugin_dir), PREDMASK_SLURM_DIR=str(tmp_path / "no-cluster"))
    if ci:
        env["CI"] = "true"
    return subprocess.run(
        [sys.executable, "-m", "pytest", SLURM_TEST, OTHER_TEST, "-p", "fake_euid", "-rs", "-q",
         "-p", "no:cacheprovider"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False,
    )


def needs_root_line(tmp_path: Path) -> str:
    return ("SLURM TESTS SKIPPED: the emulated Slurm cluster is not running and needs root to start munge and "
            "slurmd; to run them: sudo bash scripts/test.sh, or sudo bash scripts/slurm-emulated.sh start && "
            f"export SLURM_CONF={tmp_path / 'no-cluster' / 'slurm.conf'}")


def test_an_ordinary_user_sees_one_line_once_and_it_is_the_skip_reason(tmp_path: Path) -> None:
    proc = pytest_as(1000, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:]
    line = needs_root_line(tmp_path)
    lines = proc.stdout.splitlines()
    assert lines.count(line) == 1, proc.stdout  # printed once, after collection
    skipped = [x for x in lines if x.startswith("SKIPPED [")]
    assert len(skipped) == 1 and skipped[0].endswith(f": {line}"), proc.stdout  # every Slurm test, one reason
    assert "1 passed, 1 skipped" in lines[-1], lines[-1]  # the test that needs no cluster still runs


def test_root_gets_what_is_wrong_with_the_cluster_not_the_root_line(tmp_path: Path) -> None:
    proc = pytest_as(0, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "needs root" not in proc.stdout
    assert "scripts/slurm-emulated.sh start" in proc.stdout


def test_under_ci_the_slurm_tests_fail_instead(tmp_path: Path) -> None:
    proc = pytest_as(1000, tmp_path, ci=True)
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert f"CI=true but the Slurm tests cannot run: {needs_root_line(tmp_path)}" in proc.stdout
    assert "1 passed, 1 error" in proc.stdout.splitlines()[-1]  # fails in setup: an error, not a skip
