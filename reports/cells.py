"""Statistics written as text where several tables and figures print them: an accuracy over seeds in percent."""

from __future__ import annotations

from analysis.training import stats as training_stats


def pct(iv: training_stats.Interval) -> str:
    """ "41.2% ± 3.1" (t-interval half-width, percentage points); one seed: "41.2% (one seed, no interval)"."""
    return iv.text(100.0, ".1f", "%", with_n=False)
