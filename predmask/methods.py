"""The method registry and the masked policy losses of math.md §4, with verl's loss aggregation modes."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Literal

import torch
from torch import Tensor

from predmask.divergence import _ddot, _divergence, coarse_distributions
from predmask.support import binary_support_valid

__all__ = [
    "LOSS_AGG_MODES",
    "METHODS",
    "Method",
    "MethodParams",
    "agg_loss",
    "get_method",
    "policy_loss",
    "register_method",
]

LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean",
)

#: log-ratio clamp before exponentiation, for numerical safety (as verl does)
_LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True)
class Method:
    """One trust-region mask.

    kind:       "clip" (PPO ratio clipping) or "divergence" (DPPO loss form with a divergence mask)
    divergence: D of the proximity test ("kl" or "tv")
    support:    "topk" (TopK(mu) ∪ {k}) or "binary" ({k} only, DPPO's binary approximation)
    direction:  "ratio" (A·(r-1) > 0) or "predictive" (A·Ddot > 0)
    tail:       q_T estimator for the predictive direction ("aggregated", "uniform", "exact")
    """

    name: str
    kind: Literal["clip", "divergence"]
    divergence: Literal["kl", "tv"] | None = None
    support: Literal["topk", "binary"] | None = None
    direction: Literal["ratio", "predictive"] | None = None
    tail: Literal["aggregated", "uniform", "exact"] | None = None
    description: str = ""

    @property
    def needs_support(self) -> bool:
        return self.kind == "divergence"


@dataclass(frozen=True)
class MethodParams:
    """Hyperparameters of every method; each method reads the ones it uses.

    delta:          trust-region threshold on D (divergence methods)
    eps_low, eps_high: PPO clip range of grpo_clip_higher (DAPO's clip-higher values)
    ratio_cap:      c in the DPPO loss ``-A * sg(min(r, c)) * keep * log pi_k``
    loss_agg_mode:  one of verl's modes (LOSS_AGG_MODES)
    vocab_size:     V, needed by the uniform tail estimator
    """

    delta: float = 0.15
    eps_low: float = 0.2
    eps_high: float = 0.28
    ratio_cap: float = 10.0
    loss_agg_mode: str = "token-mean"
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        if not self.delta > 0:
            raise ValueError(f"delta must be > 0, got {self.delta}")
        if not (0 < self.eps_low < 1):
            raise ValueError(f"eps_low must lie in (0, 1), got {self.eps_low}")
        if not self.eps_high > 0:
            raise ValueError(f"eps_high must be > 0, got {self.eps_high}")
        if not self.ratio_cap > 0:
            raise ValueError(f"ratio_cap must be > 0, got {self.ratio_cap}")
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"unknown loss_agg_mode {self.loss_agg_mode!r}; allowed: {', '.join(LOSS_AGG_MODES)}")

    @classmethod
    def from_mapping(cls, values: dict[str, Any]) -> MethodParams:
        """Build from a config mapping, ignoring keys that are not parameters (e.g. ``name``)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})


METHODS: dict[str, Method] = {}


def register_method(method: Method) -> Method:
    """Add a method to the registry (names are unique)."""
    if method.name in METHODS:
        raise ValueError(f"method {method.name!r} is already registered")
    METHODS[method.name] = method
    return method


def get_method(name: str) -> Method:
    """Look up a method by name; unknown names raise ValueError listing the known ones."""
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; known methods: {', '.join(sorted(METHODS))}") from None


register_method(Method("grpo_clip_higher", "clip", description="GRPO with PPO clip-higher (eps 0.2/0.28)"))
for _div in ("kl", "tv"):
    register_method(
        Method(f"dppo_topk_{_div}", "divergence", _div, "topk", "ratio",
               description=f"DPPO: top-K {_div.upper()} proximity, ratio direction")
    )
    register_method(
        Method(f"dppo_binary_{_div}", "divergence", _div, "binary", "ratio",
               description=f"DPPO: binary {_div.upper()} proximity, ratio direction")
    )
for _div, _tails in (("kl", ("agg", "uniform", "exact")), ("tv", ("agg", "uniform"))):
    for _t in _tails:
        register_method(
            Method(f"predmask_{_div}_{_t}", "divergence", _div, "topk", "predictive",
                   "aggregated" if _t == "agg" else _t,
                   description=f"predictive mask: top-K {_div.upper()}, {_t} tail")
        )


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp_min(1.0)


def agg_loss(
    loss_mat: Tensor,
    loss_mask: Tensor,
    loss_agg_mode: str,
    *,
    dp_size: int = 1,
    batch_num_tokens: float | Tensor | None = None,
    global_batch_size: float | Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> Tensor:
    """Aggregate a [batch, response_len] loss matrix into a scalar with verl's semantics.

    ``dp_size``, ``batch_num_tokens`` and ``global_batch_size`` are verl's ``global_batch_info``: when given,
    normalise by the global token / sequence count so the loss does not depend on micro-batching.
    """
    mask = loss_mask.to(loss_mat.dtype)
    if loss_agg_mode == "token-mean":
        denom = mask.sum() if batch_num_tokens is None else batch_num_tokens
        return (loss_mat * mask).sum() / denom * dp_size
    if loss_agg_mode == "token-sum":
        return (loss_mat * mask).sum() * dp_size
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"):
        tokens = mask.sum(-1)
        seq_losses = (loss_mat * mask).sum(-1)
        if loss_agg_mode == "seq-mean-token-mean":
            seq_losses = seq_losses / (tokens + 1e-8)
        seq_mask = (tokens > 0).to(loss_mat.dtype)
        denom = seq_mask.sum() if global_batch_size is None else global_batch_size
        loss = (seq_losses * seq_mask).sum() / denom * dp_size
        if loss_agg_mode == "seq-mean-token-sum-norm":  # normalised by a fixed horizon, as verl 0.9 does
            loss = loss / (loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
        return loss
    raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; allowed: {', '.join(LOSS_AGG_MODES)}")


def _check_token_shapes(**tensors: Tensor) -> torch.Size:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    first = next(iter(shapes.values()))
    if any(s != first for s in shapes.values()):
        raise ValueError(f"per-token tensors must share one shape, got {shapes}")
    return torch.Size(first)


def policy_loss(
    method: str | Method,
    *,
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    mu_logprobs: Tensor | None = None,
    pi_logprobs: Tensor | None = None,
    valid: Tensor | None = None,
    sampled_index: Tensor | None = None,
    pi_tail_sq: Tensor | None = None,
    params: MethodParams | None = None,
    global_batch_info: dict[str, Any] | None = None,
    **param_overrides: Any,
) -> tuple[Tensor, dict[str, float]]:
    """The masked policy loss of a registered method and its metrics, per batch (math.md §4).

    Per-token tensors [batch, response_len]: ``log_prob`` (training log pi_k, with grad), ``old_log_prob``
    (the anchor of r; the rollout's log mu_k by default), ``advantages``, ``response_mask``.
    Divergence methods also need the support [batch, response_len, K+1]: ``mu_logprobs``, ``pi_logprobs``,
    ``valid`` and ``sampled_index``; ``predmask_*_exact`` needs ``pi_tail_sq`` and ``*_uniform`` needs
    ``params.vocab_size``. ``param_overrides`` replace fields of ``params`` (e.g. ``delta=0.05``).

    Returns ``(loss, metrics)``; metric names follow verl (``actor/pg_clipfrac``, ``actor/ppo_kl``) plus the
    mask metrics under ``actor/mask/...``.
    """
    m = method if isinstance(method, Method) else get_method(method)
    p = replace(params or MethodParams(), **param_overrides) if param_overrides else (params or MethodParams())
    _check_token_shapes(log_prob=log_prob, old_log_prob=old_log_prob, advantages=advantages,
                        response_mask=response_mask)
    mask = response_mask.bool()
    adv = advantages.to(log_prob.dtype)
    log_ratio = (log_prob - old_log_prob).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = log_ratio.exp()
    nonzero_adv = mask & (advantages != 0)
    metrics: dict[str, float] = {
        "actor/ppo_kl": float(_masked_mean(-log_ratio.detach(), mask)),
        "actor/mask/tokens": float(mask.sum()),
    }
    agg = dict(global_batch_info or {})

    if m.kind == "clip":
        surr1 = -adv * ratio
        surr2 = -adv * ratio.clamp(1.0 - p.eps_low, 1.0 + p.eps_high)
        loss_mat = torch.maximum(surr1, surr2)
        r = ratio.detach()
        dropped = ((advantages > 0) & (r > 1.0 + p.eps_high)) | ((advantages < 0) & (r < 1.0 - p.eps_low))
        dropped = dropped & mask
        loss = agg_loss(loss_mat, mask, p.loss_agg_mode, **agg)
        metrics["actor/pg_clipfrac"] = float(_masked_mean(dropped.float(), nonzero_adv))
        metrics["actor/pg_clipfrac_lower"] = float(_masked_mean((dropped & (advantages < 0)).float(), nonzero_adv))
        return loss, metrics

    missing = [n for n, t in (("mu_logprobs", mu_logprobs), ("pi_logprobs", pi_logprobs), ("valid", valid),
                              ("sampled_index", sampled_index)) if t is None]
    if missing:
        raise ValueError(f"method {m.name!r} needs the top-K support; missing: {', '.join(missing)}")
    assert mu_logprobs is not None and pi_logprobs is not None and valid is not None and sampled_index is not None
    if mu_logprobs.shape[:-1] != log_prob.shape:
        raise ValueError(
            f"support tensors {tuple(mu_logprobs.shape)} must be [*{tuple(log_prob.shape)}, K+1]"
        )
    with torch.no_grad():
        div_valid = valid if m.support == "topk" else binary_support_valid(valid, sampled_index)
        c = coarse_distributions(mu_logprobs.detach(), pi_logprobs.detach(), div_valid)
        d = _divergence(c, m.divergence or "kl")
        outside = (d > p.delta) & mask
        ratio_increases = (advantages * (ratio.detach() - 1.0)) > 0
        if m.direction == "predictive":
            ddot = _ddot(c, sampled_index, divergence=m.divergence or "kl", tail=m.tail or "aggregated",
                         vocab_size=p.vocab_size, pi_tail_sq=pi_tail_sq)
            increases = (advantages * ddot) > 0
        else:
            increases = ratio_increases
        dropped = outside & increases
        keep = mask & ~dropped

    capped = ratio.detach().clamp(max=p.ratio_cap)
    loss_mat = -adv * capped * keep.to(log_prob.dtype) * log_prob
    loss = agg_loss(loss_mat, mask, p.loss_agg_mode, **agg)

    d_masked = d[mask]
    metrics.update(
        {
            "actor/pg_clipfrac": float(_masked_mean(dropped.float(), nonzero_adv)),
            "actor/pg_clipfrac_lower": float(_masked_mean((dropped & (advantages < 0)).float(), nonzero_adv)),
            "actor/mask/divergence_mean": float(d_masked.mean()) if d_masked.numel() else 0.0,
            "actor/mask/divergence_max": float(d_masked.max()) if d_masked.numel() else 0.0,
            "actor/mask/outside_frac": float(_masked_mean(outside.float(), mask)),
            "actor/mask/mu_tail_clamped": float((c.mu_T_clamped & mask).sum()),
            "actor/mask/pi_tail_clamped": float((c.pi_T_clamped & mask).sum()),
        }
    )
    if m.direction == "predictive":
        disagree = outside & nonzero_adv & (increases != ratio_increases)
        metrics["actor/mask/direction_disagree"] = float(disagree.sum())
    return loss, metrics
