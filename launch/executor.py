"""The submitit executor of a cluster config (``conf/cluster/<name>.yaml``): local processes or Slurm."""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import submitit
from omegaconf import DictConfig, OmegaConf
from submitit.slurm.slurm import (  # the script renderer, without Slurm detection
    _convert_mem,
    _make_sbatch_string,
)

from launch.local_controller import start_controller
from launch.shell import check_env_name

BACKENDS = ("local", "slurm")
#: sbatch's ``--mem`` for all the memory of every node of the job
WHOLE_NODE_MEM = "0"
#: the sbatch options that size a job's memory: one of them in ``slurm_additional_parameters`` sizes it in place of
#: ``mem_gb`` (both set: refused)
MEMORY_OPTIONS = ("mem", "mem_per_cpu", "mem_per_gpu")


def plain_config(cfg: Mapping[str, Any] | Any) -> dict[str, Any]:
    """A plain dict from a mapping or an OmegaConf DictConfig (resolved)."""
    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    if not isinstance(cfg, Mapping):
        raise TypeError(f"cluster config must be a mapping, got {type(cfg).__name__}")
    return dict(cfg)


@dataclass(frozen=True)
class JobShape:
    """What one job of a cluster config asks for, with the launch layer's defaults filled in."""

    backend: str
    nodes: int
    tasks_per_node: int
    gpus_per_node: int
    cpus_per_task: int | None
    mem_gb: float | None
    timeout_min: int
    max_num_timeout: int
    partition: str | None
    exclusive: bool  # whole nodes: ``slurm_additional_parameters.exclusive: true``


def job_shape(cluster_cfg: Mapping[str, Any]) -> JobShape:
    """The :class:`JobShape` of a cluster config; a bad value is a one-line ValueError naming it."""
    cfg = plain_config(cluster_cfg)
    backend = cfg.get("backend")
    if backend not in BACKENDS:
        raise ValueError(f"cluster backend {backend!r} is not one of {list(BACKENDS)}")
    shape = JobShape(
        backend=str(backend),
        nodes=_int_at_least(cfg, "nodes", 1),
        tasks_per_node=_int_at_least(cfg, "tasks_per_node", 1),
        gpus_per_node=_int_at_least(cfg, "gpus_per_node", 0, low=0),
        cpus_per_task=_int_at_least(cfg, "cpus_per_task", 1) if cfg.get("cpus_per_task") is not None else None,
        mem_gb=_mem_gb(cfg),
        timeout_min=_int_at_least(cfg, "timeout_min", 24 * 60),
        max_num_timeout=_int_at_least(cfg, "max_num_timeout", 3, low=0),
        partition=str(cfg["partition"]) if cfg.get("partition") else None,
        exclusive=_extra(cfg).get("exclusive") is True,
    )
    if backend == "local" and shape.nodes != 1:
        raise ValueError(f"the local backend runs on one node, got nodes={shape.nodes}")
    return shape


#: the checkout this code runs from: a relative ``python`` (an environment of the checkout, e.g. .venv-verl) is under it
CHECKOUT = Path(__file__).resolve().parents[1]


def job_python(cluster_cfg: Mapping[str, Any]) -> str:
    """The interpreter a job runs: the cluster config's ``python`` (a command on the cluster's nodes, e.g.
    ``python3`` of the activated environment; a relative path such as ``.venv-verl/bin/python`` is in this
    checkout); this host's own interpreter when ``python`` is null."""
    cfg = plain_config(cluster_cfg)
    python = cfg.get("python")
    if python is None:
        return sys.executable
    if not isinstance(python, str) or not python.strip():
        raise ValueError(f"cluster python must be an interpreter command such as python3 or null, got {python!r}")
    if os.sep in python and not os.path.isabs(python):
        return str(CHECKOUT / python)
    return python


def setup_lines(cluster_cfg: Mapping[str, Any], env: Mapping[str, str] | None = None) -> list[str]:
    """The sbatch setup lines of a cluster config, every value shell-quoted: ``module load`` per module, the
    ``activate`` virtual environment or ``conda`` environment (not both), the ``setup`` lines verbatim
    (trusted site config), and an ``export`` per entry of its ``env`` and of ``env``."""
    cfg = plain_config(cluster_cfg)
    modules = cfg.get("modules") or []
    if isinstance(modules, str) or not isinstance(modules, Sequence):
        raise ValueError(f"cluster modules must be a list of module names, got {modules!r}")  # noqa: TRY004
    lines = [f"module load {shlex.quote(str(module))}" for module in modules]
    activate, conda = cfg.get("activate"), cfg.get("conda")
    if activate and conda:
        raise ValueError(f"cluster activate ({activate!r}) and conda ({conda!r}): set one of them, not both")
    if activate:
        lines.append(f"source {shlex.quote(str(activate).rstrip('/') + '/bin/activate')}")
    if conda:
        lines += ['eval "$(conda shell.bash hook)"', f"conda activate {shlex.quote(str(conda))}"]
    lines += [str(line) for line in (cfg.get("setup") or [])]
    merged = {**(cfg.get("env") or {}), **(env or {})}
    for name, value in merged.items():
        lines.append(f"export {check_env_name(name)}={shlex.quote(str(value))}")
    return lines


def slurm_mem(cluster_cfg: Mapping[str, Any]) -> str | None:
    """sbatch's ``--mem`` of a Slurm job: ``mem_gb`` when set; when it is null, ``0`` (all the memory of every
    node) on a job that takes whole nodes (``exclusive: true``), since ``--exclusive`` alone may leave the site's
    default memory per CPU, and nothing (the site's default) on a job that shares its nodes; nothing either when
    ``slurm_additional_parameters`` sizes the memory itself (``mem``, ``mem_per_cpu``, ``mem_per_gpu``)."""
    cfg = plain_config(cluster_cfg)
    shape = job_shape(cfg)
    given = [key for key in _extra(cfg) if key.replace("-", "_") in MEMORY_OPTIONS]
    if shape.mem_gb is not None and given:
        raise ValueError(f"cluster mem_gb={shape.mem_gb} and slurm_additional_parameters.{given[0]}: set one of "
                         "them, not both")
    if shape.mem_gb is not None:
        return _convert_mem(shape.mem_gb)
    return WHOLE_NODE_MEM if shape.exclusive and not given else None


def srun_args(cluster_cfg: Mapping[str, Any]) -> list[str]:
    """The arguments submitit adds to a Slurm job's ``srun`` line: the job's CPUs per task. submitit's line has no
    ``--cpus-per-task``, and srun of Slurm 22.05 to 23.02 does not inherit sbatch's, so each task (the Ray node
    on it included) would get 1 CPU."""
    shape = job_shape(cluster_cfg)
    return [] if shape.cpus_per_task is None else [f"--cpus-per-task={shape.cpus_per_task}"]


def sbatch_parameters(
    cluster_cfg: Mapping[str, Any], *, name: str | None = None, env: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The keyword arguments (submitit's names) of submitit's sbatch script for a Slurm cluster config: the job's
    shape, :func:`slurm_mem`, :func:`srun_args`, :func:`setup_lines`."""
    cfg = plain_config(cluster_cfg)
    shape = job_shape(cfg)
    params: dict[str, Any] = {
        "time": shape.timeout_min,
        "nodes": shape.nodes,
        "ntasks_per_node": shape.tasks_per_node,
        "gpus_per_node": shape.gpus_per_node,
        "setup": setup_lines(cfg, env),
    }
    if name is not None:
        params["job_name"] = name
    if shape.cpus_per_task is not None:
        params["cpus_per_task"] = shape.cpus_per_task
        params["srun_args"] = srun_args(cfg)
    mem = slurm_mem(cfg)
    if mem is not None:
        params["mem"] = mem
    if shape.partition:
        params["partition"] = shape.partition
    if cfg.get("signal_delay_s") is not None:
        params["signal_delay_s"] = _int_at_least(cfg, "signal_delay_s", 90)
    extra = _extra(cfg)
    if extra:
        params["additional_parameters"] = extra
    return params


def sbatch_script(
    folder: str | os.PathLike[str],
    cluster_cfg: Mapping[str, Any],
    *,
    name: str | None = None,
    env: Mapping[str, str] | None = None,
) -> str:
    """The sbatch script that :func:`make_executor`'s Slurm executor submits for one job, rendered without
    Slurm: no ``srun``/``sbatch`` needed (submitit's Slurm executor refuses to start without them)."""
    cfg = plain_config(cluster_cfg)
    folder = Path(folder).expanduser().absolute()  # as submitit's executor stores its folder
    command = " ".join([shlex.quote(job_python(cfg)), "-u -m submitit.core._submit", shlex.quote(str(folder))])
    return _make_sbatch_string(command=command, folder=folder, **sbatch_parameters(cfg, name=name, env=env))


def make_executor(
    folder: str | os.PathLike[str],
    cluster_cfg: Mapping[str, Any],
    *,
    name: str | None = None,
    env: Mapping[str, str] | None = None,
) -> submitit.Executor:
    """The submitit executor of a cluster config (``conf/cluster/<name>.yaml``): :class:`LocalExecutor` (one
    process per task on this machine) or submitit's Slurm executor with :func:`sbatch_parameters`,
    ``max_num_timeout`` requeues and :func:`job_python`; ``name``: the Slurm job name; ``env``: exports added
    to the sbatch script."""
    cfg = plain_config(cluster_cfg)
    shape = job_shape(cfg)
    if shape.backend == "local":
        params: dict[str, Any] = {"timeout_min": shape.timeout_min, "tasks_per_node": shape.tasks_per_node}
        if name is not None:
            params["name"] = name
        for key in ("cpus_per_task", "mem_gb"):
            if cfg.get(key) is not None:
                params[key] = cfg[key]
        local = LocalExecutor(folder, max_num_timeout=shape.max_num_timeout, python=shlex.quote(job_python(cfg)))
        local.update_parameters(**params)
        return local
    sbatch = sbatch_parameters(cfg, name=name, env=env)
    executor = submitit.AutoExecutor(
        folder=folder, cluster="slurm", slurm_max_num_timeout=shape.max_num_timeout,
        slurm_python=shlex.quote(job_python(cfg)),
    )
    executor.update_parameters(**{f"slurm_{key}": value for key, value in sbatch.items()})
    return executor


class LocalExecutor(submitit.LocalExecutor):
    """submitit's local executor, each job's controller started by ``launch.local_controller`` (a session of its
    own, no traceback when cancelled): a Ctrl-C reaches the submitting process alone, which cancels its jobs."""

    def _submit_command(self, command: str) -> submitit.LocalJob[Any]:
        ntasks = int(self.parameters.get("tasks_per_node", 1))
        gpus = ",".join(str(k) for k in range(int(self.parameters.get("gpus_per_node", 0))))
        env = {  # the settings submitit's own local executor hands its controller
            "SUBMITIT_LOCAL_NTASKS": str(ntasks), "SUBMITIT_LOCAL_COMMAND": command,
            "SUBMITIT_LOCAL_TIMEOUT_S": str(int(60 * self.parameters.get("timeout_min", 2.0))),
            "SUBMITIT_LOCAL_SIGNAL_DELAY_S": str(int(self.parameters.get("signal_delay_s", 30))),
            "SUBMITIT_LOCAL_NODEID": "0", "SUBMITIT_LOCAL_JOB_NUM_NODES": "1",
            "SUBMITIT_STDERR_TO_STDOUT": "1" if self.parameters.get("stderr_to_stdout") else "",
            "SUBMITIT_EXECUTOR": "local", "CUDA_VISIBLE_DEVICES": gpus, "SUBMITIT_LOCAL_WITH_SHELL": "",
        }
        process = start_controller(self.folder, env)
        return submitit.LocalJob(folder=self.folder, job_id=str(process.pid), process=process,
                                 tasks=list(range(ntasks)))


def _extra(cfg: Mapping[str, Any]) -> dict[str, Any]:
    extra = cfg.get("slurm_additional_parameters") or {}
    if not isinstance(extra, Mapping):
        raise TypeError(f"slurm_additional_parameters must be a mapping, got {extra!r}")
    return dict(extra)


def _mem_gb(cfg: Mapping[str, Any]) -> float | None:
    value = cfg.get("mem_gb")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or value <= 0):
        raise ValueError(f"cluster mem_gb must be a number of GB > 0 or null (whole nodes: all their memory; "
                         f"shared nodes: the site default), got {value!r}")
    return value


def _int_at_least(cfg: Mapping[str, Any], key: str, default: int, low: int = 1) -> int:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        allowed = "a positive integer" if low == 1 else f"an integer >= {low}"
        raise ValueError(f"cluster {key} must be {allowed}, got {value!r}")
    return value
