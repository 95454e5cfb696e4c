"""Statistics of the token-level study (math.md §5): per-seed counts and rates, across-seed summaries, extra checks.

Everything here is a pure function of the token rows (one row per studied token, ``D_pre > delta``; columns of
``analysis.store.TOKEN_COLUMNS`` plus ``dd_all``) or of the per-seed rows, so that the same numbers come out of a
worker's files and of the results database.

Criteria: ``ratio`` keeps a token when ``A (r - 1) <= 0``; ``predictive`` (aggregated tail, the paper's),
``predictive_uniform`` and ``predictive_exact`` keep it when ``A Ddot <= 0`` with that tail estimator. Each
predictive criterion is compared with the ratio criterion on its own disagreement set (the tokens on which the two
keep decisions differ); the per-seed columns ``n_keep_ratio`` / ``unsafe_keep_ratio`` refer to the aggregated-tail
disagreement set (``n_disagree``), as in the paper.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import polars as pl

__all__ = [
    "CRITERIA",
    "PAPER",
    "PREDICTIVE",
    "PairSummary",
    "first_order",
    "mean_se",
    "pair_summaries",
    "seed_summaries",
    "seed_summary",
    "sign_accuracy",
    "tail_flips",
]

#: criterion -> (keep column, dD column of the update made with that criterion's mask)
CRITERIA: dict[str, tuple[str, str]] = {
    "ratio": ("keep_ratio", "dd_ratio"),
    "predictive": ("keep_pred_agg", "dd_pred_agg"),
    "predictive_uniform": ("keep_pred_uniform", "dd_pred_uniform"),
    "predictive_exact": ("keep_pred_exact", "dd_pred_exact"),
}
#: predictive criterion -> (Ddot column, suffix of its disagreement count column)
PREDICTIVE: dict[str, tuple[str, str]] = {
    "predictive": ("ddot_agg", ""),
    "predictive_uniform": ("ddot_uniform", "_uniform"),
    "predictive_exact": ("ddot_exact", "_exact"),
}

#: The paper's figures for this study (math.md §5; Qwen3 scale, 61 seeds).
PAPER: dict[str, float] = {
    "seeds": 61,
    "outside_per_seed": 1435,
    "disagree_per_seed": 82,
    "unsafe_keep_predictive": 0.342,
    "unsafe_keep_ratio": 0.369,
    "seeds_predictive_lower": 38,
    "corrective_predictive": 0.651,
    "corrective_ratio": 0.629,
}


def _counts(keep: np.ndarray, dd: np.ndarray, disagree: np.ndarray) -> tuple[int, int, int]:
    kept = disagree & keep
    return int(kept.sum()), int((kept & (dd > 0)).sum()), int((kept & (dd < 0)).sum())


def _rate(num: int, den: int) -> float | None:
    return num / den if den else None


def seed_summary(tokens: pl.DataFrame, n_tokens: int) -> dict[str, int | float | None]:
    """The per-seed row of ``token_level_seeds`` from one seed's token rows (all of them outside, D_pre > delta).

    ``n_tokens`` is the number of response tokens of the seed's batch (the population the outside tokens came from).
    """
    col = {c: tokens.get_column(c).to_numpy() for c in tokens.columns if c.startswith(("keep_", "dd_"))}
    keep_ratio = col["keep_ratio"].astype(bool)
    row: dict[str, int | float | None] = {"n_tokens": int(n_tokens), "n_outside": tokens.height}
    for crit, (_ddot, suffix) in PREDICTIVE.items():
        keep_c, dd_c = CRITERIA[crit]
        kp = col[keep_c].astype(bool)
        disagree = kp != keep_ratio
        row[f"n_disagree{suffix}"] = int(disagree.sum())
        n_keep, n_unsafe, n_corr = _counts(kp, col[dd_c], disagree)
        row[f"n_keep_{crit}"], row[f"n_unsafe_{crit}"], row[f"n_corrective_{crit}"] = n_keep, n_unsafe, n_corr
        row[f"unsafe_keep_{crit}"] = _rate(n_unsafe, n_keep)
        if crit == "predictive":
            n_keep, n_unsafe, n_corr = _counts(keep_ratio, col["dd_ratio"], disagree)
            row["n_keep_ratio"], row["n_unsafe_ratio"], row["n_corrective_ratio"] = n_keep, n_unsafe, n_corr
            row["unsafe_keep_ratio"] = _rate(n_unsafe, n_keep)
    return row


def mean_se(values: Sequence[float | None]) -> tuple[float | None, float | None, int]:
    """Mean, standard error (sample std / sqrt(n)) and n over the defined values; (None, None, 0) when none."""
    x = np.array([v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))], float)
    if x.size == 0:
        return None, None, 0
    se = float(x.std(ddof=1) / math.sqrt(x.size)) if x.size > 1 else None
    return float(x.mean()), se, int(x.size)


@dataclass(frozen=True)
class PairSummary:
    """Ratio vs one predictive criterion, over seeds, on that criterion's disagreement sets."""

    predictive: str
    seeds: int
    disagree_mean: float
    unsafe_ratio: tuple[float | None, float | None, int]  # mean, SE, seeds with a defined rate
    unsafe_predictive: tuple[float | None, float | None, int]
    seeds_predictive_lower: int
    seeds_compared: int  # seeds where both rates are defined
    corrective_ratio: float | None  # pooled over seeds
    corrective_predictive: float | None
    kept_ratio: int  # pooled counts behind the corrective fractions
    kept_predictive: int


def seed_summaries(tokens: pl.DataFrame, n_tokens: Mapping[int, int]) -> pl.DataFrame:
    """``seed_summary`` of every seed in ``n_tokens`` (seeds without outside tokens get zero counts)."""
    rows = []
    for seed in sorted(n_tokens):
        part = tokens.filter(pl.col("seed") == seed)
        rows.append({"seed": seed, **seed_summary(part, n_tokens[seed])})
    return pl.DataFrame(rows)


def _pair_counts(tokens: pl.DataFrame, crit: str) -> pl.DataFrame:
    keep_c, dd_c = CRITERIA[crit]
    dis = pl.col("keep_ratio") != pl.col(keep_c)
    return tokens.group_by("seed").agg(
        n_disagree=dis.sum(),
        keep_r=(dis & pl.col("keep_ratio")).sum(),
        unsafe_r=(dis & pl.col("keep_ratio") & (pl.col("dd_ratio") > 0)).sum(),
        corr_r=(dis & pl.col("keep_ratio") & (pl.col("dd_ratio") < 0)).sum(),
        keep_p=(dis & pl.col(keep_c)).sum(),
        unsafe_p=(dis & pl.col(keep_c) & (pl.col(dd_c) > 0)).sum(),
        corr_p=(dis & pl.col(keep_c) & (pl.col(dd_c) < 0)).sum(),
    )


def pair_summaries(tokens: pl.DataFrame, seeds: Sequence[int]) -> list[PairSummary]:
    """Across-seed comparison of the ratio criterion with each predictive criterion (math.md §5 items 4-5).

    ``seeds`` lists every seed of the study (a seed without outside tokens counts as zero disagreement and no
    defined rate).
    """
    out = []
    base = pl.DataFrame({"seed": list(seeds)}, schema={"seed": tokens.schema.get("seed", pl.Int64)})
    for crit in PREDICTIVE:
        c = base.join(_pair_counts(tokens, crit), on="seed", how="left").fill_null(0)
        rows = c.to_dicts()
        ur = [r["unsafe_r"] / r["keep_r"] if r["keep_r"] else None for r in rows]
        up = [r["unsafe_p"] / r["keep_p"] if r["keep_p"] else None for r in rows]
        both = [(a, b) for a, b in zip(ur, up) if a is not None and b is not None]
        kr, kp = int(c["keep_r"].sum()), int(c["keep_p"].sum())
        out.append(
            PairSummary(
                predictive=crit,
                seeds=len(rows),
                disagree_mean=float(c["n_disagree"].mean()) if rows else 0.0,
                unsafe_ratio=mean_se(ur),
                unsafe_predictive=mean_se(up),
                seeds_predictive_lower=sum(1 for a, b in both if b < a),
                seeds_compared=len(both),
                corrective_ratio=_rate(int(c["corr_r"].sum()), kr),
                corrective_predictive=_rate(int(c["corr_p"].sum()), kp),
                kept_ratio=kr,
                kept_predictive=kp,
            )
        )
    return out


def _predicted_increase(tokens: pl.DataFrame, crit: str) -> pl.Expr:
    if crit == "ratio":
        return (pl.col("a") * (pl.col("r") - 1.0)) > 0
    return (pl.col("a") * pl.col(PREDICTIVE[crit][0])) > 0


def sign_accuracy(
    tokens: pl.DataFrame, reference: str = "dd_all"
) -> dict[str, tuple[float | None, float | None, int]]:
    """Per criterion: how often ``A x > 0`` (predicted increase of D) matches ``reference > 0`` (realised increase).

    Over all outside tokens with ``A != 0`` of each seed; returns mean, SE over seeds and the number of seeds.
    ``reference`` is the dD of the update that keeps every token (``dd_all``), so each token's own gradient is in it.
    """
    live = tokens.filter(pl.col("a") != 0)
    out = {}
    for crit in CRITERIA:
        per_seed = live.group_by("seed").agg(
            acc=(_predicted_increase(live, crit) == (pl.col(reference) > 0)).mean()
        )
        out[crit] = mean_se(per_seed["acc"].to_list())
    return out


def tail_flips(tokens: pl.DataFrame) -> dict[str, dict[str, float | int]]:
    """How often the aggregated and uniform tails disagree with the exact tail, pooled over outside tokens.

    ``sign``: sign(Ddot_tail) != sign(Ddot_exact) (all outside tokens); ``keep``: the keep decision differs.
    """
    n = tokens.height
    exact = np.sign(tokens.get_column("ddot_exact").to_numpy())
    keep_exact = tokens.get_column("keep_pred_exact").to_numpy().astype(bool)
    out: dict[str, dict[str, float | int]] = {}
    for name, col, keep in (
        ("aggregated", "ddot_agg", "keep_pred_agg"),
        ("uniform", "ddot_uniform", "keep_pred_uniform"),
    ):
        ddot = tokens.get_column(col).to_numpy()
        sf = int((np.sign(ddot) != exact).sum())
        kf = int((tokens.get_column(keep).to_numpy().astype(bool) != keep_exact).sum())
        err = float(np.abs(ddot - tokens.get_column("ddot_exact").to_numpy()).max()) if n else float("nan")
        out[name] = {
            "tokens": n,
            "sign_flips": sf,
            "keep_flips": kf,
            "sign_flip_frac": sf / n if n else float("nan"),
            "max_abs_err": err,
        }
    return out


def _spearman(x: np.ndarray, y: np.ndarray) -> float:
    rx = np.argsort(np.argsort(x, kind="stable"), kind="stable").astype(float)
    ry = np.argsort(np.argsort(y, kind="stable"), kind="stable").astype(float)
    return float(np.corrcoef(rx, ry)[0, 1])


def first_order(
    tokens: pl.DataFrame, ratio_cap: float, reference: str = "dd_all"
) -> dict[str, dict[str, float]]:
    """Correlation of each criterion's step-scaled predicted change with the realised ``reference`` dD.

    The token's own gradient moves its logits by ``A * min(r, c)`` (times a positive step size) along
    ``e_k - pi``, so the first-order change of D is ``A * min(r, c) * Ddot`` (the ratio criterion's stand-in for
    Ddot is ``r - 1``). Pearson and Spearman correlations over outside tokens with ``A != 0``, pooled over seeds.
    """
    live = tokens.filter(pl.col("a") != 0)
    y = live.get_column(reference).to_numpy()
    scale = live.get_column("a").to_numpy() * np.minimum(live.get_column("r").to_numpy(), ratio_cap)
    out: dict[str, dict[str, float]] = {}
    for crit, x_raw in (
        ("ratio", live.get_column("r").to_numpy() - 1.0),
        ("predictive", live.get_column("ddot_agg").to_numpy()),
        ("predictive_uniform", live.get_column("ddot_uniform").to_numpy()),
        ("predictive_exact", live.get_column("ddot_exact").to_numpy()),
    ):
        x = scale * x_raw
        if x.size < 3 or np.std(x) == 0 or np.std(y) == 0:
            out[crit] = {"tokens": int(x.size), "pearson": float("nan"), "spearman": float("nan")}
            continue
        out[crit] = {
            "tokens": int(x.size),
            "pearson": float(np.corrcoef(x, y)[0, 1]),
            "spearman": _spearman(x, y),
        }
    return out
