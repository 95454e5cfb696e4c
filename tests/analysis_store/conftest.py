"""Fixtures for the results-store tests: run directories written by hand in tmp_path."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml


def jsonl(records: Sequence[tuple[int, dict[str, Any]]]) -> str:
    """verl file-logger lines for (step, data) records."""
    return "".join(json.dumps({"step": s, "data": d}) + "\n" for s, d in records)


def make_run(
    root: Path,
    sweep: str,
    run_id: str,
    config: dict[str, Any] | None = None,
    files: dict[str, str] | None = None,
    status: dict[str, Any] | None = None,
) -> Path:
    """runs/<sweep>/<run_id>/ with config.yaml, status.json and the given metrics files (name -> text)."""
    d = root / "runs" / sweep / run_id
    d.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (d / "config.yaml").write_text(yaml.safe_dump(config))
    if status is not None:
        (d / "status.json").write_text(json.dumps(status))
    for name, text in (files or {}).items():
        (d / name).write_text(text)
    return d


def cpu_config(method: str = "predmask_kl_agg", delta: float = 0.15, seed: int = 3) -> dict[str, Any]:
    return {
        "seed": seed,
        "delta": delta,
        "top_k": 20,
        "run_dir": "ignored",
        "method": {"name": method, "delta": "${delta}", "loss_agg_mode": "token-mean"},
        "model": {"name": "cpu_s", "stands_in_for": "qwen3_4b_base"},
        "precision": {"name": "bf16"},
        "cluster": {"name": "local"},
    }


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "results" / "test.duckdb"


@pytest.fixture
def helpers():
    """The helper functions of this conftest (fixtures, so test files never import conftest by name)."""

    class H:
        pass

    H.jsonl = staticmethod(jsonl)
    H.make_run = staticmethod(make_run)
    H.cpu_config = staticmethod(cpu_config)
    return H
