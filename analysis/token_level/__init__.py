"""The token-level study of the direction criteria (docs/math.md §5): `python -m analysis token_level`.

``compute`` runs the study and imports nothing that reads stored results; ``summary`` reads and summarises
stored results and imports nothing that runs; they never import each other. The commands here use both:
``cli`` (the study), ``drift`` (the drift grid), ``bench`` (the cost benchmark).
"""
