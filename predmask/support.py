"""The top-K support a rollout reports, and the training log-probs gathered on it (math.md §1)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

#: row chunks of low-precision (bf16, fp16) logits computed in float32 at once: each float32 work buffer is
#: 1/16 of the bf16 logits (a step's peak stays near the gradient alone), while a chunk stays large enough to
#: run at speed
LOW_PRECISION_CHUNKS = 32
_FULL_PRECISION = (torch.float32, torch.float64)


@dataclass(frozen=True)
class TopKSupport:
    """The width K+1 support of each token, ``TopK(mu) ∪ {sampled}`` (math.md §1): ``ids``, ``mu_logprobs``
    and ``valid`` [..., K+1], and ``sampled_index`` [...], the sampled token's slot, always a valid one."""

    ids: Tensor
    mu_logprobs: Tensor
    valid: Tensor
    sampled_index: Tensor

    def select(self, index: slice | Tensor) -> TopKSupport:
        """Rows ``index`` of the support (along the first dimension)."""
        return TopKSupport(self.ids[index], self.mu_logprobs[index], self.valid[index], self.sampled_index[index])

    def sampled_logprob(self, logprobs: Tensor) -> Tensor:
        """Gather ``logprobs`` [..., K+1] at the sampled slot -> [...]."""
        return logprobs.gather(-1, self.sampled_index.unsqueeze(-1)).squeeze(-1)


def build_support(
    topk_ids: Tensor,
    topk_logprobs: Tensor,
    sampled_ids: Tensor,
    sampled_logprobs: Tensor,
    topk_valid: Tensor | None = None,
) -> TopKSupport:
    """Build the K+1 support (math.md §1) from what a rollout engine reports per generated token: its top-K of
    mu [..., K] (any order), the sampled token and its log-prob [...], and ``topk_valid`` [..., K] (False
    where the engine reported fewer than K entries)."""
    if topk_ids.shape != topk_logprobs.shape:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_logprobs {tuple(topk_logprobs.shape)} differ")
    if topk_ids.shape[:-1] != sampled_ids.shape or sampled_ids.shape != sampled_logprobs.shape:
        raise ValueError(
            f"sampled_ids {tuple(sampled_ids.shape)} and sampled_logprobs {tuple(sampled_logprobs.shape)} "
            f"must have the leading shape of topk_ids {tuple(topk_ids.shape[:-1])}"
        )
    if topk_valid is None:
        topk_valid = torch.ones_like(topk_ids, dtype=torch.bool)
    elif topk_valid.shape != topk_ids.shape:
        raise ValueError(f"topk_valid {tuple(topk_valid.shape)} must match topk_ids {tuple(topk_ids.shape)}")
    k = topk_ids.shape[-1]
    hit = (topk_ids == sampled_ids.unsqueeze(-1)) & topk_valid
    in_topk = hit.any(-1)
    first_hit = hit.to(torch.int8).argmax(-1)
    sampled_index = torch.where(in_topk, first_hit, torch.full_like(first_hit, k)).long()
    ids = torch.cat([topk_ids, sampled_ids.unsqueeze(-1).to(topk_ids.dtype)], -1)
    mu = torch.cat([topk_logprobs, sampled_logprobs.unsqueeze(-1).to(topk_logprobs.dtype)], -1)
    valid = torch.cat([topk_valid, (~in_topk).unsqueeze(-1)], -1)
    return TopKSupport(ids=ids, mu_logprobs=mu, valid=valid, sampled_index=sampled_index)


def binary_support_valid(valid: Tensor, sampled_index: Tensor) -> Tensor:
    """Validity mask of DPPO's binary support ``S = {k}``: only the sampled slot."""
    onehot = torch.zeros_like(valid)
    onehot.scatter_(-1, sampled_index.unsqueeze(-1), True)
    return onehot & valid


def topk_only_valid(valid: Tensor) -> Tensor:
    """Validity mask of the top-K slots alone (the DPPO reference code's support): the extra slot K, which holds
    a sampled token outside the top-K, is dropped, so that token's mass counts in the tail."""
    return torch.cat([valid[..., :-1], torch.zeros_like(valid[..., -1:])], -1)


def _chunk_rows(rows: int) -> int:
    """Rows of low-precision logits computed in float32 at once (``LOW_PRECISION_CHUNKS`` chunks in all)."""
    return max(1, -(-rows // LOW_PRECISION_CHUNKS))


def _chunked_logsumexp(logits: Tensor, temperature: float, factor: float = 1.0) -> Tensor:
    """``logsumexp(factor * (logits / temperature), -1, keepdim=True)`` in float32 for low-precision logits, one
    row chunk at a time (the same operations, in the same order, as on a float32 copy of the whole logits)."""
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    out = torch.empty(flat.shape[0], 1, dtype=torch.float32, device=logits.device)
    step = _chunk_rows(flat.shape[0])
    for s in range(0, flat.shape[0], step):
        z = flat[s:s + step].float()
        if temperature != 1.0:
            z.div_(temperature)
        if factor != 1.0:
            z.mul_(factor)
        out[s:s + step] = torch.logsumexp(z, dim=-1, keepdim=True)
    return out.view(*logits.shape[:-1], 1)


class _SupportLogSoftmax(torch.autograd.Function):
    """``log_softmax(z / T)`` gathered at ``ids``, with a hand-written backward that builds the logits
    gradient in one [..., V] buffer (autograd's own graph keeps several [..., V] tensors alive); low-precision
    logits are computed in float32 row chunks, forward and backward. Forward-mode AD (``torch.func.jvp``) is
    supported too."""

    @staticmethod
    def forward(logits: Tensor, ids: Tensor, temperature: float) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        if logits.dtype not in _FULL_PRECISION:
            lse = _chunked_logsumexp(logits, temperature)
            return logits.gather(-1, ids).float() / temperature - lse, lse
        z = logits
        lse = torch.logsumexp(z, dim=-1, keepdim=True) if temperature == 1.0 else \
            torch.logsumexp(z / temperature, dim=-1, keepdim=True)
        return z.gather(-1, ids) / temperature - lse, lse

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
        logits, ids, temperature = inputs
        _, lse = output
        ctx.mark_non_differentiable(lse)
        ctx.save_for_backward(logits, ids, lse)
        ctx.save_for_forward(logits, ids, lse)
        ctx.temperature = temperature

    @staticmethod
    def _softmax(logits: Tensor, lse: Tensor, temperature: float) -> Tensor:
        """softmax(z / T) in one fresh [..., V] buffer (float32 or float64)."""
        z = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
        p = z.sub(lse * temperature) if z is logits else z.sub_(lse * temperature)
        return p.div_(temperature).exp_()

    @staticmethod
    def backward(ctx, grad_out: Tensor, _grad_lse: Tensor | None):  # type: ignore[no-untyped-def, override]
        logits, ids, lse = ctx.saved_tensors
        t = ctx.temperature
        g = grad_out.to(lse.dtype)
        if logits.dtype not in _FULL_PRECISION:
            return _SupportLogSoftmax._chunked_grad(logits, ids, lse, g, t), None, None
        grad = _SupportLogSoftmax._softmax(logits, lse, t)
        grad.mul_(-g.sum(-1, keepdim=True)).scatter_add_(-1, ids, g)
        if t != 1.0:
            grad.div_(t)
        return grad, None, None

    @staticmethod
    def _chunked_grad(logits: Tensor, ids: Tensor, lse: Tensor, g: Tensor, t: float) -> Tensor:
        """The logits gradient of low-precision logits, in their dtype, from float32 row chunks."""
        vocab, width = logits.shape[-1], ids.shape[-1]
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        flat, flat_grad = logits.reshape(-1, vocab), grad.view(-1, vocab)
        flat_ids, flat_g, flat_lse = ids.reshape(-1, width), g.reshape(-1, width), lse.reshape(-1, 1)
        step = _chunk_rows(flat.shape[0])
        for s in range(0, flat.shape[0], step):
            e = s + step
            chunk = _SupportLogSoftmax._softmax(flat[s:e], flat_lse[s:e], t)
            chunk.mul_(-flat_g[s:e].sum(-1, keepdim=True)).scatter_add_(-1, flat_ids[s:e], flat_g[s:e])
            if t != 1.0:
                chunk.div_(t)
            flat_grad[s:e].copy_(chunk)
        return grad

    @staticmethod
    def jvp(ctx, logits_t: Tensor, ids_t: Tensor | None, temperature_t: float | None):  # type: ignore[override]
        logits, ids, lse = ctx.saved_tensors
        t = ctx.temperature
        p = _SupportLogSoftmax._softmax(logits, lse, t)
        tangent = logits_t.to(p.dtype)
        lse_t = (p * tangent).sum(-1, keepdim=True) / t
        return tangent.gather(-1, ids) / t - lse_t, None


def gather_support_logprobs(
    logits: Tensor,
    ids: Tensor,
    valid: Tensor | None = None,
    *,
    temperature: float = 1.0,
    return_tail_sq: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Training log-probs ``log_softmax(logits / temperature)`` [..., V] gathered at the support ids [..., S],
    as ``logits[ids] - logsumexp(logits)`` (math.md §1): no log-softmax tensor is materialised, forward or
    backward. Invalid slots get log-prob -inf (and no gradient). With ``return_tail_sq`` also returns
    ``pi_tail_sq`` [...], the sum of squared training probabilities off the valid support (the exact tail of
    math.md §3.1)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if ids.shape[:-1] != logits.shape[:-1]:
        raise ValueError(f"ids {tuple(ids.shape)} must share the leading shape of logits {tuple(logits.shape)}")
    valid, safe_ids = support_ids(ids, valid, logits.shape[-1])
    logp, _ = _SupportLogSoftmax.apply(logits, safe_ids, float(temperature))
    if not return_tail_sq:
        return support_outputs(logp, valid, None)
    # sum_j pi_j^2 = exp(logsumexp(2z/T) - 2 logsumexp(z/T)); the support slots' squares are subtracted after.
    with torch.no_grad():
        z = logits.detach()
        if z.dtype not in _FULL_PRECISION:
            lse = _chunked_logsumexp(z, temperature)
            total_sq = torch.exp((_chunked_logsumexp(z, temperature, 2.0) - 2.0 * lse).squeeze(-1))
        else:
            z = z / temperature
            total_sq = torch.exp(torch.logsumexp(2.0 * z, dim=-1) - 2.0 * torch.logsumexp(z, dim=-1))
        del z
    return support_outputs(logp, valid, total_sq)


def support_ids(ids: Tensor, valid: Tensor | None, vocab: int) -> tuple[Tensor, Tensor]:
    """``valid`` (every slot when None) and ``ids`` with 0 on the invalid slots; ValueError unless each valid
    slot's id lies in ``[0, vocab)``."""
    if valid is None:
        valid = torch.ones_like(ids, dtype=torch.bool)
    safe_ids = torch.where(valid, ids, torch.zeros_like(ids))
    if bool(((safe_ids < 0) | (safe_ids >= vocab)).any()):
        raise ValueError(f"support ids must lie in [0, {vocab}) on valid slots")
    return valid, safe_ids


def support_outputs(logp: Tensor, valid: Tensor, total_sq: Tensor | None) -> Tensor | tuple[Tensor, Tensor]:
    """The support log-probs with -inf on the invalid slots; given ``total_sq`` (``sum_j pi_j^2`` [...]), also
    the exact tail: ``total_sq`` minus the valid slots' squares (distinct tokens), clamped at 0."""
    logp = torch.where(valid, logp, torch.full_like(logp, float("-inf")))
    if total_sq is None:
        return logp
    support_sq = torch.where(valid, torch.exp(2.0 * logp), torch.zeros_like(logp)).sum(-1)
    return logp, (total_sq - support_sq).clamp_min(0.0)
