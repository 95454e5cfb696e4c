"""The method registry and the masked policy losses of math.md §4, with verl's loss aggregation modes.

A method (``METHODS``) is one registration naming a loss kind (``LOSS_KINDS``), a support (``SUPPORTS``), a
direction criterion (``DIRECTIONS``, a registry of functions as in verl's ``core_algos``) and, from
``predmask.divergence``, a divergence and a tail estimator. :func:`policy_loss` only dispatches. Parameter
defaults are :class:`MethodParams`' (the YAML files select values, they do not repeat the defaults).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from torch import Tensor

from predmask import metrics as M
from predmask.divergence import (
    Coarse,
    coarse_distributions,
    divergence_change,
    divergence_of,
    get_divergence,
    get_tail,
)
from predmask.registry import Registry
from predmask.support import binary_support_valid, topk_only_valid

LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean",
)
#: what the ratio r = pi / anchor is anchored on: pi_old or the rollout's mu_k (math.md §4.3)
ANCHORS: tuple[str, ...] = ("old", "rollout")
#: the loss forms (math.md §4.2): "clip" = PPO ratio clipping, "divergence" = the DPPO loss form with a divergence mask
LOSS_KINDS: tuple[str, ...] = ("clip", "divergence")
#: the slots D is taken over: the top-K support (TOPK_SUPPORTS says which) or {k} alone (DPPO's binary
#: approximation)
SUPPORTS: tuple[str, ...] = ("topk", "binary")
#: the top-K methods' support (``MethodParams.support``): "topk_plus_sampled" = TopK(mu) ∪ {k} (the paper's, the
#: default), "topk" = TopK(mu) alone, a sampled token outside it counted in the tail (the DPPO reference code's)
TOPK_SUPPORTS: tuple[str, ...] = ("topk_plus_sampled", "topk")
#: the direction criterion every other one is compared with (``actor/mask/direction_disagree``)
REFERENCE_DIRECTION = "ratio"

#: log-ratio clamp before exponentiation, for numerical safety (as verl does)
_LOG_RATIO_CLAMP = 20.0


def _delta_error(delta: float) -> str:
    return (f"delta must be a finite number > 0 (the trust-region threshold on D; delta=inf would never bind, i.e. "
            f"no trust region at all), got {delta}")


@dataclass(frozen=True)
class MethodParams:
    """Hyperparameters of every method, with their defaults (the one place of them; math.md §4); each loss
    kind reads its own. ``delta``: a run config links it to its top-level ``delta``; ``loss_agg_mode``: our
    choice, the paper's Table 1 was not available; ``anchor`` and ``support``: None = the method's default
    (``Method.anchor``, ``Method.topk_support``); ``vocab_size``: V, needed by the uniform tail (known at run
    time, not configured)."""

    delta: float = 0.15
    eps_low: float = 0.2
    eps_high: float = 0.28
    ratio_cap: float = 10.0
    loss_agg_mode: str = "token-mean"
    anchor: str | None = None
    support: str | None = None
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        if not self.delta > 0:  # inf (no trust region) only for internal reference steps: see from_mapping
            raise ValueError(_delta_error(self.delta))
        if not (0 < self.eps_low < 1):
            raise ValueError(f"eps_low must lie in (0, 1), got {self.eps_low}")
        if not self.eps_high > 0:
            raise ValueError(f"eps_high must be > 0, got {self.eps_high}")
        if not self.ratio_cap > 0:
            raise ValueError(f"ratio_cap must be > 0, got {self.ratio_cap}")
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"unknown loss_agg_mode {self.loss_agg_mode!r}; allowed: {', '.join(LOSS_AGG_MODES)}")
        if self.anchor is not None and self.anchor not in ANCHORS:
            raise ValueError(f"unknown anchor {self.anchor!r}; allowed: {', '.join(ANCHORS)}")
        if self.support is not None and self.support not in TOPK_SUPPORTS:
            raise ValueError(f"unknown support {self.support!r}; allowed: {', '.join(TOPK_SUPPORTS)}")

    @classmethod
    def from_mapping(cls, values: dict[str, Any]) -> MethodParams:
        """Build from a config mapping, ignoring keys that are not parameters (e.g. ``name``). A configured
        delta must be finite: delta=inf is no trust region at all (the token-level study's unmasked reference
        step sets it itself)."""
        known = {f.name for f in fields(cls)}
        params = cls(**{k: v for k, v in values.items() if k in known})
        if math.isinf(params.delta):
            raise ValueError(_delta_error(params.delta))
        return params


@dataclass(frozen=True)
class LossBatch:
    """The per-token inputs of one loss call, as :func:`policy_loss` prepared them: ``adv`` is the advantages
    in the log-prob dtype, ``ratio`` has grad, the support tensors and ``pi_tail_sq`` are None when the caller
    gave none."""

    log_prob: Tensor
    advantages: Tensor
    adv: Tensor
    mask: Tensor
    ratio: Tensor
    nonzero_adv: Tensor
    mu_logprobs: Tensor | None
    pi_logprobs: Tensor | None
    valid: Tensor | None
    sampled_index: Tensor | None
    pi_tail_sq: Tensor | None


@dataclass(frozen=True)
class DirectionInputs:
    """What a direction criterion sees (no grad): the coarse distributions, advantages [B, R], the detached
    ratio, the sampled slot, ``pi_tail_sq`` (or None), the method and its parameters."""

    coarse: Coarse
    advantages: Tensor
    ratio: Tensor
    sampled_index: Tensor
    pi_tail_sq: Tensor | None
    method: Method
    params: MethodParams


#: ``direction(inputs) -> bool [B, R]``: True where this token's gradient step increases D
DirectionFn = Callable[[DirectionInputs], Tensor]

DIRECTIONS: Registry[DirectionFn] = Registry("direction criterion")
#: decorator: register a direction criterion under a name
register_direction = DIRECTIONS.register


@dataclass(frozen=True)
class Method:
    """One trust-region mask: a registration naming its parts, each a key of its registry or tuple (``kind``:
    LOSS_KINDS, ``divergence``: predmask.divergence.DIVERGENCES, ``support``: SUPPORTS, ``direction``:
    DIRECTIONS, ``tail``: predmask.divergence.TAILS, the q_T estimator of the predictive direction)."""

    name: str
    kind: str
    divergence: str | None = None
    support: str | None = None
    direction: str | None = None
    tail: str | None = None
    description: str = ""
    #: this method's own parameter values where they differ from MethodParams' defaults
    defaults: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in LOSS_KINDS:
            raise ValueError(f"unknown loss kind {self.kind!r}; allowed: {', '.join(LOSS_KINDS)}")
        unread = sorted(k for k, _ in self.defaults if k not in self.params)
        if unread:
            raise ValueError(f"method {self.name!r}: defaults {unread} are not parameters its {self.kind!r} loss "
                             f"reads ({', '.join(self.params)})")
        if self.needs_support:
            missing = [f for f in ("divergence", "support", "direction") if getattr(self, f) is None]
            if missing:
                raise ValueError(f"method {self.name!r}: a {self.kind!r} loss needs {', '.join(missing)}")
            get_divergence(str(self.divergence))
            if self.support not in SUPPORTS:
                raise ValueError(f"unknown support {self.support!r}; allowed: {', '.join(SUPPORTS)}")
            DIRECTIONS.lookup(str(self.direction))
        if self.tail is not None:
            get_tail(self.tail)

    @property
    def needs_support(self) -> bool:
        """Whether the loss needs the top-K support (the divergence kind does, clipping does not)."""
        return self.kind == "divergence"

    @property
    def reads_tail_sq(self) -> bool:
        """Whether the loss reads ``pi_tail_sq`` (only the exact tail does; every other caller skips computing
        it)."""
        return self.tail == "exact"

    @property
    def params(self) -> tuple[str, ...]:
        """The MethodParams fields this method's loss kind reads (recorded in every run's config)."""
        if self.kind == "clip":
            return ("eps_low", "eps_high", "anchor", "loss_agg_mode")
        return ("delta", "ratio_cap", "loss_agg_mode")

    @property
    def default_anchor(self) -> str:
        """The anchor of the ratio when ``MethodParams.anchor`` is None (math.md §4.3)."""
        return "old" if self.kind == "clip" else "rollout"

    def anchor(self, params: MethodParams) -> str:
        """The anchor this method's ratio uses with ``params`` (ANCHORS)."""
        return params.anchor or self.default_anchor

    def topk_support(self, params: MethodParams) -> str | None:
        """The support of a top-K method with ``params`` (TOPK_SUPPORTS; the first is the default), None for
        the others; one line when ``params.support`` is set for a method that cannot take it."""
        if self.support != "topk":
            if params.support is not None:
                raise ValueError(f"method {self.name!r} takes no support={params.support} (its divergence is not "
                                 "over the top-K support); support applies to the top-K divergence methods")
            return None
        if params.support == "topk" and self.direction != REFERENCE_DIRECTION:
            raise ValueError(f"method {self.name!r}: support=topk needs the ratio direction (the {self.direction} "
                             "direction's Ddot takes the sampled token on the support); use support="
                             f"{TOPK_SUPPORTS[0]}")
        return params.support or TOPK_SUPPORTS[0]


METHODS: Registry[Method] = Registry("method")


def register_method(method: Method) -> Method:
    """Add a method to the registry (names are unique); its parts must be registered."""
    return METHODS.add(method.name, method)


def get_method(name: str) -> Method:
    """Look up a method by name; unknown names raise ValueError listing the known ones."""
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; known methods: {', '.join(sorted(METHODS))}") from None


def method_config(section: dict[str, Any]) -> dict[str, Any]:
    """A run config's ``method`` section completed with every parameter the method reads (its value, else the
    default): what a run records in its config.yaml. Other keys (``name``, ``label``) are kept.

    The anchor is recorded where the loss kind reads it, elsewhere (like the top-K support) only when it is
    not the default, so a default run's config (and its id) does not carry it. A parameter the method does not
    read (a cluster recipe's ``ratio_cap`` on a clipping method) is left out: the record says what the loss
    used."""
    m = get_method(str(section.get("name")))
    params = method_params(section)
    unread = {f.name for f in fields(MethodParams)} - set(m.params) - {"anchor"}
    out = {**{k: v for k, v in section.items() if k not in unread}, **{p: getattr(params, p) for p in m.params}}
    if "anchor" in m.params:
        out["anchor"] = m.anchor(params)
    elif m.anchor(params) == m.default_anchor:
        out.pop("anchor", None)
    support = m.topk_support(params)
    if support is not None and support != TOPK_SUPPORTS[0]:
        out["support"] = support
    return out


def method_params(section: Mapping[str, Any]) -> MethodParams:
    """The parameters of a run's ``method`` section: its values, else the method's own defaults, else
    MethodParams' (keys that are not parameters, such as ``name``, are ignored)."""
    m = get_method(str(section.get("name")))
    return MethodParams.from_mapping({**dict(m.defaults), **section})


def method_anchor(section: Mapping[str, Any]) -> str:
    """The anchor of a run's ``method`` config section (recorded, else the method's default): ``old`` |
    ``rollout``."""
    m = get_method(str(section.get("name")))
    return m.anchor(method_params(section))


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
    """Aggregate a [batch, response_len] loss matrix into a scalar with verl's semantics (math.md §4); the
    keywords are verl's ``global_batch_info``, so that the loss does not depend on micro-batching."""
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
    """The masked policy loss of a registered method and its metrics (``predmask.metrics`` names), per batch
    (math.md §4).

    Per-token tensors [batch, response_len]: ``log_prob`` (training log pi_k, with grad), ``old_log_prob``
    (the anchor of r, see ``Method.anchor``), ``advantages``, ``response_mask``. Divergence methods also need
    the support [batch, response_len, K+1]: ``mu_logprobs``, ``pi_logprobs``, ``valid`` and ``sampled_index``;
    ``predmask_*_exact`` needs ``pi_tail_sq`` and ``*_uniform`` needs ``params.vocab_size``.
    ``param_overrides`` replace fields of ``params`` (e.g. ``delta=0.05``).
    """
    m = method if isinstance(method, Method) else get_method(method)
    p = replace(params or MethodParams(), **param_overrides) if param_overrides else (params or MethodParams())
    _check_token_shapes(log_prob=log_prob, old_log_prob=old_log_prob, advantages=advantages,
                        response_mask=response_mask)
    mask = response_mask.bool()
    log_ratio = (log_prob - old_log_prob).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    batch = LossBatch(
        log_prob=log_prob, advantages=advantages, adv=advantages.to(log_prob.dtype), mask=mask,
        ratio=log_ratio.exp(), nonzero_adv=mask & (advantages != 0), mu_logprobs=mu_logprobs,
        pi_logprobs=pi_logprobs, valid=valid, sampled_index=sampled_index, pi_tail_sq=pi_tail_sq,
    )
    metrics: dict[str, float] = {
        M.PPO_KL: float(_masked_mean(-log_ratio.detach(), mask)),
        M.MASK_TOKENS: float(mask.sum()),
    }
    loss_mat, dropped, extra = (_clip_loss if m.kind == "clip" else _divergence_loss)(m, p, batch)
    loss = agg_loss(loss_mat, mask, p.loss_agg_mode, **dict(global_batch_info or {}))
    metrics[M.CLIPFRAC] = float(_masked_mean(dropped.float(), batch.nonzero_adv))
    metrics[M.CLIPFRAC_LOWER] = float(_masked_mean((dropped & (advantages < 0)).float(), batch.nonzero_adv))
    metrics.update(extra)
    return loss, metrics


# ----------------------------------------------------------------------------------------------- loss kinds
def _clip_loss(m: Method, p: MethodParams, b: LossBatch) -> tuple[Tensor, Tensor, dict[str, float]]:
    """PPO clipping with the clip-higher range: ``max(-A r, -A clip(r, 1-eps_low, 1+eps_high))``."""
    surr1 = -b.adv * b.ratio
    surr2 = -b.adv * b.ratio.clamp(1.0 - p.eps_low, 1.0 + p.eps_high)
    r = b.ratio.detach()
    dropped = ((b.advantages > 0) & (r > 1.0 + p.eps_high)) | ((b.advantages < 0) & (r < 1.0 - p.eps_low))
    return torch.maximum(surr1, surr2), dropped & b.mask, {}


def _divergence_loss(m: Method, p: MethodParams, b: LossBatch) -> tuple[Tensor, Tensor, dict[str, float]]:
    """The DPPO loss form ``-A sg(min(r, c)) keep log pi_k``: a token is dropped when it lies outside the
    trust region (D > delta) and the method's direction criterion says its step increases D."""
    missing = [n for n, t in (("mu_logprobs", b.mu_logprobs), ("pi_logprobs", b.pi_logprobs), ("valid", b.valid),
                              ("sampled_index", b.sampled_index)) if t is None]
    if missing:
        raise ValueError(f"method {m.name!r} needs the top-K support; missing: {', '.join(missing)}")
    assert b.mu_logprobs is not None and b.pi_logprobs is not None and b.valid is not None
    assert b.sampled_index is not None and m.divergence is not None
    if b.mu_logprobs.shape[:-1] != b.log_prob.shape:
        raise ValueError(
            f"support tensors {tuple(b.mu_logprobs.shape)} must be [*{tuple(b.log_prob.shape)}, K+1]"
        )
    with torch.no_grad():
        div_valid = _divergence_support(m, p, b.valid, b.sampled_index)
        c = coarse_distributions(b.mu_logprobs.detach(), b.pi_logprobs.detach(), div_valid)
        d = divergence_of(c, m.divergence)
        outside = (d > p.delta) & b.mask
        inputs = DirectionInputs(c, b.advantages, b.ratio.detach(), b.sampled_index, b.pi_tail_sq, m, p)
        increases = DIRECTIONS.lookup(str(m.direction))(inputs)
        dropped = outside & increases
        keep = b.mask & ~dropped
        # how often this criterion decides differently from the reference one, where it matters
        disagree = None if m.direction == REFERENCE_DIRECTION else \
            outside & b.nonzero_adv & (increases != DIRECTIONS[REFERENCE_DIRECTION](inputs))

    capped = b.ratio.detach().clamp(max=p.ratio_cap)
    loss_mat = -b.adv * capped * keep.to(b.log_prob.dtype) * b.log_prob
    d_masked = d[b.mask]
    extra = {
        M.MASK_DIVERGENCE_MEAN: float(d_masked.mean()) if d_masked.numel() else 0.0,
        M.MASK_DIVERGENCE_MAX: float(d_masked.max()) if d_masked.numel() else 0.0,
        M.MASK_OUTSIDE_FRAC: float(_masked_mean(outside.float(), b.mask)),
        M.MASK_MU_TAIL_CLAMPED: float((c.mu_T_clamped & b.mask).sum()),
        M.MASK_PI_TAIL_CLAMPED: float((c.pi_T_clamped & b.mask).sum()),
    }
    if disagree is not None:
        extra[M.MASK_DIRECTION_DISAGREE] = float(disagree.sum())
    return loss_mat, dropped, extra


def _divergence_support(m: Method, p: MethodParams, valid: Tensor, sampled_index: Tensor) -> Tensor:
    """The slots of the K+1 support that D is taken over: all, the top-K alone or the sampled slot alone."""
    support = m.topk_support(p)
    if support is None:
        return binary_support_valid(valid, sampled_index)
    return topk_only_valid(valid) if support == "topk" else valid


# ----------------------------------------------------------------------------------------------- directions
@register_direction("ratio")
def _ratio_direction(x: DirectionInputs) -> Tensor:
    """DPPO's criterion: the step increases D when it moves the ratio away from 1, ``A (r - 1) > 0``."""
    return (x.advantages * (x.ratio - 1.0)) > 0


@register_direction("predictive")
def _predictive_direction(x: DirectionInputs) -> Tensor:
    """The predictive criterion: the first-order change of D along the step, ``A Ddot > 0`` (math.md §3)."""
    if x.method.tail is None:
        raise ValueError(f"method {x.method.name!r}: the predictive direction needs a tail estimator (tail=...)")
    ddot = divergence_change(x.coarse, x.sampled_index, divergence=str(x.method.divergence),
                             tail=x.method.tail, vocab_size=x.params.vocab_size, pi_tail_sq=x.pi_tail_sq)
    return (x.advantages * ddot) > 0



# ----------------------------------------------------------------------------------------------- methods
register_method(Method("grpo_clip_higher", "clip", description="GRPO with PPO clip-higher"))
register_method(Method("grpo", "clip", description="GRPO with the symmetric PPO clip 0.2 / 0.2, anchored on pi_old",
                       defaults=(("eps_low", 0.2), ("eps_high", 0.2), ("anchor", "old"))))
register_method(Method("dppo_topk_kl", "divergence", "kl", "topk", "ratio",
                       description="DPPO: top-K KL proximity, ratio direction"))
register_method(Method("dppo_binary_kl", "divergence", "kl", "binary", "ratio",
                       description="DPPO: binary KL proximity, ratio direction"))
# Appendix C: on the binary support the predictive direction is the ratio direction when r is anchored on mu
# (math.md §3.1), so this method's decisions are dppo_binary_kl's under anchor=rollout and differ only under anchor=old
register_method(Method("predmask_binary_kl", "divergence", "kl", "binary", "predictive", "aggregated",
                       description="predictive mask: binary KL, aggregated tail"))
register_method(Method("dppo_topk_tv", "divergence", "tv", "topk", "ratio",
                       description="DPPO: top-K TV proximity, ratio direction"))
register_method(Method("dppo_binary_tv", "divergence", "tv", "binary", "ratio",
                       description="DPPO: binary TV proximity, ratio direction"))
register_method(Method("predmask_kl_agg", "divergence", "kl", "topk", "predictive", "aggregated",
                       description="predictive mask: top-K KL, aggregated tail"))
register_method(Method("predmask_kl_uniform", "divergence", "kl", "topk", "predictive", "uniform",
                       description="predictive mask: top-K KL, uniform tail"))
register_method(Method("predmask_kl_exact", "divergence", "kl", "topk", "predictive", "exact",
                       description="predictive mask: top-K KL, exact tail"))
register_method(Method("predmask_tv_agg", "divergence", "tv", "topk", "predictive", "aggregated",
                       description="predictive mask: top-K TV, aggregated tail"))
register_method(Method("predmask_tv_uniform", "divergence", "tv", "topk", "predictive", "uniform",
                       description="predictive mask: top-K TV, uniform tail"))
