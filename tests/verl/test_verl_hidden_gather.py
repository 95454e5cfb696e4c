"""predmask.verl.gather.hidden_support_logprobs, the logits processor's gather from hidden states: equal to the
logits path's chunked gather on one rank, and over two real gloo ranks each holding half of the lm_head rows."""

from __future__ import annotations

import socket

import pytest
import torch

from predmask.verl.gather import chunked_support_logprobs, hidden_support_logprobs


def case(seed: int, tokens: int = 9, dim: int = 6, vocab: int = 40, width: int = 5) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, dim, generator=g)
    weight = 1.5 * torch.randn(vocab, dim, generator=g)
    ids = torch.stack([torch.randperm(vocab, generator=g)[:width] for _ in range(tokens)])
    valid = torch.rand(tokens, width, generator=g) > 0.25
    valid[:, 0] = True
    return hidden, weight, ids, valid


def test_one_rank_equals_the_logits_path() -> None:
    hidden, weight, ids, valid = case(seed=1)
    ref, ref_tail = chunked_support_logprobs(hidden @ weight.T, ids, valid, temperature=0.8,
                                             return_tail_sq=True, chunk_rows=4)
    out, tail = hidden_support_logprobs(hidden, weight, ids, valid, temperature=0.8, return_tail_sq=True)
    assert not out.requires_grad and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tail, ref_tail, rtol=1e-5, atol=1e-6)
    alone, none = hidden_support_logprobs(hidden, weight, ids, valid, temperature=0.8)
    assert none is None and torch.equal(alone, out)


def _tp_worker(rank: int, world: int, port: int, path: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    hidden, weight, ids, valid = case(seed=2)
    shard = weight.shape[0] // world
    out, tail = hidden_support_logprobs(hidden, weight[rank * shard:(rank + 1) * shard], ids, valid,
                                        temperature=1.3, vocab_start=rank * shard, vocab_size=weight.shape[0],
                                        group=dist.group.WORLD, return_tail_sq=True)
    torch.save({"out": out, "tail": tail}, f"{path}.{rank}")
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_ranks_each_holding_half_the_vocabulary(tmp_path) -> None:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_tp_worker, args=(2, port, str(tmp_path / "tp")), nprocs=2, join=True)
    hidden, weight, ids, valid = case(seed=2)
    ref, ref_tail = chunked_support_logprobs(hidden @ weight.T, ids, valid, temperature=1.3, return_tail_sq=True)
    for rank in range(2):
        res = torch.load(tmp_path / f"tp.{rank}")
        torch.testing.assert_close(res["out"], ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(res["tail"], ref_tail, rtol=1e-5, atol=1e-6)
