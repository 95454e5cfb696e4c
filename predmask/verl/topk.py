"""Top-K plumbing for verl 0.9.x: vLLM's top-K log-probs travel from the rollout to the actor's policy loss.

verl 0.9.1 returns only the sampled token's log-prob from vLLM and hands its policy losses per-token tensors
only. This module (the one place that touches verl internals) closes the gap with three small hooks, each
installed lazily when its verl module is imported (see :mod:`predmask.verl`):

1. **Rollout** (``vLLMHttpServer.generate``, wrapped): when ``actor_rollout_ref.rollout.calculate_log_probs`` is an
   integer K >= 1, the request asks vLLM for ``logprobs=K``; the per-position output (the documented
   ``CompletionOutput.logprobs``: a list, per generated token, of ``{token_id: Logprob(logprob, rank,
   decoded_token)}``) is parsed into one :class:`TopKRecord` and put into ``TokenOutput.extra_fields``.
   verl's agent loop already copies ``extra_fields`` into the batch's ``non_tensor_batch`` (key
   :data:`TOPK_KEY`), and ``DataProto.to_tensordict`` ships it to the actor workers -- no change there.
   This is a monkeypatch: verl offers no hook for more than the sampled log-prob.
2. **Actor worker** (``ActorRolloutRefWorker.actor_worker_cls``, a class attribute verl provides for swapping the
   actor's TrainingWorker): our subclass wraps the loss in :class:`TopKPolicyLoss` and turns on verl's
   logits-processor path (the ``distillation_use_topk`` micro-batch flag that verl's top-K distillation uses) so
   the FSDP and Megatron engines call the loss with the temperature-scaled logits before the usual loss call.
3. **Loss** (:class:`TopKPolicyLoss`): as logits processor it gathers the training log-probs on the support
   (packed, shifted to the position that predicts each response token; TP-sharded vocab on Megatron); as loss it
   rebuilds the response-aligned support and the rollout anchor and calls verl's own ``ppo_loss`` inside
   :func:`predmask.verl.loss.rollout_support`, so verl's entropy/KL/aggregation/metrics stay verl's.

Everything else here is pure functions on tensors, tested on CPU.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import torch
from torch import Tensor

from predmask.methods import METHODS, Method
from predmask.support import TopKSupport, build_support, gather_support_logprobs
from predmask.verl.loss import RolloutSupport, rollout_support

__all__ = [
    "PI_KEY_PREFIX",
    "PI_TAIL_KEY",
    "TOPK_KEY",
    "TopKPolicyLoss",
    "TopKRecord",
    "chunked_support_logprobs",
    "install_actor",
    "install_rollout",
    "pack_response_tensor",
    "packed_response_index",
    "parse_vllm_logprobs",
    "records_to_padded",
    "sequence_lengths",
    "support_from_records",
    "topk_setting",
    "vocab_parallel_support_logprobs",
]

#: non_tensor_batch / TensorDict key holding one TopKRecord per sample
TOPK_KEY = "predmask_topk"
#: model_output keys written by the logits processor: one per support slot, plus the exact tail
PI_KEY_PREFIX = "predmask_pi_lp_"
PI_TAIL_KEY = "predmask_pi_tail_sq"
#: rows of logits processed at once when gathering (bounds the [rows, V] float32 temporaries)
DEFAULT_CHUNK_ROWS = 1024


# --------------------------------------------------------------------------------------------------------------
# Rollout side: vLLM output -> TopKRecord
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class TopKRecord:
    """The rollout's per-token top-K of one generated sequence (numpy; one opaque object per sample).

    token_ids [T] int32, logprobs [T] float32: the sampled tokens and their log-probs;
    topk_ids [T, K] int32, topk_logprobs [T, K] float32, topk_valid [T, K] bool: the K most likely tokens
    (fewer when the engine reported fewer; invalid slots hold id 0 and log-prob -inf).
    """

    token_ids: np.ndarray
    logprobs: np.ndarray
    topk_ids: np.ndarray
    topk_logprobs: np.ndarray
    topk_valid: np.ndarray

    @property
    def length(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def k(self) -> int:
        return int(self.topk_ids.shape[1])

    def truncated(self, length: int) -> TopKRecord:
        """The first ``length`` tokens."""
        return TopKRecord(
            self.token_ids[:length], self.logprobs[:length], self.topk_ids[:length],
            self.topk_logprobs[:length], self.topk_valid[:length],
        )


def topk_setting(calculate_log_probs: Any) -> int:
    """K from ``rollout.calculate_log_probs``: an int K >= 1 asks for the top-K; a bool (verl's meaning) -> 0."""
    if calculate_log_probs is None or isinstance(calculate_log_probs, bool):
        return 0
    if isinstance(calculate_log_probs, int | np.integer):
        k = int(calculate_log_probs)
        if k < 0:
            raise ValueError(f"rollout.calculate_log_probs must be a bool or an int K >= 1, got {k}")
        return k
    raise ValueError(
        f"rollout.calculate_log_probs must be a bool or an int K >= 1, got {calculate_log_probs!r}"
    )


def _entry_fields(token_id: Any, entry: Any) -> tuple[int, float, float]:
    logprob = getattr(entry, "logprob", entry)
    rank = getattr(entry, "rank", None)
    return int(token_id), float(logprob), math.inf if rank is None else float(rank)


def parse_vllm_logprobs(position_logprobs: Sequence[Mapping[int, Any]], token_ids: Sequence[int], k: int) -> TopKRecord:
    """Parse vLLM's per-position log-probs (``CompletionOutput.logprobs``) into a :class:`TopKRecord`.

    ``position_logprobs[t]`` maps token id -> ``Logprob(logprob, rank, decoded_token)`` for generated token t: the
    ``k`` most likely tokens plus the sampled one (rank > k when outside the top-k). Entries are ordered by
    (rank, -logprob, id); the first ``k`` form the top-K. The sampled token's log-prob is looked up by id.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    n = len(token_ids)
    if len(position_logprobs) != n:
        raise ValueError(f"vLLM returned log-probs for {len(position_logprobs)} positions but {n} tokens")
    ids = np.zeros((n, k), dtype=np.int32)
    lps = np.full((n, k), -np.inf, dtype=np.float32)
    valid = np.zeros((n, k), dtype=bool)
    sampled_lp = np.zeros(n, dtype=np.float32)
    for t, (token, entries) in enumerate(zip(token_ids, position_logprobs, strict=True)):
        if entries is None:
            raise ValueError(f"vLLM returned no log-probs at position {t}; request them with logprobs=K")
        fields = [_entry_fields(tid, e) for tid, e in entries.items()]
        for tid, lp, _ in fields:
            if math.isnan(lp) or lp == math.inf:
                raise ValueError(f"vLLM log-prob of token {tid} at position {t} is {lp}; allowed: finite or -inf")
        by_id = {tid: lp for tid, lp, _ in fields}
        if int(token) not in by_id:
            raise ValueError(f"the sampled token {int(token)} is missing from vLLM's log-probs at position {t}")
        sampled_lp[t] = by_id[int(token)]
        top = sorted(fields, key=lambda f: (f[2], -f[1], f[0]))[:k]
        m = len(top)
        ids[t, :m] = [f[0] for f in top]
        lps[t, :m] = [f[1] for f in top]
        valid[t, :m] = True
    return TopKRecord(np.asarray(token_ids, dtype=np.int32).reshape(n), sampled_lp, ids, lps, valid)


# --------------------------------------------------------------------------------------------------------------
# Batch side: records -> response-aligned support [B, L, K+1]
# --------------------------------------------------------------------------------------------------------------


def records_to_padded(records: Sequence[TopKRecord | None], length: int) -> dict[str, Tensor]:
    """Stack per-sample records into response-aligned tensors of width ``length`` (longer records truncated).

    Returns ``topk_ids`` long / ``topk_logprobs`` float / ``topk_valid`` bool [B, L, K], ``sampled_ids`` long /
    ``sampled_logprobs`` float [B, L], and ``present`` bool [B, L] (False past a record's end or for None).
    """
    ks = {r.k for r in records if r is not None}
    if len(ks) > 1:
        raise ValueError(f"top-K records of one batch have different K: {sorted(ks)}")
    k = ks.pop() if ks else 1
    b = len(records)
    ids = np.zeros((b, length, k), dtype=np.int64)
    lps = np.full((b, length, k), -np.inf, dtype=np.float32)
    valid = np.zeros((b, length, k), dtype=bool)
    sampled = np.zeros((b, length), dtype=np.int64)
    sampled_lp = np.zeros((b, length), dtype=np.float32)
    present = np.zeros((b, length), dtype=bool)
    for i, rec in enumerate(records):
        if rec is None:
            continue
        n = min(rec.length, length)
        ids[i, :n] = rec.topk_ids[:n]
        lps[i, :n] = rec.topk_logprobs[:n]
        valid[i, :n] = rec.topk_valid[:n]
        sampled[i, :n] = rec.token_ids[:n]
        sampled_lp[i, :n] = rec.logprobs[:n]
        present[i, :n] = True
    return {
        "topk_ids": torch.from_numpy(ids),
        "topk_logprobs": torch.from_numpy(lps),
        "topk_valid": torch.from_numpy(valid),
        "sampled_ids": torch.from_numpy(sampled),
        "sampled_logprobs": torch.from_numpy(sampled_lp),
        "present": torch.from_numpy(present),
    }


def support_from_records(
    records: Sequence[TopKRecord | None], responses: Tensor, response_mask: Tensor
) -> tuple[TopKSupport, Tensor]:
    """The rollout support [B, L, K+1] and the anchor ``log mu_k`` [B, L] for padded ``responses`` [B, L].

    Checks that every response token in ``response_mask`` has a record entry and that the recorded sampled token
    is the response token (single-turn rollouts; agent loops that insert tokens are not supported).
    """
    if len(records) != responses.shape[0]:
        raise ValueError(f"{len(records)} top-K records for a batch of {responses.shape[0]} responses")
    padded = records_to_padded(records, int(responses.shape[1]))
    mask = response_mask.bool().cpu()
    missing = mask & ~padded["present"]
    if bool(missing.any()):
        raise ValueError(
            f"{int(missing.sum())} response tokens have no rollout top-K; was the rollout run with "
            "actor_rollout_ref.rollout.calculate_log_probs=K through predmask.verl.launch?"
        )
    mismatch = mask & (padded["sampled_ids"] != responses.cpu().long())
    if bool(mismatch.any()):
        raise ValueError(
            f"rollout top-K records disagree with the response tokens on {int(mismatch.sum())} positions "
            "(multi-turn / tool agent loops are not supported by the top-K plumbing)"
        )
    present = padded["present"]
    support = build_support(
        padded["topk_ids"], padded["topk_logprobs"], padded["sampled_ids"], padded["sampled_logprobs"],
        topk_valid=padded["topk_valid"] & present.unsqueeze(-1),
    )
    device = responses.device
    support = TopKSupport(
        ids=support.ids.to(device), mu_logprobs=support.mu_logprobs.to(device),
        valid=support.valid.to(device), sampled_index=support.sampled_index.to(device),
    )
    return support, padded["sampled_logprobs"].to(device)


# --------------------------------------------------------------------------------------------------------------
# Alignment: response positions <-> verl's packed (no-padding) token stream
# --------------------------------------------------------------------------------------------------------------


def sequence_lengths(prompts: Tensor, responses: Tensor, attention_mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """Per-sample (prompt, response) token counts, computed as verl's ``no_padding_2_padding`` does."""
    if prompts.is_nested:
        return prompts.offsets().diff(), responses.offsets().diff()
    if attention_mask is None or attention_mask.is_nested:
        raise ValueError("padded prompts need the padded attention_mask to count tokens")
    width = prompts.shape[1]
    return attention_mask[:, :width].sum(dim=1), attention_mask[:, width:].sum(dim=1)


def packed_response_index(prompt_lens: Tensor, response_lens: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Where each response token's distribution sits in verl's packed stream (prompt+response per sample).

    Returns ``(rows, batch_idx, pos_idx)``, one entry per response token in sample order: token ``pos_idx`` of
    sample ``batch_idx`` is predicted by the logits at packed row ``rows`` = start of the sample + prompt length
    + pos_idx - 1 (the shift by one: row t predicts token t+1). Requires every prompt to be non-empty.
    """
    prompt_lens = prompt_lens.long().cpu()
    response_lens = response_lens.long().cpu()
    if bool((prompt_lens <= 0).any()):
        raise ValueError("every sample needs a non-empty prompt (the first response token is predicted by it)")
    seq_ends = (prompt_lens + response_lens).cumsum(0)
    batch_idx = torch.repeat_interleave(torch.arange(len(response_lens)), response_lens)
    starts = response_lens.cumsum(0) - response_lens
    pos_idx = torch.arange(int(response_lens.sum())) - torch.repeat_interleave(starts, response_lens)
    rows = (seq_ends - response_lens - 1)[batch_idx] + pos_idx
    return rows, batch_idx, pos_idx


def pack_response_tensor(values: Tensor, prompt_lens: Tensor, response_lens: Tensor, fill: float | bool = 0) -> Tensor:
    """Scatter response-aligned ``values`` [B, L, ...] into a packed [total_tokens, ...] tensor (rest = ``fill``)."""
    rows, batch_idx, pos_idx = packed_response_index(prompt_lens, response_lens)
    total = int((prompt_lens.long() + response_lens.long()).sum())
    out = torch.full((total, *values.shape[2:]), fill, dtype=values.dtype, device=values.device)
    out[rows.to(values.device)] = values[batch_idx.to(values.device), pos_idx.to(values.device)]
    return out


# --------------------------------------------------------------------------------------------------------------
# Gathering the training log-probs on the support
# --------------------------------------------------------------------------------------------------------------


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


AllReduce = Callable[[Tensor, str], None]


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


# --------------------------------------------------------------------------------------------------------------
# Actor side: the loss wrapper (logits processor + loss) and the worker subclass
# --------------------------------------------------------------------------------------------------------------


def _tu() -> ModuleType:
    from verl.utils import tensordict_utils

    return tensordict_utils


def _records_of(data: Any) -> list[TopKRecord | None]:
    records = _tu().get(data, TOPK_KEY, None)
    if records is None:
        raise ValueError(f"the micro-batch carries no {TOPK_KEY!r}")
    return list(records)


def _padded(t: Tensor, fill: float | bool = 0) -> Tensor:
    return t.to_padded_tensor(fill) if t.is_nested else t


def _policy_loss_mode(config: Any) -> str:
    policy_loss = getattr(config, "policy_loss", None)
    getter = getattr(policy_loss, "get", None)
    return str(getter("loss_mode", "vanilla")) if callable(getter) else "vanilla"


def _fp8_padding(config: Any) -> bool:
    engine = getattr(config, "megatron", None) or getattr(config, "engine", None)
    override = getattr(engine, "override_transformer_config", None) or {}
    return override.get("fp8", None) in ("e4m3", "hybrid")


class TopKPolicyLoss:
    """Wraps verl's ``ppo_loss`` partial: logits processor (support gather) and loss (support context).

    Called by verl's engines as ``loss(model_output=..., data=..., dp_group=...)`` and, when the micro-batch flag
    ``distillation_use_topk`` is set, first as ``loss(student_logits=..., data=..., [data_format=...])``.
    For losses that are not predmask methods it passes everything straight through.
    """

    def __init__(self, inner: Callable[..., Any], config: Any | None = None) -> None:
        self.inner = inner
        keywords = getattr(inner, "keywords", {}) or {}
        self.config = config if config is not None else keywords.get("config")
        if keywords.get("distillation_config") is not None:
            raise ValueError("predmask's top-K plumbing does not combine with verl's distillation loss")
        name = _policy_loss_mode(self.config)
        self.method: Method | None = METHODS.get(name)
        self.vocab_size: int | None = None
        if self.needs_logits and bool(getattr(self.config, "use_fused_kernels", False)):
            raise ValueError(
                f"policy loss {name!r} gathers log-probs from the logits: set "
                "actor_rollout_ref.model.use_fused_kernels=false"
            )

    @property
    def needs_logits(self) -> bool:
        return self.method is not None and self.method.needs_support

    @property
    def needs_tail(self) -> bool:
        return self.method is not None and self.method.tail == "exact"

    @property
    def strategy(self) -> str:
        return str(getattr(self.config, "strategy", "fsdp"))

    # -- logits processor -----------------------------------------------------------------------------------
    def _packed_support(self, data: Any) -> tuple[Tensor, Tensor]:
        """Support ids and validity [total_tokens, K+1] in verl's packed order (rows predicting each response token)."""
        records = _records_of(data)
        responses = _padded(data["responses"])
        response_mask = _padded(data["response_mask"])
        support, _ = support_from_records(records, responses, response_mask)
        attention_mask = data.get("attention_mask", None)
        prompt_lens, response_lens = sequence_lengths(data["prompts"], data["responses"], attention_mask)
        ids = pack_response_tensor(support.ids, prompt_lens, response_lens, fill=0)
        valid = pack_response_tensor(support.valid, prompt_lens, response_lens, fill=False)
        return ids, valid

    def _outputs(self, pi: Tensor, tail: Tensor | None, lead: torch.Size) -> dict[str, Tensor]:
        pi = torch.where(torch.isfinite(pi), pi, torch.zeros_like(pi))
        out = {f"{PI_KEY_PREFIX}{j}": pi[..., j].reshape(lead) for j in range(pi.shape[-1])}
        if tail is not None:
            out[PI_TAIL_KEY] = tail.reshape(lead)
        return out

    def support_logprobs(self, student_logits: Tensor, data: Any, data_format: str = "thd") -> dict[str, Tensor]:
        """Logits-processor call: per-slot training log-probs, shaped like ``student_logits.shape[:2]``."""
        if not self.needs_logits:
            return {}
        ids, valid = self._packed_support(data)
        ids, valid = ids.to(student_logits.device), valid.to(student_logits.device)
        if self.strategy == "megatron":
            return self._megatron_support(student_logits, data, ids, valid, data_format)
        return self._fsdp_support(student_logits, ids, valid)

    def _fsdp_support(self, logits: Tensor, ids: Tensor, valid: Tensor) -> dict[str, Tensor]:
        from verl.utils.ulysses import (
            get_ulysses_sequence_parallel_rank,
            get_ulysses_sequence_parallel_world_size,
        )

        sp = get_ulysses_sequence_parallel_world_size()
        if sp > 1:  # same pad-then-slice as verl's Ulysses inputs
            pad = (-ids.shape[0]) % sp
            if pad:
                ids = torch.cat([ids, ids.new_zeros((pad, ids.shape[1]))])
                valid = torch.cat([valid, valid.new_zeros((pad, valid.shape[1]))])
            part = ids.shape[0] // sp
            rank = get_ulysses_sequence_parallel_rank()
            ids, valid = ids[rank * part:(rank + 1) * part], valid[rank * part:(rank + 1) * part]
        rows = logits.reshape(-1, logits.shape[-1])
        if rows.shape[0] != ids.shape[0]:
            raise ValueError(
                f"top-K support has {ids.shape[0]} packed rows but the logits have {rows.shape[0]} "
                "(static padding such as engine pad_to_length is not supported)"
            )
        self.vocab_size = int(logits.shape[-1])
        pi, tail = chunked_support_logprobs(rows, ids, valid, return_tail_sq=self.needs_tail)
        return self._outputs(pi, tail, logits.shape[:2])

    def _megatron_support(self, logits: Tensor, data: Any, ids: Tensor, valid: Tensor, data_format: str) -> dict[str, Tensor]:
        from megatron.core import parallel_state as mpu
        from verl.models.mcore.util import preprocess_bshd_engine, preprocess_thd_engine

        offsets = data["input_ids"].offsets().to(ids.device)
        nested = [
            torch.nested.nested_tensor_from_jagged(t, offsets=offsets) for t in (ids, valid.to(torch.int8))
        ]
        tu = _tu()
        if data_format == "thd":
            kwargs = {"use_fp8_padding": _fp8_padding(self.config),
                      "local_cp_size": tu.get_non_tensor_data(data, "local_cp_size", None)}
            packed = [preprocess_thd_engine(t, pre_process=True, **kwargs)[0] for t in nested]
        else:
            kwargs = {"forced_max_seqlen": tu.get_non_tensor_data(data, "forced_max_seqlen", None)}
            packed = [preprocess_bshd_engine(t, pre_process=True, **kwargs)[0] for t in nested]
        ids_l, valid_l = (p if p.dim() == 3 else p.unsqueeze(0) for p in packed)
        if tuple(ids_l.shape[:2]) != tuple(logits.shape[:2]):
            raise ValueError(
                f"top-K support packs to {tuple(ids_l.shape[:2])} but the Megatron logits are "
                f"{tuple(logits.shape[:2])}"
            )
        v_local = int(logits.shape[-1])
        tp_rank = mpu.get_tensor_model_parallel_rank()
        self.vocab_size = v_local * mpu.get_tensor_model_parallel_world_size()
        pi, tail = vocab_parallel_support_logprobs(
            logits.reshape(-1, v_local), ids_l.reshape(-1, ids_l.shape[-1]),
            valid_l.reshape(-1, valid_l.shape[-1]).bool(), vocab_start=tp_rank * v_local,
            group=mpu.get_tensor_model_parallel_group(), return_tail_sq=self.needs_tail,
        )
        return self._outputs(pi, tail, logits.shape[:2])

    # -- loss -----------------------------------------------------------------------------------------------
    def rollout_batch(self, model_output: Mapping[str, Any], data: Any) -> RolloutSupport:
        """Response-aligned rollout support, anchor and training support log-probs for this micro-batch."""
        from verl.workers.utils.padding import no_padding_2_padding

        records = _records_of(data)
        responses = _padded(data["responses"])
        response_mask = _padded(data["response_mask"])
        support, anchor = support_from_records(records, responses, response_mask)
        if not self.needs_logits:
            return RolloutSupport(anchor_logprobs=anchor, vocab_size=self.vocab_size)
        width = support.ids.shape[-1]
        keys = [f"{PI_KEY_PREFIX}{j}" for j in range(width)]
        missing = [k for k in keys if k not in model_output]
        if missing:
            raise ValueError(
                f"model output lacks the support log-probs {missing[:2]}...: the engine did not call the "
                "top-K logits processor (is the predmask actor worker installed?)"
            )
        pi = torch.stack([no_padding_2_padding(model_output[k], data) for k in keys], dim=-1).float()
        pi = pi[:, : support.ids.shape[1]]
        pi = torch.where(support.valid, pi, torch.full_like(pi, float("-inf")))
        tail = None
        if PI_TAIL_KEY in model_output:
            tail = no_padding_2_padding(model_output[PI_TAIL_KEY], data).float()[:, : support.ids.shape[1]]
        return RolloutSupport(anchor_logprobs=anchor, support=support, pi_logprobs=pi, pi_tail_sq=tail,
                              vocab_size=self.vocab_size)

    def __call__(
        self, model_output: Mapping[str, Any] | None = None, data: Any = None, dp_group: Any = None,
        student_logits: Tensor | None = None, data_format: str = "thd",
    ) -> Any:
        if student_logits is not None:
            return self.support_logprobs(student_logits, data, data_format)
        if self.method is None or data is None or TOPK_KEY not in data:
            if self.needs_logits:
                raise ValueError(
                    f"policy loss {self.method.name!r} needs the rollout top-K (batch key {TOPK_KEY!r}): "  # type: ignore[union-attr]
                    "set actor_rollout_ref.rollout.calculate_log_probs=K"
                )
            return self.inner(model_output=model_output, data=data, dp_group=dp_group)
        with rollout_support(self.rollout_batch(model_output or {}, data)):
            return self.inner(model_output=model_output, data=data, dp_group=dp_group)


def make_training_worker_cls(base: type) -> type:
    """Subclass of verl's TrainingWorker that installs :class:`TopKPolicyLoss` and the logits-processor flag."""

    class PredmaskTrainingWorker(base):  # type: ignore[misc, valid-type]
        predmask_topk = True

        def set_loss_fn(self, loss_fn: Callable[..., Any]) -> None:
            if not isinstance(loss_fn, TopKPolicyLoss):
                loss_fn = TopKPolicyLoss(loss_fn)
            self.loss_fn = loss_fn

        def train_batch(self, data: Any) -> Any:
            loss_fn = self.loss_fn
            if isinstance(loss_fn, TopKPolicyLoss) and loss_fn.needs_logits and TOPK_KEY in data:
                _tu().assign_non_tensor(data, distillation_use_topk=True)
            return super().train_batch(data)

    PredmaskTrainingWorker.__qualname__ = PredmaskTrainingWorker.__name__ = f"Predmask{base.__name__}"
    return PredmaskTrainingWorker


def install_actor(engine_workers: ModuleType) -> None:
    """Make verl's ActorRolloutRefWorker build its actor with the predmask TrainingWorker (idempotent)."""
    worker = engine_workers.ActorRolloutRefWorker
    if getattr(worker.actor_worker_cls, "predmask_topk", False):
        return
    worker.actor_worker_cls = make_training_worker_cls(worker.actor_worker_cls)


# --------------------------------------------------------------------------------------------------------------
# Rollout hook: vLLMHttpServer.generate
# --------------------------------------------------------------------------------------------------------------


class _Pending:
    __slots__ = ("final", "k")

    def __init__(self, k: int) -> None:
        self.k = k
        self.final: Any = None


def _wrap_engine(server: Any) -> None:
    """Instance-level wrapper on the server's vLLM engine client: raise ``logprobs`` to K for our requests and keep
    the final RequestOutput."""
    engine = server.engine
    if getattr(engine, "_predmask_topk", False):
        return
    original = engine.generate

    def generate(*args: Any, **kwargs: Any) -> Any:
        pending = server._predmask_pending.get(kwargs.get("request_id"))
        params = kwargs.get("sampling_params")
        if pending is not None and params is not None and getattr(params, "logprobs", None) is not None:
            params.logprobs = max(int(params.logprobs), pending.k)
        stream = original(*args, **kwargs)
        if pending is None:
            return stream

        async def capture() -> Any:
            async for output in stream:
                pending.final = output
                yield output

        return capture()

    engine.generate = generate
    engine._predmask_topk = True


def install_rollout(vllm_async_server: ModuleType) -> None:
    """Wrap ``vLLMHttpServer.generate`` so that it returns the top-K record in ``extra_fields`` (idempotent)."""
    server_cls = vllm_async_server.vLLMHttpServer
    original = server_cls.generate
    if getattr(original, "_predmask_topk", False):
        return

    @functools.wraps(original)
    async def generate(self: Any, prompt_ids: Any, sampling_params: dict[str, Any], request_id: str, *args: Any,
                       **kwargs: Any) -> Any:
        k = topk_setting(getattr(self.config, "calculate_log_probs", None))
        if k < 1 or not sampling_params.get("logprobs"):
            return await original(self, prompt_ids, sampling_params, request_id, *args, **kwargs)
        if not hasattr(self, "_predmask_pending"):
            self._predmask_pending = {}
        _wrap_engine(self)
        pending = self._predmask_pending[request_id] = _Pending(k)
        try:
            output = await original(self, prompt_ids, sampling_params, request_id, *args, **kwargs)
        finally:
            self._predmask_pending.pop(request_id, None)
        final = pending.final
        if final is None or not getattr(final, "outputs", None) or not output.token_ids:
            return output
        completion = final.outputs[0]
        record = parse_vllm_logprobs(completion.logprobs, list(completion.token_ids), k)
        if list(record.token_ids) != list(output.token_ids):
            raise ValueError("vLLM's final output and verl's TokenOutput disagree on the generated tokens")
        output.extra_fields = {**output.extra_fields, TOPK_KEY: record}
        return output

    generate._predmask_topk = True  # type: ignore[attr-defined]
    server_cls.generate = generate
