"""The plan of a sweep before anything is submitted: its jobs, what they hold and may cost, the data and model
paths they read (and whether each exists), and the check that refuses to submit while one is missing."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from predmask.command_text import command
from sweeps.compose import RunSpec, SweepError
from sweeps.families import describe
from launch.executor import job_shape
from sweeps.submit import backend_of, job_cluster, trainer_of

__all__ = ["InputPath", "check_paths", "input_paths", "max_parallel", "plan_summary",
           "skips_old_log_prob_forward", "summary_lines"]

SKIP_CHECK = "cluster.check_paths=false"


@dataclass(frozen=True)
class InputPath:
    """A path a run's job reads: ``kind`` data or model, and how to provide it when it is missing."""

    kind: str
    path: str
    prepare: str

    @property
    def exists(self) -> bool:
        return Path(self.path).exists()


def input_paths(spec: RunSpec) -> list[InputPath]:
    """The data files and the model a run's job reads (a VeRL run; the CPU engine builds its own and reads none)."""
    if trainer_of(spec) != "verl":
        return []
    if spec.stage is not None:
        return _vr_input_paths(spec)
    from predmask.verl.overrides import data_files  # the one owner of where a VeRL run reads its data

    train, val = data_files(spec.config)
    paths = [InputPath("data", f, command(f"sweeps.datasets prepare --out {shlex.quote(str(Path(f).parent))}"))
             for f in [*train, *val]]
    model = str(spec.config["model"].get("path") or "")
    if model:
        paths.append(InputPath("model", model, "download the model to this path, or set model.path=DIR"))
    return paths


def _vr_input_paths(spec: RunSpec) -> list[InputPath]:
    """A variational stage run on VeRL: the prepared Bespoke-Stratos files (``predmask.verl.vr_cluster``, the owner
    of their names and directory) and the base model."""
    from predmask.verl.vr_cluster import VR_DATA_FILES, merged_settings  # verl-free: commands only

    directory = merged_settings(spec.config)["data_dir"]
    prepare = command("sweeps.datasets prepare --family variational --bespoke-file PATH_TO_BESPOKE_STRATOS_17K "
                      f"--out {shlex.quote(directory)}")
    paths = [InputPath("data", f"{directory}/{name}", prepare) for name in VR_DATA_FILES.values()]
    model = str(spec.config["model"].get("path") or "")
    if model:
        paths.append(InputPath("model", model, "download the model to this path, or set model.path=DIR"))
    return paths


def skips_old_log_prob_forward(spec: RunSpec) -> bool:
    """Whether a run skips verl's old-log-prob actor forward: a VeRL training run whose method is anchored on the
    rollout (:func:`predmask.verl.trainer_hook.skips_old_log_prob`, the rule the trainer hook applies)."""
    if trainer_of(spec) != "verl" or spec.stage is not None:
        return False
    from predmask.methods import method_anchor
    from predmask.verl.trainer_hook import skips_old_log_prob  # verl-free

    return skips_old_log_prob(method_anchor(spec.config["method"]))


def _assumed_share() -> float:
    """The assumed share of the actor's compute that the skipped forward saves (its one owner, verl-free)."""
    from predmask.verl.trainer_hook import ASSUMED_OLD_LOG_PROB_SHARE

    return ASSUMED_OLD_LOG_PROB_SHARE


def _unique_paths(specs: Sequence[RunSpec]) -> list[tuple[InputPath, int]]:
    """Every input path of the sweep once, with how many runs read it (first-seen order)."""
    counts: dict[InputPath, int] = {}
    for spec in specs:
        for item in dict.fromkeys(input_paths(spec)):
            counts[item] = counts.get(item, 0) + 1
    return list(counts.items())


def check_paths(specs: Sequence[RunSpec]) -> None:
    """Refuse (SweepError, one line) while a path some run reads is missing; runs whose cluster config sets
    ``check_paths: false`` are not checked."""
    checked = [spec for spec in specs if spec.config["cluster"].get("check_paths", True)]
    missing = [item for item, _ in _unique_paths(checked) if not item.exists]
    if missing:
        first, more = missing[0], len(missing) - 1
        also = f" ({more} more missing path{'s' if more != 1 else ''}: see --dry-run)" if more else ""
        raise SweepError(f"{first.kind} path {first.path} does not exist: {first.prepare}{also}; "
                         f"nothing submitted ({SKIP_CHECK} skips this check)")


def max_parallel(specs: Sequence[RunSpec], given: int | None = None) -> int:
    """Runs at once: ``given`` (--max-parallel), else the cluster config's ``max_parallel`` (default 2)."""
    value = given if given is not None else specs[0].config["cluster"].get("max_parallel", 2)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SweepError(f"max_parallel must be an integer >= 1, got {value!r}")
    return value


def plan_summary(specs: Sequence[RunSpec], parallel: int, submit: str) -> dict[str, Any]:
    """The plan of a sweep of one cluster as plain data (the ``summary`` of ``--dry-run --format json``).

    ``resource`` is ``GPU`` when the jobs ask for GPUs, else ``CPU core``; ``per_node``/``per_job`` count it;
    ``at_once`` = min(parallel, jobs) x per_job; ``worst_case_hours`` = jobs x per_job x timeout_min / 60 (every
    job running to its wall-time limit once); ``worst_case_hours_with_requeues`` = that x (1 + max_num_timeout),
    the bound when every attempt times out and is requeued. ``old_log_prob_skipped`` counts the runs that skip
    verl's old-log-prob forward and ``worst_case_hours_with_skip`` takes the assumed share of the actor's compute
    (``predmask.verl.trainer_hook.ASSUMED_OLD_LOG_PROB_SHARE``) off each such job's hours: an upper bound on the
    saving, as if the actor were all of a job's GPU time (rollout time is not saved).
    """
    if not specs:
        raise SweepError("the sweep has no runs")
    first = specs[0]
    cluster = first.config["cluster"]
    shapes = {job_shape(job_cluster(spec)) for spec in specs}
    if len(shapes) > 1:
        raise SweepError(f"one job shape per sweep invocation, got {len(shapes)}")
    (shape,) = shapes
    if shape.gpus_per_node:
        resource, per_node = "GPU", shape.gpus_per_node
    else:
        cores = shape.cpus_per_task if shape.cpus_per_task is not None else int(cluster.get("threads", 1))
        resource, per_node = "CPU core", cores * shape.tasks_per_node
    jobs, per_job = len(specs), shape.nodes * per_node
    hours = jobs * per_job * shape.timeout_min / 60
    skipped = sum(skips_old_log_prob_forward(spec) for spec in specs)
    return {
        "sweep": first.sweep,
        "cluster": str(cluster.get("name")),
        "backend": backend_of(first),
        "trainer": trainer_of(first),
        "runs": describe(specs),
        "jobs": jobs,
        "nodes_per_job": shape.nodes,
        "resource": resource,
        "per_node": per_node,
        "per_job": per_job,
        "max_parallel": parallel,
        "at_once": min(parallel, jobs) * per_job,
        "timeout_min": shape.timeout_min,
        "worst_case_hours": hours,
        "max_num_timeout": shape.max_num_timeout,
        "worst_case_hours_with_requeues": hours * (1 + shape.max_num_timeout),
        "old_log_prob_skipped": skipped,
        "assumed_old_log_prob_share": _assumed_share(),
        "worst_case_hours_with_skip": hours - skipped * per_job * shape.timeout_min / 60 * _assumed_share(),
        "partition": shape.partition,
        "check_paths": bool(cluster.get("check_paths", True)),
        "paths": [{**asdict(item), "exists": item.exists, "runs": runs} for item, runs in _unique_paths(specs)],
        "submit": submit,
    }


def _num(value: float) -> str:
    return f"{value:,.0f}" if value == int(value) else f"{value:,.1f}"


def _count(n: float, unit: str) -> str:
    return f"{_num(n)} {unit}{'' if n == 1 else 's'}"


def _skip_lines(s: dict[str, Any]) -> list[str]:
    """The old-log-prob forward's saving on a VeRL sweep (none for the CPU engine)."""
    if s["trainer"] != "verl":
        return []
    if not s["old_log_prob_skipped"]:
        return ["  old log-prob     every run recomputes pi_old (verl's actor forward; no rollout-anchored method)"]
    return [(f"  old log-prob     {s['old_log_prob_skipped']} of {_count(s['jobs'], 'run')} skip verl's actor "
             f"forward (rollout-anchored): worst case {_num(s['worst_case_hours_with_skip'])} {s['resource']}-hours "
             f"with the skip, assuming the forward is {s['assumed_old_log_prob_share']:.2f} of the actor's compute "
             "per step (an upper bound on the saving)")]


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """The plan as text lines (printed as they are, never wrapped)."""
    s, unit = summary, summary["resource"]
    hours = _num(s["timeout_min"] / 60)
    worst = (f"{_num(s['worst_case_hours'])} {unit}-hours ({s['jobs']} jobs x {_count(s['per_job'], unit)} x "
             f"{hours} h)")
    if s["max_num_timeout"]:
        worst += (f"; requeues after a time-out (max_num_timeout {s['max_num_timeout']}) could multiply it by up to "
                  f"{1 + s['max_num_timeout']}: {_num(s['worst_case_hours_with_requeues'])} {unit}-hours")
    lines = [
        f"plan: {s['sweep']} on {s['cluster']} ({s['backend']}, {s['trainer']} trainer): {s['runs']}",
        (f"  jobs             {s['jobs']}, each {_count(s['nodes_per_job'], 'node')} x "
         f"{_count(s['per_node'], unit)} = {_count(s['per_job'], unit)}"),
        f"  at once          {_count(s['at_once'], unit)} (max_parallel {s['max_parallel']})",
        f"  wall-time limit  {s['timeout_min']} min ({hours} h) per attempt",
        f"  worst case       {worst}",
        *_skip_lines(s),
        f"  partition        {s['partition'] or '(the site default)'}",
    ]
    if s["paths"]:
        checked = "" if s["check_paths"] else f" (not checked before submitting: {SKIP_CHECK})"
        lines.append(f"  paths read       {len(s['paths'])}{checked}")
        for item in s["paths"]:
            state, fix = ("ok", "") if item["exists"] else ("MISSING", f"  -> {item['prepare']}")
            lines.append(f"    {item['kind']:<5} {state:<7} {item['path']}  ({_count(item['runs'], 'run')}){fix}")
    else:
        lines.append("  paths read       none (the CPU engine builds its own model and data)")
    lines.append(f"  submit           {s['submit']}")
    return lines
