"""Paired, seed-clustered inference: cluster-bootstrap intervals, paired per-seed comparisons, the Wilson interval.

Pure numpy/scipy. A study's tokens are not independent: every token of one seed shares that seed's rollout, its
policy and its one update, so an interval that treats pooled tokens as independent draws is too narrow. The unit
of replication is the seed; everything here resamples or pairs seeds.

docs/math.md §5.1 defines the seed-cluster bootstrap, the paired comparison and where a Wilson interval (which
treats pooled tokens as independent) may be printed; the degenerate cases are stated at each function.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike
from scipy import stats as sps

from analysis.training.stats import CONFIDENCE, Interval, t_interval

#: resamples of a seed-cluster bootstrap
RESAMPLES = 2000
#: the generator seed of every bootstrap: the same inputs always give the same interval
BOOTSTRAP_SEED = 0
#: the words printed beside every Wilson interval on pooled tokens
WILSON_NOTE = "Wilson score interval, assumes independent tokens"

Statistic = Callable[[np.ndarray], np.ndarray]


def _check_level(level: float) -> None:
    if not 0.0 < level < 1.0:
        raise ValueError(f"confidence level must be in (0, 1), got {level!r}")


def z_of(level: float = CONFIDENCE) -> float:
    """The two-sided standard-normal quantile of a confidence level (1.959964 for 0.95)."""
    _check_level(level)
    return float(sps.norm.ppf(0.5 + level / 2))


def wilson_interval(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion k/n (95% by default); (NaN, NaN) for n = 0."""
    if n == 0:
        return float("nan"), float("nan")
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return centre - half, centre + half


@dataclass(frozen=True)
class ClusterInterval:
    """A pooled statistic over seeds with its seed-cluster bootstrap percentile interval.

    ``estimate`` is None when the statistic is undefined on the seeds themselves; ``lo``/``hi`` are None with it,
    and for fewer than two seeds. ``note`` gives the reason whenever there is no interval."""

    estimate: float | None
    lo: float | None
    hi: float | None
    n_seeds: int
    level: float
    resamples: int
    n_undefined: int  # resamples on which the statistic was undefined, left out of the interval
    note: str = ""

    @property
    def has_interval(self) -> bool:
        return self.lo is not None and self.hi is not None

    def text(self, scale: float = 100.0, spec: str = ".1f", unit: str = "%") -> str:
        """ "88.3% [85.1, 90.9] (seed bootstrap, 61 seeds)"; no interval: "88.3% (one seed: no interval)"."""
        if self.estimate is None:
            return f"— ({self.note})" if self.note else "—"
        est = f"{format(scale * self.estimate, spec)}{unit}"
        if self.lo is None or self.hi is None:
            return f"{est} ({self.note})"
        lo, hi = format(scale * self.lo, spec), format(scale * self.hi, spec)
        return f"{est} [{lo}, {hi}] (seed bootstrap, {self.n_seeds} seeds)"


def cluster_bootstrap(
    counts: ArrayLike,
    statistic: Statistic,
    *,
    level: float = CONFIDENCE,
    resamples: int = RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
) -> ClusterInterval:
    """A pooled statistic of per-seed count vectors (``counts``: seeds × k) with its seed-cluster bootstrap interval.

    ``statistic`` maps summed count vectors (``... × k``) to one value each (NaN where undefined); it is applied to
    the sums over all seeds for the estimate and to each resample's sums for the interval: row b of
    ``default_rng(seed).integers(0, n, size=(resamples, n))`` draws resample b, and the percentile interval is
    ``numpy.quantile`` (linear) at ``(1 ∓ level) / 2``. No seed, or a statistic undefined on the seeds: no estimate.
    One seed: no interval. A resample on which the statistic is undefined is left out and counted. Seeds that all
    give one value give that point: the bootstrap cannot show variation the seeds do not have."""
    _check_level(level)
    if resamples < 1:
        raise ValueError(f"resamples must be a positive number of bootstrap draws, got {resamples!r}")
    c = np.asarray(counts, dtype=float)
    if c.ndim != 2:
        raise ValueError(f"counts must be a seeds × k array, got shape {c.shape}")
    if not np.isfinite(c).all():
        raise ValueError("counts must be finite; leave a seed without a value out, or give it zero counts")
    n = c.shape[0]
    with np.errstate(invalid="ignore", divide="ignore"):
        estimate = float(statistic(c.sum(axis=0))) if n else float("nan")
    base = {"n_seeds": n, "level": level, "resamples": resamples}
    if not math.isfinite(estimate):
        note = "no seed" if n == 0 else "undefined on these seeds (zero denominator)"
        return ClusterInterval(None, None, None, n_undefined=0, note=note, **base)
    if n == 1:
        return ClusterInterval(estimate, None, None, n_undefined=0, note="one seed: no interval", **base)
    sums = c[np.random.default_rng(seed).integers(0, n, size=(resamples, n))].sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        values = np.asarray(statistic(sums), dtype=float)
    ok = np.isfinite(values)
    lo, hi = np.quantile(values[ok], [(1 - level) / 2, (1 + level) / 2])
    return ClusterInterval(estimate, float(lo), float(hi), n_undefined=int((~ok).sum()), **base)


def _ratio(sums: np.ndarray) -> np.ndarray:
    return sums[..., 0] / sums[..., 1]


def cluster_bootstrap_ratio(
    num: ArrayLike,
    den: ArrayLike,
    *,
    level: float = CONFIDENCE,
    resamples: int = RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
) -> ClusterInterval:
    """The pooled rate ``sum(num) / sum(den)`` over seeds (one entry per seed) with its seed-cluster interval."""
    a, b = np.asarray(num, dtype=float), np.asarray(den, dtype=float)
    if a.ndim != 1 or a.shape != b.shape:
        raise ValueError(f"num and den must be one value per seed each, got shapes {a.shape} and {b.shape}")
    if (b < 0).any():
        raise ValueError(f"denominators must be >= 0, got {float(b[b < 0][0])!r}")
    return cluster_bootstrap(np.stack([a, b], axis=1), _ratio, level=level, resamples=resamples, seed=seed)


def min_untied(level: float = CONFIDENCE) -> int:
    """The fewest untied seeds at which a two-sided sign or signed-rank test can reach p <= 1 - level
    (the smallest attainable p of n untied seeds is 2 / 2^n): 6 at level 0.95."""
    _check_level(level)
    alpha = 1.0 - level
    return max(1, math.ceil(1.0 + math.log2(1.0 / alpha) - 1e-12))


@dataclass(frozen=True)
class PairedEstimate:
    """A per-seed difference of two rates (a − b) over the seeds where both are defined: its mean with the
    Student-t interval, the seeds where a is lower / tied / higher, and the sign-test and Wilcoxon p-values."""

    mean: float | None
    lo: float | None
    hi: float | None
    n_seeds: int
    n_lower: int
    n_tied: int
    n_higher: int
    sign_p: float | None
    wilcoxon_p: float | None

    def pp(self) -> str:
        """ "+12.3 pp [+4.1, +20.5]" (percentage points); no interval: "+12.3 pp"; no seed: "—"."""
        if self.mean is None:
            return "—"
        if self.lo is None or self.hi is None:
            return f"{100 * self.mean:+.1f} pp"
        return f"{100 * self.mean:+.1f} pp [{100 * self.lo:+.1f}, {100 * self.hi:+.1f}]"


@dataclass(frozen=True)
class PairedComparison:
    """Two per-seed rates compared seed by seed: ``diffs = a - b`` on the seeds where both are finite."""

    a: np.ndarray
    b: np.ndarray
    diffs: np.ndarray
    interval: Interval  # Student-t interval of the mean difference
    n_lower: int  # seeds where a < b
    n_tied: int
    n_higher: int
    n_dropped: int  # seeds left out because one of the two rates is undefined there
    sign_p: float | None  # two-sided sign test on the untied seeds; None without seeds
    wilcoxon_p: float | None  # two-sided Wilcoxon signed-rank test (zero_method="wilcox"); None without seeds
    note: str  # why a p-value is 1.0 or weak, "" otherwise

    @property
    def n(self) -> int:
        return int(self.diffs.size)

    @property
    def estimate(self) -> PairedEstimate:
        """What a stored row and a printed table keep of the comparison."""
        iv = self.interval
        return PairedEstimate(
            iv.mean, iv.lo, iv.hi, self.n, self.n_lower, self.n_tied, self.n_higher, self.sign_p, self.wilcoxon_p
        )


def _tests(d: np.ndarray, level: float) -> tuple[float | None, float | None, str]:
    """(sign test p, Wilcoxon p, note) of paired differences."""
    if d.size == 0:
        return None, None, "no paired seed"
    higher, lower = int((d > 0).sum()), int((d < 0).sum())
    untied = higher + lower
    if untied == 0:
        return 1.0, 1.0, f"all {d.size} seeds tied: no evidence either way (p = 1)"
    sign_p = float(sps.binomtest(higher, untied, 0.5, alternative="two-sided").pvalue)
    wil_p = float(sps.wilcoxon(d, zero_method="wilcox", alternative="two-sided", method="auto").pvalue)
    need = min_untied(level)
    note = ""
    if untied < need:
        alpha = 1.0 - level
        note = (
            f"only {untied} untied seeds (< {need}): neither test can reach p <= {alpha:g} "
            f"(smallest two-sided p = {2.0 / 2**untied:.3g})"
        )
    return sign_p, wil_p, note


def paired_comparison(a: ArrayLike, b: ArrayLike, level: float = CONFIDENCE) -> PairedComparison:
    """Per-seed rates ``a`` and ``b`` (aligned: entry i of both is seed i) compared seed by seed: the mean difference
    with ``t_interval``, a two-sided sign test (``binomtest``, p = 1/2) and Wilcoxon signed-rank test
    (``zero_method="wilcox"``, ``method="auto"``) on the untied seeds; all tied: both p-values 1.0."""
    _check_level(level)
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if x.ndim != 1 or x.shape != y.shape:
        raise ValueError(
            f"a and b must be one rate per seed each, aligned, got shapes {x.shape} and {y.shape}"
        )
    both = np.isfinite(x) & np.isfinite(y)
    x, y = x[both], y[both]
    d = x - y
    sign_p, wil_p, note = _tests(d, level)
    return PairedComparison(
        a=x,
        b=y,
        diffs=d,
        interval=t_interval(d, level),
        n_lower=int((d < 0).sum()),
        n_tied=int((d == 0).sum()),
        n_higher=int((d > 0).sum()),
        n_dropped=int((~both).sum()),
        sign_p=sign_p,
        wilcoxon_p=wil_p,
        note=note,
    )
