"""The training log-probs on the rollout support from hidden states and the lm_head weight, without [tokens, vocab].

Streams over chunks of vocabulary columns (math.md §1.1); vocabulary-parallel ranks reduce their partial sums
with an injected all-reduce (``torch.distributed`` over the tensor-parallel group in a trainer, a fake one in
tests).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from predmask.support import support_ids, support_outputs

#: vocabulary columns whose logits are computed at once: small work buffers, while each chunk's matrix product
#: stays large enough to run at speed
DEFAULT_VOCAB_CHUNK = 2048

#: ``all_reduce(tensor, op)`` reduces ``tensor`` in place over the tensor-parallel ranks; ``op`` is "max" or "sum"
AllReduce = Callable[[Tensor, str], None]


def _compute_dtype(hidden: Tensor) -> torch.dtype:
    return torch.float64 if hidden.dtype == torch.float64 else torch.float32


def _chunk_logits(hidden: Tensor, weight: Tensor, temperature: float, dtype: torch.dtype) -> Tensor:
    """``(hidden @ weight.T)`` in the inputs' dtype (as the lm_head computes the logits), then in ``dtype``, / T."""
    z = (hidden @ weight.T).to(dtype)
    return z.div_(temperature) if temperature != 1.0 else z


def _slot_chunks(ids: Tensor, vocab_start: int, v_local: int, chunk: int) -> tuple[Tensor, Tensor]:
    """Each support slot's chunk of this rank's columns (-1: another rank's) and its column inside the chunk."""
    local = ids - vocab_start
    mine = (local >= 0) & (local < v_local)
    local = torch.where(mine, local, 0)
    return torch.where(mine, local.div(chunk, rounding_mode="floor"), -1), local.remainder(chunk)


def _slot_mask(slot_chunk: Tensor, slot_col: Tensor, index: int) -> tuple[Tensor, Tensor]:
    """The slots in chunk ``index`` and their columns (0 for the others, masked by the first)."""
    inside = slot_chunk == index
    return inside, torch.where(inside, slot_col, 0)


class _HiddenSupportLogSoftmax(torch.autograd.Function):
    """``log_softmax(hidden @ W.T / T)`` gathered at ``ids`` [N, S] (global ids; W holds rows from
    ``vocab_start``), streamed over vocabulary chunks. Outputs: the support log-probs (differentiable), the
    log-normaliser [N] and ``sum_j pi_j^2`` [N] (NaN unless asked; both non-differentiable)."""

    @staticmethod
    def forward(hidden: Tensor, weight: Tensor, ids: Tensor, temperature: float, chunk: int,  # type: ignore[override]
                vocab_start: int, all_reduce: AllReduce | None, total_sq: bool) -> tuple[Tensor, Tensor, Tensor]:
        n, v_local = hidden.shape[0], weight.shape[0]
        cd = _compute_dtype(hidden)
        lse = torch.full((n,), float("-inf"), dtype=cd, device=hidden.device)  # LSE(u) over the columns so far
        lse2 = torch.full_like(lse, float("-inf"))  # LSE(2u)
        picked = torch.zeros(ids.shape, dtype=cd, device=hidden.device)
        slot_chunk, slot_col = _slot_chunks(ids, vocab_start, v_local, chunk)
        for index, c0 in enumerate(range(0, v_local, chunk)):
            z = _chunk_logits(hidden, weight[c0:c0 + chunk], temperature, cd)
            inside, col = _slot_mask(slot_chunk, slot_col, index)
            picked += torch.where(inside, z.gather(1, col), 0.0)
            lse = torch.logaddexp(lse, torch.logsumexp(z, 1))
            if total_sq:
                lse2 = torch.logaddexp(lse2, torch.logsumexp(z.mul_(2.0), 1))
            del z
        if all_reduce is not None:  # rescale to the ranks' largest LSE, then sum the exps and the picked logits
            top = lse.clone()
            all_reduce(top, "max")
            sums = torch.cat([(lse - top).exp()[:, None], (lse2 - 2.0 * top).exp()[:, None], picked], 1)
            all_reduce(sums, "sum")
            lse, lse2, picked = top + sums[:, 0].log(), 2.0 * top + sums[:, 1].log(), sums[:, 2:]
        sum_sq = (lse2 - 2.0 * lse).exp() if total_sq else torch.full_like(lse, float("nan"))
        return picked - lse[:, None], lse, sum_sq

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
        hidden, weight, ids, temperature, chunk, vocab_start, all_reduce, _ = inputs
        _, lse, sum_sq = output
        ctx.mark_non_differentiable(lse, sum_sq)
        ctx.save_for_backward(hidden, weight, ids, lse)
        ctx.temperature, ctx.chunk, ctx.vocab_start, ctx.all_reduce = temperature, chunk, vocab_start, all_reduce

    @staticmethod
    @once_differentiable
    def backward(  # type: ignore[no-untyped-def, override]
        ctx, grad_logp: Tensor, _grad_lse: Tensor | None, _grad_sq: Tensor | None,
    ):
        """Per chunk ``dz`` (math.md §1.1), ``dh += dz @ W_c`` and ``dW_c = dz.T @ h``; the hidden states are
        the same on every rank, so their gradient is summed over the ranks."""
        hidden, weight, ids, lse = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        cd = lse.dtype
        g = grad_logp.to(cd)
        g_total = g.sum(1, keepdim=True)
        slot_chunk, slot_col = _slot_chunks(ids, ctx.vocab_start, weight.shape[0], chunk)
        grad_h = torch.zeros(hidden.shape, dtype=cd, device=hidden.device) if ctx.needs_input_grad[0] else None
        grad_w = torch.empty_like(weight) if ctx.needs_input_grad[1] else None
        for index, c0 in enumerate(range(0, weight.shape[0], chunk)):
            c1 = min(c0 + chunk, weight.shape[0])
            dz = _chunk_logits(hidden, weight[c0:c1], t, cd).sub_(lse[:, None]).exp_().mul_(-g_total)
            inside, col = _slot_mask(slot_chunk, slot_col, index)
            dz.scatter_add_(1, col, torch.where(inside, g, 0.0))
            if t != 1.0:
                dz.div_(t)
            dz = dz.to(hidden.dtype)
            if grad_h is not None and grad_h.dtype == dz.dtype:
                grad_h.addmm_(dz, weight[c0:c1])
            elif grad_h is not None:  # bf16/fp16: each product in their dtype (as autograd's), summed in float32
                grad_h += (dz @ weight[c0:c1]).to(cd)
            if grad_w is not None:
                torch.mm(dz.T, hidden, out=grad_w[c0:c1])
            del dz
        if grad_h is not None and ctx.all_reduce is not None:
            ctx.all_reduce(grad_h, "sum")
        grad_h = grad_h.to(hidden.dtype) if grad_h is not None else None
        return grad_h, grad_w, None, None, None, None, None, None


def gather_support_logprobs_from_hidden(
    hidden: Tensor,
    lm_head_weight: Tensor,
    ids: Tensor,
    valid: Tensor | None = None,
    *,
    temperature: float = 1.0,
    return_tail_sq: bool = False,
    chunk: int = DEFAULT_VOCAB_CHUNK,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    all_reduce: AllReduce | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """``predmask.gather_support_logprobs(hidden @ lm_head_weight.T, ids, valid, ...)`` without the logits
    (math.md §1.1), the gradient reaching ``hidden`` [..., D] and ``lm_head_weight`` [V_local, D] (one dtype;
    each chunk's logits are computed in it, as the lm_head does, then in float32).

    Vocabulary-parallel: this rank holds the rows ``[vocab_start, vocab_start + V_local)`` of a vocabulary of
    ``vocab_size`` (default: ``vocab_start + V_local``); ``all_reduce`` combines the ranks' partial results
    (None: one rank holds the whole vocabulary).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk < 1:
        raise ValueError(f"chunk must be a positive number of vocabulary columns, got {chunk}")
    if lm_head_weight.dim() != 2 or hidden.shape[-1] != lm_head_weight.shape[1]:
        raise ValueError(f"lm_head_weight {tuple(lm_head_weight.shape)} must be [V_local, D] with D = "
                         f"hidden's last dimension ({tuple(hidden.shape)})")
    if hidden.dtype != lm_head_weight.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and lm_head_weight ({lm_head_weight.dtype}) must share a dtype")
    if ids.shape[:-1] != hidden.shape[:-1]:
        raise ValueError(f"ids {tuple(ids.shape)} must share the leading shape of hidden {tuple(hidden.shape)}")
    vocab = vocab_size if vocab_size is not None else vocab_start + lm_head_weight.shape[0]
    if not 0 <= vocab_start <= vocab - lm_head_weight.shape[0]:
        raise ValueError(f"vocab_start {vocab_start} with {lm_head_weight.shape[0]} weight rows does not fit a "
                         f"vocabulary of {vocab}: allowed 0 <= vocab_start <= {vocab - lm_head_weight.shape[0]}")
    valid, safe_ids = support_ids(ids, valid, vocab)
    lead, width = ids.shape[:-1], ids.shape[-1]
    logp, _, sum_sq = _HiddenSupportLogSoftmax.apply(
        hidden.reshape(-1, hidden.shape[-1]), lm_head_weight, safe_ids.reshape(-1, width), float(temperature),
        int(chunk), int(vocab_start), all_reduce, bool(return_tail_sq))
    return support_outputs(logp.reshape(*lead, width), valid,
                           sum_sq.reshape(lead) if return_tail_sq else None)
