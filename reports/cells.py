"""Statistics written as text where several tables and figures print them: an accuracy over seeds in percent, the
paired difference a setting's seeds can detect (Table 2 and Figure 1), and the one interval rule every figure names."""

from __future__ import annotations

import math

import numpy as np

from analysis.training import stats as training_stats

#: the paired difference in accuracy (a fraction) whose seed count Table 2 and Figure 1 state: 2 points
TARGET_DIFFERENCE = 0.02
NEEDS_SEEDS = "n/a (needs ≥ 2 seeds)"
ZERO_SD = "n/a (the paired differences have zero SD)"
DETECTABLE_HEADER = f"detectable Δ final ({training_stats.POWER:.0%} power)"


#: The report's one interval rule (docs/results.md, "Intervals: one rule"): which interval a kind of quantity gets
#: and why. A value per seed summarised over seeds: the Student-t interval (the seeds are the replicates); a rate
#: pooled over the tokens of several seeds: the seed-cluster bootstrap (a seed's tokens are not independent); the
#: paper's own spreads (± SE, Wilson) only where a figure reproduces the paper's statistic, and named as such.
INTERVALS: dict[str, str] = {
    "seeds": f"{training_stats.INTERVAL_NAME} over seeds for values computed per seed (the seeds are the "
    "replicates)",
    "pooled": "95% seed-cluster bootstrap interval for rates pooled over the tokens of several seeds (seeds "
    "resampled: a seed's tokens are not independent)",
    "se": "± one standard error over seeds where the figure reproduces the paper's mean ± SE (a spread, not a 95% "
    "interval: the 95% t-interval is t(0.975, n − 1) ≈ 2.0–4.3 times wider at 30–3 seeds)",
    "wilson": "95% Wilson interval where the figure reproduces the paper's pooled count (it treats tokens as "
    "independent, so it is narrower than the seed-cluster bootstrap)",
    "none": "no interval drawn: each dot is one observation",
}
INTERVAL_RULE_DOC = "docs/results.md"


def interval_caption(*kinds: str) -> str:
    """The sentence every figure's caption ends with: the intervals it draws, by the one rule (INTERVALS)."""
    unknown = [k for k in kinds if k not in INTERVALS]
    if unknown or not kinds:
        raise ValueError(
            f"interval kinds {unknown or list(kinds)!r} not allowed; allowed: {', '.join(INTERVALS)}"
        )
    return f"Intervals, by the report's one rule ({INTERVAL_RULE_DOC}): {'; '.join(INTERVALS[k] for k in kinds)}."


def pct(iv: training_stats.Interval) -> str:
    """ "41.2% ± 3.1" (t-interval half-width, percentage points); one seed: "41.2% (one seed, no interval)"."""
    return iv.text(100.0, ".1f", "%", with_n=False)


def detectable_note() -> str:
    """What a detectable-difference cell states, as a sentence without its full stop (Table 2's note, Figure 1's
    caption and subtitle)."""
    alpha = 1.0 - training_stats.CONFIDENCE
    return (
        f"{DETECTABLE_HEADER[0].upper()}{DETECTABLE_HEADER[1:]}: the smallest mean paired difference in final validation accuracy (predictive mask "
        f"minus its pair, percentage points) that a two-sided paired t-test at α = {alpha:.2g} detects with "
        f"{training_stats.POWER:.0%} power on the seeds run, from the SD of their paired differences; and the "
        f"seeds a {100 * TARGET_DIFFERENCE:g}-point difference would need at that SD (docs/results.md)"
    )


def detectable(d: training_stats.PairedDifference | None) -> str:
    """ "8.2 pp with 3 seeds; 2 pp needs 15 seeds" for a paired difference of accuracies (fractions); "—" without
    a pair; NEEDS_SEEDS for fewer than two paired seeds; ZERO_SD when the paired differences do not vary."""
    if d is None:
        return "—"
    if d.n < 2:
        return NEEDS_SEEDS
    sd = float(np.std(d.diffs, ddof=1))
    if not (math.isfinite(sd) and sd > 0):
        return ZERO_SD
    mde = training_stats.minimum_detectable_difference(d.n, sd)
    needed = training_stats.seeds_needed(TARGET_DIFFERENCE, sd)
    return f"{100 * mde:.1f} pp with {d.n} seeds; {100 * TARGET_DIFFERENCE:g} pp needs {needed} seeds"
