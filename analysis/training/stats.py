"""Every statistic of training runs over seeds: intervals, EMA smoothing, seed curves, coincidence, summaries, collapse.

Pure functions on numpy arrays. A series is ``(steps, values)`` with steps ascending (one run's logged points of one
metric); a group of seeds is a mapping ``key -> series`` whose keys pair the runs of two methods (the seed).
The figures and tables of ``reports`` call these functions and print what they return; docs/results.md states the
definitions in words, one each, and each function's docstring states its own.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import integrate as sps_integrate
from scipy import optimize as sps_optimize
from scipy import signal as sps_signal
from scipy import stats as sps

Series = tuple[np.ndarray, np.ndarray]  # (steps ascending, values)

CONFIDENCE = 0.95
INTERVAL_NAME = "95% t-interval"
IDENTICAL_ATOL = 1e-12
#: a collapse needs at least this many logged points below half the best, from some step to the end of the run
MIN_COLLAPSE_POINTS = 2
#: the power a paired comparison of methods is sized for (``minimum_detectable_difference``, ``seeds_needed``)
POWER = 0.8


def interval_note(n: int | str = "n") -> str:
    """ "mean ± 95% t-interval over 3 seeds" (n = 1: no interval), the words every figure and table prints."""
    if n == 1:
        return "mean of 1 seed (no interval: one seed)"
    return f"mean ± {INTERVAL_NAME} over {n} seeds"


@dataclass(frozen=True)
class Interval:
    """Mean of per-seed values with its t-interval; ``lo``/``hi`` are None for fewer than two seeds."""

    mean: float | None
    lo: float | None
    hi: float | None
    n: int

    @property
    def half_width(self) -> float | None:
        return None if self.lo is None or self.hi is None else (self.hi - self.lo) / 2

    def text(self, scale: float = 1.0, spec: str = ".3f", unit: str = "", with_n: bool = True) -> str:
        """ "41.2% ± 3.1 (n = 3 seeds)"; one seed: "41.2% (n = 1 seed, no interval)"; no seed: "—". Without n
        (a table whose seeds column gives it): "41.2% ± 3.1" and "41.2% (one seed, no interval)"."""
        if self.mean is None:
            return "—"
        mean = f"{format(scale * self.mean, spec)}{unit}"
        if self.half_width is None:
            return f"{mean} (n = {self.n} seed, no interval)" if with_n else f"{mean} (one seed, no interval)"
        text = f"{mean} ± {format(scale * self.half_width, spec)}"
        return f"{text} (n = {self.n} seeds)" if with_n else text


def finite_values(values: Iterable[float | None]) -> np.ndarray:
    """The finite values as a float array (None, NaN and infinities left out)."""
    x = np.array([np.nan if v is None else v for v in values], dtype=float)
    return x[np.isfinite(x)]


def _finite_points(steps: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A series' points whose value is finite (steps keep their dtype, values are floats)."""
    y = np.asarray(values, dtype=float)
    ok = np.isfinite(y)
    return np.asarray(steps)[ok], y[ok]


def t_interval(values: Iterable[float | None], confidence: float = CONFIDENCE) -> Interval:
    """The two-sided Student-t interval of the mean, ``mean ± t_{(1+confidence)/2, n-1} s / sqrt(n)``, of the finite
    values (None and NaN are left out)."""
    x = finite_values(values)
    if x.size == 0:
        return Interval(None, None, None, 0)
    mean, lo, hi = (float(a[0]) for a in t_band(x[:, None], confidence))  # one formula: t_band's
    if x.size == 1:
        return Interval(mean, None, None, 1)
    return Interval(mean, lo, hi, int(x.size))


def t_band(values: np.ndarray, confidence: float = CONFIDENCE) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mean, lo, hi) per column of a seeds × steps array: the t-interval of each step's finite values
    (lo/hi NaN where fewer than two seeds have a value, mean NaN where none has)."""
    v = np.asarray(values, dtype=float)
    finite = np.isfinite(v)
    n = finite.sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(finite, v, 0.0).sum(axis=0) / n
        dev = np.where(finite, v - mean, 0.0)
        sd = np.sqrt((dev**2).sum(axis=0) / (n - 1))
        q = sps.t.ppf(0.5 + confidence / 2, np.maximum(n, 2) - 1)
        half = np.where(n >= 2, q * sd / np.sqrt(n), np.nan)
    mean = np.where(n > 0, mean, np.nan)
    return mean, mean - half, mean + half


def ema(values: np.ndarray, alpha: float) -> np.ndarray:
    """Debiased exponential moving average over logged points: point t is the mean of the points up to t weighted
    by ``(1 - alpha)^(t - i)`` (so the first point is itself, with no pull towards zero). alpha = 1: unchanged.
    NaN points stay NaN and are left out of the later means."""
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"EMA alpha must be in (0, 1], got {alpha!r}")
    v = np.asarray(values, dtype=float)
    finite = np.isfinite(v)
    decay = [1.0, alpha - 1.0]  # y_t = x_t + (1 - alpha) y_{t-1}, for the weighted sum and the sum of weights
    num = sps_signal.lfilter([1.0], decay, np.where(finite, v, 0.0))
    den = sps_signal.lfilter([1.0], decay, finite.astype(float))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(finite, num / den, np.nan)


@dataclass(frozen=True)
class Smoothing:
    """An EMA by its half-life in logged points (the weight of a point halves after that many points); 0 = raw."""

    half_life: float

    def __post_init__(self) -> None:
        if not self.half_life >= 0:
            raise ValueError(f"smoothing half-life must be >= 0 logged points, got {self.half_life!r}")

    @property
    def alpha(self) -> float:
        return 1.0 if self.half_life == 0 else 1.0 - 0.5 ** (1.0 / self.half_life)

    def apply(self, values: np.ndarray) -> np.ndarray:
        return np.asarray(values, dtype=float) if self.half_life == 0 else ema(values, self.alpha)

    def describe(self) -> str:
        """ "EMA, half-life 5 logged points (alpha = 0.129)" or "raw values (no smoothing)"."""
        if self.half_life == 0:
            return "raw values (no smoothing)"
        points = "point" if self.half_life == 1 else "points"
        return f"EMA, half-life {self.half_life:g} logged {points} (alpha = {self.alpha:.3f})"


RAW = Smoothing(0.0)
#: per-step metrics (one point per training step, ~100 steps): a half-life of 5 steps
STEP_SMOOTHING = Smoothing(5.0)
#: validation curves (one point every 10-25 steps: 5-11 points per run): a half-life of one evaluation
VAL_SMOOTHING = Smoothing(1.0)


def mean_on_common_steps(a: Series, b: Series) -> Series:
    """Pointwise mean of two series on the steps both have (validation accuracy = mean of the two AIME scores)."""
    steps, ia, ib = np.intersect1d(a[0], b[0], assume_unique=True, return_indices=True)
    return steps, (a[1][ia] + b[1][ib]) / 2.0


@dataclass(frozen=True)
class Curve:
    """One method's line in one panel: the seeds' (smoothed) values on the steps they all logged, mean and band."""

    steps: np.ndarray
    keys: tuple[Hashable, ...]  # the seeds, in the row order of `values`
    values: np.ndarray  # seeds × steps
    mean: np.ndarray
    lo: np.ndarray | None  # None: a single seed, no band
    hi: np.ndarray | None
    n_left_out: int  # logged points of some seed on steps not every seed logged

    @property
    def n(self) -> int:
        return len(self.keys)


def seed_curve(
    series: Mapping[Hashable, Series], smoothing: Smoothing = RAW, confidence: float = CONFIDENCE
) -> Curve | None:
    """Mean and t-band over seeds: each seed smoothed on its own points, then taken on the steps all seeds logged.
    None when there is no seed or no step that every seed logged."""
    if not series:
        return None
    keys = tuple(series)
    common = series[keys[0]][0]
    for k in keys[1:]:
        common = np.intersect1d(common, series[k][0], assume_unique=True)
    if len(common) == 0:
        return None
    rows = []
    for k in keys:
        steps, values = series[k]
        rows.append(smoothing.apply(values)[np.isin(steps, common)])
    values = np.vstack(rows)
    mean, lo, hi = t_band(values, confidence)
    band = len(keys) >= 2
    left_out = sum(len(series[k][0]) for k in keys) - values.size
    return Curve(
        np.asarray(common), keys, values, mean, lo if band else None, hi if band else None, int(left_out)
    )


def identical(a: Series, b: Series, atol: float = IDENTICAL_ATOL) -> bool:
    """The same steps and values equal within atol (NaN equal to NaN)."""
    return (
        np.array_equal(a[0], b[0])
        and len(a[1]) == len(b[1])
        and bool(np.allclose(a[1], b[1], rtol=0.0, atol=atol, equal_nan=True))
    )


def coincidences(
    groups: Mapping[str, Mapping[Hashable, Series]], atol: float = IDENTICAL_ATOL
) -> dict[str, str]:
    """method -> the earlier method whose line it coincides with, for the methods of a panel in `groups` order
    (callers pass them by method rank, so the reference is the first). Two methods coincide when they have the
    same seeds and every seed's series are identical; a method is compared only with methods drawn as lines of
    their own (not themselves identical to an earlier one)."""
    shown: list[str] = []
    out: dict[str, str] = {}
    for method, seeds in groups.items():
        ref = next(
            (
                m
                for m in shown
                if seeds
                and set(groups[m]) == set(seeds)
                and all(identical(groups[m][k], seeds[k], atol) for k in seeds)
            ),
            None,
        )
        if ref is None:
            shown.append(method)
        else:
            out[method] = ref
    return out


def area_under_curve(steps: np.ndarray, values: np.ndarray) -> float:
    """Trapezoid area under the curve over steps divided by the step span: the curve's mean value over the run
    (one point: that point). Non-finite points are left out."""
    x, y = _finite_points(np.asarray(steps, dtype=float), values)
    if len(x) == 0:
        return float("nan")
    if len(x) == 1 or x[-1] == x[0]:
        return float(y.mean())
    return float(sps_integrate.trapezoid(y, x) / (x[-1] - x[0]))  # numpy < 2 has no np.trapezoid


@dataclass(frozen=True)
class RunSummary:
    """One run's validation curve in three numbers (final: the last logged value; best: the largest;
    ``area_under_curve``), and where they come from."""

    final: float
    best: float
    best_step: int
    auc: float
    first_step: int
    last_step: int
    n_points: int


def run_summary(steps: np.ndarray, values: np.ndarray) -> RunSummary | None:
    """Final, best and AUC of one run's curve (its finite points); None when it has none."""
    x, y = _finite_points(steps, values)
    if len(x) == 0:
        return None
    i = int(np.argmax(y))
    return RunSummary(
        float(y[-1]), float(y[i]), int(x[i]), area_under_curve(x, y), int(x[0]), int(x[-1]), len(x)
    )


@dataclass(frozen=True)
class Collapse:
    """Whether a run collapsed, its best, and the step from which it stayed below half of that best."""

    collapsed: bool
    best: float | None
    best_step: int | None
    since_step: int | None  # first step of the final stretch below best / 2 (None when there is none)


def collapse(steps: np.ndarray, values: np.ndarray, min_points: int = MIN_COLLAPSE_POINTS) -> Collapse:
    """Whether the run collapsed (docs/results.md): with best b > 0 first reached at step s_b, every logged value
    from some step s > s_b to the end is < b / 2, over at least `min_points` points. Non-finite points left out."""
    if min_points < 1:
        raise ValueError(f"min_points must be >= 1, got {min_points!r}")
    x, y = _finite_points(steps, values)
    if len(y) == 0:
        return Collapse(False, None, None, None)
    i = int(np.argmax(y))
    best = float(y[i])
    below = y < best / 2
    # length of the final run of points below half the best
    tail = len(y) - (int(np.flatnonzero(~below)[-1]) + 1) if not below.all() else len(y)
    start = len(y) - tail
    since = int(x[start]) if tail and start > i else None
    return Collapse(best > 0 and since is not None and tail >= min_points, best, int(x[i]), since)


@dataclass(frozen=True)
class PairedDifference:
    """A method minus its reference, paired on seed: per-seed differences, their t-interval, how many are > 0."""

    method: str
    reference: str
    keys: tuple[Hashable, ...]
    diffs: np.ndarray
    interval: Interval
    n_positive: int

    @property
    def n(self) -> int:
        return len(self.keys)

    def text(self, scale: float = 1.0, spec: str = "+.1f", unit: str = "") -> str:
        """ "+1.7 [−2.1, +5.5] (2/3 seeds > 0)"; one pair: "+1.7 (1/1 seeds > 0, no interval)"; none: "—"."""
        iv = self.interval
        if iv.mean is None:
            return "—"
        mean = f"{format(scale * iv.mean, spec)}{unit}"
        count = f"{self.n_positive}/{self.n} seeds > 0"
        if iv.lo is None or iv.hi is None:
            return f"{mean} ({count}, no interval)"
        return f"{mean} [{format(scale * iv.lo, spec)}, {format(scale * iv.hi, spec)}] ({count})"


def paired_difference(
    method: str,
    values: Mapping[Hashable, float],
    reference: str,
    ref_values: Mapping[Hashable, float],
    confidence: float = CONFIDENCE,
) -> PairedDifference:
    """``values[k] - ref_values[k]`` on the keys (seeds) both have and whose values are finite."""
    keys = tuple(
        k for k in values if k in ref_values and math.isfinite(values[k]) and math.isfinite(ref_values[k])
    )
    try:
        keys = tuple(sorted(keys))  # type: ignore[type-var]
    except TypeError:
        pass
    diffs = np.array([values[k] - ref_values[k] for k in keys], dtype=float)
    return PairedDifference(
        method, reference, keys, diffs, t_interval(diffs, confidence), int((diffs > 0).sum())
    )


def predictive_references(methods: Sequence[str]) -> dict[str, str]:
    """predictive mask -> the method it is compared with, for the registered methods among `methods`.

    A predictive mask is a divergence method whose direction criterion is not the reference one (the ratio's,
    ``predmask.methods.REFERENCE_DIRECTION``); its reference is the registered method with the same loss kind,
    divergence and support and the reference direction (for the KL masks on the top-K support: DPPO-TopK-KL).
    Read from ``predmask.methods.METHODS``; methods it does not know are left out.
    """
    from predmask.methods import METHODS, REFERENCE_DIRECTION  # lazy: torch is needed only here

    out: dict[str, str] = {}
    for name in methods:
        m = METHODS.get(name)
        if m is None or not m.needs_support or m.direction == REFERENCE_DIRECTION:
            continue
        ref = next(
            (
                r.name
                for r in METHODS.values()
                if r.direction == REFERENCE_DIRECTION
                and (r.kind, r.divergence, r.support) == (m.kind, m.divergence, m.support)
            ),
            None,
        )
        if ref is not None:
            out[name] = ref
    return out


def _check_test(sd: float, alpha: float) -> None:
    if not (math.isfinite(sd) and sd > 0):
        raise ValueError(f"the SD of the paired differences must be finite and > 0, got {sd!r}")
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")


def _check_power_args(sd: float, power: float, alpha: float) -> None:
    _check_test(sd, alpha)
    if not alpha < power < 1.0:
        raise ValueError(f"power must be in (alpha, 1) = ({alpha:g}, 1), got {power!r}")


def paired_t_power(difference: float, sd: float, n: int, alpha: float = 1.0 - CONFIDENCE) -> float:
    """Power of the two-sided paired t-test at level ``alpha`` on ``n`` seeds whose paired differences have mean
    ``difference`` and standard deviation ``sd`` (exact, through the noncentral t distribution)."""
    if not (isinstance(n, (int, np.integer)) and n >= 2):
        raise ValueError(f"a paired t-test needs n >= 2 seeds, got {n!r}")
    _check_test(sd, alpha)
    if not math.isfinite(difference):
        raise ValueError(f"the paired difference must be finite, got {difference!r}")
    df = n - 1
    crit = float(sps.t.ppf(1.0 - alpha / 2, df))
    nc = abs(difference) * math.sqrt(n) / sd  # the power is symmetric in the sign of the difference
    upper = float(sps.nct.sf(crit, df, nc))
    # P(T_nc < -crit) = P(T_-nc > crit): scipy's nct.cdf returns NaN for some far lower tails, its sf does not
    lower = float(sps.nct.sf(crit, df, -nc))
    if not (math.isfinite(upper) and math.isfinite(lower)):
        raise ArithmeticError(f"scipy's noncentral t gave NaN for n = {n}, noncentrality {nc:g}")
    return min(1.0, upper + lower)


def minimum_detectable_difference(
    n: int, sd: float, power: float = POWER, alpha: float = 1.0 - CONFIDENCE
) -> float:
    """The smallest mean paired difference (> 0, in the units of ``sd``) that the two-sided paired t-test on ``n``
    seeds detects with probability ``power`` at level ``alpha``; solved with ``scipy.optimize.brentq``."""
    _check_power_args(sd, power, alpha)
    hi = sd
    while paired_t_power(hi, sd, n, alpha) < power:  # power rises with the difference: bracket the root
        hi *= 2.0
    return float(
        sps_optimize.brentq(lambda d: paired_t_power(d, sd, n, alpha) - power, 0.0, hi, xtol=1e-12 * sd)
    )


def seeds_needed(
    difference: float,
    sd: float,
    power: float = POWER,
    alpha: float = 1.0 - CONFIDENCE,
    max_seeds: int = 1_000_000,
) -> int:
    """The smallest number of seeds n >= 2 at which the two-sided paired t-test at level ``alpha`` detects a mean
    paired difference ``difference`` (SD ``sd``) with probability at least ``power``. Power rises with n, so a
    doubling search brackets n and a bisection finds it."""
    _check_power_args(sd, power, alpha)
    if not (math.isfinite(difference) and difference != 0):
        raise ValueError(f"the difference to detect must be finite and non-zero, got {difference!r}")

    def enough(n: int) -> bool:
        return paired_t_power(difference, sd, n, alpha) >= power

    if enough(2):
        return 2
    lo, hi = 2, 4  # enough(lo) is False
    while not enough(hi):
        if hi >= max_seeds:
            raise ValueError(f"more than max_seeds = {max_seeds} seeds needed for difference {difference!r}")
        lo, hi = hi, min(2 * hi, max_seeds)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if enough(mid) else (mid, hi)
    return hi


def proportion_mdd(trials: int, p: float = 0.5, power: float = POWER, alpha: float = 1.0 - CONFIDENCE) -> float:
    """The smallest difference of two accuracies, each a proportion over ``trials`` 0/1 outcomes at accuracy ``p``,
    that the two-sided z-test at level ``alpha`` detects with probability ``power`` (normal approximation:
    ``(z_{1-alpha/2} + z_{power}) sqrt(2 p (1 - p) / trials)``); it shrinks as 1/sqrt(trials), so a difference d
    needs ``trials * (mdd / d)**2`` trials."""
    if isinstance(trials, bool) or not isinstance(trials, (int, np.integer)) or trials < 1:
        raise ValueError(f"trials must be an integer >= 1 (problems x seeds), got {trials!r}")
    if not 0.0 < p < 1.0:
        raise ValueError(f"the accuracy p must be in (0, 1), got {p!r}")
    _check_power_args(1.0, power, alpha)
    z = float(sps.norm.ppf(1.0 - alpha / 2) + sps.norm.ppf(power))
    return z * math.sqrt(2.0 * p * (1.0 - p) / trials)


@dataclass(frozen=True)
class MethodResult:
    """One method in one setting: each seed's summary and collapse verdict, the intervals over seeds, and (for a
    predictive mask whose reference ran in the setting) the paired differences in final accuracy and AUC."""

    method: str
    runs: dict[Hashable, RunSummary]
    collapses: dict[Hashable, Collapse]
    final: Interval
    best: Interval
    auc: Interval
    vs_final: PairedDifference | None = None
    vs_auc: PairedDifference | None = None

    @property
    def n(self) -> int:
        return len(self.runs)

    @property
    def collapsed(self) -> tuple[Hashable, ...]:
        """The seeds that collapsed."""
        return tuple(k for k, c in self.collapses.items() if c.collapsed)


def setting_results(groups: Mapping[str, Mapping[Hashable, Series]]) -> dict[str, MethodResult]:
    """method -> its MethodResult, from each method's validation curves by seed (the runs of one setting); runs
    without a finite validation point are left out, methods without any such run too."""
    summaries: dict[str, dict[Hashable, RunSummary]] = {}
    collapses: dict[str, dict[Hashable, Collapse]] = {}
    for method, seeds in groups.items():
        done = {k: (run_summary(*s), collapse(*s)) for k, s in seeds.items()}
        done = {k: v for k, v in done.items() if v[0] is not None}
        if done:
            summaries[method] = {k: v[0] for k, v in done.items()}  # type: ignore[misc]
            collapses[method] = {k: v[1] for k, v in done.items()}
    refs = {m: r for m, r in predictive_references(list(summaries)).items() if r in summaries}

    def diff(method: str, field: str) -> PairedDifference | None:
        if method not in refs:
            return None
        ref = refs[method]
        values = {k: getattr(s, field) for k, s in summaries[method].items()}
        return paired_difference(
            method, values, ref, {k: getattr(s, field) for k, s in summaries[ref].items()}
        )

    return {
        m: MethodResult(
            m,
            runs,
            collapses[m],
            t_interval(s.final for s in runs.values()),
            t_interval(s.best for s in runs.values()),
            t_interval(s.auc for s in runs.values()),
            diff(m, "final"),
            diff(m, "auc"),
        )
        for m, runs in summaries.items()
    }


@dataclass(frozen=True)
class Correlation:
    """Pearson's r of paired finite values with its two-sided p-value and the number of pairs (r, p None for fewer
    than three pairs or a constant side)."""

    r: float | None
    p: float | None
    n: int

    def text(self) -> str:
        """ "r = 0.42 (p = 0.003, n = 64)"; undefined: "r undefined (n = 2)"."""
        if self.r is None:
            return f"r undefined (n = {self.n})"
        return f"r = {self.r:.2f} (p = {self.p:.2g}, n = {self.n})"


def correlation(x: Iterable[float], y: Iterable[float]) -> Correlation:
    """Pearson's correlation of the pairs where both values are finite (scipy.stats.pearsonr)."""
    a, b = np.asarray(list(x), dtype=float), np.asarray(list(y), dtype=float)
    if a.shape != b.shape:
        raise ValueError(f"correlation needs paired values, got {a.size} x and {b.size} y")
    keep = np.isfinite(a) & np.isfinite(b)
    a, b = a[keep], b[keep]
    n = int(a.size)
    if n < 3 or np.ptp(a) == 0 or np.ptp(b) == 0:
        return Correlation(None, None, n)
    res = sps.pearsonr(a, b)
    return Correlation(float(res.statistic), float(res.pvalue), n)
