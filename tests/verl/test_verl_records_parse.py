"""The vectorised top-K parse against the per-entry reference on the same vLLM-shaped objects, and the ``parse``
benchmark as a real subprocess.

vLLM needs a GPU machine, so the objects are built the way vLLM 0.24 builds them (``append_logprobs_for_next_position``:
the sampled token first, then ranks 1..K) with classes of the same shape (``predmask.verl.records_bench``); the
edge cases (ranks missing, tied log-probs, fewer entries than K) are written by hand. Truth: the per-entry parser's
record, field by field (dtype and values), and its error messages.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from predmask.verl.records import parse_vllm_logprobs, parse_vllm_logprobs_per_entry
from predmask.verl.records_bench import FlatLogprobsLike, same_record, vllm_like_logprobs
from predmask.verl.records_bench import LogprobLike as L

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("tokens", "vocab", "k", "seed"), [(64, 50, 5, 0), (40, 12, 11, 1), (1, 30, 1, 2),
                                                           (0, 10, 3, 3)])
def test_both_forms_parse_to_the_reference_record(tokens: int, vocab: int, k: int, seed: int) -> None:
    positions, flat, ids = vllm_like_logprobs(tokens, vocab, k, seed)
    reference = parse_vllm_logprobs_per_entry(positions, ids, k)
    assert same_record(parse_vllm_logprobs(positions, ids, k), reference)
    assert same_record(parse_vllm_logprobs(flat, ids, k), reference)
    if tokens:  # the objects hold samples both inside and outside the top-K
        assert any(t in row for t, row in zip(ids, reference.topk_ids.tolist(), strict=True))


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_ranks_missing_tied_or_too_few_follow_the_reference(k: int) -> None:
    """No ranks (ordered by log-prob, then id), a tie in rank, fewer entries than k, -inf log-probs."""
    positions = [
        {4: L(-1.0), 2: L(-0.5), 9: L(-0.5)},
        {3: L(-2.0, 7), 1: L(-0.1, 1), 5: L(-0.3, 1)},
        {6: L(float("-inf"), 3), 0: L(-0.2, 1)},
        {8: L(-0.7, 2), 7: L(-0.4, 1), 2: L(-1.5, None)},
    ]
    ids = [4, 3, 6, 2]
    assert same_record(parse_vllm_logprobs(positions, ids, k), parse_vllm_logprobs_per_entry(positions, ids, k))


def _as_dicts(flat: FlatLogprobsLike) -> list[dict[int, L]]:
    """The flat lists as vLLM's dict form: an id listed twice at a position keeps its last entry."""
    return [{flat.token_ids[i]: L(flat.logprobs[i], flat.ranks[i]) for i in range(start, end)}
            for start, end in zip(flat.start_indices, flat.end_indices, strict=True)]


@pytest.mark.parametrize("change", ["none", "rank_none", "tied_rank", "short", "repeated_id", "offset"])
def test_flat_lists_outside_vllms_layout_follow_the_reference(change: str) -> None:
    """vLLM's flat layout (read by reshaping) and its departures (read by the general path) against the reference
    on the same entries as a dict: a rank None, the sampled token ranked within k yet not among ranks 1..k, a
    position with one entry fewer, an id repeated among the top-k, lists that start at an offset."""
    k = 4
    _, flat, ids = vllm_like_logprobs(12, 40, k, seed=5)
    outside = next(t for t, start in enumerate(flat.start_indices) if flat.ranks[start] > k)
    at = flat.start_indices[outside]
    if change == "rank_none":
        flat.ranks[at] = None
    elif change == "tied_rank":
        flat.ranks[at] = 2
    elif change == "short":
        for name in ("token_ids", "logprobs", "ranks", "decoded_tokens"):
            del getattr(flat, name)[at + k]
        flat.end_indices[outside:] = [e - 1 for e in flat.end_indices[outside:]]
        flat.start_indices[outside + 1:] = [s - 1 for s in flat.start_indices[outside + 1:]]
    elif change == "repeated_id":
        flat.token_ids[at + 2] = flat.token_ids[at + 1]
    elif change == "offset":
        for name in ("token_ids", "logprobs", "ranks", "decoded_tokens"):
            setattr(flat, name, getattr(flat, name)[:3] + getattr(flat, name))
        flat.start_indices = [s + 3 for s in flat.start_indices]
        flat.end_indices = [e + 3 for e in flat.end_indices]
    assert same_record(parse_vllm_logprobs(flat, ids, k), parse_vllm_logprobs_per_entry(_as_dicts(flat), ids, k))


@pytest.mark.parametrize(("positions", "ids", "message"), [
    ([{1: L(-0.1, 1)}, None], [1, 1], "no log-probs at position 1"),
    ([{1: L(float("nan"), 1)}], [1], "log-prob of token 1 at position 0 is nan"),
    ([{1: L(float("inf"), 1)}], [1], "is inf; allowed: finite or -inf"),
    ([{1: L(-0.1, 1)}, {2: L(-0.1, 1)}], [1, 3], "the sampled token 3 is missing from vLLM's log-probs at position 1"),
    ([{1: L(-0.1, 1)}], [1, 2], "log-probs for 1 positions but 2 tokens"),
])
def test_bad_input_gets_the_reference_message(positions, ids, message: str) -> None:
    for parse in (parse_vllm_logprobs, parse_vllm_logprobs_per_entry):
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            parse(positions, ids, 2)


def test_the_parse_benchmark_prints_both_costs_and_equal_records() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "benchmark.py"), "parse", "--tokens", "64",
                          "--vocab", "500", "--topk", "8", "--repeats", "2"],
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode in (0, 1), out.stderr  # 1: the speed target missed on a loaded machine, not an error
    assert "per entry (before)" in out.stdout and "vectorised (after)" in out.stdout
    assert "disagree" not in out.stdout
    lines = [line for line in out.stdout.splitlines() if "vectorised (after)" in line]
    assert len(lines) == 2 and all("True" in line for line in lines)
    assert np.isfinite(float(lines[0].split("│")[3]))
