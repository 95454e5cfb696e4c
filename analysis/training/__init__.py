"""Statistics of training runs over seeds (``stats``): intervals, smoothing, curves, per-run summaries, collapse."""
