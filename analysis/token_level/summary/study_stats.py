"""Every statistic of the token-level study (docs/math.md §5), and the paper's numbers beside which they are printed.

Two inputs. A worker turns one seed's token rows (one row per studied token, ``D_pre > delta``; the columns of
``analysis.store.TOKEN_COLUMNS``) into that seed's row of counts and rates (``seed_summary``). Everything printed
about a study is then a pure function of those per-seed rows (``study_summary``), whether they come from a worker's
files or from the results database: the CLI, its report, the figures and the tables all call it.

The criteria and every column are named by ``analysis.token_columns``; docs/math.md §5 defines the statistics (a
mean of per-seed unsafe-keep rates is over the PAIRED seeds of its comparison and names its n; corrective
fractions and shares are pooled over seeds, with Wilson intervals). A drift point (``drift_point``) also carries the
criteria judged against the own-update ground truth (§5.1), read from the rows of
``analysis.token_level.summary.criteria.criteria_table`` (which this module does not import: it judges nothing).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl

from analysis import token_columns
from analysis.paired import PairedEstimate, wilson_interval  # their one owner; re-exported here
from analysis.token_columns import CRITERIA, HEADLINE, OWN_UPDATE, PREDICTIVE, RATIO
from analysis.training.stats import finite_values

#: The paper's figures for this study (docs/math.md §5; Qwen3 scale, 61 seeds): the one copy of them.
PAPER_TOKEN_LEVEL: dict[str, float] = {
    "seeds": 61,
    "outside_per_seed": 1435,
    "disagree_per_seed": 82,
    "unsafe_keep_predictive": 0.342,
    "unsafe_keep_ratio": 0.369,
    "seeds_predictive_lower": 38,
    "corrective_predictive": 0.651,
    "corrective_ratio": 0.629,
}
PAPER_LABEL = "paper (Qwen3, 61 seeds)"
#: The paper does not report its share of response tokens outside the trust region, nor its mean response length.
#: Its share is 1,435 / (1,024 * L) for a mean response length L; this range of L is an ASSUMPTION (from one
#: response-budget block of 1,024 tokens up to the 8,192-token response budget of the cluster configs,
#: conf/model/qwen3_*.yaml max_response_length), so the paper's share is drawn as a band, never as a point.
PAPER_RESPONSE_LENGTHS: tuple[int, int] = (1024, 8192)

PAIRED = "paired seeds"
SEEDS = "seeds"

#: the token set of the paired statistics a drift point carries: the aggregated-tail criterion's disagreement set
DISAGREE_SET = "disagree"


def paper_text(key: str) -> str:
    """One of the paper's numbers as it is printed beside a study's ("34.2%", "1,435", "≈ 82", "38 of 61")."""
    if key not in PAPER_TOKEN_LEVEL:
        raise KeyError(f"unknown paper number {key!r}; known: {', '.join(PAPER_TOKEN_LEVEL)}")
    v = PAPER_TOKEN_LEVEL[key]
    if key.startswith(("unsafe_keep_", "corrective_")):
        return f"{100 * v:.1f}%"
    if key == "seeds_predictive_lower":
        return f"{v:.0f} of {PAPER_TOKEN_LEVEL['seeds']:.0f}"
    if key == "disagree_per_seed":
        return f"≈ {v:.0f}"
    return f"{v:,.0f}"


def paper_share_outside() -> tuple[float, float]:
    """(low, high) share of response tokens outside the trust region implied by the paper's 1,435 outside tokens
    per 1,024 responses for a mean response length in ``PAPER_RESPONSE_LENGTHS`` (an assumption, see there)."""
    per_response = PAPER_TOKEN_LEVEL["outside_per_seed"] / 1024
    long, short = PAPER_RESPONSE_LENGTHS[1], PAPER_RESPONSE_LENGTHS[0]
    return per_response / long, per_response / short


def paper_disagreement_share() -> float:
    """The paper's disagreement set as a share of its outside tokens (≈ 82 of 1,435 per seed)."""
    return PAPER_TOKEN_LEVEL["disagree_per_seed"] / PAPER_TOKEN_LEVEL["outside_per_seed"]


@dataclass(frozen=True)
class MeanSE:
    """Mean and standard error of per-seed values, with the number of seeds and which seeds they are."""

    mean: float | None
    se: float | None  # sample std / sqrt(n); None for n < 2
    n: int
    over: str  # what n counts: "seeds" or "paired seeds"

    def value(self) -> tuple[float, float]:
        """(mean, se) as floats, NaN where undefined (for plotting)."""
        return (
            float("nan") if self.mean is None else self.mean,
            float("nan") if self.se is None else self.se,
        )

    def _fmt(self, scale: float, spec: str, unit: str) -> str:
        if self.mean is None:
            return "—"
        spread = f" ± {format(scale * self.se, spec)}" if self.se is not None else ""
        return f"{format(scale * self.mean, spec)}{unit}{spread} (n = {self.n} {self.over})"

    def pct(self) -> str:
        """ "88.3% ± 2.3 (n = 58 paired seeds)"; "—" when no seed has a value."""
        return self._fmt(100.0, ".1f", "%")

    def count(self) -> str:
        """ "1,435.2 ± 12.1 (n = 61 seeds)"; "—" when no seed has a value."""
        return self._fmt(1.0, ",.1f", "")


def mean_se(values: Iterable[float | None], over: str = SEEDS) -> MeanSE:
    """Mean, standard error and n of the defined values (None and NaN are left out)."""
    x = finite_values(values)
    if x.size == 0:
        return MeanSE(None, None, 0, over)
    se = float(x.std(ddof=1) / math.sqrt(x.size)) if x.size > 1 else None
    return MeanSE(float(x.mean()), se, int(x.size), over)


@dataclass(frozen=True)
class Pooled:
    """k of n tokens, pooled over the seeds of a study."""

    k: int
    n: int

    @property
    def fraction(self) -> float | None:
        return self.k / self.n if self.n else None

    @property
    def interval(self) -> tuple[float, float]:
        return wilson_interval(self.k, self.n)

    def pct(self) -> str:
        """ "65.1% (123/189)"; "—" when nothing was kept."""
        f = self.fraction
        return "—" if f is None else f"{100 * f:.1f}% ({self.k}/{self.n})"


def _counts(keep: np.ndarray, dd: np.ndarray, disagree: np.ndarray) -> tuple[int, int, int]:
    kept = disagree & keep
    return int(kept.sum()), int((kept & (dd > 0)).sum()), int((kept & (dd < 0)).sum())


def _keep_and_dd(tokens: pl.DataFrame, crit: str) -> tuple[np.ndarray, np.ndarray]:
    keep, dd = CRITERIA[crit]
    return tokens.get_column(keep).to_numpy().astype(bool), tokens.get_column(dd).to_numpy()


def seed_summary(tokens: pl.DataFrame, n_tokens: int) -> dict[str, int | float | None]:
    """The per-seed row of ``token_level_seeds`` from one seed's token rows (all of them outside, D_pre > delta).

    ``n_tokens`` is the number of response tokens of the seed's batch (the population the outside tokens came from).
    For each predictive criterion: its disagreement set with the ratio criterion, and on that set the kept,
    unsafe (dD > 0) and corrective (dD < 0) counts of both criteria and their unsafe-keep rates.
    """
    keep_ratio, dd_ratio = _keep_and_dd(tokens, RATIO)
    row: dict[str, int | float | None] = {"n_tokens": int(n_tokens), "n_outside": tokens.height}
    for crit, (_ddot, suffix) in PREDICTIVE.items():
        keep_pred, dd_pred = _keep_and_dd(tokens, crit)
        disagree = keep_pred != keep_ratio
        row[token_columns.disagree_column(suffix)] = int(disagree.sum())
        ratio = token_columns.ratio_side(suffix)
        for side, keep, dd in ((crit, keep_pred, dd_pred), (ratio, keep_ratio, dd_ratio)):
            counts = _counts(keep, dd, disagree)
            row.update(zip(token_columns.count_columns(side), counts))
            row[token_columns.unsafe_keep_column(side)] = counts[1] / counts[0] if counts[0] else None
    return row


SeedRows = pl.DataFrame | Mapping[str, Any]


def seed_columns(seed_rows: SeedRows) -> dict[str, np.ndarray]:
    """Per-seed rows as float columns (NaN where a value is missing), ordered by seed; non-numeric columns dropped."""
    frame = (
        seed_rows
        if isinstance(seed_rows, pl.DataFrame)
        else pl.DataFrame(
            {k: np.asarray(v) if not isinstance(v, list) else v for k, v in seed_rows.items()}, strict=False
        )
    )
    if "seed" in frame.columns:
        frame = frame.sort("seed")
    out: dict[str, np.ndarray] = {}
    for name, dtype in frame.schema.items():
        if dtype.is_numeric() or dtype == pl.Boolean or dtype == pl.Null:
            out[name] = frame.get_column(name).cast(pl.Float64).fill_null(float("nan")).to_numpy()
    return out


def _column(cols: Mapping[str, np.ndarray], name: str) -> np.ndarray:
    n = len(cols.get("seed", ()))
    return cols.get(name, np.full(n, np.nan))


def _pooled(cols: Mapping[str, np.ndarray], part: str, whole: str) -> Pooled:
    """``part`` / ``whole``, pooled over the seeds that have both counts."""
    k, n = _column(cols, part), _column(cols, whole)
    ok = np.isfinite(k) & np.isfinite(n)
    return Pooled(int(k[ok].sum()), int(n[ok].sum()))


def _corrective(cols: Mapping[str, np.ndarray], side: str) -> Pooled:
    """The corrective fraction of one side of a comparison, pooled over seeds."""
    kept, _unsafe, corrective = token_columns.count_columns(side)
    return _pooled(cols, corrective, kept)


@dataclass(frozen=True)
class Paired:
    """Per-seed unsafe-keep rates of the ratio criterion and one predictive criterion, on their paired seeds."""

    predictive: str
    n_seeds: int  # all seeds of the study
    seeds: np.ndarray  # the paired seeds (both rates defined), ascending
    ratio: np.ndarray  # per paired seed
    pred: np.ndarray
    ratio_mean: MeanSE
    pred_mean: MeanSE
    n_lower: int  # paired seeds where the predictive rate is lower
    n_tied: int

    @property
    def n_paired(self) -> int:
        return int(self.seeds.size)


def _paired(cols: Mapping[str, np.ndarray], crit: str) -> Paired:
    suffix = PREDICTIVE[crit][1]
    seed = _column(cols, "seed")
    sides = (token_columns.ratio_side(suffix), crit)
    ratio, pred = (_column(cols, token_columns.unsafe_keep_column(side)) for side in sides)
    both = np.isfinite(ratio) & np.isfinite(pred)
    r, p = ratio[both], pred[both]
    return Paired(
        predictive=crit,
        n_seeds=int(seed.size),
        seeds=seed[both].astype(int),
        ratio=r,
        pred=p,
        ratio_mean=mean_se(r, PAIRED),
        pred_mean=mean_se(p, PAIRED),
        n_lower=int((p < r).sum()),
        n_tied=int((p == r).sum()),
    )


def paired_unsafe_keep(seed_rows: SeedRows, predictive: str = HEADLINE) -> Paired:
    """The paired per-seed unsafe-keep rates of the ratio criterion and ``predictive`` (Figure 3's data)."""
    if predictive not in PREDICTIVE:
        raise ValueError(f"unknown predictive criterion {predictive!r}; valid: {', '.join(PREDICTIVE)}")
    return _paired(seed_columns(seed_rows), predictive)


@dataclass(frozen=True)
class PairSummary:
    """The ratio criterion vs one predictive criterion, on that criterion's disagreement sets."""

    predictive: str
    disagree: MeanSE  # disagreement-set size per seed, over all seeds
    unsafe_keep: Paired
    corrective_ratio: Pooled  # pooled over seeds, on this pair's disagreement set
    corrective_pred: Pooled


@dataclass(frozen=True)
class StudySummary:
    """Every headline number of one study."""

    seeds: tuple[int, ...]
    outside: MeanSE  # tokens outside the trust region per seed
    pairs: dict[str, PairSummary]  # predictive criterion -> its comparison with the ratio criterion
    corrective: dict[str, Pooled]  # criterion -> pooled corrective fraction (criteria that kept something)

    @property
    def n_seeds(self) -> int:
        return len(self.seeds)

    @property
    def headline(self) -> PairSummary | None:
        """The paper's comparison: the ratio criterion vs the predictive criterion with the aggregated tail."""
        return self.pairs.get(HEADLINE)


def study_summary(seed_rows: SeedRows) -> StudySummary:
    """The study's numbers from its per-seed rows (a polars frame of ``token_level_seeds`` rows, or columns).

    A comparison is summarised when its disagreement-count column exists. Corrective fractions: the ratio
    criterion on its disagreement set with the aggregated-tail criterion, each predictive criterion on its own.
    """
    cols = seed_columns(seed_rows)
    pairs: dict[str, PairSummary] = {}
    for crit, (_ddot, s) in PREDICTIVE.items():
        if token_columns.disagree_column(s) not in cols:
            continue
        pairs[crit] = PairSummary(
            predictive=crit,
            disagree=mean_se(cols[token_columns.disagree_column(s)]),
            unsafe_keep=_paired(cols, crit),
            corrective_ratio=_corrective(cols, token_columns.ratio_side(s)),
            corrective_pred=_corrective(cols, crit),
        )
    pooled = {c: _corrective(cols, c) for c in CRITERIA}
    return StudySummary(
        seeds=tuple(int(s) for s in _column(cols, "seed")),
        outside=mean_se(_column(cols, "n_outside")),
        pairs=pairs,
        corrective={c: p for c, p in pooled.items() if p.n > 0},
    )


def share_outside(seed_rows: SeedRows) -> Pooled:
    """Outside tokens / response tokens, pooled over the seeds that have both counts."""
    return _pooled(seed_columns(seed_rows), "n_outside", "n_tokens")


@dataclass(frozen=True)
class Estimate:
    """A pooled rate with its seed-cluster bootstrap interval (``lo``/``hi`` None without one), as a row of
    ``token_level_criteria`` holds it."""

    value: float | None
    lo: float | None
    hi: float | None

    def pct(self) -> str:
        """ "82.3% [75.1, 88.0]"; "82.3%" without an interval; "—" without a value."""
        if self.value is None:
            return "—"
        if self.lo is None or self.hi is None:
            return f"{100 * self.value:.1f}%"
        return f"{100 * self.value:.1f}% [{100 * self.lo:.1f}, {100 * self.hi:.1f}]"


def _criteria_row(criteria: pl.DataFrame | None, criterion: str) -> dict[str, Any] | None:
    """The row of a ``criteria_table`` frame for ``criterion`` against ``OWN_UPDATE`` on ``DISAGREE_SET``."""
    if criteria is None or criteria.height == 0:
        return None
    rows = criteria.filter(
        (pl.col("token_set") == DISAGREE_SET)
        & (pl.col("truth") == OWN_UPDATE)
        & (pl.col("criterion") == criterion)
    )
    if rows.height > 1:
        raise ValueError(
            f"criteria rows hold {rows.height} rows for {DISAGREE_SET}/{OWN_UPDATE}/{criterion}, expected one"
        )
    return rows.row(0, named=True) if rows.height else None


def _estimate(row: Mapping[str, Any] | None, prefix: str) -> Estimate | None:
    if row is None:
        return None
    return Estimate(row[prefix], row[f"{prefix}_lo"], row[f"{prefix}_hi"])


def _paired_estimate(row: Mapping[str, Any] | None, prefix: str) -> PairedEstimate | None:
    if row is None or row[f"{prefix}_seeds"] is None:
        return None
    mean, lo, hi, *counts, sign_p, wilcoxon_p = (
        row[f"{prefix}_{k}"] for k in ("mean", "lo", "hi", "seeds", "lower", "tied", "higher", "sign_p", "wilcoxon_p")
    )
    return PairedEstimate(mean, lo, hi, *(int(c) for c in counts), sign_p, wilcoxon_p)


@dataclass(frozen=True)
class DriftPoint:
    """One study as a point of the drift grid: where it sits (share outside) and the paper's statistics there, as
    in ``study_summary``, for the aggregated-tail comparison (``disagreement``: disagreement tokens / outside
    tokens, pooled; ``min_disagree``: the smallest per-seed disagreement set, None without seeds).

    Beyond the paper, against the own-update ground truth (``OWN_UPDATE``) on the disagreement set, when the
    study's tokens carry it (None otherwise): the tokens judged, each criterion's pooled balanced accuracy and
    the per-seed paired difference predictive − ratio.
    """

    n_seeds: int
    share_outside: Pooled
    disagreement: Pooled
    outside_per_seed: MeanSE
    disagree_per_seed: MeanSE
    min_disagree: int | None
    n_paired: int
    n_lower: int
    unsafe_keep_predictive: MeanSE
    unsafe_keep_ratio: MeanSE
    corrective_predictive: Pooled
    corrective_ratio: Pooled
    judged_disagree: int | None = None
    balanced_predictive: Estimate | None = None
    balanced_ratio: Estimate | None = None
    balanced_difference: PairedEstimate | None = None


def drift_point(seed_rows: SeedRows, criteria: pl.DataFrame | None = None) -> DriftPoint:
    """The drift-grid point of one study from its per-seed rows (the headline, aggregated-tail comparison) and,
    when given, the ``criteria_table`` rows judged on the same seeds' tokens (``token_level_criteria``'s columns)."""
    cols = seed_columns(seed_rows)
    summary = study_summary(cols)
    headline = token_columns.disagree_column(PREDICTIVE[HEADLINE][1])
    disagree = _column(cols, headline)
    pred, ratio = _criteria_row(criteria, HEADLINE), _criteria_row(criteria, RATIO)
    head = summary.headline
    paired, empty = (head.unsafe_keep if head else None), mean_se([], PAIRED)
    finite = disagree[np.isfinite(disagree)]
    return DriftPoint(
        n_seeds=summary.n_seeds,
        share_outside=share_outside(cols),
        disagreement=_pooled(cols, headline, "n_outside"),
        outside_per_seed=summary.outside,
        disagree_per_seed=mean_se(disagree),
        min_disagree=int(finite.min()) if finite.size else None,
        n_paired=paired.n_paired if paired else 0,
        n_lower=paired.n_lower if paired else 0,
        unsafe_keep_predictive=paired.pred_mean if paired else empty,
        unsafe_keep_ratio=paired.ratio_mean if paired else empty,
        corrective_predictive=head.corrective_pred if head else Pooled(0, 0),
        corrective_ratio=head.corrective_ratio if head else Pooled(0, 0),
        judged_disagree=None if ratio is None else int(ratio["n_tokens"]),
        balanced_predictive=_estimate(pred, "balanced_accuracy"),
        balanced_ratio=_estimate(ratio, "balanced_accuracy"),
        balanced_difference=_paired_estimate(pred, "vs_ratio_balanced"),
    )


def _predicted_increase(crit: str) -> pl.Expr:
    if crit == RATIO:
        return (pl.col("a") * (pl.col("r") - 1.0)) > 0
    return (pl.col("a") * pl.col(PREDICTIVE[crit][0])) > 0


def sign_accuracy(tokens: pl.DataFrame, reference: str = token_columns.DD_ALL) -> dict[str, MeanSE]:
    """Per criterion: how often ``A x > 0`` (predicted increase of D) matches ``reference > 0`` (realised increase).

    Per seed over its outside tokens with ``A != 0``, then mean ± SE over the seeds that have such tokens.
    ``reference`` is the dD of the update that keeps every token (``dd_all``), so each token's own gradient is in it.
    """
    live = tokens.filter(pl.col("a") != 0)
    out = {}
    for crit in CRITERIA:
        per_seed = live.group_by("seed").agg(  # sorted: the float sums of mean_se do not depend on polars' order
            acc=(_predicted_increase(crit) == (pl.col(reference) > 0)).mean()
        ).sort("seed")
        out[crit] = mean_se(per_seed["acc"].to_list())
    return out


def _ddot_and_keep(tokens: pl.DataFrame, tail: str) -> tuple[np.ndarray, np.ndarray]:
    ddot, keep = token_columns.ddot_column(tail), token_columns.keep_column(token_columns.predictive_mask(tail))
    return tokens.get_column(ddot).to_numpy(), tokens.get_column(keep).to_numpy().astype(bool)


def tail_flips(tokens: pl.DataFrame) -> dict[str, dict[str, float | int]]:
    """How often the aggregated and uniform tails disagree with the exact tail, pooled over outside tokens.

    ``sign``: sign(Ddot_tail) != sign(Ddot_exact) (all outside tokens); ``keep``: the keep decision differs.
    """
    n = tokens.height
    exact_ddot, keep_exact = _ddot_and_keep(tokens, "exact")
    out: dict[str, dict[str, float | int]] = {}
    for tail in ("agg", "uniform"):
        ddot, keep = _ddot_and_keep(tokens, tail)
        sf = int((np.sign(ddot) != np.sign(exact_ddot)).sum())
        kf = int((keep != keep_exact).sum())
        out[token_columns.TAILS[tail]] = {
            "tokens": n,
            "sign_flips": sf,
            "keep_flips": kf,
            "sign_flip_frac": sf / n if n else float("nan"),
            "max_abs_err": float(np.abs(ddot - exact_ddot).max()) if n else float("nan"),
        }
    return out


def _spearman(x: np.ndarray, y: np.ndarray) -> float:
    rx = np.argsort(np.argsort(x, kind="stable"), kind="stable").astype(float)
    ry = np.argsort(np.argsort(y, kind="stable"), kind="stable").astype(float)
    return float(np.corrcoef(rx, ry)[0, 1])


def first_order(
    tokens: pl.DataFrame, ratio_cap: float, reference: str = token_columns.DD_ALL
) -> dict[str, dict[str, float]]:
    """Correlation of each criterion's step-scaled predicted change with the realised ``reference`` dD.

    The token's own gradient moves its logits by ``A * min(r, c)`` (times a positive step size) along
    ``e_k - pi``, so the first-order change of D is ``A * min(r, c) * Ddot`` (the ratio criterion's stand-in for
    Ddot is ``r - 1``). Pearson and Spearman correlations over outside tokens with ``A != 0``, pooled over seeds.
    """
    live = tokens.filter(pl.col("a") != 0)
    y = live.get_column(reference).to_numpy()
    scale = live.get_column("a").to_numpy() * np.minimum(live.get_column("r").to_numpy(), ratio_cap)
    predicted = {RATIO: live.get_column("r").to_numpy() - 1.0}
    predicted.update({crit: live.get_column(ddot).to_numpy() for crit, (ddot, _s) in PREDICTIVE.items()})
    out: dict[str, dict[str, float]] = {}
    for crit, x_raw in predicted.items():
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
