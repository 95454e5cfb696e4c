"""Time every figure on a synthetic database (88 runs × 500 steps × 30 metrics, 61 seeds); run by
``python scripts/benchmark.py reports``.

The runs are written as run directories (config.yaml, status.json, metrics.jsonl) and loaded through the real
ingest; the study through upsert_token_level. Only `paper` (all figures, tables and the page) is timed against
the target; the ingest time is printed beside it. Synthetic numbers, never a result.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa

from analysis.store import connect, ingest_paths, upsert_token_level
from analysis.token_columns import CRITERIA, RATIO, TAIL_COLUMNS
from analysis.token_level.summary import study_stats as stats
from predmask import config, metrics
from predmask.bench import stopwatch, target
from predmask.precisions import get_precision
from predmask.rl.task import EVAL_SPLITS
from predmask.rundir import METRICS_FILE, metrics_line, run_path, write_config, write_status
from reports import labels
from reports.paper import build_paper

TARGET_S = 15.0
SWEEPS = ("main_comparison", "tight_threshold", "smoke")  # the synthetic runs mirror these sweeps of conf/
SEEDS_PER_CELL = int(config.group_entry("cluster", "local")["seeds"])  # as the CPU engine runs each cell


def _seeds(sweep: str) -> tuple[int, ...]:
    """The seeds the CPU engine runs per cell of a sweep: its own seed axis if it has one, else the cluster's."""
    axis = config.sweep_params(sweep).get("seed")
    return tuple(int(v) for v in str(axis).split(",")) if axis is not None else tuple(range(SEEDS_PER_CELL))


A24, A25 = (metrics.val_acc(split, 16) for split in EVAL_SPLITS)  # the CPU engine's AIME stand-ins
CORE_METRICS = (metrics.SCORE_MEAN, metrics.RESPONSE_LENGTH_MEAN, metrics.PPO_KL, metrics.CLIPFRAC, A24, A25)
FILLER_METRICS = (
    metrics.CLIPFRAC_LOWER, metrics.MASK_TOKENS, metrics.MASK_DIVERGENCE_MEAN, metrics.MASK_DIVERGENCE_MAX,
    metrics.MASK_OUTSIDE_FRAC, metrics.MASK_MU_TAIL_CLAMPED, metrics.MASK_PI_TAIL_CLAMPED,
    metrics.MASK_DIRECTION_DISAGREE, metrics.ACTOR_PG_LOSS, metrics.ACTOR_GRAD_NORM, metrics.ACTOR_LR,
    metrics.SCORE_MAX, metrics.SCORE_MIN, metrics.ADVANTAGES_MEAN, metrics.ADVANTAGES_MAX, metrics.ADVANTAGES_MIN,
    metrics.RESPONSE_LENGTH_MAX, metrics.RESPONSE_LENGTH_MIN, metrics.RESPONSE_LENGTH_CLIP_RATIO,
    metrics.TIMING_STEP, metrics.TIMING_GEN, metrics.TIMING_UPDATE_ACTOR, metrics.PERF_THROUGHPUT,
    metrics.GLOBAL_STEP,
)


def run_grid() -> list[dict]:
    """Synthetic run specs, one per seed of each cell of each sweep in SWEEPS (today 16 x 3 + 12 x 3 + 4 = 88),
    in conf/'s order."""
    grid = [
        (sweep, method, labels.sweep_delta(sweep), labels.setting_choice(setting), seed)
        for sweep in SWEEPS
        for setting in labels.sweep_axis(sweep, "+setting")
        for method in labels.sweep_axis(sweep, "method")
        for seed in _seeds(sweep)
    ]
    specs = []
    for i, (sweep, method, delta, (paper_model, precision), seed) in enumerate(grid):
        model, emulated = labels.cpu_standin(paper_model), get_precision(precision)
        method_cfg: dict = {"name": method, "loss_agg_mode": "token-mean"}
        if method == "grpo_clip_higher":
            method_cfg.update(eps_low=0.2, eps_high=0.28)
        else:
            method_cfg.update(delta=delta, ratio_cap=10.0)
        specs.append(
            {
                "run_id": f"synth{i:03d}",
                "sweep": sweep,
                "config": {
                    "seed": seed,
                    "delta": delta,
                    "top_k": 20,
                    "run_dir": f"runs/{sweep}/synth{i:03d}",
                    "method": method_cfg,
                    "model": {
                        "name": model,
                        "stands_in_for": paper_model,
                        "hidden_size": {"cpu_s": 64, "cpu_m": 128}.get(model, 96),
                        "num_layers": 2,
                        "num_experts": 4 if model == "cpu_moe" else 0,
                    },
                    "precision": {
                        "name": precision,
                        "rollout": "fp8" if emulated.rollout_fp8 else "bf16",
                        "train": "fp8" if emulated.train_fp8 else "fp32",
                    },
                    "cluster": {"name": "local"},
                    "trainer": {
                        "lr": 1e-3,
                        "batch_size": 64,
                        "group_size": 8,
                        "ppo_epochs": 1,
                        "temperature": 1.0,
                        "max_response_length": 32,
                        "val_n": 16,
                    },
                },
            }
        )
    return specs


def _curves(rng: np.random.Generator, spec: dict, steps: int) -> dict[str, np.ndarray]:
    cfg = spec["config"]
    method, precision = cfg["method"]["name"], cfg["precision"]["name"]
    t = np.arange(1, steps + 1) / steps
    gain = {
        "grpo_clip_higher": 0.8,
        "dppo_topk_kl": 0.9,
        "predmask_kl_agg": 1.0,
        "predmask_kl_uniform": 0.98,
    }[method]
    gain *= 0.8 if cfg["delta"] < 0.1 else 1.0
    acc = 0.1 + 0.35 * gain * (1 - np.exp(-4 * t))
    if method == "grpo_clip_higher" and precision.startswith("fp8"):
        acc = np.where(t > 0.6, acc * np.exp(-8 * (t - 0.6)), acc)  # the collapse the paper reports
    noise = lambda s: rng.normal(0, s, steps)
    out = {
        metrics.SCORE_MEAN: np.clip(acc + 0.1 + noise(0.03), 0, 1),
        metrics.RESPONSE_LENGTH_MEAN: 20 + 8 * t + noise(1.0),
        metrics.PPO_KL: np.abs(0.002 + 0.001 * gain + noise(0.0005)),
        metrics.CLIPFRAC: np.clip(0.02 + (0.01 if method == "dppo_topk_kl" else 0) + noise(0.003), 0, 1),
        A24: np.clip(acc + noise(0.02), 0, 1),
        A25: np.clip(acc - 0.05 + noise(0.02), 0, 1),
    }
    for name in FILLER_METRICS:
        out[name] = rng.normal(0, 1, steps)
    return out


def write_runs(root: Path, steps: int = 500, seed: int = 0) -> list[Path]:
    """Write the synthetic run directories under root/runs/<sweep>/<run_id>; return them."""
    rng = np.random.default_rng(seed)
    dirs = []
    for spec in run_grid():
        d = run_path(spec["sweep"], spec["run_id"], root / "runs")
        d.mkdir(parents=True, exist_ok=True)
        write_config(d, spec["config"])
        write_status(d, "completed", steps, steps, updated=1.7e9)
        curves = _curves(rng, spec, steps)
        names = list(curves)
        with (d / METRICS_FILE).open("w") as fh:
            for i in range(steps):
                fh.write(metrics_line(i + 1, {n: float(curves[n][i]) for n in names}))
        dirs.append(d)
    return dirs


#: the synthetic study has the paper's size: seeds, outside tokens and disagreement tokens per seed
PAPER_SEEDS = int(stats.PAPER_TOKEN_LEVEL["seeds"])
PAPER_OUTSIDE = int(stats.PAPER_TOKEN_LEVEL["outside_per_seed"])
PAPER_DISAGREE = float(stats.PAPER_TOKEN_LEVEL["disagree_per_seed"])


def synthetic_study(
    n_seeds: int = PAPER_SEEDS, outside: int = PAPER_OUTSIDE, seed: int = 0
) -> tuple[pa.Table, pa.Table]:
    """(seed rows, token rows) of a synthetic study; the per-seed rows are computed from its tokens by the study's
    own per-seed summary."""
    rng = np.random.default_rng(seed)
    seed_rows, token_parts = [], []
    for s in range(n_seeds):
        n = int(rng.normal(outside, 40))
        keep_ratio = rng.random(n) < 0.5
        flip = rng.random(n) < PAPER_DISAGREE / outside
        keep_agg = np.where(flip, ~keep_ratio, keep_ratio)
        dd = {c: rng.normal(-0.01, 0.03, n) for c in CRITERIA}
        tokens = pa.table(
            {
                "seed": pa.array(np.full(n, s), pa.int32()),
                "position": pa.array(np.arange(n), pa.int64()),
                "d_pre": rng.uniform(0.15, 1.0, n),
                "r": rng.lognormal(0, 0.2, n),
                "a": rng.normal(0, 1, n),
                **{column: rng.normal(0, 1, n) for column in TAIL_COLUMNS},
                **{keep: keep_ratio if c == RATIO else keep_agg for c, (keep, _) in CRITERIA.items()},
                **{column: dd[c] for c, (_, column) in CRITERIA.items()},
            }
        )
        seed_rows.append({"seed": s, **stats.seed_summary(pl.from_arrow(tokens), n_tokens=n * 12)})
        token_parts.append(tokens)
    return pa.Table.from_pylist(seed_rows), pa.concat_tables(token_parts)


def build_db(root: Path, steps: int = 500) -> tuple[Path, float]:
    """The synthetic database under root; returns its path and the ingest time in seconds."""
    db = root / "bench.duckdb"
    write_runs(root, steps)
    with connect(db) as con:
        with stopwatch() as ingest:
            summary = ingest_paths(con, [root / "runs"])
        n_runs = len(run_grid())
        assert len(summary.runs) == n_runs, f"expected {n_runs} runs, ingested {len(summary.runs)}"
        seeds, tokens = synthetic_study()
        paper_model, precision = labels.paper_settings()[0]  # the study's setting: the paper's first
        study_cfg = {
            "model": {"name": labels.cpu_standin(paper_model), "stands_in_for": paper_model},
            "precision": {"name": precision},
            "cluster": {"name": "local"},
            "delta": labels.sweep_delta("main_comparison"),
            "seeds": PAPER_SEEDS,
            "sequences": 1024,
            "synthetic": True,
        }
        upsert_token_level(con, "synthetic-61", study_cfg, seeds, tokens)
    return db, ingest["wall"]



def bench(root: Path, steps: int = 500) -> dict[str, Any]:
    """Build the synthetic database under ``root`` and time the paper on it, against ``TARGET_S``."""
    db, ingest_s = build_db(root, steps)
    with stopwatch() as paper_s:
        paper = build_paper(db, root / "out")
    return {"runs": len(run_grid()), "steps": steps, "metrics": len(CORE_METRICS) + len(FILLER_METRICS),
            "ingest_s": ingest_s, "paper_s": paper_s, "failures": paper.failures,
            "target": target("all figures, tables and index, wall s", paper_s["wall"], TARGET_S)}
