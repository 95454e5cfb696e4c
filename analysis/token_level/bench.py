"""Cost of the token-level study: per-seed wall and CPU time single-threaded (split into rollout, stale updates,
masked steps and ground truths), its scaling with the batch size, the 61-seed extrapolation, and the ground truths'
cost as a ratio; run by ``python scripts/benchmark.py study``. CPU time is the figure to trust on a shared
machine: wall time there includes other load.
"""

from __future__ import annotations

import math
import subprocess
import sys
from typing import Any

from predmask.bench import stopwatch, target

#: the study with its per-token ground truths may take at most this multiple of its time without them
GROUND_TRUTH_RATIO_MAX = 1.5


def _startup_seconds() -> float:
    """Wall time of a fresh interpreter importing the study's modules (what each worker pays before its seeds)."""
    modules = "analysis.token_level.compute.backend, analysis.token_level.compute.fanout, submitit"
    with stopwatch() as t:
        subprocess.run([sys.executable, "-c", f"import {modules}"], check=True, capture_output=True)
    return t["wall"]


def bench(overrides: list[str], sequences: list[int], seeds: int, threads: int = 1) -> dict[str, Any]:
    """Per-seed timings of the study for each batch size (seeds 1000.. so no stored study is touched), the model
    load, and a worker's start-up."""
    import torch

    from analysis.token_level.compute.backend import make_backend, run_seed
    from analysis.token_level.compute.study_config import compose_study, settings_of, validate
    from analysis.token_level.summary.study_stats import seed_summary

    torch.set_num_threads(threads)
    cfg = compose_study(overrides)
    validate(cfg)
    with stopwatch() as load:
        backend = make_backend(cfg)
    rows = []
    for n in sequences:
        cfg_n = dict(cfg, sequences=n)
        settings = settings_of(cfg_n, backend.vocab_size)
        for i in range(seeds):
            seed = 1000 + i
            with stopwatch() as seconds:
                res = run_seed(backend, cfg_n, settings, seed)
            summary = seed_summary(res.tokens, res.n_tokens)
            rows.append({"sequences": n, "seed": seed, **seconds, **res.facts,
                         **{k: summary[k] for k in ("n_tokens", "n_outside", "n_disagree")}})
    return {"label": cfg["label"], "overrides": overrides, "threads": threads, "backend_load": load, "seeds": rows,
            "startup_wall": _startup_seconds()}


def ground_truth_ratio(rows: list[dict[str, Any]]) -> float | None:
    """Seconds of the study with its per-token ground truths over the same seeds without them (measured in one run:
    each seed's wall time over that time less its ground-truth pass); None when no seed computed them."""
    with_gt = sum(r["wall"] for r in rows)
    gt = sum(r.get("seconds_ground_truth", 0.0) for r in rows)
    return with_gt / (with_gt - gt) if gt > 0 and with_gt > gt else None


def ground_truth_target(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The ratio as a PASS/FAIL row against ``GROUND_TRUTH_RATIO_MAX``; None when no seed computed ground truths."""
    ratio = ground_truth_ratio(rows)
    return None if ratio is None else target("ground truths: the study's time with them over without them", ratio,
                                             GROUND_TRUTH_RATIO_MAX)


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares ``y = a + b x`` (b = 0 with a single x)."""
    if len(set(xs)) < 2:
        return sum(ys) / len(ys), 0.0
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def extrapolate(result: dict[str, Any], seeds: int, sequences: int, workers: int) -> None:
    """Add to a ``bench`` result the fits of CPU and wall time against the batch size
    and the estimate of ``seeds`` seeds x ``sequences`` sequences on ``workers`` single-threaded workers."""
    rows = result["seeds"]
    result["fit"] = {}
    for clock in ("cpu", "wall"):
        a, b = _fit([r["sequences"] for r in rows], [r[clock] for r in rows])
        result["fit"][clock] = {"a": a, "b_per_sequence": b}
    fit = result["fit"]["cpu"]
    per_seed = fit["a"] + fit["b_per_sequence"] * sequences
    per_worker = math.ceil(seeds / workers)
    result["extrapolation"] = {
        "seeds": seeds, "sequences": sequences, "workers": workers, "cpu_per_seed": per_seed,
        "seeds_per_worker": per_worker,
        "wall_estimate": per_worker * per_seed + result["startup_wall"] + result["backend_load"]["wall"],
    }
