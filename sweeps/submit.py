"""The sweep's loop: submit its runs through the launch layer (local processes or Slurm), follow them, join
the live ones of an earlier invocation, resume the others, and hand each finished run on (to be ingested).

Not hydra-submitit-launcher: it submits one job array, blocks on it and has no multi-node Ray start-up; here
each run is its own job, and finished runs are ingested as they end."""

from __future__ import annotations

import json
import shlex
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import submitit
from rich.console import Console

from launch.command_job import CommandJob
from launch.executor import job_python, sbatch_script
from launch.executor import make_executor as cluster_executor
from launch.follow import Ended, follow, rejoin_slurm_job
from launch.ray_job import RayJob
from launch.ray_slurm import ray_options
from launch.warm_worker import WORKER_ENV, local_worker
from predmask.progress import eta_from_durations, progress, read_phase
from predmask.rundir import (
    JOB_LOG_FILE,
    PHASE_FILE,
    first_line,
    read_job_record,
    run_writer_alive,
    write_config,
    write_job_record,
)
from predmask.verl.overrides import hydra_value, verl_command  # plain config translation: imports no verl
from sweeps.compose import RunSpec, SweepError
from sweeps.run_dirs import (
    DAMAGED,
    RunState,
    check_inside_root,
    failure_cause,
    log_size,
    read_state,
    run_dir,
    write_planned_config,
)
from sweeps.verl_inputs import recorded_config, with_verl_inputs


@dataclass
class Outcome:
    """How each run of a sweep ended in this invocation."""

    completed: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # run_id -> message with the log path
    blocked: dict[str, str] = field(default_factory=dict)  # run_id -> why it did not start (an input failed)

    def merge(self, other: Outcome) -> None:
        self.completed += other.completed
        self.skipped += other.skipped
        self.failed.update(other.failed)
        self.blocked.update(other.blocked)


class SweepInterrupted(KeyboardInterrupt):
    """Ctrl-C while a sweep follows its runs, after its one line saying so (the local runs stopped)."""


def backend_of(spec: RunSpec) -> str:
    return str(spec.config["cluster"].get("backend", "local"))


def trainer_of(spec: RunSpec) -> str:
    return str(spec.config["cluster"].get("trainer", "cpu"))


def job_cluster(spec: RunSpec) -> dict[str, Any]:
    """The cluster config a run's job is submitted with: the run's own, except that a CPU-engine run is one
    process (one node, one task, no GPU) whatever shape the cluster has."""
    cluster = dict(spec.config["cluster"])
    if trainer_of(spec) == "cpu":
        cluster = {**cluster, "nodes": 1, "tasks_per_node": 1, "gpus_per_node": 0}
    return cluster


def job_name(spec: RunSpec) -> str:
    """The run's job name (Slurm's, as squeue and sacct show it): ``predmask-<sweep>-<run_id>``."""
    return f"predmask-{spec.sweep}-{spec.run_id}"


#: what a local sweep's warm worker imports once for its CPU runs (``launch.warm_worker``): the trainer and Hydra
WORKER_PRELOAD = ("hydra", "predmask.rl.train")

#: the CPU program of a variational stage run (reads RUN_DIR/config.yaml, which the sweep writes)
VR_STAGE_MODULE = "predmask.rl.vr_runner"


def job_command(spec: RunSpec, path: Path, *, make_inputs: bool = False) -> list[str]:
    """The exact argv a run executes with the job's interpreter: the CPU trainer, the VeRL launcher, or a
    variational stage run's program; ``make_inputs``: make the inputs a verl run on the CPU reads first
    (sweeps.verl_inputs; else only their paths)."""
    python = job_python(spec.config["cluster"])
    if spec.stage is not None:
        if trainer_of(spec) == "verl":
            from predmask.verl.vr_cluster import stage_command  # verl-free: commands only

            return stage_command(spec.config, path.resolve(), python)
        return [python, "-m", VR_STAGE_MODULE, str(path.resolve())]
    if trainer_of(spec) == "verl":
        return verl_command(with_verl_inputs(spec.config, make=make_inputs), path.resolve(), python=python)
    # the CPU trainer (it holds the run's writer lock for its whole life): the sweep's overrides and the run
    # directory, quoted for Hydra's override grammar (a path may hold spaces, quotes, ``$``, ``=``, ``,`` or
    # brackets)
    return [python, "-m", "predmask.rl.train", *spec.overrides, f"run_dir={hydra_value(str(path.resolve()))}"]


def make_executor(spec: RunSpec, folder: Path) -> submitit.Executor:
    return cluster_executor(folder, job_cluster(spec), name=job_name(spec))


def make_job(spec: RunSpec, path: Path, worker: str | None = None) -> Any:
    """The picklable callable a run's job executes; ``worker``: the socket of the sweep's warm worker (local CPU
    runs), which runs the command in a forked child instead of a new interpreter."""
    log = str(path / JOB_LOG_FILE)
    if trainer_of(spec) == "verl":
        return RayJob(command=job_command(spec, path, make_inputs=True), run_dir=str(path), log_file=log,
                      env=dict(spec.config["cluster"].get("env") or {}), ray=ray_options(spec.config["cluster"]))
    # the job runs inside its run directory: hand it the sweep's base-model cache as an absolute path, so
    # every run of the sweep shares one base model
    cache = Path(str(spec.config.get("cache_dir", "results/cache"))).resolve()
    return CommandJob(command=job_command(spec, path), run_dir=str(path), log_file=log,
                      env={**thread_env(spec), "PREDMASK_CACHE": str(cache), **({WORKER_ENV: worker} if worker else {})})


def thread_env(spec: RunSpec) -> dict[str, str]:
    threads = str(spec.config["cluster"].get("threads", 1))
    return {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "PREDMASK_THREADS": threads}


def submitit_folder(spec: RunSpec, root: Path) -> Path:
    return root / spec.sweep / ".submitit"


def sbatch_text(spec: RunSpec, root: Path) -> str | None:
    """The sbatch script submitit submits for this run (None for local runs), rendered without Slurm, with the
    trainer command in a comment after the shebang."""
    if backend_of(spec) == "local":
        return None
    text = sbatch_script(submitit_folder(spec, root), job_cluster(spec), name=job_name(spec))
    header = "\n".join(["# predmask run " + spec.run_id, "# trainer command (inside the job):",
                        "#   " + shlex.join(job_command(spec, run_dir(spec, root)))])
    return text.replace("\n", "\n" + header + "\n", 1)


def _start(spec: RunSpec, root: Path, worker: str | None) -> submitit.Job[Any]:
    """The run's job: the live one of an earlier invocation (Slurm), else a new submission."""
    path = run_dir(spec, root)
    if backend_of(spec) == "local" and run_writer_alive(path):
        raise RuntimeError(f"run {spec.run_id} is live in another process ({path}); "
                           "wait for it or stop it before rerunning the sweep")
    record = read_job_record(path) if backend_of(spec) == "slurm" else {}
    job = None  # a Slurm job of this run submitted earlier and still live is joined, not resubmitted
    if record.get("backend") == "slurm" and record.get("job_id"):
        job = rejoin_slurm_job(str(record["folder"]), str(record["job_id"]))
    if job is None:
        write_planned_config(path, spec)
        if trainer_of(spec) == "verl" or spec.stage is not None:  # trainers that write no config.yaml themselves
            write_config(path, recorded_config(spec.config))
        folder = submitit_folder(spec, root)
        submitted, log_offset = time.time(), log_size(path)  # before the job can write: its lines and records follow
        job = make_executor(spec, folder).submit(make_job(spec, path, worker))
        write_job_record(path, {"backend": backend_of(spec), "job_id": str(job.job_id), "folder": str(folder),
                                "command": job_command(spec, path), "submitted": submitted,
                                "log_offset": log_offset})
    return job


def run_sweep(
    specs: list[RunSpec],
    *,
    root: Path,
    max_parallel: int,
    on_finished: Callable[[RunSpec, Path], None],
    console: Console,
) -> Outcome:
    """Submit every run not yet completed (at most ``max_parallel`` at once), follow them until they end, and
    call ``on_finished`` for each that ends. Ctrl-C cancels the local runs this invocation started (Slurm jobs
    go on, and a rerun joins them)."""
    outcome = Outcome()
    pending: dict[str, RunSpec] = {}
    for spec in specs:
        state = read_state(run_dir(spec, root))
        if state.status == "completed":
            outcome.skipped.append(spec.run_id)
        else:
            if state.status == DAMAGED:  # its trainer rewrites status.json, or fails with its own line
                console.print(f"run {spec.run_id}: {state.error}; started again (it resumes from its checkpoints)")
            pending[spec.run_id] = spec
    warm = [spec for spec in pending.values() if backend_of(spec) == "local" and trainer_of(spec) == "cpu"]
    # plain lines go to stdout beside the sweep's other lines: `python -m sweeps ... | tee log` keeps them
    with (local_worker(root, WORKER_PRELOAD, thread_env(warm[0])) if warm else nullcontext()) as worker, \
            progress(f"sweep {specs[0].sweep}" if specs else "sweep", total=len(specs), unit="runs",
                     completed=len(outcome.skipped), stream=sys.stdout) as bar:

        began: dict[str, float] = {}  # run_id -> when this invocation started it (monotonic seconds)
        durations: dict[str, list[float]] = {}  # kind -> wall seconds of the runs of that kind completed here

        def started() -> Iterator[tuple[str, submitit.Job[Any]]]:
            for run_id, spec in pending.items():
                began[run_id] = time.monotonic()
                job = _start(spec, root, worker if spec in warm else None)
                console.print(f"run {run_id} {spec.method} {spec.model}/{spec.precision}: job {job.job_id}")
                yield run_id, job

        def poll(active: Mapping[str, Any]) -> None:
            """The running runs' steps beside the count; their share of their steps moves the ETA."""
            states = {run_id: read_state(run_dir(pending[run_id], root)) for run_id in active}
            text = " · ".join(f"{run_id} {run_progress_text(run_dir(pending[run_id], root), s)}"
                              for run_id, s in states.items())
            bar.working(sum(min(1.0, s.step / s.total_steps) for s in states.values() if s.total_steps), text)
            now = time.monotonic()
            bar.estimate(eta_from_durations(
                durations, [(run_kind(pending[r]), now - began[r]) for r in active],
                [run_kind(spec) for r, spec in pending.items() if r not in began], max_parallel))

        def on_end(end: Ended[str]) -> None:
            spec, path = pending[end.key], run_dir(pending[end.key], root)
            if end.ok:
                outcome.completed.append(end.key)
                durations.setdefault(run_kind(spec), []).append(time.monotonic() - began[end.key])
            else:
                outcome.failed[end.key] = f"{failure_cause(path) or end.error} (log: {path / JOB_LOG_FILE})"
            on_finished(spec, path)
            bar.advance(1)

        try:
            follow(started(), max_parallel=max_parallel, on_poll=poll, on_end=on_end, cancel_slurm_on_interrupt=False)
        except KeyboardInterrupt:
            stopped = ("the Slurm jobs go on (a rerun joins them)" if specs and backend_of(specs[0]) == "slurm"
                       else "local runs stopped")
            console.print(f"[yellow]interrupted: {stopped}; rerun the same command to resume them[/]")
            raise SweepInterrupted from None
    return outcome


def run_kind(spec: RunSpec) -> str:
    """Runs of one kind take about as long as each other (the sweep's ETA): the same model setting, trainer and
    (variational) stage."""
    return "/".join([spec.model, trainer_of(spec), *([spec.stage] if spec.stage is not None else [])])


def run_progress_text(path: Path, state: RunState) -> str:
    """``pretraining base model tiny 430/1000`` while the run is in a phase before its steps, else ``step 3/60``."""
    phase = read_phase(path / PHASE_FILE) if state.status in ("new", "running") else None
    return phase.text() if phase is not None else f"step {state.step}/{state.total_steps or '?'}"


def validate_runs(specs: list[RunSpec], root: Path) -> None:
    """Every run passes its trainer's own checks (the CPU engine's, the stage runner's or the VeRL
    translation's) before anything is written; the first bad run is one SweepError line naming its cell and
    the trainer's message."""
    from predmask.rl.engine import prepare_config
    from predmask.schemas.variational_schema import VRConfig

    for spec in specs:
        try:
            if spec.stage is not None:
                VRConfig.from_mapping(spec.config)  # the stage runner's own view and checks
            elif trainer_of(spec) == "cpu":
                prepare_config(spec.config)
            job_command(spec, run_dir(spec, root))
        except ValueError as err:
            message = first_line(err)
            raise SweepError(f"run {spec.run_id} ({spec.cell}): {message}; nothing submitted") from None


def dry_run_records(specs: list[RunSpec], root: Path) -> list[dict[str, Any]]:
    """One record per run: its id, axes, the exact trainer argv and the sbatch script (None for local)."""
    records = []
    for spec in specs:
        path = run_dir(spec, root)
        record = {
            "run_id": spec.run_id, "method": spec.method, "delta": spec.delta, "model": spec.model,
            "precision": spec.precision, "seed": spec.seed, "command": job_command(spec, path),
            "sbatch": sbatch_text(spec, root),
        }
        if spec.stage is not None:  # a variational stage run: which stage, and the runs it reads
            record.update({"stage": spec.stage, "data": spec.config["method"].get("data"), "inputs": spec.inputs})
        records.append(record)
    return records


def write_dry_run(payload: dict[str, Any], directory: Path, root: Path) -> Path:
    """Write a dry run under ``<sweep dir>/dry-run/`` (replaced as a whole): each run's ``.cmd`` and
    ``.sbatch``, and ``plan.json``; a folder that leads out of the runs ``root`` is refused before anything is
    deleted or written."""
    out = directory / "dry-run"
    check_inside_root(root, [directory, out])
    out.mkdir(parents=True, exist_ok=True)
    for old in out.iterdir():
        old.unlink()
    for rec in payload["runs"]:
        (out / f"{rec['run_id']}.cmd").write_text(shlex.join(rec["command"]) + "\n")
        if rec["sbatch"]:
            (out / f"{rec['run_id']}.sbatch").write_text(rec["sbatch"])
    (out / "plan.json").write_text(json.dumps(payload, indent=2) + "\n")
    return out


def run_waves(
    specs: list[RunSpec],
    *,
    root: Path,
    max_parallel: int,
    on_finished: Callable[[RunSpec, Path], None],
    console: Console,
    resume: str,
) -> Outcome:
    """Run a sweep whose runs read each other's outputs in waves, each through :func:`run_sweep`; a run whose
    input failed (or was itself blocked) does not start, and its message names that run and ``resume``."""
    from sweeps.vr_chain import waves

    outcome = Outcome()
    by_id = {spec.run_id: spec for spec in specs}
    for wave in waves(specs):
        ready = []
        for spec in wave:
            bad = [rid for rid in spec.inputs.values() if rid in outcome.failed or rid in outcome.blocked]
            if bad:
                up = by_id[bad[0]]
                why = "failed" if bad[0] in outcome.failed else "did not run"
                outcome.blocked[spec.run_id] = (f"not started: its input run {bad[0]} ({up.cell}) {why}; fix that, "
                                                f"then resume with: {resume}")
            else:
                ready.append(spec)
        if ready:
            outcome.merge(run_sweep(ready, root=root, max_parallel=max_parallel, on_finished=on_finished,
                                    console=console))
    return outcome
