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
    """The settings of the study's optimiser steps: declared once, as fields of the schema (``StudyConfig``) and
    of the runtime settings (``analysis.token_level.compute.study.StudySettings``, which checks their ranges).

    delta:          trust-region threshold on the top-K KL (tokens with D_pre > delta are studied)
    group_size:     GRPO group size (rows g*n .. g*n+n-1 of the batch share a prompt)
    staleness:      mini-batch updates applied before the studied step (0 = pi_pre is the rollout's policy up
                    to precision mismatch)
    minibatches:    the batch is split into this many group-aligned mini-batches; stale update j trains on
                    mini-batch j mod minibatches
    stale_method:   the predmask method of the stale updates
    lr, betas, weight_decay, adam_eps: AdamW hyperparameters (the optimiser of the stale and studied steps)
    grad_clip:      gradient-norm clip of every step (None: no clipping)
    ratio_cap, loss_agg_mode: predmask.MethodParams of every loss
    reference_update: also take the unmasked step (``dd_all``, used by the sign-accuracy and first-order checks)
    micro_batch:    sequences per forward/backward (None: the whole batch at once); gradients are accumulated
    temperature:    the rollout temperature (training log-probs use the same)
    update_path:    one of UPDATE_PATHS: "split" (share the work of the masked steps; exact up to float rounding),
                    "direct" (each step on its own, as the trainer takes it) or "auto" (split unless the loss
                    aggregation is seq-mean-token-mean, whose per-sequence normalisation is not linear in the kept
                    tokens, or the training forward is FP8 with per-tensor activation scales, which couple the rows
                    of a forward)
    ground_truth:   also compute each outside token's own-update ground truths (docs/math.md §5.1): ``ddot_net``,
                    ``ddot_net_adam`` (after at least one stale update) and ``dd_cf``, the same-token
                    counterfactual with the optimiser state ``cf_mode`` (one of CF_MODES; not for an FP8 training
                    forward, whose per-tensor activation scales couple the rows)
    ground_truth_chunk: tokens per vectorised pass of the ground truths (memory: about 8 parameter copies each)
    """

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
