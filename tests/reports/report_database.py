"""A small results database with known values, built through the real ingest from JSONL files in a temp dir.

Runs (all CPU engine, local):
  main_comparison  m_dppo_s{0,1,2}   dppo_topk_kl        cpu_s   bf16         δ 0.15  steps 1-6, val at 2, 4, 6
                   m_agg_s{0,1,2}    predmask_kl_agg     cpu_s   bf16         δ 0.15  files identical to m_dppo_s*
                   m_uni_s{0,1,2}    predmask_kl_uniform cpu_s   bf16         δ 0.15  val = dppo's + UNI_OFFSET[seed]
                   m_agg_moe         predmask_kl_agg     cpu_moe fp8_rollout  δ 0.15  steps 1-3 (two attempts), 1 seed
                   m_grpo_e2e_s{0,1,2} grpo_clip_higher  cpu_moe fp8_e2e      δ 0.15  steps 1-4 (other AIME names)
  tight_threshold  t_dppo_s          dppo_topk_kl        cpu_s   bf16         δ 0.05  steps 1-4
  smoke            sm_agg_s          predmask_kl_agg     cpu_s   bf16         δ 0.15  steps 1-6, AIME25 only at 4, 6
No cpu_m run: the Qwen3-8B panel must be empty. Studies: st_tokens (tokens + seeds, judged on the same tokens at
ingest), st_counts (seeds only, not judged), and a drift grid of six cells (GRID_CELLS), each a study, the last
not judged.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import yaml

from analysis.store import connect, ingest_paths, upsert_grid, upsert_token_level
from analysis.token_level.summary.study_stats import seed_summary
from analysis.token_level.summary.study_tables import study_tables

STAND_IN = {"cpu_s": "qwen3_4b_base", "cpu_m": "qwen3_8b_base", "cpu_moe": "qwen3_30b_a3b_base"}
A24, A25 = "val-core/aime24_standin/acc/mean@16", "val-core/aime25_standin/acc/mean@16"


#: problems per evaluation split in every run's recorded config (not conf/'s 30: the report must read it)
EVAL_SIZE = 24


def config(method: str, model: str, precision: str, delta: float, seed: int = 0) -> dict[str, Any]:
    m: dict[str, Any] = {"name": method, "loss_agg_mode": "token-mean"}
    if method == "grpo_clip_higher":
        m.update(eps_low=0.2, eps_high=0.28)
    else:
        m.update(delta="${delta}", ratio_cap=10.0)
    return {
        "seed": seed,
        "delta": delta,
        "top_k": 20,
        "run_dir": "x",
        "method": m,
        "model": {
            "name": model,
            "stands_in_for": STAND_IN[model],
            "hidden_size": {"cpu_s": 32, "cpu_moe": 48}[model],
        },
        "precision": {"name": precision},
        "task": {"name": "arithmetic", "eval_size": EVAL_SIZE},
        "cluster": {"name": "local"},
        "trainer": {"lr": 0.001, "batch_size": 8, "data_path": "/some/where/long/path"},
    }


SEEDS = (0, 1, 2)
UNI_OFFSET = {
    0: 0.02,
    1: 0.04,
    2: -0.01,
}  # predmask_kl_uniform minus dppo_topk_kl at every evaluation, by seed
GRPO_VAL = {  # validation accuracy of the three GRPO seeds at steps 1-4
    0: [0.1, 0.4, 0.1, 0.05],  # collapsed: below 0.2 from step 3 to the end
    1: [0.1, 0.4, 0.1, 0.3],  # recovered at the last step
    2: [0.2, 0.2, 0.2, 0.2],  # flat
}


def train_metrics(step: int, scale: float = 1.0, seed: int = 0) -> dict[str, float]:
    """Known training metrics of every run at a step."""
    return {
        "critic/score/mean": scale * step / 10 + 0.01 * seed,
        "response_length/mean": 10.0 + step + seed,
        "actor/ppo_kl": 0.001 * step,
        "actor/pg_clipfrac": 0.01 * step,
        "timing_s/step": 1.5,
    }


def dppo_val(step: int, seed: int) -> float:
    """Validation accuracy of the DPPO (and aggregated) runs: AIME24 0.05 below it, AIME25 0.05 above."""
    return 0.05 * step + 0.01 * seed


def lines(records: list[tuple[int, dict[str, Any]]]) -> str:
    return "".join(json.dumps({"step": s, "data": d}) + "\n" for s, d in records)


def write_run(root: Path, sweep: str, run_id: str, cfg: dict, files: dict[str, str]) -> None:
    d = root / "runs" / sweep / run_id
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    (d / "status.json").write_text(
        json.dumps({"status": "completed", "step": 6, "total_steps": 6, "updated": 1.7e9, "error": None})
    )
    for name, text in files.items():
        (d / name).write_text(text)


def build_runs(root: Path) -> None:
    for seed in SEEDS:
        for method, run_id, scale, offset in (
            ("dppo_topk_kl", f"m_dppo_s{seed}", 1.0, 0.0),
            ("predmask_kl_agg", f"m_agg_s{seed}", 1.0, 0.0),  # the same run as DPPO's: its lines coincide
            ("predmask_kl_uniform", f"m_uni_s{seed}", 2.0, UNI_OFFSET[seed]),
        ):
            recs = []
            for s in range(1, 7):
                data = train_metrics(s, scale, seed)
                if s % 2 == 0:
                    v = dppo_val(s, seed) + offset
                    data |= {A24: v - 0.05, A25: v + 0.05}
                recs.append((s, data))
            write_run(
                root,
                "main_comparison",
                run_id,
                config(method, "cpu_s", "bf16", 0.15, seed),
                {"metrics.jsonl": lines(recs)},
            )
    # fp8_rollout run that restarted at step 3 and stopped there: attempt 1 logged 1-3, the current attempt 3
    att1 = lines([(s, train_metrics(s) | {A24: 0.5, A25: 0.7}) for s in (1, 2, 3)])
    cur = lines([(3, train_metrics(3) | {A24: 0.6, A25: 0.8})])
    write_run(
        root,
        "main_comparison",
        "m_agg_moe",
        config("predmask_kl_agg", "cpu_moe", "fp8_rollout", 0.15),
        {"metrics.attempt-1.jsonl": att1, "metrics.jsonl": cur},
    )
    # GRPO on fp8_e2e with cluster-style AIME names; a mean@4 variant must lose to mean@16
    for seed, values in GRPO_VAL.items():
        recs = [
            (
                s,
                train_metrics(s, seed=seed)
                | {
                    "val-core/aime_2024/acc/mean@16": v - 0.02,
                    "val-core/AIME2025/acc/mean@16": v + 0.02,
                    "val-core/aime_2024/acc/mean@4": 0.9,
                },
            )
            for s, v in zip(range(1, 5), values)
        ]
        write_run(
            root,
            "main_comparison",
            f"m_grpo_e2e_s{seed}",
            config("grpo_clip_higher", "cpu_moe", "fp8_e2e", 0.15, seed),
            {"metrics.jsonl": lines(recs)},
        )
    recs = [(s, train_metrics(s) | {A24: 0.05, A25: 0.15}) for s in range(1, 5)]
    write_run(
        root,
        "tight_threshold",
        "t_dppo_s",
        config("dppo_topk_kl", "cpu_s", "bf16", 0.05),
        {"metrics.jsonl": lines(recs)},
    )
    # smoke: aime24 at 2, 4, 6 (0.2 s), aime25 only at 4, 6 (0.4 s) -> val mean 0.3 s at steps 4, 6
    recs = []
    for s in range(1, 7):
        data = train_metrics(s, scale=2.0)
        if s % 2 == 0:
            data[A24] = 0.2 * s
        if s in (4, 6):
            data[A25] = 0.4 * s
        recs.append((s, data))
    write_run(
        root,
        "smoke",
        "sm_agg_s",
        config("predmask_kl_agg", "cpu_s", "bf16", 0.15),
        {"metrics.jsonl": lines(recs)},
    )


# token-level study with tokens. Disagreement tokens kept, by criterion (pooled):
#   ratio:      seed 0 t0 (dd -0.1, corrective), t1 (+0.2, unsafe); seed 1 t0 (-0.5, corrective)  -> 2 / 3
#   predictive: seed 0 t2 (-0.3), t3 (-0.1), t5 (+0.1)                                          -> 2 / 3
#   uniform:    seed 0 t2 (-1.0)                                                               -> 1 / 1
# Seeds 2 and 3 store tokens for the same-token judgement only (docs/math.md §5.1; their per-seed rows below are set
# by hand and do not count them). Every token has A = 1; a criterion drops a token (keep False) when it predicts a
# rise, and the own update raises D where ddot_net > 0. On the disagreement set (keep_ratio != keep_pred_agg):
#   seed 0: t0 (pred drops, rises), t1 (pred drops, falls), t2, t3 (ratio drops, fall), t5 (ratio drops, rises)
#   seed 1: t0 (pred drops, rises): one class, no balanced accuracy of its own
#   seed 2: two the predictive criterion drops that rise, two the ratio criterion drops that fall
#   seed 3: one of each: the predictive and ratio criteria drop one rising and one falling token each
T, F = True, False
# token columns listed seed by seed: seed 0 (t0-t5), seed 1 (t0), seed 2 (t0-t3), seed 3 (t0-t3)
STUDY_TOKENS = {
    "seed": [0] * 6 + [1] + [2] * 4 + [3] * 4,
    "position": [0, 1, 2, 3, 4, 5] + [0] + [0, 1, 2, 3] * 2,
    "d_pre": [0.2] * 15,
    "keep_ratio": [T, T, F, F, T, F] + [T] + [T, T, F, F] * 2,
    "keep_pred_agg": [F, F, T, T, T, T] + [F] + [F, F, T, T] * 2,
    "keep_pred_uniform": [F, F, T, F, T, F] + [T] + [F, F, T, T] * 2,
    "keep_pred_exact": [F, F, T, T, T, T] + [F] + [F, F, T, T] * 2,
    "dd_ratio": [-0.1, 0.2, 0.0, 0.0, -0.4, 0.0] + [-0.5] + [0.0] * 8,
    "dd_pred_agg": [0.0, 0.0, -0.3, -0.1, 0.3, 0.1] + [0.0] + [0.0] * 8,
    "dd_pred_uniform": [0.0, 0.0, -1.0, 0.0, 0.0, 0.0] + [0.0] + [0.0] * 8,
    "a": [1.0] * 15,
    # consistent with the keep decisions at A = 1: the ratio criterion keeps r <= 1, the predictive one Ddot <= 0
    "r": [0.8, 0.8, 1.2, 1.2, 0.8, 1.2] + [0.8] + [0.8, 0.8, 1.2, 1.2] * 2,
    "ddot_agg": [0.1, 0.1, -0.1, -0.1, -0.1, -0.1] + [0.1] + [0.1, 0.1, -0.1, -0.1] * 2,
    "ddot_net": [v / 100 for v in [1, -1, -2, -3, -1, 2] + [1] + [3, 1, -1, -2] + [2, -1, 1, -2]],
    "dd_cf": [v / 100 for v in [2, -2, -1, -1, -2, 1] + [2] + [1, 2, -2, -1] + [1, 1, 2, -1]],
    "context_id": [0, 0, 1, 2, 3, 4] + [10] + [20, 21, 22, 23, 30, 31, 32, 33],
}
# The per-seed rows. The kept / corrective counts are those of seeds 0 and 1's tokens above (seeds 2 and 3 count none); the
# per-seed rates are set by hand, apart from the counts, so that Figure 3 (rates) and Figure 4 (pooled counts) are
# checked separately. Seed 3: the ratio criterion kept nothing -> NULL rate, left out of the pairs.
STUDY_SEEDS = {
    "seed": [0, 1, 2, 3],
    "n_tokens": [100, 100, 100, 100],
    "n_outside": [6, 1, 10, 20],
    "n_disagree": [5, 1, 3, 2],
    "unsafe_keep_ratio": [0.5, 0.4, 0.3, None],
    "unsafe_keep_predictive": [0.25, 0.5, 0.2, 0.1],
    "unsafe_keep_predictive_uniform": [0.0, 0.5, None, None],
    "unsafe_keep_ratio_uniform": [0.5, None, 0.1, None],  # paired with the uniform rate on seed 0 only
    "n_keep_ratio": [2, 1, 0, 0],
    "n_corrective_ratio": [1, 1, 0, 0],
    "n_keep_predictive": [3, 0, 0, 0],
    "n_corrective_predictive": [2, 0, 0, 0],
    "n_keep_predictive_uniform": [1, 0, 0, 0],
    "n_corrective_predictive_uniform": [1, 0, 0, 0],
}
COUNTS_SEEDS = {
    "seed": [0, 1],
    "unsafe_keep_ratio": [0.5, 0.5],
    "unsafe_keep_predictive": [0.5, 0.25],
    "n_keep_ratio": [4, 6],
    "n_corrective_ratio": [1, 3],
    "n_keep_predictive": [5, 5],
    "n_corrective_predictive": [5, 0],
}
STUDY_CONFIG = {
    "model": {"name": "cpu_s", "stands_in_for": "qwen3_4b_base"},
    "precision": {"name": "bf16"},
    "cluster": {"name": "local"},
    "delta": 0.15,
}


# The drift grid: one study per cell, 4 seeds of GRID_TOKENS_PER_SEED response tokens each, tokens drawn at random
# (seeded) so that the cell's share outside is about `share` and its own-update truth is A · Ddot with its sign
# flipped on a share `flip` of the tokens (the predictive criterion's balanced accuracy on the disagreement set is
# then about 1 - flip, the ratio criterion's about flip). The last cell's tokens carry no ground truth: a study
# stored before the ground truths, not judged.
GRID_ID = "grid_test"
GRID_SEEDS = (0, 1, 2, 3)
GRID_TOKENS_PER_SEED = 4000
#: (study id, precision, lr, staleness, share outside, flip, judged)
GRID_CELLS: tuple[tuple[str, str, float, int, float, float, bool], ...] = (
    ("g_bf16_low", "bf16", 1.5e-4, 1, 0.004, 0.20, True),
    ("g_bf16_mid", "bf16", 3e-4, 3, 0.03, 0.30, True),
    ("g_bf16_high", "bf16", 3e-4, 7, 0.15, 0.40, True),
    ("g_fp8_low", "fp8_rollout", 1.5e-4, 1, 0.01, 0.25, True),
    ("g_fp8_high", "fp8_rollout", 3e-4, 7, 0.2, 0.45, True),
    ("g_fp8_old", "fp8_rollout", 3e-4, 3, 0.05, 0.30, False),
)
#: the token columns the last cell lacks (a study stored before the ground truths)
TRUTH_COLUMNS: tuple[str, ...] = ("ddot_net", "dd_cf", "context_id")


def grid_tokens(cell: int, share: float, flip: float, judged: bool) -> pl.DataFrame:
    """One cell's outside tokens, every seed: keep decisions from A, r and Ddot, and the own-update truth."""
    frames = []
    for seed in GRID_SEEDS:
        rng = np.random.default_rng(1000 * cell + seed)
        n = round(share * GRID_TOKENS_PER_SEED * rng.uniform(0.8, 1.2))
        a = rng.choice([-1.0, 1.0], n)
        x = rng.normal(size=n)
        r = np.exp(0.3 * x + 0.2 * rng.normal(size=n))
        ddot = x + 0.6 * rng.normal(size=n)
        cols: dict[str, object] = {
            "seed": np.full(n, seed),
            "position": np.arange(n),
            "d_pre": 0.15 + rng.exponential(0.05, n),
            "a": a,
            "r": r,
            "ddot_agg": ddot,
            "ddot_uniform": ddot + 1e-3 * rng.normal(size=n),
            "ddot_exact": ddot + 1e-3 * rng.normal(size=n),
            "keep_ratio": a * (r - 1) <= 0,
        }
        for tail in ("agg", "uniform", "exact"):
            cols[f"keep_pred_{tail}"] = a * cols[f"ddot_{tail}"] <= 0
        for name in ("dd_ratio", "dd_pred_agg", "dd_pred_uniform", "dd_pred_exact"):
            cols[name] = 0.01 * rng.normal(size=n)
        if judged:
            sign = np.where(rng.random(n) < flip, -1.0, 1.0)
            cols["ddot_net"] = sign * a * ddot * rng.uniform(0.5, 1.5, n)
            cols["dd_cf"] = cols["ddot_net"] * rng.uniform(0.5, 1.5, n)
            cols["context_id"] = rng.integers(0, 10**6, n)
        frames.append(pl.DataFrame(cols))
    return pl.concat(frames)


def build_grid(con) -> None:
    """The drift grid's cells, each a study stored with its judgement as ingest derives it, older than the main
    studies (so that none of them is the default study)."""
    rows = []
    for i, (sid, precision, lr, staleness, share, flip, judged) in enumerate(GRID_CELLS):
        tokens = grid_tokens(i, share, flip, judged)
        seeds = pl.DataFrame(
            [
                {"seed": s, **seed_summary(tokens.filter(pl.col("seed") == s), GRID_TOKENS_PER_SEED)}
                for s in GRID_SEEDS
            ]
        )
        config = {**STUDY_CONFIG, "precision": {"name": precision}, "lr": lr, "staleness": staleness}
        upsert_token_level(con, sid, config, seeds, tokens, derive=study_tables)
        con.execute(
            "UPDATE token_level_studies SET created_at = TIMESTAMP '2019-01-01' WHERE study_id = ?", [sid]
        )
        rows.append(
            {
                "grid_name": "test",
                "cell": i,
                "study_id": sid,
                "precision": precision,
                "lr": lr,
                "staleness": staleness,
                "minibatches": 8,
                "sequences": 1024,
                "params": {"lr": lr, "staleness": staleness, "precision": precision},
            }
        )
    upsert_grid(con, GRID_ID, rows)


def build_db(root: Path, with_study: bool = True) -> Path:
    build_runs(root)
    db = root / "results" / "reports.duckdb"
    con = connect(db)
    try:
        summary = ingest_paths(con, [root / "runs"])
        assert len(summary.runs) == 15 and not summary.unmatched
        if with_study:
            upsert_token_level(con, "st_counts", STUDY_CONFIG, pa.table(COUNTS_SEEDS), None)
            con.execute(
                "UPDATE token_level_studies SET created_at = TIMESTAMP '2020-01-01' WHERE study_id = 'st_counts'"
            )
            upsert_token_level(
                con,
                "st_tokens",
                STUDY_CONFIG,
                pa.table(STUDY_SEEDS),
                pa.table(STUDY_TOKENS),
                derive=study_tables,
            )
            build_grid(con)
    finally:
        con.close()
    return db


def build_study_only_db(db: Path) -> Path:
    """A database holding one token-level study of one seed and no training runs (empty training sections)."""
    con = connect(db)
    upsert_token_level(
        con,
        "only",
        {"model": {"name": "cpu_s"}},
        pa.table({"seed": [0], "unsafe_keep_ratio": [0.5], "unsafe_keep_predictive": [0.25]}),
        None,
    )
    con.close()
    return db
