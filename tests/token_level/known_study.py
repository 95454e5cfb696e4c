"""A synthetic token-level study whose judgement against the own-update ground truth is known by construction.

Per seed s (``SEEDS``), tokens of five kinds (A: advantage, truth: ``ddot_net``, > 0 means keeping the token's update
raises its D, so a right decision drops it):

- ``D1`` (2 + s % 2 tokens): the disagreement set, the predictive criterion drops, the ratio criterion keeps, the
  truth rises: predictive right, ratio wrong;
- ``D2`` (2): the disagreement set, the predictive criterion keeps, the ratio criterion drops, the truth falls:
  predictive right, ratio wrong;
- ``K`` (3): both keep, the truth falls: both right;
- ``R`` (1): both keep, the truth rises: both wrong; the only kind where sign(truth) != sign(A · Ddot_agg);
- ``Z`` (1): A = 0, outside every judged set.

Each kind of a seed shares one ``context_id``, so a set holds one distinct (context, token) pair per kind and seed.
``flip`` turns the truth of the first ``D1`` token of the seeds it names to falling, so per-seed rates differ.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import polars as pl

from analysis.token_level.summary.study_stats import seed_summary

SEEDS = tuple(range(6))
#: response tokens per seed (the population the outside tokens come from)
RESPONSE_TOKENS = 1000
#: kind -> (A, r, Ddot of every tail, ddot_net)
KINDS: dict[str, tuple[float, float, float, float]] = {
    "D1": (1.0, 0.9, 1.0, 0.5),
    "D2": (1.0, 1.1, -1.0, -0.5),
    "K": (1.0, 0.9, -1.0, -0.2),
    "R": (-1.0, 1.1, 1.0, 0.3),
    "Z": (0.0, 1.0, 1.0, 0.0),
}


def kind_count(kind: str, seed: int) -> int:
    return {"D1": 2 + seed % 2, "D2": 2, "K": 3, "R": 1, "Z": 1}[kind]


def seed_tokens(seed: int, flip: Iterable[int] = (), truths: bool = True) -> pl.DataFrame:
    """One seed's token rows (``truths=False``: an older study's rows, without the ground truths and context)."""
    rows = []
    for k, (kind, (a, r, ddot, net)) in enumerate(KINDS.items()):
        for i in range(kind_count(kind, seed)):
            truth = -net if (kind == "D1" and i == 0 and seed in set(flip)) else net
            rows.append(
                {"kind": kind, "a": a, "r": r, "ddot": ddot, "ddot_net": truth, "context_id": 100 * seed + k}
            )
    f = pl.DataFrame(rows)
    n = f.height
    rng = np.random.default_rng(seed)
    out = pl.DataFrame(
        {
            "seed": [seed] * n,
            "sequence": list(range(n)),
            "position": [0] * n,
            "d_pre": [0.3] * n,
            "r": f["r"],
            "a": f["a"],
            **{c: f["ddot"] for c in ("ddot_agg", "ddot_uniform", "ddot_exact")},
            "keep_ratio": (f["a"] * (f["r"] - 1.0)) <= 0,
            **{
                c: (f["a"] * f["ddot"]) <= 0
                for c in ("keep_pred_agg", "keep_pred_uniform", "keep_pred_exact")
            },
            **{
                c: rng.normal(size=n) for c in ("dd_ratio", "dd_pred_agg", "dd_pred_uniform", "dd_pred_exact")
            },
            "dd_all": rng.normal(size=n),
        }
    )
    if truths:
        out = out.with_columns(
            ddot_net=f["ddot_net"], dd_cf=0.5 * f["ddot_net"], context_id=f["context_id"].cast(pl.Int64)
        )
    return out


def study(
    seeds: Iterable[int] = SEEDS, flip: Iterable[int] = (), truths: bool = True
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(seed rows, token rows) of the study over ``seeds``."""
    tokens = [seed_tokens(s, flip, truths) for s in seeds]
    rows = pl.DataFrame([{"seed": s, **seed_summary(t, RESPONSE_TOKENS)} for s, t in zip(seeds, tokens)])
    return rows, pl.concat(tokens)
