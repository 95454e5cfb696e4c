"""Statistics written as text where several tables and figures print them: an accuracy over seeds in percent, and
the paired difference a setting's seeds can detect (Table 2 and Figure 1)."""

from __future__ import annotations

import math

import numpy as np

from analysis.training import stats as training_stats

#: the paired difference in accuracy (a fraction) whose seed count Table 2 and Figure 1 state: 2 points
TARGET_DIFFERENCE = 0.02
NEEDS_SEEDS = "n/a (needs ≥ 2 seeds)"
ZERO_SD = "n/a (the paired differences have zero SD)"
DETECTABLE_HEADER = f"detectable Δ final ({training_stats.POWER:.0%} power)"


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
