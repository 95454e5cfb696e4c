"""The token-level study of the direction criteria (docs/math.md §5): `python -m analysis token_level`.

Two sub-packages that never import each other: ``compute`` runs the study (``study_config`` compose, study id and
validation; ``study`` one seed's masked steps and per-token quantities; ``backend`` the CPU engine backend and the
choice of backend; ``hf`` the Hugging Face / vLLM backend; ``fanout`` per-seed files and workers through the launch
layer) and imports nothing that reads stored results; ``summary`` reads and summarises stored results (``study_stats``
every statistic and the paper's numbers; ``report`` the printed tables) and imports nothing that runs. The commands
here use both: ``cli`` (the study's command line, its ingest, the seed workers of one study or of the drift grid's
cells), ``drift`` (the drift grid), ``bench`` (the cost benchmark).
"""
