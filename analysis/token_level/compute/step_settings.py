"""The settings of the study's optimiser steps, declared once: the schema and the runtime settings both build on them.

Kept apart from ``study_config`` (compose, validation) and ``study`` (the torch code) so that both can import it
without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: how the masked steps are taken (StepSettings.update_path)
UPDATE_PATHS: tuple[str, ...] = ("auto", "split", "direct")
#: the optimiser state of the same-token counterfactual (StepSettings.cf_mode; docs/math.md §5.1)
CF_MODES: tuple[str, ...] = ("adam_carried", "adam_reset", "sgd")


@dataclass(frozen=True, kw_only=True)
class StepSettings:
    """Fields of the schema (``StudyConfig``) and of the runtime settings (``study.StudySettings``, which
    checks their ranges), each described beside its value in conf/token_level.yaml; ``grad_clip=None`` does
    not clip, ``micro_batch=None`` takes the whole batch in one forward/backward (else gradients are
    accumulated)."""

    delta: float
    group_size: int
    staleness: int
    minibatches: int
    stale_method: str
    lr: float
    betas: list[float]
    weight_decay: float
    adam_eps: float
    grad_clip: float | None
    ratio_cap: float
    loss_agg_mode: str
    reference_update: bool
    micro_batch: int | None
    temperature: float
    update_path: str
    ground_truth: bool
    cf_mode: str
    ground_truth_chunk: int


def require(ok: bool, key: str, value: Any, allowed: str) -> None:
    """The one form of a range check: ValueError ``<key> must be <allowed>, got <value>`` unless ``ok``."""
    if not ok:
        raise ValueError(f"{key} must be {allowed}, got {value!r}")
