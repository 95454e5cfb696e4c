"""Top-K divergences D and their predicted first-order change Ddot along the policy-gradient step (math.md §1-3).

Two registries: ``DIVERGENCES`` (a divergence and its directional derivative, :func:`register_divergence`) and
``TAILS`` (estimators of q_T, :func:`register_tail`); adding either is one registered function.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from predmask.registry import Registry

#: Probability floor for tail masses and log-probs (the DPPO reference code uses 1e-12).
MASS_FLOOR = 1e-12
_LOG_FLOOR = math.log(MASS_FLOOR)


@dataclass(frozen=True)
class Coarse:
    """The K+2-category view ``S ∪ {T}`` of mu and pi for each token (math.md §1): probabilities and log-probs
    (floored at log(MASS_FLOOR)) [..., S], 0 on invalid slots; tail masses [...] clamped at MASS_FLOOR, with
    where the clamp fired; the number of valid slots, and ``has_support`` (False for padding: D and Ddot are
    0)."""

    mu: Tensor
    pi: Tensor
    mu_lp: Tensor
    pi_lp: Tensor
    valid: Tensor
    mu_T: Tensor
    pi_T: Tensor
    mu_T_clamped: Tensor
    pi_T_clamped: Tensor
    n_support: Tensor
    has_support: Tensor


#: ``value(c)``: D per token [...]
DivergenceValue = Callable[[Coarse], Tensor]
#: ``change(c, k, q_T)``: Ddot per token along ``v = e_k - pi`` (``k`` long [..., 1] the sampled slot, ``q_T`` [...])
DivergenceChange = Callable[[Coarse, Tensor, Tensor], Tensor]
#: ``tail(c, vocab_size, pi_tail_sq)``: q_T per token [...]
TailEstimator = Callable[[Coarse, int | None, Tensor | None], Tensor]


@dataclass(frozen=True)
class Divergence:
    """A registered divergence: ``value(c)`` is D per token over ``S ∪ {T}`` (rows with support; the caller zeroes
    the rest), ``change(c, k, q_T)`` its directional derivative along ``e_k - pi`` (math.md §3)."""

    name: str
    value: DivergenceValue
    change: DivergenceChange


DIVERGENCES: Registry[Divergence] = Registry("divergence")
TAILS: Registry[TailEstimator] = Registry("tail estimator")
#: decorator: register a q_T estimator under a name
register_tail = TAILS.register
#: the registered divergence / q_T estimator of a name (one-line ValueError listing the allowed names)
get_divergence = DIVERGENCES.lookup
get_tail = TAILS.lookup


def register_divergence(name: str, *, change: DivergenceChange) -> Callable[[DivergenceValue], DivergenceValue]:
    """Decorator: register ``value`` as the divergence ``name`` with its directional derivative ``change``."""

    def decorator(value: DivergenceValue) -> DivergenceValue:
        DIVERGENCES.add(name, Divergence(name, value, change))
        return value

    return decorator


def _compute_dtype(*tensors: Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _check_inputs(mu_logprobs: Tensor, pi_logprobs: Tensor, valid: Tensor) -> None:
    if mu_logprobs.shape != pi_logprobs.shape or mu_logprobs.shape != valid.shape:
        raise ValueError(
            "mu_logprobs, pi_logprobs and valid must have one shape, got "
            f"{tuple(mu_logprobs.shape)}, {tuple(pi_logprobs.shape)}, {tuple(valid.shape)}"
        )
    if valid.dtype != torch.bool:
        raise ValueError(f"valid must be a bool tensor, got {valid.dtype}")
    if mu_logprobs.ndim == 0 or mu_logprobs.shape[-1] == 0:
        raise ValueError("the support dimension (last) must have at least one slot")
    for name, lp in (("mu_logprobs", mu_logprobs), ("pi_logprobs", pi_logprobs)):
        if not (lp.is_floating_point()):
            raise ValueError(f"{name} must be a float tensor, got {lp.dtype}")
        bad = valid & (torch.isnan(lp) | (lp == float("inf")))
        if bool(bad.any()):
            raise ValueError(
                f"{name} has {int(bad.sum())} NaN or +inf log-probs on valid support slots; "
                "allowed: finite values or -inf (probability 0)"
            )


def coarse_distributions(mu_logprobs: Tensor, pi_logprobs: Tensor, valid: Tensor) -> Coarse:
    """Validate the support log-probs and build the coarse distributions over ``S ∪ {T}`` (math.md §1), in
    float64 for float64 input, else in float32."""
    _check_inputs(mu_logprobs, pi_logprobs, valid)
    dtype = _compute_dtype(mu_logprobs, pi_logprobs)
    zero = torch.zeros((), dtype=dtype, device=mu_logprobs.device)

    def prep(lp: Tensor) -> tuple[Tensor, Tensor]:
        lp = torch.where(valid, lp.to(dtype), zero).clamp(min=_LOG_FLOOR, max=0.0)
        p = torch.where(valid, lp.exp(), zero)
        return lp, p

    mu_lp, mu = prep(mu_logprobs)
    pi_lp, pi = prep(pi_logprobs)
    raw_mu_T = 1.0 - mu.sum(-1)
    raw_pi_T = 1.0 - pi.sum(-1)
    n_support = valid.sum(-1)
    return Coarse(
        mu=mu,
        pi=pi,
        mu_lp=mu_lp,
        pi_lp=pi_lp,
        valid=valid,
        mu_T=raw_mu_T.clamp_min(MASS_FLOOR),
        pi_T=raw_pi_T.clamp_min(MASS_FLOOR),
        mu_T_clamped=raw_mu_T < MASS_FLOOR,
        pi_T_clamped=raw_pi_T < MASS_FLOOR,
        n_support=n_support,
        has_support=n_support > 0,
    )


def divergence_of(c: Coarse, divergence: str) -> Tensor:
    """D per token of the registered ``divergence`` on coarse distributions; rows without support get 0."""
    d = get_divergence(divergence).value(c)
    return torch.where(c.has_support, d, torch.zeros_like(d))


def topk_divergence(mu_logprobs: Tensor, pi_logprobs: Tensor, valid: Tensor, *, divergence: str = "kl") -> Tensor:
    """D per token [...] over the coarse distributions ``S ∪ {T}`` of the support log-probs [..., S] (math.md
    §2): ``divergence`` names a registered divergence (``"kl"``: KL(mu‖pi), ``"tv"``); padding rows get D =
    0."""
    return divergence_of(coarse_distributions(mu_logprobs, pi_logprobs, valid), divergence)


def _check_sampled_index(sampled_index: Tensor, c: Coarse) -> None:
    if sampled_index.shape != c.valid.shape[:-1]:
        raise ValueError(
            f"sampled_index {tuple(sampled_index.shape)} must have the leading shape {tuple(c.valid.shape[:-1])}"
        )
    if sampled_index.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"sampled_index must be an integer tensor, got {sampled_index.dtype}")
    width = c.valid.shape[-1]
    out_of_range = (sampled_index < 0) | (sampled_index >= width)
    if bool(out_of_range.any()):
        raise ValueError(f"sampled_index must lie in [0, {width}), got values outside on {int(out_of_range.sum())} tokens")
    on_valid = c.valid.gather(-1, sampled_index.long().unsqueeze(-1)).squeeze(-1)
    bad = c.has_support & ~on_valid
    if bool(bad.any()):
        raise ValueError(
            f"sampled_index points at an invalid support slot on {int(bad.sum())} tokens; the sampled token must "
            "always have a valid slot (build the support with predmask.build_support)"
        )


@register_tail("aggregated")
def _tail_aggregated(c: Coarse, vocab_size: int | None, pi_tail_sq: Tensor | None) -> Tensor:
    """q_T = pi_T**2: the tail as one token (math.md §3.1)."""
    return c.pi_T**2


@register_tail("uniform")
def _tail_uniform(c: Coarse, vocab_size: int | None, pi_tail_sq: Tensor | None) -> Tensor:
    """q_T = pi_T**2 / (V - |S|): the tail spread evenly over the tokens off the support."""
    if vocab_size is None or isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise ValueError(f"tail='uniform' needs vocab_size as an int, got {vocab_size!r}")
    width = c.valid.shape[-1]
    if vocab_size <= width:
        raise ValueError(f"vocab_size={vocab_size} must exceed the support width {width} for tail='uniform'")
    off_support = (vocab_size - c.n_support).to(c.pi_T.dtype)
    return c.pi_T**2 / off_support


@register_tail("exact")
def _tail_exact(c: Coarse, vocab_size: int | None, pi_tail_sq: Tensor | None) -> Tensor:
    """q_T = sum of squared training probabilities off the support, given as ``pi_tail_sq``."""
    if pi_tail_sq is None:
        raise ValueError("tail='exact' needs pi_tail_sq (sum of squared training probabilities off the support)")
    if pi_tail_sq.shape != c.pi_T.shape:
        raise ValueError(f"pi_tail_sq {tuple(pi_tail_sq.shape)} must have shape {tuple(c.pi_T.shape)}")
    q = pi_tail_sq.to(c.pi_T.dtype)
    if bool((~torch.isfinite(q)).any()) or bool((q < 0).any()):
        raise ValueError("pi_tail_sq must be finite and >= 0")
    return q


def _kl_change(c: Coarse, k: Tensor, q_T: Tensor) -> Tensor:
    pi_k = c.pi.gather(-1, k).squeeze(-1)
    mu_k = c.mu.gather(-1, k).squeeze(-1)
    local = pi_k - mu_k
    global_ = (c.pi * (c.mu - c.pi)).sum(-1)
    tail = -q_T * (1.0 - c.mu_T / c.pi_T)
    return local + global_ + tail


@register_divergence("kl", change=_kl_change)
def _kl(c: Coarse) -> Tensor:
    """Forward KL(mu‖pi) over ``S ∪ {T}``."""
    support = (c.mu * (c.mu_lp - c.pi_lp)).sum(-1)
    tail = c.mu_T * (c.mu_T.log() - c.pi_T.log())
    return support + tail


def _tv_change(c: Coarse, k: Tensor, q_T: Tensor) -> Tensor:
    # sign(0) = 0: TV is not differentiable where pi_b = mu_b; that bucket contributes nothing.
    s = torch.sign(c.pi - c.mu)
    s_T = torch.sign(c.pi_T - c.mu_T)
    pi_k = c.pi.gather(-1, k).squeeze(-1)
    s_k = s.gather(-1, k).squeeze(-1)
    g = pi_k - (c.pi**2).sum(-1) - q_T
    signed_mass = (s * c.pi).sum(-1) + s_T * c.pi_T
    return 0.5 * (s_k * pi_k - (s * c.pi**2).sum(-1) - s_T * q_T - g * signed_mass)


@register_divergence("tv", change=_tv_change)
def _tv(c: Coarse) -> Tensor:
    """Total variation over ``S ∪ {T}``."""
    return 0.5 * ((c.mu - c.pi).abs().sum(-1) + (c.mu_T - c.pi_T).abs())


def predicted_divergence_change(
    mu_logprobs: Tensor,
    pi_logprobs: Tensor,
    valid: Tensor,
    sampled_index: Tensor,
    *,
    divergence: str = "kl",
    tail: str = "aggregated",
    vocab_size: int | None = None,
    pi_tail_sq: Tensor | None = None,
) -> Tensor:
    """Ddot per token: the directional derivative of D along the unit logit step ``v = e_k - pi`` (math.md §3).

    ``sampled_index`` long [...] is the slot of the sampled token k (valid on rows with support); ``tail``
    names a registered q_T estimator ("uniform" needs ``vocab_size``, "exact" needs ``pi_tail_sq``, e.g. from
    ``gather_support_logprobs(..., return_tail_sq=True)``). Rows without support get 0.
    """
    c = coarse_distributions(mu_logprobs, pi_logprobs, valid)
    return divergence_change(c, sampled_index, divergence=divergence, tail=tail, vocab_size=vocab_size,
                             pi_tail_sq=pi_tail_sq)


def divergence_change(
    c: Coarse,
    sampled_index: Tensor,
    *,
    divergence: str,
    tail: str,
    vocab_size: int | None,
    pi_tail_sq: Tensor | None,
) -> Tensor:
    """Ddot per token on coarse distributions (see :func:`predicted_divergence_change`)."""
    change = get_divergence(divergence).change
    _check_sampled_index(sampled_index, c)
    q_T = get_tail(tail)(c, vocab_size, pi_tail_sq)
    d = change(c, sampled_index.long().unsqueeze(-1), q_T)
    return torch.where(c.has_support, d, torch.zeros_like(d))
