"""The calibration's training runs: compose each setting's runs, train those not completed through the launch layer
(local processes), and read a completed run's metric records. It runs; the regime is summarised by
``analysis.calibrate``, the command, which imports this module."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from predmask.config import ConfigError, bare_key, compose, stable_id, to_container
from predmask.rundir import JOB_LOG_FILE, METRICS_FILE, read_metrics, read_status

#: the ratio-direction method and the predictive mask whose runs the calibration compares
METHODS: tuple[str, str] = ("dppo_topk_kl", "predmask_kl_agg")
#: the calibration's progress lines, under the output root
PROGRESS_LOG = "calibrate.log"


@dataclass(frozen=True)
class PlannedRun:
    """One training run of the calibration: its setting and method, run id and directory, config and command."""

    setting: str
    method: str
    run_id: str
    run_dir: Path
    config: dict[str, Any]
    command: list[str]


def plan_runs(settings: Sequence[str], seed: int, overrides: Sequence[str], out: Path) -> list[PlannedRun]:
    """Compose every run first (a bad override fails here, before anything is written)."""
    for ov in overrides:
        if bare_key(ov) in ("method", "setting", "seed", "run_dir"):
            raise ConfigError(f"override {ov!r}: the calibration sets method, setting, seed and run_dir itself")
    planned = []
    for setting in settings:
        for method in METHODS:
            ovs = [f"+setting={setting}", f"method={method}", f"seed={seed}", *overrides]
            cfg = to_container(compose("train", ovs))
            run_id = stable_id(cfg)
            run_dir = (out / run_id).resolve()
            cache = Path(str(cfg["cache_dir"])).resolve()  # the job runs in its run directory
            if "'" in str(run_dir) + str(cache):
                raise ConfigError(f"output path {run_dir} or cache {cache} contains a quote; choose another")
            cmd = [sys.executable, "-m", "predmask.rl.train", *ovs, f"run_dir='{run_dir}'", f"cache_dir='{cache}'",
                   "trainer.progress=false"]
            planned.append(PlannedRun(setting, method, run_id, run_dir, cfg, cmd))
    return planned


def read_run(run_dir: Path) -> list[dict[str, Any]]:
    """A completed run's metric records; RuntimeError naming the run and its status when it did not complete."""
    status = read_status(run_dir)
    if status.get("status") != "completed":
        raise RuntimeError(f"run {run_dir.name} did not complete ({status.get('status', 'no status.json')}: "
                           f"{status.get('error') or 'see its train.log'}); rerun the same command to train it "
                           "(completed runs are reused)")
    return read_metrics(run_dir / METRICS_FILE)


def train_runs(planned: Sequence[PlannedRun], max_parallel: int, out: Path) -> list[str]:
    """Train the runs not yet completed, ``max_parallel`` at a time; returns one message per failed run."""
    from launch.command_job import CommandJob
    from launch.executor import make_executor
    from launch.follow import follow
    from predmask.progress import progress

    todo = [p for p in planned if read_status(p.run_dir).get("status") != "completed"]
    if not todo:
        return []
    total_steps = sum(int(p.config["trainer"]["steps"]) for p in todo)
    executor = make_executor(out / "jobs", {"backend": "local"}, name="calibrate")

    def poll(_active: object) -> None:  # status.json is replaced atomically: never read half-written
        states = [read_status(p.run_dir) for p in todo]
        done = sum(1 for st in states if st.get("status") == "completed")
        bar.advance_to(sum(int(st.get("step", 0)) for st in states), status=f"{done}/{len(todo)} runs done")

    def jobs():
        for p in todo:
            p.run_dir.mkdir(parents=True, exist_ok=True)
            job = CommandJob(p.command, run_dir=str(p.run_dir), log_file=str(p.run_dir / JOB_LOG_FILE))
            yield p.run_id, executor.submit(job)

    failed: list[str] = []
    print(f"progress: {out / PROGRESS_LOG}", flush=True)
    with progress(f"calibration: {len(todo)} runs", total=total_steps, unit="steps", stream=sys.stdout,
                  log_file=out / PROGRESS_LOG) as bar:
        ends = follow(jobs(), max_parallel=max_parallel, on_poll=poll)
        poll(None)  # the final line counts what the runs wrote last
    by_id = {p.run_id: p for p in todo}
    for e in ends:
        if not e.ok:
            p = by_id[e.key]
            failed.append(f"{p.setting} {p.method}: {e.error} (log: {p.run_dir / JOB_LOG_FILE})")
    return failed
