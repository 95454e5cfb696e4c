"""The policy-loss metrics of a verl run, exact under any parallel layout, from the plugin's per-micro-batch statistics.

verl averages every policy-loss metric over micro-batches and ranks, so its ``actor/mask/tokens``, the tail and
disagreement counts and the maxima depend on how a batch is split. The plugin writes each micro-batch's values
(``<run dir>/loss_stats/<session>.rank<R>.jsonl``, the format of ``predmask.metrics.STATS_FIELDS``);
:func:`exact_step_metrics` merges them per step: the micro-batches of one mini-batch, on every rank, by
``predmask.metrics.merge_micro_batches`` (counts summed, extremes taken, means weighted by their counts), then the
step's mini-batches by ``predmask.metrics.reduce_metrics``, as the CPU engine reduces its mini-batches. Ingest stores
these values in place of verl's for the same step. A step written by several launches (a restart) is taken from the
latest launch that wrote it.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from predmask.metrics import LOSS_STATS_DIR, STATS_FIELDS, merge_micro_batches, reduce_metrics


def _record(line: str, where: str) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not a JSON line ({err.msg})") from None
    missing = [f for f in STATS_FIELDS if not isinstance(record, dict) or f not in record]
    if missing:
        raise ValueError(f"{where}: a loss-statistics line lacks {', '.join(missing)} "
                         f"(fields: {', '.join(STATS_FIELDS)})")
    if not isinstance(record["metrics"], dict):
        raise TypeError(f"{where}: 'metrics' must be an object of metric name -> value")
    return record


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of one statistics file; a torn last line (a killed writer, no newline) is left out."""
    complete = path.read_text().split("\n")[:-1]  # after the last newline: nothing, or a line not finished
    return [_record(line, f"{path}:{i}") for i, line in enumerate(complete, 1) if line.strip()]


def merge_records(records: Iterable[Mapping[str, Any]]) -> dict[int, dict[str, float]]:
    """step -> merged metrics of the given records (the latest session of each step; see the module docstring)."""
    by_step: dict[int, dict[str, list[Mapping[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        by_step[int(r["step"])][str(r["session"])].append(r)
    out: dict[int, dict[str, float]] = {}
    for step, sessions in sorted(by_step.items()):
        latest = sessions[max(sessions)]
        mini: dict[int, list[Mapping[str, float]]] = defaultdict(list)
        for r in sorted(latest, key=lambda r: (int(r["mini_batch"]), int(r["rank"]), int(r["micro_batch"]))):
            mini[int(r["mini_batch"])].append(r["metrics"])
        out[step] = reduce_metrics([merge_micro_batches(parts) for _, parts in sorted(mini.items())])
    return out


def exact_step_metrics(run_dir: str | Path) -> dict[int, dict[str, float]]:
    """step -> exact policy-loss metrics of the verl run in ``run_dir`` ({} when it has no loss statistics)."""
    folder = Path(run_dir) / LOSS_STATS_DIR
    if not folder.is_dir():
        return {}
    return merge_records(r for path in sorted(folder.glob("*.jsonl")) for r in read_records(path))
