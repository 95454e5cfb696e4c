"""The weights of variational-reasoning traces and the weighted SFT loss (math.md §8), pure torch, in log space.

log w = :func:`trace_log_ratio` + :func:`log_correct_estimate` (:func:`trace_log_weights`), normalised over
the K traces of a question (:func:`normalise_weights`); the estimators of P̂(correct | x, z) are the registry
``ESTIMATORS``, one registered function each; the weights table has one column per estimator
(:func:`weights_columns`)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from predmask.evaluation import check_binary, check_int
from predmask.registry import Registry

#: what an estimator may be called (its name is part of a column name)
_NAME = re.compile(r"[a-z][a-z0-9_]*")
#: summed log-probs up to this far above 0 are rounding (log_softmax in float32) and read as 0
_LOGP_ROUNDING = 1e-4
#: ``fn(answer_logp, answer_tokens, correct)``: log P̂(correct | x, z) per trace [N]; unused inputs are None
EstimatorFn = Callable[[Tensor | None, Tensor | None, Tensor | None], Tensor]


@dataclass(frozen=True)
class Estimator:
    """A registered estimator of log P(correct | x, z): ``inputs`` names the keyword arguments of
    :func:`log_correct_estimate` it needs, ``fn`` computes it from them (math.md §8)."""

    name: str
    label: str
    inputs: tuple[str, ...]
    fn: EstimatorFn


ESTIMATORS: Registry[Estimator] = Registry("estimator")
#: the registered estimator of a name (one-line ValueError listing the allowed names)
get_estimator = ESTIMATORS.lookup


def register_estimator(name: str, *, label: str, inputs: tuple[str, ...]) -> Callable[[EstimatorFn], EstimatorFn]:
    """Decorator: register ``fn`` as the estimator ``name`` needing the keyword inputs ``inputs``; the name becomes a
    column (:func:`weight_column`), so it must be lower-case letters, digits and ``_``, starting with a letter."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"estimator name {name!r} is not allowed: lower-case letters, digits and _, starting with a "
                         "letter (it names the column weight_<name>)")

    def decorator(fn: EstimatorFn) -> EstimatorFn:
        ESTIMATORS.add(name, Estimator(name, label, inputs, fn))
        return fn

    return decorator


#: the weights table's per-trace columns, before its weight columns (``weights_columns``)
TRACE_FIELDS: tuple[str, ...] = ("question", "trace", "trace_tokens", "answer_tokens", "log_prior", "log_posterior",
                                 "log_ratio", "answer_logp", "acc", "posterior_correct")


def weight_column(estimator: str) -> str:
    """The weights table's column of the normalised weights of ``estimator``: ``weight_<estimator>``."""
    return f"weight_{estimator}"


def weights_columns() -> tuple[str, ...]:
    """The weights table's columns: TRACE_FIELDS, then the weight column of every registered estimator in
    registration order."""
    return (*TRACE_FIELDS, *(weight_column(name) for name in ESTIMATORS))


def check_counts(k: object, m: object) -> tuple[int, int]:
    """Check the number of traces per question ``k`` and of answers per trace ``m``: both integers >= 1."""
    return check_int("traces per question K", k, 1), check_int("answers per trace M", m, 1)


def _float(t: Tensor) -> Tensor:
    return t if t.is_floating_point() else t.to(torch.float64)


def _check_no_nan(name: str, t: Tensor) -> None:
    bad = torch.isnan(t) | (t == float("inf"))
    if bool(bad.any()):
        raise ValueError(f"{name} has {int(bad.sum())} NaN or +inf values; allowed: finite values or -inf")


def _check_lengths(name: str, tokens: Tensor, n: int, minimum: int) -> Tensor:
    if tokens.shape != (n,):
        raise ValueError(f"{name} must have shape ({n},), got {tuple(tokens.shape)}")
    if tokens.is_floating_point() and bool((tokens != tokens.round()).any()):
        raise ValueError(f"{name} must hold whole token counts; allowed: integers >= {minimum}")
    if bool((tokens < minimum).any()):
        raise ValueError(f"{name} has a count {int(tokens.min())}; allowed: integers >= {minimum}")
    return tokens


def sequence_logprob(token_logp: Tensor, mask: Tensor) -> Tensor:
    """Σ_t log p_bt over the positions where ``mask`` is true (whatever the others hold), per row: [B, T] ->
    [B]."""
    if token_logp.shape != mask.shape or token_logp.ndim != 2:
        raise ValueError(
            f"token_logp and mask must be [B, T] of one shape, got {tuple(token_logp.shape)} and {tuple(mask.shape)}"
        )
    keep = mask.to(torch.bool)
    return torch.where(keep, token_logp, torch.zeros((), dtype=token_logp.dtype)).sum(-1)


def trace_log_ratio(log_prior: Tensor, log_posterior: Tensor, trace_tokens: Tensor) -> Tensor:
    """Per-token (geometric-mean) log ratio (log π_θ0(z|x) − log q_φ(z|x,y′)) / |z| per trace, 0 where |z| = 0.

    ``log_prior`` and ``log_posterior`` are the summed trace log-probs [N]; ``trace_tokens`` the lengths |z| >= 0."""
    log_prior, log_posterior = _float(log_prior), _float(log_posterior)
    if log_prior.ndim != 1 or log_prior.shape != log_posterior.shape:
        raise ValueError(
            f"log_prior and log_posterior must be [N] of one shape, got {tuple(log_prior.shape)} and "
            f"{tuple(log_posterior.shape)}"
        )
    _check_lengths("trace_tokens", trace_tokens, log_prior.shape[0], 0)
    for name, t in (("log_prior", log_prior), ("log_posterior", log_posterior)):
        bad = ~torch.isfinite(t)
        if bool(bad.any()):
            raise ValueError(f"{name} has {int(bad.sum())} non-finite values; allowed: finite log-probs")
    empty = trace_tokens == 0
    length = torch.where(empty, torch.ones_like(trace_tokens), trace_tokens).to(log_prior.dtype)
    ratio = (log_prior - log_posterior) / length
    return torch.where(empty, torch.zeros((), dtype=ratio.dtype), ratio)


@register_estimator("acc", label="accuracy of M sampled answers", inputs=("correct",))
def _log_accuracy(answer_logp: Tensor | None, answer_tokens: Tensor | None, correct: Tensor | None) -> Tensor:
    assert correct is not None
    if correct.ndim != 2:
        raise ValueError(f"correct must be [N, M], got shape {tuple(correct.shape)}")
    check_int("answers per trace M", int(correct.shape[1]), 1)
    check_binary(correct)
    hits = correct.to(torch.float64).sum(-1)
    return torch.log(hits) - math.log(correct.shape[1])  # log 0 = -inf: no correct answer


@register_estimator("gml", label="geometric mean of the answer's token probabilities",
                    inputs=("answer_logp", "answer_tokens"))
def _log_geometric_mean(answer_logp: Tensor | None, answer_tokens: Tensor | None, correct: Tensor | None) -> Tensor:
    assert answer_logp is not None and answer_tokens is not None
    lengths = _check_lengths("answer_tokens", answer_tokens, answer_logp.shape[0], 1)
    return answer_logp / lengths.to(answer_logp.dtype)


@register_estimator("likelihood", label="likelihood of the answer", inputs=("answer_logp",))
def _log_likelihood(answer_logp: Tensor | None, answer_tokens: Tensor | None, correct: Tensor | None) -> Tensor:
    assert answer_logp is not None
    return answer_logp


def log_correct_estimate(
    name: str,
    *,
    answer_logp: Tensor | None = None,
    answer_tokens: Tensor | None = None,
    correct: Tensor | None = None,
) -> Tensor:
    """log P̂(correct | x, z) per trace [N] by the estimator ``name`` (math.md §8; -inf: ``acc`` with no
    correct answer), from the inputs it names (``Estimator.inputs``)."""
    estimator = get_estimator(name)
    given = {"answer_logp": answer_logp, "answer_tokens": answer_tokens, "correct": correct}
    missing = [key for key in estimator.inputs if given[key] is None]
    if missing:
        raise ValueError(f"estimator {name!r} needs {', '.join(missing)}; allowed: pass {', '.join(estimator.inputs)}")
    if answer_logp is not None:
        answer_logp = _float(answer_logp)
        if answer_logp.ndim != 1:
            raise ValueError(f"answer_logp must be [N], got shape {tuple(answer_logp.shape)}")
        bad = torch.isnan(answer_logp) | (answer_logp > _LOGP_ROUNDING)
        if bool(bad.any()):
            raise ValueError(f"answer_logp has {int(bad.sum())} NaN or positive values; allowed: log-probs <= 0")
        answer_logp = answer_logp.clamp(max=0.0)  # rounding just above 0
    return estimator.fn(answer_logp, answer_tokens, correct)


def trace_log_weights(log_ratio: Tensor, log_correct: Tensor) -> Tensor:
    """The unnormalised log weight of each trace: log ratio + log P̂(correct) [N] (-inf where P̂ = 0)."""
    if log_ratio.ndim != 1 or log_ratio.shape != log_correct.shape:
        raise ValueError(
            f"log_ratio and log_correct must be [N] of one shape, got {tuple(log_ratio.shape)} and "
            f"{tuple(log_correct.shape)}"
        )
    if not bool(torch.isfinite(log_ratio).all()):
        raise ValueError("log_ratio has non-finite values; allowed: finite values")
    _check_no_nan("log_correct", log_correct)
    return _float(log_ratio) + _float(log_correct)


def _group_max(values: Tensor, group: Tensor) -> tuple[Tensor, Tensor]:
    """(each row's position among the sorted distinct group ids [N], each group's largest value [G])."""
    n = values.shape[0]
    if group.shape != (n,) or group.is_floating_point() or group.dtype == torch.bool:
        raise ValueError(f"group must be an integer tensor of shape ({n},), got {group.dtype} {tuple(group.shape)}")
    ids, inverse = torch.unique(group, sorted=True, return_inverse=True)
    top = torch.full((ids.shape[0],), float("-inf"), dtype=values.dtype, device=values.device)
    return inverse, top.scatter_reduce(0, inverse, values, reduce="amax")


def normalise_weights(log_weights: Tensor, group: Tensor) -> Tensor:
    """Softmax of ``log_weights`` within each group (the K traces of a question), in log space: [N] -> [N]; a
    group whose log weights are all -inf gets zeros."""
    if log_weights.ndim != 1:
        raise ValueError(f"log_weights must be [N], got shape {tuple(log_weights.shape)}")
    _check_no_nan("log_weights", log_weights)
    log_weights = _float(log_weights)
    inverse, top = _group_max(log_weights, group)
    alive = torch.isfinite(top)
    shift = torch.where(alive, top, torch.zeros((), dtype=top.dtype))[inverse]
    unnorm = torch.exp(log_weights - shift)  # exp(-inf) = 0; the group's largest is exp(0) = 1
    total = torch.zeros_like(top).index_add(0, inverse, unnorm)
    total = torch.where(alive, total, torch.ones((), dtype=total.dtype))
    return unnorm / total[inverse]


def best_trace(weights: Tensor, group: Tensor) -> Tensor:
    """The row index of the highest-weight trace of each group, groups in ascending id order: [N] -> [G] (long).

    Ties go to the lowest row index. A group whose weights are all zero still gets its first row: callers that must
    skip such questions check ``weights[best] > 0``."""
    if weights.ndim != 1:
        raise ValueError(f"weights must be [N], got shape {tuple(weights.shape)}")
    if bool(torch.isnan(weights).any()):
        raise ValueError("weights has NaN values; allowed: finite weights")
    inverse, top = _group_max(_float(weights), group)
    n = weights.shape[0]
    rows = torch.arange(n, device=weights.device)
    candidate = torch.where(_float(weights) == top[inverse], rows, torch.full_like(rows, n))
    best = torch.full(top.shape, n, dtype=torch.long, device=weights.device)
    return best.scatter_reduce(0, inverse, candidate, reduce="amin")


def weighted_sft_loss(token_logp: Tensor, mask: Tensor, weights: Tensor, normaliser: float) -> Tensor:
    """The constant-normaliser weighted SFT loss −Σ_b w_b Σ_t m_bt log p_bt / normaliser (a scalar, math.md
    §8): a fixed token count, so a sequence's gradient does not depend on what else is in the batch."""
    if isinstance(normaliser, bool) or not isinstance(normaliser, (int, float)) or not normaliser > 0 \
            or not math.isfinite(normaliser):
        raise ValueError(f"normaliser = {normaliser!r} is not allowed; allowed: a finite number > 0")
    sums = sequence_logprob(token_logp, mask)
    if weights.shape != sums.shape:
        raise ValueError(f"weights must have shape {tuple(sums.shape)}, got {tuple(weights.shape)}")
    if not bool(torch.isfinite(weights).all()) or bool((weights < 0).any()):
        raise ValueError("weights must be finite and >= 0; allowed: finite non-negative weights")
    return -(weights.to(sums.dtype) * sums).sum() / normaliser
