"""The accuracy-weighting analysis (docs/math.md §9): closed forms (``theory``), exact bandit and real-batch
measurements (``measure``), and ``python -m analysis accuracy_weighting`` (``cli``)."""
