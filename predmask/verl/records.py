"""vLLM's per-token top-K log-probs as one :class:`TopKRecord` per generated sequence (pure; imports no verl).

:func:`parse_vllm_logprobs` reads vLLM's ``CompletionOutput.logprobs`` (per token a ``{token_id: Logprob}`` of
the K most likely tokens plus the sampled one, or vLLM's ``FlatLogprobs``: the same entries in flat lists,
what the rollout hook asks for) in numpy, the whole sequence at once; :func:`parse_vllm_logprobs_per_entry`
reads it entry by entry, the reference it is checked and benchmarked against (``python scripts/benchmark.py
parse``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import chain, islice
from operator import methodcaller
from typing import Any

import numpy as np

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


def _positions(position_logprobs: Any, token_ids: Sequence[int], k: int) -> int:
    """The number of generated tokens, checked against ``k`` and the positions vLLM returned log-probs for."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    n = len(token_ids)
    if len(position_logprobs) != n:
        raise ValueError(f"vLLM returned log-probs for {len(position_logprobs)} positions but {n} tokens")
    return n


def parse_vllm_logprobs_per_entry(position_logprobs: Sequence[Mapping[int, Any]], token_ids: Sequence[int],
                                  k: int) -> TopKRecord:
    """Parse vLLM's per-position log-probs into a :class:`TopKRecord`, entry by entry (the reference of
    :func:`parse_vllm_logprobs`): per position the entries ordered by (rank, -logprob, id), the first ``k``
    the top-K (rank > k: outside it); the sampled token's log-prob looked up by id."""
    n = _positions(position_logprobs, token_ids, k)
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


_VALUES = methodcaller("values")
_FLAT_FIELDS = ("start_indices", "end_indices", "token_ids", "logprobs", "ranks")


def _flat_arrays(position_logprobs: Any, n: int, flat: bool) -> tuple[np.ndarray, ...]:
    """(position, id, log-prob, rank) of every entry, in vLLM's order (position by position); rank None -> inf."""
    if flat:  # vLLM's FlatLogprobs
        flat = position_logprobs
        starts = np.asarray(flat.start_indices, dtype=np.int64)
        counts = np.asarray(flat.end_indices, dtype=np.int64) - starts
        lo = int(starts[0]) if n else 0
        hi = lo + int(counts.sum())
        ids = np.asarray(flat.token_ids[lo:hi], dtype=np.int64)
        lps = np.asarray(flat.logprobs[lo:hi], dtype=np.float64)
        ranks = np.array(flat.ranks[lo:hi], dtype=np.float64)
    else:
        for t, entries in enumerate(position_logprobs):
            if entries is None:
                raise ValueError(f"vLLM returned no log-probs at position {t}; request them with logprobs=K")
        counts = np.fromiter(map(len, position_logprobs), dtype=np.int64, count=n)
        total = int(counts.sum())
        ids = np.fromiter(chain.from_iterable(position_logprobs), dtype=np.int64, count=total)
        values = list(chain.from_iterable(map(_VALUES, position_logprobs)))
        lps = np.array([e.logprob for e in values], dtype=np.float64).reshape(total)
        ranks = np.array([e.rank for e in values], dtype=np.float64).reshape(total)  # None -> nan
    ranks[np.isnan(ranks)] = np.inf  # rank None
    return np.repeat(np.arange(n), counts), ids, lps, ranks


def _pair_key(major: np.ndarray, minor: np.ndarray) -> np.ndarray:
    """One int64 sort key ordering by (major, minor) for non-negative integers."""
    return major * (int(minor.max(initial=0)) + 1) + minor


def _top_order(pos: np.ndarray, ids: np.ndarray, lps: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """The entries ordered by (position, rank, -logprob, id). vLLM's ranks are distinct integers within a position,
    so one integer sort usually decides; ties or missing ranks fall back to the full four-key sort."""
    if ranks.size and np.isfinite(ranks).all() and (ranks >= 0).all():
        key = _pair_key(pos, ranks.astype(np.int64))
        order = np.argsort(key, kind="stable")
        if not (key[order][1:] == key[order][:-1]).any():
            return order
    return np.lexsort((ids, -lps, ranks, pos))


def _vllm_flat_record(flat: Any, tokens: np.ndarray, k: int) -> TopKRecord | None:
    """The record of a ``FlatLogprobs`` in vLLM's own layout, read by reshaping its lists to [T, k + 1]: per
    position the sampled token, then ranks 1..k (distinct ids; the sampled one repeated among them or ranked below
    k). None when the lists differ from that layout or hold a bad log-prob (the general path decides them)."""
    n = tokens.size
    starts = np.asarray(flat.start_indices, dtype=np.int64)
    ends = np.asarray(flat.end_indices, dtype=np.int64)
    if n == 0 or (ends - starts != k + 1).any() or (starts[1:] != ends[:-1]).any():
        return None
    lo, hi = int(starts[0]), int(ends[-1])
    try:  # a rank None (or not a number) leaves the layout to the general path
        ids, lps, ranks = (np.fromiter(islice(values, lo, hi), dtype=dtype, count=hi - lo).reshape(n, k + 1)
                           for values, dtype in ((flat.token_ids, np.int64), (flat.logprobs, np.float64),
                                                 (flat.ranks, np.int64)))
    except (TypeError, ValueError, OverflowError):
        return None
    top_ids, top_lps = ids[:, 1:], lps[:, 1:]
    in_top = top_ids == tokens[:, None]
    found = in_top.any(axis=1)
    sorted_ids = np.sort(top_ids, axis=1)
    if not ((lps < np.inf).all() and (ranks[:, 1:] == np.arange(1, k + 1)).all() and (ids[:, 0] == tokens).all()
            and (sorted_ids[:, 1:] != sorted_ids[:, :-1]).all() and (found | ~(ranks[:, 0] <= k)).all()):
        return None
    sampled_lp = np.where(found, top_lps[np.arange(n), in_top.argmax(axis=1)], lps[:, 0]).astype(np.float32)
    return TopKRecord(tokens.astype(np.int32), sampled_lp, top_ids.astype(np.int32), top_lps.astype(np.float32),
                      np.ones((n, k), dtype=bool))


def parse_vllm_logprobs(position_logprobs: Sequence[Mapping[int, Any]] | Any, token_ids: Sequence[int],
                        k: int) -> TopKRecord:
    """Parse vLLM's per-position log-probs (a list of ``{id: Logprob}`` or vLLM's ``FlatLogprobs``) into the
    same :class:`TopKRecord` as :func:`parse_vllm_logprobs_per_entry` (an id listed twice at a position counts
    once)."""
    n = _positions(position_logprobs, token_ids, k)
    tokens = np.asarray(token_ids, dtype=np.int64).reshape(n)
    flat = all(hasattr(position_logprobs, f) for f in _FLAT_FIELDS)
    if flat and (record := _vllm_flat_record(position_logprobs, tokens, k)) is not None:
        return record
    pos, ids, lps, ranks = _flat_arrays(position_logprobs, n, flat)
    bad = np.flatnonzero(np.isnan(lps) | (lps == np.inf))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"vLLM log-prob of token {int(ids[i])} at position {int(pos[i])} is {float(lps[i])}; "
                         "allowed: finite or -inf")
    if flat:  # an id listed twice at one position (the sampled token in the top-K) counts once: keep the last
        order = np.argsort(_pair_key(pos, ids), kind="stable")
        last = np.ones(order.size, dtype=bool)
        last[:-1] = (pos[order][1:] != pos[order][:-1]) | (ids[order][1:] != ids[order][:-1])
        keep = np.sort(order[last])
        pos, ids, lps, ranks = pos[keep], ids[keep], lps[keep], ranks[keep]
    sampled = ids == tokens[pos]
    found = np.zeros(n, dtype=bool)
    found[pos[sampled]] = True
    if not found.all():
        t = int(np.flatnonzero(~found)[0])
        raise ValueError(f"the sampled token {int(tokens[t])} is missing from vLLM's log-probs at position {t}")
    sampled_lp = np.zeros(n, dtype=np.float32)
    sampled_lp[pos[sampled]] = lps[sampled]
    topk_ids = np.zeros((n, k), dtype=np.int32)
    topk_lps = np.full((n, k), -np.inf, dtype=np.float32)
    valid = np.zeros((n, k), dtype=bool)
    top = ranks <= k
    rows, slot = pos[top], ranks[top].astype(np.int64) - 1
    if (slot >= 0).all() and (ranks[top] == slot + 1).all():
        valid[rows, slot] = True  # vLLM's usual structure: ranks 1..k once each, so a rank is its slot
        if valid.all() and top.sum() == n * k:
            topk_ids[rows, slot] = ids[top]
            topk_lps[rows, slot] = lps[top]
            return TopKRecord(tokens.astype(np.int32), sampled_lp, topk_ids, topk_lps, valid)
        valid[:] = False
    order = _top_order(pos, ids, lps, ranks)
    pos, ids, lps = pos[order], ids[order], lps[order]
    first = np.searchsorted(pos, np.arange(n))
    slot = np.arange(pos.size) - first[pos]
    top = slot < k
    topk_ids[pos[top], slot[top]] = ids[top]
    topk_lps[pos[top], slot[top]] = lps[top]
    valid[pos[top], slot[top]] = True
    return TopKRecord(tokens.astype(np.int32), sampled_lp, topk_ids, topk_lps, valid)
