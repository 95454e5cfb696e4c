"""The token-level study's compute side: the seed study and its per-token ground truths (docs/math.md §5), its
config, backends and fan-out to workers. It runs the study and reads no stored results (``summary`` does)."""
