"""Follow submitted jobs until each has ended, with its result, its error, or dead: a Slurm job that left
the queue without writing a result (cancelled, killed, node failure) is reported, never waited on forever.
Completion is read from submitit's result files and Slurm's own job state (``squeue``/``scontrol``), so it
works on clusters without accounting (no ``sacct``)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import submitit

from launch.slurm import LIVE_STATES, slurm_job_state

POLL_S = 1.0
K = TypeVar("K")


@dataclass(frozen=True)
class Ended(Generic[K]):
    """A followed job that has ended: ``result`` when it completed, else ``error`` (one line saying why)."""

    key: K
    job: submitit.Job[Any]
    result: Any = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def job_ended(job: submitit.Job[Any]) -> bool:
    """Ended with a result file, or gone from Slurm without one (cancelled, killed, node failure)."""
    if job.done():
        return True
    if isinstance(job, submitit.SlurmJob):
        return slurm_job_state(str(job.job_id)) not in LIVE_STATES
    return False


def job_result(job: submitit.Job[Any]) -> Any:
    """The job's result; multi-task jobs (Ray over 4 nodes) report through rank 0."""
    if not job.done():
        raise RuntimeError(f"job {job.job_id} ended without a result (cancelled or killed)")
    return job.results()[0]


def rejoin_slurm_job(folder: str, job_id: str) -> submitit.SlurmJob[Any] | None:
    """The Slurm job ``job_id`` submitted earlier (submitit folder ``folder``) while it is still queued or
    running, to follow instead of submitting again; None once it has ended."""
    if slurm_job_state(str(job_id)) not in LIVE_STATES:
        return None
    return submitit.SlurmJob(folder=folder, job_id=str(job_id))


def one_line(err: BaseException) -> str:
    """One line for a job's error: the exception line of the job's own traceback (which submitit wraps
    between its header and the log paths), else the error's last non-blank line, else its type."""
    text = str(err)
    lines = [ln for ln in text.split("Traceback (most recent call last):")[-1].splitlines() if ln.strip()]
    if "Traceback (most recent call last):" in text:
        header = [ln for ln in lines if not ln[0].isspace()]
        if header:
            return header[0]
    return lines[-1] if lines else type(err).__name__


def _ended(key: K, job: submitit.Job[Any]) -> Ended[K]:
    try:
        return Ended(key, job, result=job_result(job))
    except Exception as err:  # noqa: BLE001 - a failed job is reported, the others are followed on
        return Ended(key, job, error=one_line(err))


def _no_sacct_noise(record: logging.LogRecord) -> bool:
    """Drop submitit's repeated "Bypassing sacct error" warnings (clusters without accounting, e.g. the
    emulated one): completion is read from the result files and Slurm's own job state, not from sacct."""
    return "Bypassing sacct error" not in record.getMessage()


def follow(
    jobs: Iterable[tuple[K, submitit.Job[Any]]],
    *,
    max_parallel: int | None = None,
    on_poll: Callable[[Mapping[K, submitit.Job[Any]]], None] | None = None,
    on_end: Callable[[Ended[K]], None] | None = None,
    cancel_slurm_on_interrupt: bool = True,
    poll_s: float = POLL_S,
) -> list[Ended[K]]:
    """Follow ``(key, job)`` pairs until every job has ended; returns them in the order they ended.

    ``jobs`` is pulled lazily, only while fewer than ``max_parallel`` jobs are followed (None: all at once).
    Every round calls ``on_poll`` with the jobs still followed, then ``on_end`` for each job that has ended.
    On Ctrl-C the followed jobs are cancelled (Slurm jobs only when ``cancel_slurm_on_interrupt``: left
    running, a later call may :func:`rejoin_slurm_job` them) and the KeyboardInterrupt goes on."""
    if max_parallel is not None and max_parallel < 1:
        raise ValueError(f"max_parallel must be >= 1 or None, got {max_parallel}")
    log = logging.getLogger("submitit")
    if _no_sacct_noise not in log.filters:
        log.addFilter(_no_sacct_noise)
    source: Iterator[tuple[K, submitit.Job[Any]]] = iter(jobs)
    active: dict[K, submitit.Job[Any]] = {}
    ended: list[Ended[K]] = []
    exhausted = False
    try:
        while True:
            while not exhausted and (max_parallel is None or len(active) < max_parallel):
                try:
                    key, job = next(source)
                except StopIteration:
                    exhausted = True
                else:
                    active[key] = job
            if on_poll is not None:
                on_poll(active)
            for key, job in list(active.items()):
                if job_ended(job):
                    del active[key]
                    end = _ended(key, job)
                    ended.append(end)
                    if on_end is not None:
                        on_end(end)
            if exhausted and not active:
                return ended
            time.sleep(poll_s)
    except KeyboardInterrupt:
        for job in active.values():
            if cancel_slurm_on_interrupt or not isinstance(job, submitit.SlurmJob):
                with contextlib.suppress(Exception):  # best effort: a finished job cannot be cancelled
                    job.cancel(check=False)
        raise
