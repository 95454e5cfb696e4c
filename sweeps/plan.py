"""The plan of a sweep before anything is submitted: the risks it takes (a warning block), its jobs, what they
hold and may cost, the data and model paths they read (and whether each exists), and the checks that refuse to
submit while a path is missing or, with --strict, while a warning remains."""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from launch.executor import JobShape, job_python, job_shape
from predmask.command_text import command
from predmask.verl.overrides import MEGATRON_ATTENTION  # verl-free
from sweeps.compose import RunSpec, SweepError
from sweeps.families import describe
from sweeps.submit import backend_of, job_cluster, trainer_of

SKIP_CHECK = "cluster.check_paths=false"
#: the command that makes a CPU verl run's interpreter (.venv-verl)
VERL_CPU_INSTALL = "EXTRAS=verl-cpu bash scripts/install.sh"

#: verl engines the plugin has never run with, and why the plan says so (docs/cluster.md, "What was verified where")
UNVERIFIED_ENGINES: dict[str, str] = {
    "megatron": "verl's Megatron engine has never run with the plugin, on GPUs or in the tests (docs/cluster.md, "
                "\"What was verified where\"): start with one such run",
}

#: per cluster file, the keys marked ``# placeholder`` in conf/cluster/<name>.yaml (``modules`` and
#: ``activate`` are marked too: the environment warning speaks for them); a run's value is still a placeholder
#: while it equals the file's and the command line does not set the key
PLACEHOLDERS: dict[str, tuple[str, ...]] = {"h20_4x8": ("partition", "cpus_per_task", "mem_gb", "ray.temp_root")}

#: the cluster keys that put the jobs' environment in place (launch.executor.setup_lines renders them)
ENVIRONMENT_KEYS: tuple[str, ...] = ("modules", "activate", "conda", "setup")

#: filesystem types that other machines mount too (network and parallel filesystems): a runs root on one of them
#: may be shared with the nodes; on any other type (ext4, xfs, overlay, tmpfs, ...) it is this host's own disk
SHARED_FILESYSTEMS = frozenset({"nfs", "nfs4", "lustre", "gpfs", "beegfs", "cephfs", "fuse.ceph", "glusterfs",
                                "fuse.glusterfs", "wekafs", "panfs", "fuse.juicefs", "cifs", "smb3", "afs",
                                "orangefs"})

#: minutes one verl training step (rollout, actor update, amortised validation) is assumed to take: an
#: assumption, not a measurement, until a run's first steps are timed on GPUs
ASSUMED_STEP_MINUTES = 5.0

MOUNTS = Path("/proc/self/mounts")


def filesystem_type(path: Path, mounts: Path = MOUNTS) -> str:
    """The type of the filesystem ``path`` lies on (the longest mount point above it in ``mounts``, a
    /proc/self/mounts table), ``unknown`` when the table cannot be read. ``path`` need not exist yet."""
    try:
        table = mounts.read_text()
    except OSError:
        return "unknown"
    target = os.path.abspath(path)
    best, fstype = "", "unknown"
    for line in table.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].encode().decode("unicode_escape")  # the table writes a space as \040
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, fstype = point, fields[2]
    return fstype


def _warning(cause: str, text: str, runs: Sequence[str] = ()) -> dict[str, Any]:
    return {"cause": cause, "text": text, "runs": list(runs)}


def _nested(mapping: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        mapping = mapping.get(part) if isinstance(mapping, dict) else None  # type: ignore[assignment]
    return mapping


def _unverified(specs: Sequence[RunSpec]) -> list[dict[str, Any]]:
    """One warning per unverified engine that some VeRL run of the sweep trains with, naming its runs."""
    out = []
    for engine, why in UNVERIFIED_ENGINES.items():
        runs = [spec.run_id for spec in specs
                if trainer_of(spec) == "verl" and spec.config["model"].get("engine") == engine]
        if runs:
            out.append(_warning("unverified", f"{len(runs)} of {_count(len(specs), 'run')} use model.engine={engine}"
                                f": {why}; runs {', '.join(runs)}", runs))
    return out


def _environment(cluster: dict[str, Any]) -> list[dict[str, Any]]:
    """Nothing activates an environment on the nodes and the interpreter is a bare command."""
    python = job_python(cluster)
    if any(cluster.get(key) for key in ENVIRONMENT_KEYS) or os.path.isabs(python):
        return []
    return [_warning("environment", f"cluster.activate, conda, modules and setup are all unset: the nodes run "
                     f"`{python}` from their bare PATH, without predmask, verl or vLLM unless the site installs them; "
                     "set cluster.activate=DIR (or conda=NAME, modules=[...]; docs/cluster.md, section 1)")]


def _placeholders(specs: Sequence[RunSpec], cluster: dict[str, Any]) -> list[dict[str, Any]]:
    """The PLACEHOLDERS keys of the cluster's file that still hold the file's value, unset on the command line."""
    from predmask.config import bare_key, group_entry

    name = str(cluster.get("name"))
    keys = PLACEHOLDERS.get(name, ())
    if not keys:
        return []
    shipped = group_entry("cluster", name)
    given = {bare_key(o) for spec in specs for o in spec.overrides}
    held = [f"cluster.{key}={'null' if _nested(cluster, key) is None else _nested(cluster, key)}"
            for key in keys
            if f"cluster.{key}" not in given and _nested(cluster, key) == _nested(shipped, key)]
    if not held:
        return []
    return [_warning("placeholder", f"{', '.join(held)} still hold conf/cluster/{name}.yaml's placeholder values, "
                     "not your site's: set each on the command line (the same value confirms it) or in a copy of "
                     "the file")]


def _shared_dirs(cluster: dict[str, Any], root: Path, mounts: Path) -> list[dict[str, Any]]:
    """The run directories lie on a filesystem of this host only; a cluster whose ``python`` is null runs this
    host's own interpreter (its nodes are this host, as the emulated one's) and is not asked."""
    if cluster.get("python") is None:
        return []
    fstype = filesystem_type(root, mounts)
    if fstype in SHARED_FILESYSTEMS:
        return []
    return [_warning("shared dirs", f"run and checkpoint directories go under {os.path.abspath(root)}, on this "
                     f"host's {fstype} filesystem that the nodes may not see (nothing checks that they share "
                     "it): give --runs-root (or $PREDMASK_RUNS) a directory on the cluster's shared filesystem "
                     f"({', '.join(sorted(SHARED_FILESYSTEMS)[:4])}, ...)")]


def plan_warnings(specs: Sequence[RunSpec], root: Path | None = None, mounts: Path = MOUNTS) -> list[dict[str, Any]]:
    """Every risk a Slurm sweep's plan takes, as ``{cause, text, runs}`` (run directories under ``root``,
    default ``runs_root()``); a local sweep takes none."""
    slurm = [spec for spec in specs if backend_of(spec) == "slurm"]
    if not slurm:
        return []
    from predmask.rundir import runs_root

    cluster = job_cluster(slurm[0])
    return [*_unverified(slurm), *_environment(cluster), *_placeholders(slurm, cluster),
            *_shared_dirs(cluster, root if root is not None else runs_root(), mounts)]


def refuse_warnings(warnings: Sequence[dict[str, Any]]) -> None:
    """--strict: refuse (SweepError, one line) while the plan has a warning."""
    if warnings:
        n = len(warnings)
        raise SweepError(f"--strict: {n} warning{'s' if n != 1 else ''} remain{'s' if n == 1 else ''} (the WARNINGS "
                         "block at the top of the plan; --dry-run prints it); nothing submitted")


def warning_lines(warnings: Sequence[dict[str, Any]]) -> list[str]:
    """The warning block (nothing when there is no warning)."""
    if not warnings:
        return []
    return [f"WARNINGS ({len(warnings)}): risks this plan takes; --strict refuses to submit while any remains",
            *(f"  ! {w['cause']:<12} {w['text']}" for w in warnings)]


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
    if spec.config["cluster"].get("device") == "cpu":  # the sweep makes the model and data (sweeps.verl_inputs)
        return [InputPath("environment", job_python(spec.config["cluster"]), VERL_CPU_INSTALL)]
    if spec.stage is not None:
        paths = _vr_data_paths(spec)
    else:
        from predmask.verl.overrides import data_files  # the one owner of where a VeRL run reads its data

        train, val = data_files(spec.config)
        paths = _prepared([*train, *val])
    model = str(spec.config["model"].get("path") or "")
    if model:
        paths.append(InputPath("model", model, "download the model to this path, or set model.path=DIR"))
    return paths


def _prepared(files: list[str]) -> list[InputPath]:
    """Files of ``python -m sweeps.datasets prepare``, each with the command that writes its directory."""
    return [InputPath("data", f, command(f"sweeps.datasets prepare --out {shlex.quote(str(Path(f).parent))}"))
            for f in files]


def _vr_data_paths(spec: RunSpec) -> list[InputPath]:
    """A variational stage run on VeRL: the prepared Bespoke-Stratos files and an eval run's AIME files."""
    from predmask.verl.vr_cluster import (  # verl-free: commands only
        VR_DATA_FILES,
        eval_files,
        merged_settings,
    )

    directory = merged_settings(spec.config)["data_dir"]
    prepare = command("sweeps.datasets prepare --family variational --bespoke-file PATH_TO_BESPOKE_STRATOS_17K "
                      f"--out {shlex.quote(directory)}")
    paths = [InputPath("data", f"{directory}/{name}", prepare) for name in VR_DATA_FILES.values()]
    return paths + (_prepared(eval_files(spec.config)) if spec.stage == "eval" else [])


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


def _job_size(specs: Sequence[RunSpec]) -> tuple[JobShape, str, int]:
    """The one job shape of the sweep's runs, the resource it is counted in (GPU, else CPU core) and how many of
    it one node holds."""
    shapes = {job_shape(job_cluster(spec)) for spec in specs}
    if len(shapes) > 1:
        raise SweepError(f"one job shape per sweep invocation, got {len(shapes)}")
    (shape,) = shapes
    if shape.gpus_per_node:
        return shape, "GPU", shape.gpus_per_node
    threads = int(specs[0].config["cluster"].get("threads", 1))
    return shape, "CPU core", (shape.cpus_per_task or threads) * shape.tasks_per_node


def _attention(specs: Sequence[RunSpec]) -> list[dict[str, Any]]:
    """What the VeRL runs' models attend with, ``{attention, runs, needs}`` per implementation (first-seen order;
    ``needs``: the Python module the nodes must import, None for torch's own); vLLM's sampling stages load none."""
    from predmask.schemas.cluster_schema import ATTENTION_MODULES
    from predmask.verl.overrides import run_attention  # verl-free
    from predmask.verl.vr_cluster import stage_attention

    counts: dict[str, int] = {}
    for spec in specs:
        if trainer_of(spec) != "verl":
            continue
        attention = stage_attention(spec.config) if spec.stage is not None else run_attention(spec.config)
        if attention is not None:
            counts[attention] = counts.get(attention, 0) + 1
    return [{"attention": name, "runs": runs, "needs": ATTENTION_MODULES.get(name)} for name, runs in counts.items()]


def plan_summary(specs: Sequence[RunSpec], parallel: int, submit: str, root: Path | None = None) -> dict[str, Any]:
    """The plan of a sweep of one cluster as plain data (the ``summary`` of ``--dry-run --format json``, its
    fields in ``python -m sweeps --help``). ``worst_case_hours_with_skip`` takes the assumed share of the
    actor's compute off each skipping job's hours: an upper bound on the saving, as if the actor were all of a
    job's GPU time."""
    from predmask.methods import method_anchor
    from predmask.verl.trainer_hook import ASSUMED_OLD_LOG_PROB_SHARE as share  # verl-free
    from predmask.verl.trainer_hook import skips_old_log_prob

    if not specs:
        raise SweepError("the sweep has no runs")
    first = specs[0]
    cluster = first.config["cluster"]
    shape, resource, per_node = _job_size(specs)
    jobs, per_job = len(specs), shape.nodes * per_node
    hours = jobs * per_job * shape.timeout_min / 60
    trained = [spec for spec in specs if trainer_of(spec) == "verl" and spec.stage is None]  # VeRL training
    skipped = sum(skips_old_log_prob(method_anchor(spec.config["method"])) for spec in trained)
    steps = [int(spec.config["model"]["batch"]["total_steps"]) for spec in trained]
    bound_h = shape.timeout_min * (1 + shape.max_num_timeout) / 60
    estimated = len(trained) == len(specs)
    expected = (sum(min(n * ASSUMED_STEP_MINUTES / 60, bound_h) for n in steps) * per_job
                if estimated else None)
    return {
        "warnings": plan_warnings(specs, root),
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
        "planned_steps": sum(steps) if estimated else None,
        "assumed_step_minutes": ASSUMED_STEP_MINUTES,
        "expected_hours": expected,
        "old_log_prob_skipped": skipped,
        "assumed_old_log_prob_share": share,
        "worst_case_hours_with_skip": hours - skipped * per_job * shape.timeout_min / 60 * share,
        "attention": _attention(specs),
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


def _expected_lines(s: dict[str, Any]) -> list[str]:
    """The expected cost beside the worst case, labelled as the estimate it is (VeRL sweeps only)."""
    if s["trainer"] != "verl":
        return []
    if s["expected_hours"] is None:
        return ["  expected         not estimated (a variational stage plans no step count)"]
    return [(f"  expected         ~{_num(round(s['expected_hours']))} {s['resource']}-hours, an estimate: "
             f"{_num(s['planned_steps'])} planned steps over {_count(s['jobs'], 'job')} x "
             f"{s['assumed_step_minutes']:g} min per step assumed (sweeps.plan.ASSUMED_STEP_MINUTES, not measured) "
             f"x {_count(s['per_job'], s['resource'])}")]


def _attention_lines(s: dict[str, Any]) -> list[str]:
    """What the VeRL runs' models attend with, and what the nodes need for it (none for the CPU engine)."""
    if not s.get("attention"):
        return []
    parts = []
    for item in s["attention"]:
        part = f"{item['attention']} for {_count(item['runs'], 'run')}"
        if item["attention"] == MEGATRON_ATTENTION:
            part += " (Megatron's own attention, verl's megatron attention_backend; not cluster.attn_implementation)"
        if item["needs"]:
            part += (f" (the nodes must import {item['needs']}, which scripts/gpu_check.py checks; "
                     "cluster.attn_implementation=sdpa needs nothing beyond torch)")
        parts.append(part)
    return [f"  attention        {'; '.join(parts)}"]


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """The plan as text lines (printed as they are, never wrapped), the warning block first."""
    s, unit = summary, summary["resource"]
    hours = _num(s["timeout_min"] / 60)
    worst = (f"{_num(s['worst_case_hours'])} {unit}-hours ({s['jobs']} jobs x {_count(s['per_job'], unit)} x "
             f"{hours} h)")
    if s["max_num_timeout"]:
        worst += (f"; requeues after a time-out (max_num_timeout {s['max_num_timeout']}) could multiply it by up to "
                  f"{1 + s['max_num_timeout']}: {_num(s['worst_case_hours_with_requeues'])} {unit}-hours")
    lines = [
        *warning_lines(s.get("warnings", [])),
        f"plan: {s['sweep']} on {s['cluster']} ({s['backend']}, {s['trainer']} trainer): {s['runs']}",
        (f"  jobs             {s['jobs']}, each {_count(s['nodes_per_job'], 'node')} x "
         f"{_count(s['per_node'], unit)} = {_count(s['per_job'], unit)}"),
        f"  at once          {_count(s['at_once'], unit)} (max_parallel {s['max_parallel']})",
        f"  wall-time limit  {s['timeout_min']} min ({hours} h) per attempt",
        f"  worst case       {worst}",
        *_expected_lines(s),
        *_skip_lines(s),
        *_attention_lines(s),
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
