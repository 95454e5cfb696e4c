"""The project root (predmask.rundir.project_root): found from a subfolder by the project's runs or its
pyproject.toml, named by $PREDMASK_ROOT from anywhere, and used by `python -m sweeps status` and the database
default (real folders, real subprocesses)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from predmask.command_text import sweep_command
from predmask.rundir import ROOT_ENV, project_root
from sweeps.families import expand
from sweeps.run_dirs import run_dir, write_planned_config

ENVS = ("PREDMASK_RUNS", "PREDMASK_DB", ROOT_ENV)


@pytest.fixture(autouse=True)
def _no_configured_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENVS:
        monkeypatch.delenv(name, raising=False)


def _project_with_a_completed_run(root: Path) -> str:
    """``root/runs/smoke/<id>``: one planned smoke run whose status says completed; returns its id."""
    spec = expand("smoke", ["method=dppo_topk_kl"])[0]
    path = run_dir(spec, root / "runs")
    path.mkdir(parents=True)
    write_planned_config(path, spec)
    (path / "status.json").write_text(json.dumps({"status": "completed", "step": 6, "total_steps": 6}))
    return spec.run_id


def _python(args: list[str], cwd: Path, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ENVS}
    out = subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env={**clean, **env},
    )
    return out.stdout


def test_the_nearest_folder_holding_runs_or_the_pyproject_is_the_root(tmp_path: Path) -> None:
    proj, deep = tmp_path / "proj", tmp_path / "proj" / "a" / "b"
    deep.mkdir(parents=True)
    assert project_root(deep) == deep  # nothing marks a project: a new one starts here
    (proj / "runs" / "smoke").mkdir(parents=True)
    assert project_root(deep) == deep  # an empty runs/ holds no run
    _project_with_a_completed_run(proj)
    assert project_root(deep) == proj and project_root(proj) == proj
    repo = tmp_path / "repo"
    (repo / "src").mkdir(parents=True)
    (repo / "pyproject.toml").write_text('[tool.x]\nname = "predmask"\n[project]\nname = "other"\n')
    assert project_root(repo / "src") == repo / "src"  # another project's pyproject is no marker
    (repo / "pyproject.toml").write_text(
        '[build-system]\nrequires = []\n\n[project]\nname = "predmask"  # us\n'
    )
    assert project_root(repo / "src") == repo


def test_a_configured_root_wins_from_anywhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _project_with_a_completed_run(tmp_path / "proj")
    monkeypatch.setenv(ROOT_ENV, str(tmp_path / "elsewhere"))
    assert project_root(tmp_path / "proj") == tmp_path / "elsewhere"


def test_sweeps_status_and_the_database_find_the_root_from_a_subfolder_and_a_configured_sibling(
    tmp_path: Path,
) -> None:
    proj, sub, sibling = tmp_path / "proj", tmp_path / "proj" / "notes" / "today", tmp_path / "sibling"
    run_id = _project_with_a_completed_run(proj)
    sub.mkdir(parents=True)
    sibling.mkdir()
    status = ["-m", "sweeps", "status", "smoke"]
    db = ["-c", "from analysis.store import default_db_path; print(default_db_path())"]

    from_sub = _python(status, sub)
    assert f"runs under {proj / 'runs'}" in from_sub and f" {run_id} " in from_sub
    assert from_sub.splitlines()[-1] == "every run completed; next: python -m reports paper"
    assert _python(db, sub).strip() == str(proj / "results" / "predmask.duckdb")

    alone = _python(status, sibling)  # a sibling is no ancestor: a new project there
    assert run_id not in alone and "no runs under runs yet" in alone.splitlines()[-1]
    assert _python(db, sibling).strip() == str(sibling / "results" / "predmask.duckdb")

    configured = _python(status, sibling, **{ROOT_ENV: str(proj)})
    assert f" {run_id} " in configured and configured.splitlines()[-1].startswith("every run completed")
    assert _python(db, sibling, **{ROOT_ENV: str(proj)}).strip() == str(proj / "results" / "predmask.duckdb")
    runs_elsewhere = _python(
        status, sub, PREDMASK_RUNS=str(sibling / "runs")
    )  # $PREDMASK_RUNS keeps priority
    assert run_id not in runs_elsewhere


def test_other_roots_are_the_folders_near_here_holding_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from predmask.rundir import other_roots

    proj, sibling, below = tmp_path / "proj", tmp_path / "sibling", tmp_path / "here" / "below"
    for folder in (proj, sibling, below):
        _project_with_a_completed_run(folder)
    (tmp_path / "empty" / "runs").mkdir(parents=True)
    here = tmp_path / "here"
    found = other_roots(here)
    assert {proj, sibling, below} <= set(found) and tmp_path / "empty" not in found and here not in found
    assert other_roots(proj).count(sibling) == 1 and proj not in other_roots(proj)  # the root found is no other
    monkeypatch.setenv(ROOT_ENV, str(tmp_path / "new"))
    assert proj in other_roots(tmp_path / "new")  # a configured root elsewhere: the runs near here are others


def test_a_sweep_that_would_start_over_names_where_its_finished_runs_are(tmp_path: Path) -> None:
    """From a sibling folder and from the folder above the project, `--dry-run` plans the run afresh and warns with
    the finished run's root and the command that uses it; from a subfolder, or with that root configured, it does
    not warn (the runs are found)."""
    proj, sibling = tmp_path / "proj", tmp_path / "sibling"
    seed = "seed=977"  # a run id no other folder on this machine holds (the checkout's own runs/ is searched too)
    spec = expand("smoke", ["method=dppo_topk_kl", seed])[0]
    path = run_dir(spec, proj / "runs")
    path.mkdir(parents=True)
    write_planned_config(path, spec)
    (path / "status.json").write_text(json.dumps({"status": "completed", "step": 6, "total_steps": 6}))
    (proj / "notes").mkdir()
    sibling.mkdir()
    dry = ["-m", "sweeps", "smoke", "method=dppo_topk_kl", seed, "--dry-run"]

    def warnings(cwd: Path, **env: str) -> list[str]:
        clean = {k: v for k, v in os.environ.items() if k not in ENVS}
        out = subprocess.run([sys.executable, *dry], cwd=cwd, capture_output=True, text=True, timeout=120,
                             check=True, env={**clean, **env})
        return [line for line in out.stderr.splitlines() if line.startswith("warning: ")]

    for cwd in (sibling, tmp_path):
        assert warnings(cwd) == [(
            f"warning: 1 of these 1 runs would start over under {cwd / 'runs'}, but runs with the same ids finished "
            f"under {proj / 'runs'}; to use them: PREDMASK_ROOT={proj} {sweep_command(f'smoke {dry[3]} {seed}')}"
        )]
    assert warnings(proj / "notes") == [] and warnings(sibling, **{ROOT_ENV: str(proj)}) == []
    assert warnings(sibling, PREDMASK_RUNS=str(sibling / "runs")) == []  # a runs root named, not found
