"""Fan the token-level study's seeds out to workers (submitit: local processes or a Slurm job array).

A worker loads the backend once per study and runs its share of the seeds in turn. Every finished seed is two
files in the study directory, each written atomically: ``seed-<n>.parquet`` (its token rows), then
``seed-<n>.json`` (its response-token count, batch facts and timings), which marks the seed as finished. A
worker only computes and writes, so a killed worker or a Ctrl-C loses only the seeds in progress; the main
process, the only database writer, ingests whatever is finished.
"""

from __future__ import annotations

import json
import socket
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from predmask.io import atomic_write, atomic_write_text
from predmask.rundir import first_line


@dataclass(frozen=True)
class SeedFiles:
    """The per-seed files of one study directory."""

    root: Path

    def tokens_path(self, seed: int) -> Path:
        return self.root / f"seed-{seed:06d}.parquet"

    def row_path(self, seed: int) -> Path:
        return self.root / f"seed-{seed:06d}.json"

    def done(self, seed: int) -> bool:
        return self.row_path(seed).is_file() and self.tokens_path(seed).is_file()

    def finished(self, seeds: Sequence[int]) -> list[int]:
        return [s for s in seeds if self.done(s)]

    def write(self, seed: int, tokens: pl.DataFrame, row: Mapping[str, Any]) -> None:
        """Token rows first, then the seed row (whose presence marks the seed as finished)."""
        self.root.mkdir(parents=True, exist_ok=True)
        atomic_write(
            self.tokens_path(seed),
            tokens.with_columns(pl.lit(seed, dtype=pl.Int32).alias("seed")).write_parquet,
        )
        atomic_write_text(self.row_path(seed), json.dumps({"seed": seed, **row}, sort_keys=True))

    def read_row(self, seed: int) -> dict[str, Any]:
        return json.loads(self.row_path(seed).read_text())

    def read_tokens(self, seed: int) -> pl.DataFrame:
        return pl.read_parquet(self.tokens_path(seed))


@dataclass(frozen=True)
class WorkerSpec:
    """What one worker runs (pickled once at submission)."""

    config: dict[str, Any]
    study_dir: str
    seeds: tuple[int, ...]
    threads: int = 1


def run_worker(spec: WorkerSpec, on_seed: Callable[[int], None] | None = None) -> list[int]:
    """Run ``spec.seeds`` not yet finished; returns the seeds this call finished.

    A seed that raises is reported (traceback on stderr, the job's log) and skipped; the worker goes on with its
    other seeds and raises one RuntimeError naming the failed seeds at the end.
    """
    import torch

    from analysis.token_level.compute.backend import make_backend, run_seed
    from analysis.token_level.compute.study_config import settings_of

    torch.set_num_threads(spec.threads)
    files = SeedFiles(Path(spec.study_dir))
    todo = [s for s in spec.seeds if not files.done(s)]
    if not todo:
        return []
    backend = make_backend(spec.config)
    settings = settings_of(spec.config, backend.vocab_size)
    finished: list[int] = []
    failed: dict[int, str] = {}
    for seed in todo:
        if files.done(seed):
            continue
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            result = run_seed(backend, spec.config, settings, seed)
        except Exception as exc:  # noqa: BLE001 - one bad seed must not cost the worker's other seeds
            traceback.print_exc()
            failed[seed] = first_line(exc, typed=True)
            continue
        row = {
            "n_tokens": int(result.n_tokens),
            **{k: float(v) for k, v in result.facts.items()},
            "seconds": time.perf_counter() - t0,
            "cpu_seconds": time.process_time() - c0,
            "host": socket.gethostname(),
        }
        files.write(seed, result.tokens, row)
        finished.append(seed)
        if on_seed is not None:
            on_seed(seed)
    if failed:
        first = next(iter(failed.items()))
        raise RuntimeError(
            f"{len(failed)} seed(s) failed ({', '.join(map(str, failed))}); seed {first[0]}: {first[1]}"
        )
    return finished


def deal(studies: Sequence[tuple[Mapping[str, Any], Path, Sequence[int]]], workers: int) -> list[list[WorkerSpec]]:
    """One list of WorkerSpecs per worker for the pending seeds of one or several studies (config, study directory,
    pending seeds): the seeds dealt round-robin, the dealer carrying on across studies, so partial progress is spread
    over each seed range (worker i of one study gets seeds i, i+W, ...) and every worker gets about the same share
    of every study (studies differ in cost); a worker dealt nothing is dropped."""
    dealt: list[dict[int, list[int]]] = [{} for _ in range(max(1, workers))]
    turn = 0
    for index, (_cfg, _dir, pending) in enumerate(studies):
        for seed in pending:
            dealt[turn % len(dealt)].setdefault(index, []).append(seed)
            turn += 1
    return [
        [WorkerSpec(dict(studies[i][0]), str(studies[i][1]), tuple(s), studies[i][0]["launcher"]["threads"])
         for i, s in share.items()]
        for share in dealt
        if share
    ]


def run_specs(specs: Sequence[WorkerSpec]) -> list[int]:
    """One job: ``run_worker`` on each spec in turn (shares of one or several studies); returns the seeds finished.

    A spec whose seeds fail does not stop the others; one RuntimeError naming every failed spec is raised at the end.
    """
    finished: list[int] = []
    failed: list[str] = []
    for spec in specs:
        try:
            finished += run_worker(spec)
        except RuntimeError as exc:
            failed.append(f"{Path(spec.study_dir).name}: {exc}")
    if failed:
        raise RuntimeError("; ".join(failed))
    return finished


def submit_shares(
    cfg: Mapping[str, Any],
    folder: Path,
    shares: Sequence[Sequence[WorkerSpec]],
    count_finished: Callable[[], int],
    on_poll: Callable[[int], None],
) -> list[str]:
    """Submit one job per share (``run_specs``) through the launch layer's executor
    (``launch.executor.make_executor``: one single-node task per worker, a job array on Slurm with at most
    ``launcher.array_parallelism`` at once), follow them until every job has ended (``launch.follow``: a Slurm
    job that died without a result ends too), calling ``on_poll(count_finished())`` each round. Returns one
    message per failed job. Ctrl-C cancels every job and re-raises."""
    from launch.executor import make_executor
    from launch.follow import follow

    launcher = cfg["launcher"]
    cluster = {**cfg["cluster"], "nodes": 1, "tasks_per_node": 1}
    for key in ("gpus_per_node", "cpus_per_task", "mem_gb", "timeout_min", "slurm_additional_parameters"):
        if launcher.get(key) is not None:  # a seed worker is one small task, not the cluster's multi-node run
            cluster[key] = launcher[key]
    if launcher["gpus_per_node"] is None:
        cluster["gpus_per_node"] = 1 if cfg["model"].get("backend") == "hf" else 0
    if cluster.get("backend") == "local":
        cluster.pop("gpus_per_node", None)
    executor = make_executor(folder, cluster, name="token_level")
    if cluster.get("backend") == "slurm":
        executor.update_parameters(slurm_array_parallelism=launcher["array_parallelism"] or len(shares))
        jobs = executor.map_array(run_specs, [list(share) for share in shares])
    else:
        jobs = [executor.submit(run_specs, list(share)) for share in shares]

    def tick(_active: object = None) -> None:
        on_poll(count_finished())

    ends = follow(enumerate(jobs), on_poll=tick)
    tick()
    return [
        f"worker {e.job.job_id} failed: {e.error} (log: {e.job.paths.stderr})"
        for e in sorted(ends, key=lambda e: e.key)
        if not e.ok
    ]
