"""The training log-probs on the rollout support from [N, V] logits, in row chunks (pure torch; imports no verl).

Three sources: full-vocabulary logits (FSDP), vocab-sharded logits (Megatron tensor parallelism, with
``torch.distributed`` all-reduces) and, for verl's fused-kernel path, which builds no logits, the hidden
states and the lm_head weight.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from predmask.hidden_gather import AllReduce, gather_support_logprobs_from_hidden
from predmask.support import gather_support_logprobs

#: rows of logits processed at once when gathering (bounds the [rows, V] float32 temporaries)
DEFAULT_CHUNK_ROWS = 1024


@torch.no_grad()
def chunked_support_logprobs(
    logits: Tensor, ids: Tensor, valid: Tensor, *, temperature: float = 1.0, return_tail_sq: bool = False,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> tuple[Tensor, Tensor | None]:
    """``predmask.gather_support_logprobs`` over [N, V] logits in row chunks (no grad): (pi [N, S], tail [N])."""
    n = logits.shape[0]
    out = torch.empty(ids.shape, dtype=torch.float32, device=logits.device)
    tail = torch.empty(n, dtype=torch.float32, device=logits.device) if return_tail_sq else None
    for s in range(0, n, chunk_rows):
        e = min(s + chunk_rows, n)
        res = gather_support_logprobs(logits[s:e], ids[s:e], valid[s:e], temperature=temperature,
                                      return_tail_sq=return_tail_sq)
        if return_tail_sq:
            out[s:e], tail[s:e] = res[0].float(), res[1].float()  # type: ignore[index]
        else:
            out[s:e] = res.float()  # type: ignore[union-attr]
    return out, tail


def _torch_all_reduce(group: Any) -> AllReduce:
    def reduce(t: Tensor, op: str) -> None:
        if group is None:
            return
        dist = torch.distributed
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)

    return reduce


@torch.no_grad()
def vocab_parallel_support_logprobs(
    local_logits: Tensor, ids: Tensor, valid: Tensor, *, vocab_start: int, group: Any = None,
    return_tail_sq: bool = False, chunk_rows: int = DEFAULT_CHUNK_ROWS, all_reduce: AllReduce | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Support log-probs from vocab-sharded logits (Megatron TP): each rank holds columns
    ``[vocab_start, vocab_start + V_local)`` and global ``ids``; results are identical on every rank.

    The same quantity as ``predmask.gather_support_logprobs`` on the full logits, computed from shard-local sums
    and three all-reduces (max, sum of exp, gathered logits; a fourth for the exact tail).
    """
    reduce = all_reduce or _torch_all_reduce(group)
    n, v_local = local_logits.shape
    out = torch.empty(ids.shape, dtype=torch.float32, device=local_logits.device)
    tail = torch.empty(n, dtype=torch.float32, device=local_logits.device) if return_tail_sq else None
    for s in range(0, n, chunk_rows):
        e = min(s + chunk_rows, n)
        z = local_logits[s:e].float()
        m = z.max(dim=-1).values
        reduce(m, "max")
        shifted = z - m.unsqueeze(-1)
        sum_exp = shifted.exp().sum(-1)
        reduce(sum_exp, "sum")
        lse = m + sum_exp.log()
        local_ids = ids[s:e] - vocab_start
        mine = valid[s:e] & (local_ids >= 0) & (local_ids < v_local)
        picked = z.gather(-1, local_ids.clamp(0, v_local - 1)) * mine
        reduce(picked, "sum")
        lp = torch.where(valid[s:e], picked - lse.unsqueeze(-1), torch.full_like(picked, float("-inf")))
        out[s:e] = lp
        if tail is not None:
            sum_sq = (2.0 * shifted).exp().sum(-1)
            reduce(sum_sq, "sum")
            total_sq = sum_sq / sum_exp.square()
            support_sq = torch.where(valid[s:e], (2.0 * lp).exp(), torch.zeros_like(lp)).sum(-1)
            tail[s:e] = (total_sq - support_sq).clamp_min(0.0)
    return out, tail


@torch.no_grad()
def hidden_support_logprobs(
    hidden: Tensor, lm_head_weight: Tensor, ids: Tensor, valid: Tensor, *, temperature: float = 1.0,
    vocab_start: int = 0, vocab_size: int | None = None, group: Any = None, return_tail_sq: bool = False,
    all_reduce: AllReduce | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``predmask.gather_support_logprobs_from_hidden`` without grad, as the logits processor's (pi [N, S], tail
    [N]) in float32: hidden [N, D], this rank's lm_head rows from ``vocab_start`` (all of them: ``group`` None),
    the shards reduced over ``group`` (``torch.distributed``) or with ``all_reduce``."""
    sharded = group is not None or all_reduce is not None
    res = gather_support_logprobs_from_hidden(
        hidden, lm_head_weight, ids, valid, temperature=temperature, return_tail_sq=return_tail_sq,
        vocab_start=vocab_start, vocab_size=vocab_size,
        all_reduce=(all_reduce or _torch_all_reduce(group)) if sharded else None)
    if return_tail_sq:
        return res[0].float(), res[1].float()  # type: ignore[index]
    return res.float(), None  # type: ignore[union-attr]
