"""The rollout hook's parse cost: vLLM-shaped top-K log-probs parsed entry by entry and vectorised (imports no vLLM).

vLLM 0.24 reports a generated sequence's log-probs as a list, per token, of ``{token_id: Logprob}`` (``Logprob``: a
dataclass of ``logprob``, ``rank``, ``decoded_token``), built for each position from the sampled token first and
then the tokens of ranks 1..K (the sampled one once when it is among them), or, with flat log-probs on, as
``FlatLogprobs``: the same entries in flat lists. :func:`vllm_like_logprobs` builds both from random logits with
the same construction and classes of the same shape (vLLM itself needs a GPU machine); :func:`measure` times
:func:`~predmask.verl.records.parse_vllm_logprobs_per_entry` (before) against
:func:`~predmask.verl.records.parse_vllm_logprobs` (after) on the same objects, checks that their records are
equal, and reports the cost per generated token. Target: the flat form (what the rollout hook asks vLLM for)
parsed at least :data:`SPEEDUP_MIN` x cheaper than the dict form entry by entry (the original path).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from predmask.bench import target
from predmask.verl.records import TopKRecord, parse_vllm_logprobs, parse_vllm_logprobs_per_entry

#: the parse of the flat form must be at least this many times cheaper than the per-entry reference on dicts
SPEEDUP_MIN = 5.0
_FIELDS = ("token_ids", "logprobs", "topk_ids", "topk_logprobs", "topk_valid")


@dataclass
class LogprobLike:
    """The shape of vLLM 0.24's ``vllm.logprobs.Logprob``."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class FlatLogprobsLike:
    """The fields of vLLM 0.24's ``vllm.logprobs.FlatLogprobs`` that the parser reads (plus its length)."""

    start_indices: list[int] = field(default_factory=list)
    end_indices: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int | None] = field(default_factory=list)
    decoded_tokens: list[str | None] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.start_indices)


def vllm_like_logprobs(tokens: int, vocab: int, k: int, seed: int = 0
                       ) -> tuple[list[dict[int, LogprobLike]], FlatLogprobsLike, list[int]]:
    """One sequence of ``tokens`` sampled tokens with their log-probs in both of vLLM's forms, and the token ids."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((tokens, vocab)) * rng.uniform(1.0, 6.0, (tokens, 1))
    logp = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
    positions: list[dict[int, LogprobLike]] = []
    flat = FlatLogprobsLike()
    sampled_ids: list[int] = []
    for row in logp:
        sampled = int(rng.choice(vocab, p=np.exp(row) / np.exp(row).sum()))
        order = np.argsort(-row, kind="stable")
        rank = int(np.flatnonzero(order == sampled)[0]) + 1
        ids = [sampled, *order[:k].tolist()]
        lps = [float(row[i]) for i in ids]
        ranks = [rank, *range(1, k + 1)]
        decoded = [f"<{i}>" for i in ids]
        positions.append({i: LogprobLike(lp, r, d) for i, lp, r, d in zip(ids, lps, ranks, decoded, strict=True)})
        flat.start_indices.append(len(flat.logprobs))
        flat.token_ids += ids
        flat.logprobs += lps
        flat.ranks += ranks
        flat.decoded_tokens += decoded
        flat.end_indices.append(len(flat.logprobs))
        sampled_ids.append(sampled)
    return positions, flat, sampled_ids


def same_record(a: TopKRecord, b: TopKRecord) -> bool:
    """Every array of the two records equal (shape, dtype and values)."""
    return all(getattr(a, f).dtype == getattr(b, f).dtype and np.array_equal(getattr(a, f), getattr(b, f))
               for f in _FIELDS)


def _best_cpu_seconds(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Each function's least CPU time (``time.process_time``: robust to other processes on a shared machine) over
    ``repeats`` rounds; the functions take turns within a round."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.process_time()
            fn()
            best[name] = min(best[name], time.process_time() - start)
    return best


def measure(tokens: int = 2048, vocab: int = 32000, k: int = 20, repeats: int = 7, seed: int = 0) -> dict[str, Any]:
    """CPU microseconds per generated token of both parsers on both forms, their ratio, equality, and the target row."""
    positions, flat, ids = vllm_like_logprobs(tokens, vocab, k, seed)
    before = parse_vllm_logprobs_per_entry(positions, ids, k)
    equal = {"dict": same_record(before, parse_vllm_logprobs(positions, ids, k)),
             "flat": same_record(before, parse_vllm_logprobs(flat, ids, k))}
    seconds = _best_cpu_seconds({
        "before_dict": lambda: parse_vllm_logprobs_per_entry(positions, ids, k),
        "after_dict": lambda: parse_vllm_logprobs(positions, ids, k),
        "after_flat": lambda: parse_vllm_logprobs(flat, ids, k),
    }, repeats)
    us = {name: s / tokens * 1e6 for name, s in seconds.items()}
    speedup = us["before_dict"] / us["after_dict"]
    return {"tokens": tokens, "vocab": vocab, "k": k, "repeats": repeats, "us_per_token": us, "equal": equal,
            "speedup_dict": speedup, "speedup_flat": us["before_dict"] / us["after_flat"],
            "targets": [target(f"parse cost after (flat form) / before (dict form; >= {SPEEDUP_MIN:g}x cheaper)",
                               us["after_flat"] / us["before_dict"], 1.0 / SPEEDUP_MIN)]}
