"""The plugin's loss statistics: every micro-batch's policy-loss metrics, as one JSON line, beside verl's own metrics.

verl reduces every policy-loss metric by a mean over micro-batches and ranks, so its counts and maxima depend
on the parallel layout; ingest merges these lines per step instead (``predmask.metrics.merge_micro_batches``;
the fields: ``predmask.metrics.STATS_FIELDS``). Imports no verl.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

_STEP_DIR = re.compile(r"global_step_(\d+)")


def checkpoint_step(local_path: str | os.PathLike[str]) -> int:
    """The global step of a verl checkpoint path (``.../global_step_<N>/actor``); ValueError when it names none."""
    found = _STEP_DIR.findall(str(local_path))
    if not found:
        raise ValueError(f"checkpoint path {str(local_path)!r} names no global_step_<N> folder")
    return int(found[-1])


class LossStatsWriter:
    """Appends one line per micro-batch to ``<directory>/<session>.rank<rank>.jsonl``.

    ``begin_step(step)`` starts a training step, ``begin_mini_batch()`` each of its mini-batches; ``write(metrics)``
    records one micro-batch (its index counts from 0 within the mini-batch). Each line is written by one ``write``
    call on a file opened for appending, so a killed process leaves whole lines (at most a torn last one).
    """

    def __init__(self, directory: str | os.PathLike[str], session: str, rank: int) -> None:
        if not session or not re.fullmatch(r"[A-Za-z0-9_.-]+", session):
            raise ValueError(f"loss statistics session must be a plain name, got {session!r}")
        self.path = Path(directory) / f"{session}.rank{int(rank)}.jsonl"
        self.session = session
        self.rank = int(rank)
        self.step = 0
        self.mini_batch = -1
        self.micro_batch = 0

    def begin_step(self, step: int) -> None:
        self.step = int(step)
        self.mini_batch = -1
        self.micro_batch = 0

    def begin_mini_batch(self) -> None:
        self.mini_batch += 1
        self.micro_batch = 0

    def write(self, metrics: Mapping[str, float]) -> None:
        record = {"session": self.session, "step": self.step, "mini_batch": max(self.mini_batch, 0),
                  "rank": self.rank, "micro_batch": self.micro_batch,
                  "metrics": {k: float(v) for k, v in sorted(metrics.items())}}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
        self.micro_batch += 1
