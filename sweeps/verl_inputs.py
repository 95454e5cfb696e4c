"""The inputs of a verl run on the CPU: its stand-in model exported for vLLM, and the engine's task as verl parquet.

A run on a cluster with ``device: cpu`` trains the cluster's ``standin`` model (:mod:`predmask.verl.cpu_standin`).
Before its job starts the sweep makes, once for every run that shares them and under the base-model cache:

- the stand-in's base model as a Hugging Face directory (:func:`predmask.rl.hf_export.export_base_model`; the
  CPU engine's cached base model, pretrained first if the cache has none);
- the task's training stream for the run's seed and the held-out splits as verl parquet
  (:func:`sweeps.datasets.write_arithmetic`) in ``<cache>/verl-data-<key>/``, written whole or not at all.

:func:`verl_inputs` returns their paths, which the run's verl command reads; a dry run computes the same paths
without making anything.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from predmask.config import group_entry
from predmask.io import atomic_write_dir
from predmask.schemas.task_schema import TaskConfig
from predmask.schemas.train_schema import BaseConfig
from predmask.verl.arithmetic_task import ARITHMETIC_DATA_FILES
from predmask.verl.cpu_standin import INPUTS_KEY
from sweeps.datasets import arithmetic_train_size, write_arithmetic

#: the data folder's prefix under the cache (one folder per task, seed and stream length)
DATA_PREFIX = "verl-data-"


def _standin_model(run_cfg: Mapping[str, Any]) -> dict[str, Any]:
    name = (run_cfg.get("cluster") or {}).get("standin")
    if not name:
        raise ValueError("cluster.standin is not set: a verl run on the CPU needs the CPU model it trains")
    return group_entry("model", str(name))


def data_dir(run_cfg: Mapping[str, Any], cache: Path) -> Path:
    """The parquet folder of ``run_cfg``: keyed by everything that decides its rows (task, seed, stream length)."""
    payload = {"task": run_cfg["task"], "seed": int(run_cfg["seed"]), "rows": arithmetic_train_size(run_cfg)}
    key = hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return cache / f"{DATA_PREFIX}{key}"


def verl_inputs(run_cfg: Mapping[str, Any], *, make: bool) -> dict[str, Any]:
    """The paths a CPU verl run of ``run_cfg`` reads (the run config's ``verl_inputs``), made first when ``make``
    and missing; ValueError (one line) for a stand-in vLLM's CPU build cannot serve."""
    from predmask.rl.hf_export import (  # torch: only where a CPU run is planned
        export_base_model,
        hf_export_dir,
    )

    model_cfg = _standin_model(run_cfg)
    task = TaskConfig.from_mapping(dict(run_cfg["task"]))
    base = BaseConfig.from_mapping(run_cfg["base"])
    cache = Path(str(run_cfg.get("cache_dir") or "results/cache")).resolve()
    model_path = hf_export_dir(model_cfg, task, base, cache)
    data = data_dir(run_cfg, cache)
    if make:
        model_path, _ = export_base_model(model_cfg, task, base, cache_dir=cache)
        if not (data / ARITHMETIC_DATA_FILES["train"]).is_file():
            atomic_write_dir(data, lambda tmp: write_arithmetic(tmp, run_cfg))
    files = {key: str(data / name) for key, name in ARITHMETIC_DATA_FILES.items()}
    return {"model_path": str(model_path), "max_position_embeddings": int(model_cfg["max_position_embeddings"]),
            "label": str(model_cfg.get("label") or model_cfg["name"]), "train_files": [files.pop("train")],
            "val_files": sorted(files.values())}


def with_verl_inputs(run_cfg: Mapping[str, Any], *, make: bool) -> dict[str, Any]:
    """``run_cfg`` with its ``verl_inputs`` (:func:`verl_inputs`) when its cluster runs verl on the CPU."""
    cluster = run_cfg.get("cluster") or {}
    if cluster.get("trainer") != "verl" or cluster.get("device") != "cpu":
        return dict(run_cfg)
    return {**run_cfg, INPUTS_KEY: verl_inputs(run_cfg, make=make)}


def recorded_config(run_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The config.yaml of a run: ``run_cfg`` itself, except that a CPU verl run records the model it trains (the
    cluster's stand-in, ``resolved_from`` the model it replaces, as the CPU engine records its stand-ins) and its
    inputs' paths, so that ingest and the reports name what ran."""
    cluster = run_cfg.get("cluster") or {}
    if cluster.get("trainer") != "verl" or cluster.get("device") != "cpu":
        return dict(run_cfg)
    model = run_cfg.get("model") or {}
    model = model if isinstance(model, Mapping) else {"name": model}
    standin = _standin_model(run_cfg)
    paper = model.get("stands_in_for") or model.get("name")
    label = (f"{standin['name']}: tiny Qwen3 trained by verl on a CPU, stand-in for {model.get('label') or paper} "
             "(not the real model)")
    return {**with_verl_inputs(run_cfg, make=False),
            "model": {**standin, "stands_in_for": paper, "label": label, "resolved_from": model.get("name")}}

