"""scripts/install.sh and scripts/test.sh run for real (bash, subprocesses) in a scratch copy of the project.

Faked, because a real venv means minutes of pip installs and a network: the interpreters. ``PYTHON`` and the
``.venv/bin/python`` install.sh makes are tests/install/fake_python.py (see its docstring): they run install.sh's
own ``-c`` checks on the real interpreter but claim a version, a base prefix and whether ensurepip exists, and
"install" a package by writing a module. What is checked is install.sh's logic: which interpreter it uses, what
it asks pip for and in which order, that it reuses ``.venv``, and that it refuses bad input in one line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
FAKE = Path(__file__).resolve().parent / "fake_python.py"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def make_fake(path: Path, **cfg: Any) -> Path:
    """An executable fake interpreter at path/python (fake.json beside it: version, base_prefix, ...)."""
    path.mkdir(parents=True)
    exe = path / "python"
    exe.write_text(f"#!{sys.executable} -IS\n" + FAKE.read_text())
    exe.chmod(0o755)
    (path / "fake.json").write_text(json.dumps({"version": "3.11.2", "base_prefix": str(path), **cfg}))
    return exe


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A scratch project: the real scripts, a pyproject.toml, no .venv."""
    root = tmp_path / "project"
    (root / "scripts").mkdir(parents=True)
    for name in ("install.sh", "test.sh"):
        shutil.copy(REPO / "scripts" / name, root / "scripts" / name)
    (root / "pyproject.toml").write_text('[project]\nname = "predmask"\n')
    return root


def run(project: Path, script: str = "install.sh", *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "EXTRAS", "CI", "SLURM_CONF")}
    base["FAKE_PYTHON_LOG"] = str(project.parent / "calls.jsonl")
    return subprocess.run(["bash", str(project / "scripts" / script), *args], capture_output=True, text=True,
                          env={**base, **env}, timeout=120, check=False)


def calls(project: Path) -> list[tuple[str, list[str]]]:
    """(which interpreter: 'base' or 'venv', argv) of every fake interpreter call so far, then forgets them."""
    log = project.parent / "calls.jsonl"
    if not log.exists():
        return []
    venv = str((project / ".venv").resolve())
    out = [json.loads(line) for line in log.read_text().splitlines()]
    log.unlink()
    return [("venv" if c["exe"].startswith(venv) else "base", c["argv"]) for c in out]


def pip_installs(seen: list[tuple[str, list[str]]]) -> list[list[str]]:
    assert all(who == "venv" for who, argv in seen if argv[:2] == ["-m", "pip"]), "pip must be the venv's"
    return [argv[3:] for who, argv in seen if argv[:3] == ["-m", "pip", "install"]]


def one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode != 0, proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("install.sh: "), proc.stderr
    return lines[0]


def test_fresh_install_makes_venv_from_python_then_cpu_torch_then_the_project(project: Path, tmp_path: Path) -> None:
    py = make_fake(tmp_path / "sys", base_prefix="/usr")
    proc = run(project, PYTHON=str(py))
    assert proc.returncode == 0, proc.stderr
    seen = calls(project)
    assert ("base", ["-m", "venv", ".venv"]) in seen
    assert pip_installs(seen) == [["--progress-bar", "off", "torch==2.13.0+cpu"], ["--progress-bar", "off", "-e", ".[dev]"]]
    assert f"in {(project / '.venv').resolve()}" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1].startswith("install.sh: next: .venv/bin/python -m sweeps ")


def test_in_a_terminal_pip_shows_its_progress_and_each_step_says_how_long_it_took(project: Path, tmp_path: Path) -> None:
    """Run under a real pseudo-terminal (util-linux ``script``): pip gets no ``--progress-bar off`` (its bars show),
    while redirected output (the test above) turns the bars off and keeps pip's line per package."""
    if shutil.which("script") is None:
        pytest.skip("util-linux 'script' (a pseudo-terminal) is not installed")
    py = make_fake(tmp_path / "sys", base_prefix="/usr")
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "EXTRAS", "CI", "SLURM_CONF")}
    env = {**base, "FAKE_PYTHON_LOG": str(project.parent / "calls.jsonl"), "PYTHON": str(py)}
    cmd = f"bash {project / 'scripts' / 'install.sh'}"
    proc = subprocess.run(["script", "-qec", cmd, "/dev/null"], capture_output=True, text=True, env=env,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert pip_installs(calls(project)) == [["torch==2.13.0+cpu"], ["-e", ".[dev]"]]
    assert "install.sh: torch installed (" in proc.stdout and "installed (0m" in proc.stdout


def test_torch_comes_from_pytorchs_cpu_index_when_pips_sources_lack_it_never_as_cuda_build(
    project: Path, tmp_path: Path
) -> None:
    py = make_fake(tmp_path / "sys", pip_fails=[["torch", "--extra-index-url"]])
    proc = run(project, PYTHON=str(py))
    assert proc.returncode == 0, proc.stderr
    torch_calls = [args for args in pip_installs(calls(project)) if any(a.startswith("torch") for a in args)]
    assert torch_calls == [["--progress-bar", "off", "torch==2.13.0+cpu"],
                           ["--progress-bar", "off", "torch==2.13.0+cpu", "--extra-index-url", CPU_INDEX]]


def test_torch_nowhere_is_one_line_and_leaves_no_stamp_so_the_next_run_retries(project: Path, tmp_path: Path) -> None:
    py = make_fake(tmp_path / "sys", pip_fails=[["torch", ""]])
    proc = run(project, PYTHON=str(py))
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        f"install.sh: pip could not install torch==2.13.0+cpu from its configured sources nor {CPU_INDEX}"
        " (output above)")
    calls(project)
    (project / ".venv" / "bin" / "fake.json").write_text(json.dumps(
        {**json.loads((project / ".venv" / "bin" / "fake.json").read_text()), "pip_fails": []}))
    assert run(project).returncode == 0
    assert [a[-1] for a in pip_installs(calls(project))] == ["torch==2.13.0+cpu", ".[dev]"]


def test_a_second_run_reuses_the_venv_and_installs_nothing_until_extras_or_pyproject_change(
    project: Path, tmp_path: Path
) -> None:
    py = make_fake(tmp_path / "sys")
    assert run(project, PYTHON=str(py)).returncode == 0
    calls(project)
    again = run(project, PYTHON=str(py))
    assert again.returncode == 0 and "is up to date (predmask 0.1.0, torch 2.13.0+cpu; extras dev)" in again.stdout
    seen = calls(project)
    assert pip_installs(seen) == [] and not any(argv[:2] == ["-m", "venv"] for _, argv in seen)

    assert run(project, EXTRAS="dev,verl").returncode == 0  # no PYTHON: the existing venv, whatever made it
    assert pip_installs(calls(project)) == [["--progress-bar", "off", "-e", ".[dev,verl]"]]  # torch is there already
    back = run(project, EXTRAS="verl,dev")  # what is installed already, in any order
    assert back.returncode == 0 and "; extras dev,verl)" in back.stdout
    assert run(project).returncode == 0
    assert pip_installs(calls(project)) == []

    with open(project / "pyproject.toml", "a") as f:
        f.write('version = "0.2.0"\n')
    assert run(project, EXTRAS="dev,verl").returncode == 0
    assert pip_installs(calls(project)) == [["--progress-bar", "off", "-e", ".[dev,verl]"]]


def test_python_is_honoured_a_venv_of_another_interpreter_is_refused_not_reused(project: Path, tmp_path: Path) -> None:
    first = make_fake(tmp_path / "a", base_prefix="/opt/a")
    other = make_fake(tmp_path / "b", base_prefix="/opt/b", version="3.12.1")
    assert run(project, PYTHON=str(first)).returncode == 0
    calls(project)
    line = one_error_line(run(project, PYTHON=str(other)))
    assert line == (f"install.sh: .venv was made from Python '/opt/a 3.11.2', not PYTHON={other} ('/opt/b 3.12.1');"
                    " remove it (rm -rf .venv) to rebuild it")
    assert pip_installs(calls(project)) == []


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        ({"ensurepip": False},
         ("install.sh: '{py}' (Python 3.11) has no venv/ensurepip to make .venv; on Debian/Ubuntu: apt install"
          " python3-venv (or python3.11-venv)")),
        ({"version": "3.9.18"},
         "install.sh: '{py}' is Python 3.9; predmask needs Python 3.10-3.13 (set PYTHON=/path/to/python3.X)"),
        ({"version": "3.14.0"},
         "install.sh: '{py}' is Python 3.14; predmask needs Python 3.10-3.13 (set PYTHON=/path/to/python3.X)"),
    ],
)
def test_an_interpreter_that_cannot_serve_is_refused_in_one_line_before_anything_is_made(
    project: Path, tmp_path: Path, cfg: dict[str, Any], message: str
) -> None:
    py = make_fake(tmp_path / "sys", **cfg)
    assert one_error_line(run(project, PYTHON=str(py))) == message.format(py=py)
    assert not (project / ".venv").exists()
    assert all(who == "base" and argv[0] == "-c" for who, argv in calls(project))  # checks only, no venv


def test_no_interpreter_at_all_is_one_line(project: Path, tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "python3"
    assert one_error_line(run(project, PYTHON=str(missing))) == (
        f"install.sh: no Python interpreter '{missing}' on PATH; install Python 3.10-3.13 or set"
        " PYTHON=/path/to/python3")


def test_a_failed_venv_creation_keeps_nothing(project: Path, tmp_path: Path) -> None:
    py = make_fake(tmp_path / "sys", venv_fails=True)
    proc = run(project, PYTHON=str(py))
    assert proc.returncode == 1 and not (project / ".venv").exists()
    assert proc.stderr.strip().splitlines()[-1] == f"install.sh: '{py}' -m venv .venv failed (output above); nothing was kept"


def test_a_broken_venv_is_named_not_patched(project: Path) -> None:
    (project / ".venv" / "bin").mkdir(parents=True)
    assert one_error_line(run(project)) == (
        f"install.sh: {project.resolve()}/.venv exists but .venv/bin/python is not a working virtual environment;"
        " remove it (rm -rf .venv) and rerun")


def test_bad_extras_are_refused_before_anything_runs(project: Path) -> None:
    assert one_error_line(run(project, EXTRAS="dev;rm -rf /")) == (
        "install.sh: EXTRAS must be comma-separated extra names such as dev,verl, got 'dev;rm -rf /'")
    assert calls(project) == []


def test_test_sh_installs_dev_and_verl_then_runs_pytest_with_the_venvs_interpreter(project: Path, tmp_path: Path) -> None:
    py = make_fake(tmp_path / "sys")
    proc = run(project, "test.sh", "-x", "tests/method", PYTHON=str(py))
    assert proc.returncode == 0, proc.stderr
    seen = calls(project)
    assert pip_installs(seen)[-1] == ["--progress-bar", "off", "-e", ".[dev,verl]"]
    assert seen[-1] == ("venv", ["-m", "pytest", "-x", "tests/method"])


def test_test_sh_treats_no_collected_tests_as_a_failure(project: Path, tmp_path: Path) -> None:
    py = make_fake(tmp_path / "sys")
    proc = run(project, "test.sh", PYTHON=str(py), FAKE_PYTEST_RC="5")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == "test.sh: pytest collected no tests: that is a failure here"
