"""predmask's methods as verl policy losses: verl's signature, predmask's math (``predmask.policy_loss``).

Every method of ``predmask.METHODS`` is registered under its own name, so
``actor_rollout_ref.actor.policy_loss.loss_mode=<name>`` selects it. verl calls a policy loss with per-token
tensors only; the rollout's top-K support reaches the loss through :func:`rollout_support`, a context that
:class:`predmask.verl.topk_loss.TopKPolicyLoss` sets around verl's ``ppo_loss``. Imports no verl: verl's
``core_algos`` module is passed to :func:`register_all` by the plugin's hook.

The method parameters come from predmask's own keys (:mod:`predmask.verl.settings`) and, for
grpo_clip_higher's PPO clip range and the aggregation mode, from verl's own (docs/verl-plugin.md, "The
losses"). Inside a :func:`loss_statistics` block every call also hands its micro-batch's metrics, with the
count ``actor/mask/adv_tokens`` that weights the clip fractions, to the block's sink
(:mod:`predmask.verl.loss_stats`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from predmask.methods import METHODS, Method, MethodParams, get_method
from predmask.methods import policy_loss as predmask_policy_loss
from predmask.metrics import MASK_ADV_TOKENS, MASK_PI_SAMPLED_GAP
from predmask.support import TopKSupport
from predmask.verl.overrides import config_get
from predmask.verl.settings import PluginSettings, current_settings

#: metrics added on top of ``predmask.policy_loss``'s: the largest |pi_k from the support gather - verl's
#: log_prob| over response tokens -- a runtime check that the support is aligned with verl's log-probs.
EXTRA_METRICS: tuple[str, ...] = (MASK_PI_SAMPLED_GAP,)

_GLOBAL_BATCH_KEYS = ("dp_size", "batch_num_tokens", "global_batch_size", "loss_scale_factor")


@dataclass(frozen=True)
class RolloutSupport:
    """The rollout-side inputs of one micro-batch, response-aligned like verl's log_prob [B, L].

    anchor_logprobs: [B, L]    log mu_k of the sampled token (the anchor of r)
    support:         TopKSupport [B, L, K+1] with the rollout log-probs mu (None for grpo_clip_higher)
    pi_logprobs:     [B, L, K+1] training log-probs on the support (-inf on invalid slots)
    pi_tail_sq:      [B, L]    sum of squared training probabilities off the support (exact tail only)
    vocab_size:      V of the training logits
    """

    anchor_logprobs: Tensor
    support: TopKSupport | None = None
    pi_logprobs: Tensor | None = None
    pi_tail_sq: Tensor | None = None
    vocab_size: int | None = None


_CURRENT: ContextVar[RolloutSupport | None] = ContextVar("predmask_rollout_support", default=None)
StatsSink = Callable[[dict[str, float]], None]
_STATS: ContextVar[StatsSink | None] = ContextVar("predmask_loss_statistics", default=None)


@contextmanager
def _bound(var: ContextVar[Any], value: Any) -> Iterator[Any]:
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)


def rollout_support(batch: RolloutSupport | None) -> AbstractContextManager[RolloutSupport | None]:
    """Make ``batch`` visible to the registered losses for the duration of the block."""
    return _bound(_CURRENT, batch)


def loss_statistics(sink: StatsSink | None) -> AbstractContextManager[StatsSink | None]:
    """Every predmask loss called in the block passes its micro-batch's metrics to ``sink`` (None: nowhere)."""
    return _bound(_STATS, sink)


def _hf_vocab_size(config: Any) -> int | None:
    vocab = getattr(config_get(config_get(config, "model_config"), "hf_config"), "vocab_size", None)
    return int(vocab) if isinstance(vocab, int) and not isinstance(vocab, bool) else None


def method_params(config: Any, loss_agg_mode: str, vocab_size: int | None = None,
                  settings: PluginSettings | None = None) -> MethodParams:
    """MethodParams from verl's actor config and predmask's settings (default: this process's; see the module
    docstring for the keys)."""
    if config is None:
        raise ValueError("predmask policy losses need verl's actor config (config=None was passed)")
    s = current_settings() if settings is None else settings

    def number(key: str, default: float) -> float:
        value = config_get(config, key)
        return float(default if value is None else value)

    return MethodParams(
        delta=MethodParams.delta if s.delta is None else float(s.delta),
        eps_low=number("clip_ratio_low", MethodParams.eps_low),
        eps_high=number("clip_ratio_high", MethodParams.eps_high),
        ratio_cap=MethodParams.ratio_cap if s.ratio_cap is None else float(s.ratio_cap),
        loss_agg_mode=loss_agg_mode,
        anchor=s.anchor,
        support=s.support,
        vocab_size=vocab_size if vocab_size is not None else _hf_vocab_size(config),
    )


def _global_batch_info(config: Any) -> dict[str, Any]:
    info = config_get(config, "global_batch_info") or {}
    if not isinstance(info, Mapping):
        raise TypeError(f"config.global_batch_info must be a mapping, got {type(info).__name__}")
    return {k: v for k, v in info.items() if k in _GLOBAL_BATCH_KEYS}


def _rollout_inputs(name: str, method: Method, params: MethodParams, batch: RolloutSupport | None,
                    old_log_prob: Tensor, log_prob: Tensor, mask: Tensor) -> tuple[Tensor, dict[str, Tensor | None]]:
    """The ratio's anchor (pi_old, or log mu on response tokens) and the support arguments of
    ``predmask.policy_loss``; one line naming the fix when the method's rollout records are missing."""
    if method.anchor(params) == "old":
        anchor = old_log_prob
    elif batch is None:
        raise ValueError(
            f"policy loss {name!r} anchors on the rollout (predmask.anchor=rollout) and needs the rollout "
            "top-K records: set predmask.top_k=K and start verl with `python -m predmask.verl.launch`"
        )
    else:
        if tuple(batch.anchor_logprobs.shape) != tuple(log_prob.shape):
            raise ValueError(
                f"rollout anchor {tuple(batch.anchor_logprobs.shape)} does not match log_prob "
                f"{tuple(log_prob.shape)}"
            )
        anchor = torch.where(mask, batch.anchor_logprobs.to(old_log_prob.dtype), old_log_prob)
    if not method.needs_support:
        return anchor, {}
    if batch is None or batch.support is None or batch.pi_logprobs is None:
        raise ValueError(
            f"policy loss {name!r} needs the rollout top-K support: set predmask.top_k=K and start "
            "verl with `python -m predmask.verl.launch`"
        )
    return anchor, {"mu_logprobs": batch.support.mu_logprobs, "pi_logprobs": batch.pi_logprobs,
                    "valid": batch.support.valid, "sampled_index": batch.support.sampled_index,
                    "pi_tail_sq": batch.pi_tail_sq}


PolicyLossFn = Callable[..., tuple[Tensor, dict[str, Any]]]


def make_policy_loss(name: str) -> PolicyLossFn:
    """verl-signature policy loss for the predmask method ``name``."""
    method: Method = get_method(name)

    def policy_loss_fn(
        old_log_prob: Tensor,
        log_prob: Tensor,
        advantages: Tensor,
        response_mask: Tensor,
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        rollout_is_weights: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Any]]:
        if rollout_is_weights is not None:
            raise ValueError(
                f"policy loss {name!r} takes no rollout importance weights; "
                "disable algorithm.rollout_correction (the ratio is already anchored on the rollout)"
            )
        batch = _CURRENT.get()
        mask = response_mask.bool()
        params = method_params(config, loss_agg_mode, batch.vocab_size if batch is not None else None)
        anchor, support_kwargs = _rollout_inputs(name, method, params, batch, old_log_prob, log_prob, mask)
        loss, metrics = predmask_policy_loss(
            method,
            log_prob=log_prob,
            old_log_prob=anchor,
            advantages=advantages,
            response_mask=response_mask,
            params=params,
            global_batch_info=_global_batch_info(config),
            **support_kwargs,
        )
        if method.needs_support:  # checked by _rollout_inputs: the batch has the support and pi
            pi_k = batch.support.sampled_logprob(batch.pi_logprobs.detach()).to(log_prob.dtype)
            gap = (pi_k - log_prob.detach()).abs()[mask]
            metrics[MASK_PI_SAMPLED_GAP] = float(gap.max()) if gap.numel() else 0.0
        sink = _STATS.get()
        if sink is not None:
            sink({**metrics, MASK_ADV_TOKENS: float((mask & (advantages != 0)).sum())})
        return loss, metrics

    policy_loss_fn.__name__ = f"predmask_policy_loss_{name}"
    policy_loss_fn.__qualname__ = policy_loss_fn.__name__
    policy_loss_fn.__doc__ = f"verl policy loss for predmask method {name!r}: {method.description}"
    policy_loss_fn.predmask_method = name  # type: ignore[attr-defined]
    return policy_loss_fn


def register_all(core_algos: ModuleType) -> list[str]:
    """Register every predmask method in ``core_algos``'s policy-loss registry; returns the names.

    Idempotent. Refuses to shadow a verl loss of the same name that is not ours.
    """
    registry: dict[str, Any] = core_algos.POLICY_LOSS_REGISTRY
    for name in METHODS:
        existing = registry.get(name)
        if existing is not None and getattr(existing, "predmask_method", None) != name:
            raise ValueError(f"verl already has a policy loss named {name!r}; predmask will not replace it")
        if existing is None:
            core_algos.register_policy_loss(name)(make_policy_loss(name))
    return list(METHODS)
