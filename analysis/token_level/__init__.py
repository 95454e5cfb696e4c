"""The token-level study of the direction criteria (docs/math.md §5): `python -m analysis token_level`.

Parts, one module each: ``cli`` (the command line), ``config`` (compose, study id, validation), ``study`` (one
seed's masked steps and per-token quantities), ``cpu`` (the CPU engine backend and the choice of backend), ``hf``
(the Hugging Face / vLLM backend), ``fanout`` (per-seed files and workers through the launch layer), ``stats``
(every statistic and the paper's numbers), ``report`` (the printed tables), ``bench`` (the cost benchmark).
"""
