"""The verl-free top-K functions: vLLM output parsing, records -> support, the packed layout, the support gather.

Nothing here imports verl (or ray, tensordict, vLLM): ``test_verl_free.py`` runs this file again in a process where
those imports fail. Truth is independent of the code under test: full distributions (parsing), the packed token
stream built by concatenation (layout), ``torch.log_softmax`` on the full logits (gather), real
``torch.distributed`` all-reduces over two gloo ranks (vocab-parallel gather). vLLM's ``Logprob`` entries are
mocked with its documented structure (vLLM cannot be installed on the CPU machines; scripts/gpu_check.py parses
real vLLM output on a GPU).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from verl_helpers import MockLogprob, padded_batch, vllm_position

from predmask.verl.gather import chunked_support_logprobs, vocab_parallel_support_logprobs
from predmask.verl.packing import (
    pack_response_tensor,
    packed_response_index,
    records_to_padded,
    sequence_lengths,
    support_from_records,
)
from predmask.verl.records import TopKRecord, parse_vllm_logprobs

pytestmark = pytest.mark.verl


# --------------------------------------------------------------------------------------------------------------
# vLLM output parsing (mock Logprob objects: the documented CompletionOutput.logprobs structure)
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("seed", range(4))
def test_parse_recovers_topk_of_the_full_distribution(k: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    vocab, length = 30, 12
    mu = torch.log_softmax(torch.randn(length, vocab, generator=g) * 2.5, -1)
    sampled = torch.distributions.Categorical(logits=mu).sample().tolist()
    sampled[0] = int(mu[0].argmin())  # at least one token far outside the top-k
    positions = [vllm_position(mu[t], sampled[t], k) for t in range(length)]
    rec = parse_vllm_logprobs(positions, sampled, k)
    expect = mu.topk(k, -1)
    assert np.array_equal(rec.topk_ids, expect.indices.numpy())
    np.testing.assert_allclose(rec.topk_logprobs, expect.values.numpy(), rtol=0, atol=1e-6)
    assert rec.topk_valid.all()
    np.testing.assert_allclose(rec.logprobs, mu.gather(-1, torch.tensor(sampled)[:, None])[:, 0].numpy(), atol=1e-6)
    support, anchor = support_from_records([rec], torch.tensor([sampled]), torch.ones(1, length))
    # every valid slot carries mu at its id; the sampled token always has a valid slot
    assert torch.allclose(torch.where(support.valid[0], support.mu_logprobs[0], 0.0),
                          torch.where(support.valid[0], mu.gather(-1, support.ids[0]), 0.0), atol=1e-6)
    assert torch.equal(support.ids[0].gather(-1, support.sampled_index[0][:, None])[:, 0], torch.tensor(sampled))
    in_topk = torch.tensor([s in set(expect.indices[t].tolist()) for t, s in enumerate(sampled)])
    assert torch.equal(support.valid[0, :, k], ~in_topk)  # the extra slot is used exactly when needed
    assert torch.allclose(anchor[0], torch.from_numpy(rec.logprobs))


def test_parse_pads_positions_with_fewer_than_k_entries_and_keeps_minus_inf() -> None:
    positions = [
        {5: MockLogprob(-0.1, 1), 2: MockLogprob(-2.5, 2)},
        {7: MockLogprob(float("-inf"), 3), 1: MockLogprob(-0.2, 1), 3: MockLogprob(-1.9, 2)},
    ]
    rec = parse_vllm_logprobs(positions, [5, 7], 3)
    assert rec.topk_valid.tolist() == [[True, True, False], [True, True, True]]
    assert rec.topk_ids.tolist() == [[5, 2, 0], [1, 3, 7]]
    assert rec.logprobs[1] == -math.inf and rec.topk_logprobs[0, 2] == -math.inf


def test_parse_orders_by_logprob_when_ranks_are_missing() -> None:
    positions = [{4: MockLogprob(-3.0), 9: MockLogprob(-0.5), 1: MockLogprob(-1.0)}]
    rec = parse_vllm_logprobs(positions, [4], 2)
    assert rec.topk_ids.tolist() == [[9, 1]]


@pytest.mark.parametrize(
    ("positions", "tokens", "match"),
    [
        ([{1: MockLogprob(-0.1, 1)}], [2], "sampled token 2 is missing"),
        ([{1: MockLogprob(float("nan"), 1)}], [1], "NaN|nan"),
        ([{1: MockLogprob(-0.1, 1)}], [1, 1], "positions"),
        ([None], [1], "no log-probs"),
    ],
)
def test_parse_rejects_bad_vllm_output(positions, tokens, match) -> None:
    with pytest.raises(ValueError, match=match):
        parse_vllm_logprobs(positions, tokens, 2)


# --------------------------------------------------------------------------------------------------------------
# Records -> response-aligned support
# --------------------------------------------------------------------------------------------------------------


def record(tokens: list[int], k: int = 2, seed: int = 0) -> TopKRecord:
    g = torch.Generator().manual_seed(seed)
    n = len(tokens)
    lp = torch.log_softmax(torch.randn(n, 16, generator=g), -1)
    top = lp.topk(k, -1)
    sampled_lp = lp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]
    return TopKRecord(np.array(tokens, np.int32), sampled_lp.numpy(), top.indices.numpy().astype(np.int32),
                      top.values.numpy(), np.ones((n, k), bool))


def test_records_to_padded_pads_truncates_and_marks_presence() -> None:
    padded = records_to_padded([record([3, 4, 5]), None, record([6, 7, 8, 9, 10])], 4)
    assert padded["present"].tolist() == [[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]]
    assert padded["sampled_ids"][2].tolist() == [6, 7, 8, 9]
    assert padded["topk_ids"].shape == (3, 4, 2) and not padded["topk_valid"][0, 3].any()
    with pytest.raises(ValueError, match="different K"):
        records_to_padded([record([1], k=2), record([1], k=3)], 2)


def test_support_from_records_checks_alignment_with_the_responses() -> None:
    responses = torch.tensor([[3, 4, 5, 0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    support, anchor = support_from_records([record([3, 4, 5])], responses, mask)
    assert support.ids.shape == (1, 4, 3) and anchor.shape == (1, 4)
    with pytest.raises(ValueError, match="disagree"):
        support_from_records([record([3, 9, 5])], responses, mask)
    with pytest.raises(ValueError, match="no rollout top-K"):
        support_from_records([record([3, 4])], responses, mask)
    with pytest.raises(ValueError, match="records for a batch"):
        support_from_records([record([3]), record([3])], responses, mask)


# --------------------------------------------------------------------------------------------------------------
# The packed layout, against the packed token stream built by concatenation
# --------------------------------------------------------------------------------------------------------------


def packed_stream(prompts: torch.Tensor, responses: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
    """verl's no-padding stream: each sample's real prompt tokens, then its real response tokens, concatenated."""
    width_p = prompts.shape[1]
    parts = []
    for b in range(prompts.shape[0]):
        parts += [prompts[b][attention[b, :width_p].bool()], responses[b][attention[b, width_p:].bool()]]
    return torch.cat(parts)


@pytest.mark.parametrize(("plens", "rlens"), [([3, 1, 5], [4, 6, 1]), ([2], [2]), ([1, 1], [0, 3])])
def test_packed_index_points_at_the_row_before_each_response_token(plens, rlens) -> None:
    prompts, responses, attention = padded_batch(plens, rlens, 5, 6)
    stream = packed_stream(prompts, responses, attention)
    p_lens, r_lens = sequence_lengths(prompts, responses, attention)
    assert p_lens.tolist() == plens and r_lens.tolist() == rlens
    rows, bidx, pidx = packed_response_index(p_lens, r_lens)
    assert len(rows) == sum(rlens)
    # row t predicts token t + 1: the next token of the stream is the response token
    assert torch.equal(stream[rows + 1], responses[bidx, pidx])
    # and that row lies inside the same sample, at or after its last prompt token
    starts = torch.tensor([0, *np.cumsum([p + r for p, r in zip(plens, rlens, strict=True)])[:-1]])
    assert torch.all(rows >= starts[bidx] + torch.tensor(plens)[bidx] - 1)
    # scattering response-aligned values lands them on those rows; every other row keeps the fill
    x = torch.randn(len(plens), 6, 3)
    packed = pack_response_tensor(x, p_lens, r_lens, fill=-7.0)
    assert packed.shape == (len(stream), 3) and torch.equal(packed[rows], x[bidx, pidx])
    others = torch.ones(len(stream), dtype=torch.bool)
    others[rows] = False
    assert torch.all(packed[others] == -7.0)


def test_sequence_lengths_of_nested_tensors_and_missing_mask() -> None:
    prompts = torch.nested.nested_tensor_from_jagged(torch.arange(6), offsets=torch.tensor([0, 2, 6]))
    responses = torch.nested.nested_tensor_from_jagged(torch.arange(5), offsets=torch.tensor([0, 4, 5]))
    p_lens, r_lens = sequence_lengths(prompts, responses, None)
    assert p_lens.tolist() == [2, 4] and r_lens.tolist() == [4, 1]
    with pytest.raises(ValueError, match="attention_mask"):
        sequence_lengths(torch.zeros(2, 3), torch.zeros(2, 2), None)


def test_packed_index_rejects_empty_prompts() -> None:
    with pytest.raises(ValueError, match="non-empty prompt"):
        packed_response_index(torch.tensor([0, 2]), torch.tensor([1, 1]))


# --------------------------------------------------------------------------------------------------------------
# The gather: chunked, vocab-parallel (reference: torch.log_softmax on the full logits)
# --------------------------------------------------------------------------------------------------------------


def reference(logits: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor, temperature: float = 1.0):
    """log_softmax(logits / T) at the support ids (-inf off the valid slots) and the squared mass off the support."""
    lp = torch.log_softmax(logits.double() / temperature, -1)
    picked = lp.gather(-1, ids)
    on_support = torch.where(valid, picked, torch.full_like(picked, float("-inf")))
    tail_sq = (lp.exp() ** 2).sum(-1) - torch.where(valid, picked.exp() ** 2, torch.zeros_like(picked)).sum(-1)
    return on_support.float(), tail_sq.clamp_min(0).float()


def gather_case(seed: int = 0, n: int = 23, vocab: int = 37, width: int = 5):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g) * 3
    ids = torch.stack([torch.randperm(vocab, generator=g)[:width] for _ in range(n)])
    valid = torch.rand(n, width, generator=g) > 0.2
    return logits, ids, valid


@pytest.mark.parametrize(("temperature", "chunk_rows"), [(1.0, 1024), (0.7, 5), (1.3, 1)])
def test_chunked_gather_equals_log_softmax(temperature: float, chunk_rows: int) -> None:
    logits, ids, valid = gather_case()
    ref, ref_tail = reference(logits, ids, valid, temperature)
    out, tail = chunked_support_logprobs(logits, ids, valid, temperature=temperature, return_tail_sq=True,
                                         chunk_rows=chunk_rows)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tail, ref_tail, rtol=1e-5, atol=1e-6)
    out_only, none = chunked_support_logprobs(logits, ids, valid, temperature=temperature, chunk_rows=chunk_rows)
    assert none is None and torch.equal(out_only, out)


def test_vocab_parallel_gather_on_one_rank_equals_log_softmax() -> None:
    logits, ids, valid = gather_case(seed=1)
    ref, ref_tail = reference(logits, ids, valid)
    out, tail = vocab_parallel_support_logprobs(logits, ids, valid, vocab_start=0, return_tail_sq=True, chunk_rows=7)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tail, ref_tail, rtol=1e-5, atol=1e-6)


def _tp_worker(rank: int, world: int, port: int, path: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    logits, ids, valid = gather_case(seed=2, vocab=36)
    shard = logits.shape[1] // world
    out, tail = vocab_parallel_support_logprobs(logits[:, rank * shard:(rank + 1) * shard], ids, valid,
                                                vocab_start=rank * shard, group=dist.group.WORLD, return_tail_sq=True)
    torch.save({"out": out, "tail": tail}, f"{path}.{rank}")
    dist.destroy_process_group()


@pytest.mark.slow
def test_vocab_parallel_gather_over_two_gloo_ranks(tmp_path) -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_tp_worker, args=(2, port, str(tmp_path / "tp")), nprocs=2, join=True)
    logits, ids, valid = gather_case(seed=2, vocab=36)
    ref, ref_tail = reference(logits, ids, valid)
    for rank in range(2):
        res = torch.load(tmp_path / f"tp.{rank}")
        torch.testing.assert_close(res["out"], ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(res["tail"], ref_tail, rtol=1e-5, atol=1e-6)
