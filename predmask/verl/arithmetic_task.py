"""The CPU engine's arithmetic task on verl: its data sources, its parquet files and its verifier as verl's reward.

``python -m sweeps.datasets prepare --family arithmetic`` writes the task as verl RLHF parquet
(:data:`ARITHMETIC_DATA_FILES`): the training stream with data_source :data:`ARITHMETIC_SOURCE`, each held-out split
with its split's name as its data_source, so that verl's validation metrics are named as the engine's
(``val-core/aime24_standin/acc/mean@16``, ``predmask.metrics.val_acc``). verl scores them with
:func:`compute_score`, named in its config as

    reward.custom_reward_function.path=pkg://predmask.verl.arithmetic_task
    reward.custom_reward_function.name=compute_score

(:data:`REWARD_FUNCTION_PATH`, :data:`REWARD_FUNCTION_NAME`; verl 0.9.1 imports a ``pkg://`` path as a module and
still migrates the legacy top-level ``custom_reward_function`` section there). For the task's sources the score
is the engine's own reward, :func:`predmask.rl.task.reward` (1.0 or 0.0); any other source goes to verl's
default dispatch (:func:`predmask.verl.reward.default_score`), which needs verl. Imports no verl itself, so the
data preparation and the score run on a machine without it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from predmask.rl.task import EVAL_SPLITS, reward

#: the data_source of the training rows (verl's own dispatch knows no such source: a run that forgets
#: :func:`compute_score` fails on its first training batch instead of scoring the task as something else)
ARITHMETIC_SOURCE = "predmask_arithmetic"
#: every data_source of the task: the training stream and the held-out splits, named as the engine's metrics name them
ARITHMETIC_SOURCES: tuple[str, ...] = (ARITHMETIC_SOURCE, *EVAL_SPLITS)
#: the task's parquet files under a data directory, per set (the training stream, then each held-out split)
ARITHMETIC_DATA_FILES: dict[str, str] = {"train": "arithmetic_train.parquet",
                                         **{split: f"arithmetic_{split}.parquet" for split in EVAL_SPLITS}}
#: verl's ``reward.custom_reward_function.path`` / ``.name`` for :func:`compute_score`
REWARD_FUNCTION_PATH = f"pkg://{__name__}"
REWARD_FUNCTION_NAME = "compute_score"


def ground_truth_answer(ground_truth: Any) -> int:
    """The integer answer of a row's ``reward_model.ground_truth`` (written as a string, e.g. ``"42"``)."""
    text = str(ground_truth).strip()
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"ground truth {ground_truth!r} of the arithmetic task is not an integer") from None


def compute_score(data_source: str, solution_str: str, ground_truth: Any,
                  extra_info: Mapping[str, Any] | None = None, **kwargs: Any) -> float | dict[str, Any]:
    """verl's ``custom_reward_function``: the engine's reward (:func:`predmask.rl.task.reward`) of ``solution_str``
    for the task's data sources (:data:`ARITHMETIC_SOURCES`); verl's default dispatch for any other source, as
    verl computes it (a float or a dict with ``score``). ``extra_info`` and verl's keyword arguments
    (``reward_router_address``, ``reward_kwargs``, ...) are accepted and do not change the task's score; the
    default dispatch receives them all."""
    if data_source in ARITHMETIC_SOURCES:
        return reward(solution_str, ground_truth_answer(ground_truth))
    try:
        from predmask.verl.reward import default_score
    except ImportError as exc:
        raise ValueError(
            f"data_source {data_source!r} is not the arithmetic task's ({', '.join(ARITHMETIC_SOURCES)}) and verl's "
            f"default reward dispatch cannot be imported here ({exc})"
        ) from None
    return default_score(data_source, solution_str, ground_truth, extra_info=extra_info, **kwargs)
