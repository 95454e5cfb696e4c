"""predmask.verl.gather.hidden_support_logprobs, the logits processor's gather from hidden states: equal to the
logits path's chunked gather on one rank, and over two real gloo ranks each holding half of the lm_head rows; and
verl's real FSDP2 actor worker with its fused kernels on (the plugin gathering the support from the hidden states)
against the same worker with them off (the logits path).

Stand-ins for the worker test, because this machine has no GPU: verl's CPU platform (predmask.verl.cpu,
gloo), transformers' ``sdpa`` attention, verl's torch backend of the fused kernel (its default; the triton one
needs a GPU); one process, no Ray (tests/verl/verl_cpu_worker.py).
"""

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


@pytest.mark.slow
@pytest.mark.verl
@pytest.mark.parametrize("sp", [1, 2], ids=["one-process", "ulysses-sp2"])
def test_verl_worker_with_fused_kernels_trains_as_the_logits_path(tmp_path, sp: int) -> None:
    """The same batch (predmask_kl_exact: support and exact tail) through ActorRolloutRefWorker.update_actor with
    verl's fused kernels off, then on, one mini-batch holding the whole batch (both gradients at the same
    parameters), in one process and over two Ulysses ranks: per micro-batch the same support log-probs, tail and
    loss, and the same gradient on every parameter (float32: verl's fused kernel computes in float32)."""
    import torch.multiprocessing as mp
    from verl_helpers import require_verl

    require_verl("verl.plugin.platform")
    import verl_cpu_worker as cpu_worker

    # tied lm_head (as Qwen3-4B's): verl 0.9.1 shards an untied lm_head as its own FSDP2 unit, which its fused
    # forward then multiplies still sharded (verl's own fused path fails, predmask's hook or not)
    model_dir = cpu_worker.save_tiny_qwen3(tmp_path / "model", tied=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(cpu_worker.run_rank, nprocs=sp, start_method="spawn", join=True,
                       args=(sp, port, sp, (True,), str(model_dir), str(tmp_path), (False, True),
                             len(cpu_worker.PROMPT_LENS)))
    for rank in range(sp):
        ref, fused = (torch.load(tmp_path / f"rank{rank}-rmpad1{tag}.pt", weights_only=False) for tag in ("", "-fused"))
        check_same_update(ref, fused)


def check_same_update(ref: dict, fused: dict) -> None:
    assert ref["actor_cls"] == fused["actor_cls"] == "PredmaskTrainingWorker"
    assert len(ref["micro_batches"]) == len(fused["micro_batches"]) > 1
    for a, b in zip(ref["micro_batches"], fused["micro_batches"], strict=True):
        assert torch.equal(a["responses"], b["responses"])
        ok = a["pi"].isfinite()
        assert torch.equal(ok, b["pi"].isfinite()) and ok.any()
        torch.testing.assert_close(b["pi"][ok], a["pi"][ok], rtol=1e-5, atol=1e-5)
        mask = a["mask"]
        torch.testing.assert_close(b["tail"][mask], a["tail"][mask], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(b["log_prob"][mask], a["log_prob"][mask], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b["loss"], a["loss"], rtol=1e-5, atol=1e-6)
    assert ref["grads"].keys() == fused["grads"].keys() and len(ref["grads"]) > 10
    for name, grad in ref["grads"].items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(fused["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=name)
