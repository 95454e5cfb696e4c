"""A variational-family results database with known values, built through the store's real ingest and upserts.

Run directories (runs/variational_reasoning/<run_id>/ with config.yaml, status.json, metrics.jsonl; CPU engine,
cpu_s standing in for Qwen3-4B-Base), ingested by analysis.store.ingest_paths:
  vr_prior                  stage prior (π_θ0)                      1 run
  vr_final_sft_s{0,1,2}     stage final, sft                          3 seeds
  vr_final_rft_s{0,1,2}     stage final, rft                          3 seeds
  vr_final_acc_aw_s{0,1,2}  stage final, vr_acc, all_weighted         3 seeds
  vr_final_acc_bm_s{0,1}    stage final, vr_acc, best_mixed           2 seeds
  vr_final_gml_aw_s0        stage final, vr_gml, all_weighted         1 seed
  vr_grpo_s{0,1,2}          engine run, method grpo (no family key)   3 seeds
  vr_weights                stage weights with weights.parquet (its rows: vr_traces, by the store's ingest)
  vr_posterior              stage posterior: train/loss only (no evaluation: in no accuracy artefact)
  vr_traces_s{0,1}          stage traces: q_φ's hint-use metrics (HINT_USE, per seed), no evaluation
Every evaluated run logs at step 1 a decoy (all 0.0) and at its last step the values of ``final_acc``/``pass_at``;
the artefacts must read the last step. An accuracy-weighting analysis (source model and bandit) is stored through
analysis.store's upsert.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from analysis.store import connect, ingest_paths, upsert_accuracy_weighting
from predmask import metrics
from predmask.rl.task import EVAL_SPLITS

SWEEP = "variational_reasoning"
MODEL = {"name": "cpu_s", "stands_in_for": "qwen3_4b_base"}
LAST_STEP = 5

# (run id stem, method name, estimator, data setting, seeds, base accuracy)
FINAL_RUNS: tuple[tuple[str, str, str | None, str | None, tuple[int, ...], float], ...] = (
    ("vr_final_sft", "sft", None, None, (0, 1, 2), 0.30),
    ("vr_final_rft", "rft", None, None, (0, 1, 2), 0.35),
    ("vr_final_acc_aw", "vr_acc", "acc", "all_weighted", (0, 1, 2), 0.50),
    ("vr_final_acc_bm", "vr_acc", "acc", "best_mixed", (0, 1), 0.45),
    ("vr_final_gml_aw", "vr_gml", "gml", "all_weighted", (0,), 0.40),
)
GRPO_BASE, PRIOR_ACC = 0.38, 0.20
EVAL_SIZE = 24  # task.eval_size of every run: problems per stand-in split (not the default 30: a literal fails)
#: the traces runs' hint-use metrics per seed (decoy-following, q_φ's and π_θ0's hinted-answer rates): a posterior
#: that ignores its hint, as measured on the CPU stand-in
HINT_USE: dict[int, dict[str, float]] = {
    0: {metrics.VR_DECOY_HIT: 0.01, metrics.VR_POSTERIOR_CORRECT: 0.375, metrics.VR_PRIOR_CORRECT: 0.39},
    1: {metrics.VR_DECOY_HIT: 0.03, metrics.VR_POSTERIOR_CORRECT: 0.385, metrics.VR_PRIOR_CORRECT: 0.39},
}
SEED_STEP = {0: 0.0, 1: 0.04, 2: -0.02}  # added to a recipe's base accuracy by seed
SPLIT_OFFSET = {EVAL_SPLITS[0]: 0.0, EVAL_SPLITS[1]: 0.05}


def final_acc(base: float, seed: int, split: str) -> float:
    """The avg@16 a run logs at its last step."""
    return base + SEED_STEP[seed] + SPLIT_OFFSET[split]


def pass_at(acc: float, k: int) -> float:
    """The pass@k a run logs at its last step (increasing in k, pass@1 = avg@16)."""
    return 1.0 - (1.0 - acc) ** math.sqrt(k)


def eval_metrics(base: float, seed: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for split in EVAL_SPLITS:
        acc = final_acc(base, seed, split)
        out[metrics.val_acc(split, 16)] = acc
        out[metrics.val_response_length(split)] = 12.0
        out |= {metrics.val_pass(split, k): pass_at(acc, k) for k in range(1, 17)}
    return out


def _lines(records: list[tuple[int, dict[str, Any]]]) -> str:
    return "".join(json.dumps({"step": s, "data": d}) + "\n" for s, d in records)


def _evaluated(base: float, seed: int) -> str:
    decoy = {name: 0.0 for name in eval_metrics(base, seed)}
    train = [(s, {"train/loss": 1.0 / s}) for s in range(1, LAST_STEP)]
    return _lines([(1, decoy | train[0][1]), *train[1:], (LAST_STEP, eval_metrics(base, seed))])


def write_run(root: Path, run_id: str, cfg: dict[str, Any], files: dict[str, str | bytes]) -> Path:
    d = root / "runs" / SWEEP / run_id
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    (d / "status.json").write_text(
        json.dumps({"status": "completed", "step": LAST_STEP, "total_steps": LAST_STEP, "updated": 1.7e9,
                    "error": None})
    )
    for name, content in files.items():
        (d / name).write_bytes(content) if isinstance(content, bytes) else (d / name).write_text(content)
    return d


def stage_config(stage: str, method: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    return {
        "family": "variational",
        "stage": stage,
        "seed": seed,
        "method": method,
        "model": dict(MODEL),
        "cluster": {"name": "local"},
        "task": {"name": "arithmetic", "eval_size": EVAL_SIZE},
        "data": {"questions": 4, "noise": 0.1, "seed": 0},
        "traces": {"k": 3, "temperature": 1.0},
        "weights": {"m": 8, "temperature": 1.0},
    }


# weights.parquet: 4 questions x 3 traces with known lengths and log-likelihoods
N_Q, N_K = 4, 3
TRACE_TOKENS = np.array([3, 5, 8, 4, 6, 9, 2, 7, 10, 5, 5, 11])
ANSWER_TOKENS = np.array([2, 3, 2, 4, 3, 2, 5, 2, 3, 4, 2, 3])
LOG_RATIO = -0.05 * TRACE_TOKENS + np.array([0.1, -0.2, 0.05, 0.0, 0.3, -0.1, 0.2, -0.3, 0.1, 0.0, -0.05, 0.15])
ANSWER_LOGP = -0.7 * ANSWER_TOKENS + np.array([0.2, -0.1, 0.0, 0.3, -0.2, 0.1, 0.0, 0.2, -0.3, 0.1, 0.0, -0.1])


def weights_table() -> pa.Table:
    q = np.repeat(np.arange(N_Q), N_K)
    t = np.tile(np.arange(N_K), N_Q)
    log_posterior = -0.4 * TRACE_TOKENS
    log_prior = log_posterior + LOG_RATIO * TRACE_TOKENS
    acc = np.linspace(0.0, 1.0, N_Q * N_K)

    def norm(x: np.ndarray) -> np.ndarray:
        out = np.zeros_like(x)
        for g in range(N_Q):
            s = x[q == g].sum()
            out[q == g] = x[q == g] / s if s > 0 else 0.0
        return out

    return pa.table(
        {
            "question": q.astype(np.int64),
            "trace": t.astype(np.int64),
            "trace_tokens": TRACE_TOKENS.astype(np.int64),
            "answer_tokens": ANSWER_TOKENS.astype(np.int64),
            "log_prior": log_prior,
            "log_posterior": log_posterior,
            "log_ratio": LOG_RATIO,
            "answer_logp": ANSWER_LOGP,
            "acc": acc,
            "posterior_correct": acc > 0.3,
            "weight_acc": norm(np.exp(LOG_RATIO) * acc),
            "weight_gml": norm(np.exp(LOG_RATIO + ANSWER_LOGP / ANSWER_TOKENS)),
            "weight_likelihood": norm(np.exp(LOG_RATIO + ANSWER_LOGP)),
        }
    )


def _parquet(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


# accuracy weighting: per method, measured weights near the closed forms at a few accuracies
WEIGHT_ACCURACY = (0.125, 0.25, 0.5, 0.75)
WEIGHT_METHODS = ("rft", "reinforce", "grpo", "vr")


def predicted(method: str, p: float) -> float:
    return {"rft": p, "reinforce": p, "grpo": math.sqrt(p / (1 - p)), "vr": 1.0}[method]


def weighting_rows() -> list[dict[str, Any]]:
    rows = []
    for source in ("model", "bandit"):
        for method in WEIGHT_METHODS:
            for i, p in enumerate(WEIGHT_ACCURACY):
                noise = 0.0 if source == "bandit" else 0.03 * (-1) ** i
                rows.append(
                    {
                        "method": method,
                        "question": i,
                        "accuracy": p,
                        "measured_weight": predicted(method, p) + noise,
                        "predicted_weight": predicted(method, p),
                        "n_samples": 8,
                        "group_size": 8,
                        "source": source,
                        "model": "cpu_s",
                    }
                )
            # a question without a correct sample: no weight (NULL), never drawn
            rows.append({**rows[-1], "question": 99, "accuracy": 0.0, "measured_weight": None,
                         "predicted_weight": predicted(method, 0.0)})
    return rows


WEIGHTING_CONFIG = {"model": "cpu_s", "questions": 4, "samples": 8, "group_size": 8}


def build_runs(root: Path) -> None:
    write_run(root, "vr_prior", stage_config("prior", {"name": "prior"}), {"metrics.jsonl": _evaluated(PRIOR_ACC, 0)})
    write_run(root, "vr_posterior", stage_config("posterior", {"name": "posterior"}),
              {"metrics.jsonl": _lines([(s, {"train/loss": 1.0 / s}) for s in range(1, 4)])})
    for stem, name, estimator, data, seeds, base in FINAL_RUNS:
        for seed in seeds:
            method = {"name": name, "label": name}
            if estimator:
                method |= {"estimator": estimator, "data": data}
            write_run(root, f"{stem}_s{seed}", stage_config("final", method, seed),
                      {"metrics.jsonl": _evaluated(base, seed)})
    for seed in (0, 1, 2):  # the GRPO baseline: an ordinary engine run in the same sweep
        cfg = {"seed": seed, "method": {"name": "grpo", "eps_low": 0.2, "eps_high": 0.2}, "model": dict(MODEL),
               "precision": {"name": "bf16"}, "cluster": {"name": "local"},
               "task": {"name": "arithmetic", "eval_size": EVAL_SIZE}}
        write_run(root, f"vr_grpo_s{seed}", cfg, {"metrics.jsonl": _evaluated(GRPO_BASE, seed)})
    for seed, values in HINT_USE.items():
        write_run(root, f"vr_traces_s{seed}", stage_config("traces", {"name": "traces"}, seed),
                  {"metrics.jsonl": _lines([(0, values)])})
    write_run(root, "vr_weights", stage_config("weights", {"name": "weights"}),
              {"metrics.jsonl": _lines([(1, {"weights/seconds": 1.0})]), "weights.parquet": _parquet(weights_table())})


def build_variational_db(root: Path, with_weighting: bool = True) -> Path:
    """Write the run directories under root/runs, ingest them, store the accuracy-weighting analysis."""
    build_runs(root)
    db = root / "results" / "variational.duckdb"
    con = connect(db)
    try:
        summary = ingest_paths(con, [root / "runs"])
        assert len(summary.runs) == 20 and not summary.unmatched, summary
        if with_weighting:
            upsert_accuracy_weighting(con, "aw_fixture", WEIGHTING_CONFIG, weighting_rows())
    finally:
        con.close()
    return db
