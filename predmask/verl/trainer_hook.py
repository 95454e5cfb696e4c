"""The trainer hook: verl's old-log-prob actor forward is skipped for the methods whose loss never reads it.

A method anchored on the rollout (``anchor=rollout``) takes its ratio's anchor from the top-K records (log
mu_k) and reads ``old_log_probs`` nowhere but on padding, which the loss masks (docs/verl-plugin.md, hook 5).
With the forward skipped, ``old_log_probs`` is mu itself, so verl's metrics that compare pi_old with mu
(``rollout_corr/*`` of its rollout correction, ``training/rollout_probs_diff_*`` and the log-prob correlation of
its debug metrics) would read kl 0, chi2 0, ppl_ratio 1: they are dropped, not logged, for such a step (the batch
carries :data:`OLD_LOG_PROBS_FROM`). Imports no verl: the verl modules are passed in by the plugin.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from predmask.methods import METHODS, MethodParams
from predmask.verl._hooks import when_imported
from predmask.verl.overrides import config_select
from predmask.verl.settings import PluginSettings, current_settings

#: ASSUMPTION (not measured here): verl's old-log-prob forward is about a third of the actor's compute per step (one
#: forward against the update's forward + backward, ~1 : 2). The dry-run's GPU-hour estimate (sweeps.plan) takes it
#: off every skipping run; ``bash scripts/device_check.sh`` measures the ratio on a GPU.
ASSUMED_OLD_LOG_PROB_SHARE = 1 / 3

#: the rollout's log-probs in verl's batch (``rollout.calculate_log_probs=true``)
ROLLOUT_LOG_PROBS = "rollout_log_probs"
#: the verl router-replay engine sections whose ``R2`` mode records the routing in the old-log-prob forward
_ROUTER_REPLAY_SECTIONS = ("megatron", "veomni")
#: the batch's ``meta_info`` key set when ``old_log_probs`` holds the rollout's mu (the forward was skipped)
OLD_LOG_PROBS_FROM = "predmask_old_log_probs_from"
#: verl's rollout-correction settings that change the batch by the ratio pi_old / mu (IS weights, rejection)
_ROLLOUT_CORRECTION_READERS = ("rollout_is", "rollout_rs")
#: verl's functions whose metrics compare pi_old with mu, per module: (function, its metrics' result index or None
#: when the function returns the metrics dict itself); both modules import them inside ``fit``, at call time
_PI_OLD_VS_MU_METRICS: dict[str, tuple[str, int | None]] = {
    "verl.trainer.ppo.rollout_corr_helper": ("compute_rollout_correction_and_add_to_batch", 1),
    "verl.utils.debug.metrics": ("calculate_debug_metrics", None),
}


def skips_old_log_prob(anchor: str) -> bool:
    """The rule: a loss whose ratio is anchored on the rollout (``anchor`` ``rollout``) never reads pi_old."""
    return anchor == "rollout"


def old_log_prob_readers(config: Any, settings: PluginSettings | None = None) -> list[str]:
    """What reads verl's old-log-prob forward in this run (verl's trainer config), one reason each; empty: the
    forward can be skipped. ``settings`` default to this process's (:func:`current_settings`)."""
    s = current_settings() if settings is None else settings
    actor = "actor_rollout_ref.actor"
    loss_mode = str(config_select(config, f"{actor}.policy_loss.loss_mode", "vanilla"))
    readers: list[str] = []
    if loss_mode not in METHODS:
        readers.append(f"the policy loss {loss_mode!r} is verl's own (it reads old_log_probs)")
    else:
        anchor = METHODS[loss_mode].anchor(MethodParams(anchor=s.anchor))
        if not skips_old_log_prob(anchor):
            readers.append(f"the policy loss {loss_mode!r} is anchored on pi_old (anchor={anchor})")
    if config_select(config, "algorithm.use_kl_in_reward", False):
        readers.append("algorithm.use_kl_in_reward=true (the KL penalty reads old_log_probs)")
    if config_select(config, f"{actor}.calculate_sum_pi_squared", False):
        readers.append(f"{actor}.calculate_sum_pi_squared=true (the forward computes sum pi^2)")
    for section in _ROUTER_REPLAY_SECTIONS:
        if str(config_select(config, f"{actor}.{section}.router_replay.mode", "disabled")) == "R2":
            readers.append(f"{actor}.{section}.router_replay.mode=R2 (the forward records the routing)")
    for key in _ROLLOUT_CORRECTION_READERS:
        value = config_select(config, f"algorithm.rollout_correction.{key}")
        if value is not None:
            readers.append(f"algorithm.rollout_correction.{key}={value} (it weighs or rejects by pi_old / mu)")
    return readers


def old_log_probs_are_mu(batch: Any) -> bool:
    """Whether ``batch``'s ``old_log_probs`` are the rollout's mu put there by the skipped forward."""
    return getattr(batch, "meta_info", {}).get(OLD_LOG_PROBS_FROM) == ROLLOUT_LOG_PROBS


def _rollout_anchor_batch(batch: Any) -> tuple[Any, float]:
    """What ``_compute_old_log_prob`` returns, without the forward: old_log_probs = mu, entropys = NaN, MFU 0."""
    if ROLLOUT_LOG_PROBS not in batch.batch:
        raise ValueError(
            "a rollout-anchored method skips the old-log-prob forward and needs the rollout's log-probs: set "
            "actor_rollout_ref.rollout.calculate_log_probs=true (or predmask.anchor=old)")
    mu = batch.batch[ROLLOUT_LOG_PROBS].float()
    tensors = {"old_log_probs": mu.clone(), "entropys": torch.full_like(mu, float("nan"))}
    return type(batch).from_dict(tensors=tensors, meta_info={OLD_LOG_PROBS_FROM: ROLLOUT_LOG_PROBS}), 0.0


def _drop_pi_old_vs_mu_metrics(module: ModuleType) -> None:
    """Wrap the function of ``module`` named in :data:`_PI_OLD_VS_MU_METRICS` so that its metrics are empty for a
    batch whose ``old_log_probs`` are mu (idempotent); everything else it does is kept."""
    name, index = _PI_OLD_VS_MU_METRICS[module.__name__]
    original: Callable[..., Any] = getattr(module, name)
    if getattr(original, "_predmask_skip", False):
        return

    @functools.wraps(original)
    def wrapped(batch: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(batch, *args, **kwargs)
        if not old_log_probs_are_mu(batch):
            return result
        if index is None:
            return {}
        return (*result[:index], {}, *result[index + 1:])

    wrapped._predmask_skip = True  # type: ignore[attr-defined]
    setattr(module, name, wrapped)


def install_trainer(ray_trainer: ModuleType) -> None:
    """Wrap ``RayPPOTrainer._compute_old_log_prob`` so that it skips the actor forward when no reader needs it,
    and verl's pi_old-vs-mu metric functions so that a skipping step logs none of them (idempotent)."""
    for module_name in _PI_OLD_VS_MU_METRICS:
        when_imported(module_name, _drop_pi_old_vs_mu_metrics)
    trainer_cls = ray_trainer.RayPPOTrainer
    original = trainer_cls._compute_old_log_prob
    if getattr(original, "_predmask_skip", False):
        return

    @functools.wraps(original)
    def _compute_old_log_prob(self: Any, batch: Any) -> Any:
        if old_log_prob_readers(self.config):
            return original(self, batch)
        return _rollout_anchor_batch(batch)

    _compute_old_log_prob._predmask_skip = True  # type: ignore[attr-defined]
    trainer_cls._compute_old_log_prob = _compute_old_log_prob
