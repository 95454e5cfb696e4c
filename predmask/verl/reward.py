"""verl's reward for a math response: its default dispatch on ``data_source`` (DAPO math scoring, +1 / -1).

The data written by ``python -m sweeps.datasets prepare`` is scored by verl's trainer through this same dispatch
(``math_dapo`` and ``aime*`` data sources: the last ``Answer: ...`` line, else ``\\boxed{}``); this module lets
data preparation and its tests check a row's answer contract against verl's own scoring. Imports verl. The CPU
engine's arithmetic task is scored by its own verifier instead, verl's ``custom_reward_function``
:func:`predmask.verl.arithmetic_task.compute_score` (verl-free), which hands every other source to
:func:`default_score`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from verl.utils.reward_score import default_compute_score


def default_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None,
                  **kwargs: Any) -> Any:
    """verl's default dispatch as its reward loop calls it: its result as verl returns it (a number or a dict)."""
    return default_compute_score(data_source, solution_str, ground_truth, extra_info, **kwargs)


def reward_score(data_source: str, response: str, ground_truth: str) -> float:
    """The score verl gives ``response`` for a row of ``data_source`` with answer ``ground_truth``."""
    result = default_compute_score(data_source, response, ground_truth)
    return float(result["score"] if isinstance(result, Mapping) else result)
