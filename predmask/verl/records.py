"""vLLM's per-token top-K log-probs as one :class:`TopKRecord` per generated sequence (pure; imports no verl).

vLLM's ``CompletionOutput.logprobs`` is a list, per generated token, of ``{token_id: Logprob(logprob, rank,
decoded_token)}`` holding the K most likely tokens plus the sampled one (rank > K when outside the top-K).
:func:`parse_vllm_logprobs` turns it into a :class:`TopKRecord` (numpy arrays), the object the rollout hook puts
into ``TokenOutput.extra_fields[TOPK_KEY]`` and verl's agent loop carries to the actor in ``non_tensor_batch``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["TOPK_KEY", "TopKRecord", "parse_vllm_logprobs"]

#: non_tensor_batch / TensorDict key holding one TopKRecord per sample
TOPK_KEY = "predmask_topk"


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
