"""The submitit executor of a cluster config (``conf/cluster/<name>.yaml``): local processes or Slurm."""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from typing import Any

import submitit

from sweeps.launch.shell import check_env_name

__all__ = ["BACKENDS", "make_executor", "plain_config", "setup_lines"]

BACKENDS = ("local", "slurm")


def plain_config(cfg: Mapping[str, Any] | Any) -> dict[str, Any]:
    """A plain dict from a mapping or an OmegaConf DictConfig (resolved)."""
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(cfg, DictConfig):
            return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        pass
    if not isinstance(cfg, Mapping):
        raise TypeError(f"cluster config must be a mapping, got {type(cfg).__name__}")
    return dict(cfg)


def setup_lines(cluster_cfg: Mapping[str, Any], env: Mapping[str, str] | None = None) -> list[str]:
    """The sbatch setup lines of a cluster config: its ``setup`` lines verbatim (trusted site config such as
    ``module load``), then one ``export NAME=<shlex-quoted value>`` per entry of its ``env`` and of ``env``."""
    cfg = plain_config(cluster_cfg)
    lines = [str(line) for line in (cfg.get("setup") or [])]
    merged = {**(cfg.get("env") or {}), **(env or {})}
    for name, value in merged.items():
        lines.append(f"export {check_env_name(name)}={shlex.quote(str(value))}")
    return lines


def make_executor(
    folder: str | os.PathLike[str],
    cluster_cfg: Mapping[str, Any],
    *,
    name: str | None = None,
    env: Mapping[str, str] | None = None,
) -> submitit.AutoExecutor:
    """The submitit executor of a cluster config (``conf/cluster/<name>.yaml``).

    ``backend: local`` gives submitit's local executor (one process per task on this machine);
    ``backend: slurm`` gives its Slurm executor with ``nodes``, ``tasks_per_node``, ``gpus_per_node``,
    ``cpus_per_task``, ``mem_gb``, ``partition``, ``timeout_min``, ``max_num_timeout`` (requeues after a
    timeout), ``signal_delay_s``, ``slurm_additional_parameters`` and the setup lines of :func:`setup_lines`.
    ``env`` adds exports (quoted) to the sbatch script.
    """
    cfg = plain_config(cluster_cfg)
    backend = cfg.get("backend")
    if backend not in BACKENDS:
        raise ValueError(f"cluster backend {backend!r} is not one of {list(BACKENDS)}")
    nodes = _positive_int(cfg, "nodes", 1)
    tasks_per_node = _positive_int(cfg, "tasks_per_node", 1)
    timeout_min = _positive_int(cfg, "timeout_min", 24 * 60)
    max_num_timeout = _nonnegative_int(cfg, "max_num_timeout", 3)
    params: dict[str, Any] = {"timeout_min": timeout_min, "tasks_per_node": tasks_per_node}
    if name is not None:
        params["name"] = name
    for key in ("cpus_per_task", "mem_gb"):
        if cfg.get(key) is not None:
            params[key] = cfg[key]
    if backend == "local":
        if nodes != 1:
            raise ValueError(f"the local backend runs on one node, got nodes={nodes}")
        executor = submitit.AutoExecutor(
            folder=folder, cluster="local", local_max_num_timeout=max_num_timeout
        )
        executor.update_parameters(**params)
        return executor
    gpus_per_node = _nonnegative_int(cfg, "gpus_per_node", 0)
    params.update(nodes=nodes, gpus_per_node=gpus_per_node, slurm_setup=setup_lines(cfg, env))
    if cfg.get("partition"):
        params["slurm_partition"] = str(cfg["partition"])
    if cfg.get("signal_delay_s") is not None:
        params["slurm_signal_delay_s"] = _positive_int(cfg, "signal_delay_s", 90)
    extra = cfg.get("slurm_additional_parameters") or {}
    if not isinstance(extra, Mapping):
        raise TypeError(f"slurm_additional_parameters must be a mapping, got {extra!r}")
    if extra:
        params["slurm_additional_parameters"] = dict(extra)
    executor = submitit.AutoExecutor(folder=folder, cluster="slurm", slurm_max_num_timeout=max_num_timeout)
    executor.update_parameters(**params)
    return executor


def _positive_int(cfg: Mapping[str, Any], key: str, default: int) -> int:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"cluster {key} must be a positive integer, got {value!r}")
    return value


def _nonnegative_int(cfg: Mapping[str, Any], key: str, default: int) -> int:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"cluster {key} must be an integer >= 0, got {value!r}")
    return value
