"""predmask.verl.gather.hidden_support_logprobs, the logits processor's gather from hidden states: equal to the
logits path's chunked gather on one rank, and over two real gloo ranks each holding half of the lm_head rows; and
verl's real actor worker with its fused kernels on (the plugin gathering the support from the hidden states)
against the same worker with them off (the logits path): FSDP2 with a tied lm_head, FSDP1 with an untied one.

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


def check_same_update(ref: dict, fused: dict, min_params: int = 11) -> dict[str, float]:
    """Fused (hidden-states support) against the logits path, per micro-batch and on every gradient (``min_params``
    parameters at least: FSDP1 holds one flat parameter per unit); returns the largest differences."""
    assert ref["actor_cls"] == fused["actor_cls"] == "PredmaskTrainingWorker"
    assert len(ref["micro_batches"]) == len(fused["micro_batches"]) > 1
    gaps = {"pi": 0.0, "loss": 0.0, "grad": 0.0}
    for a, b in zip(ref["micro_batches"], fused["micro_batches"], strict=True):
        assert torch.equal(a["responses"], b["responses"]) and torch.equal(a["ids"], b["ids"])
        ok = a["pi"].isfinite()
        assert torch.equal(ok, b["pi"].isfinite()) and ok.any()
        torch.testing.assert_close(b["pi"][ok], a["pi"][ok], rtol=1e-5, atol=1e-5)
        mask = a["mask"]
        # every valid support slot at every response token (the invalid ones are -inf on both paths)
        assert torch.equal(ok[mask], a["valid"][mask]) and a["valid"][mask].any(-1).all()
        torch.testing.assert_close(b["tail"][mask], a["tail"][mask], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(b["log_prob"][mask], a["log_prob"][mask], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b["loss"], a["loss"], rtol=1e-5, atol=1e-6)
        gaps["pi"] = max(gaps["pi"], float((b["pi"][ok] - a["pi"][ok]).abs().max()))
        gaps["loss"] = max(gaps["loss"], float((b["loss"] - a["loss"]).abs()))
    assert ref["grads"].keys() == fused["grads"].keys() and len(ref["grads"]) >= min_params
    for name, grad in ref["grads"].items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(fused["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=name)
        gaps["grad"] = max(gaps["grad"], float((fused["grads"][name] - grad).abs().max()))
    return gaps


@pytest.mark.slow
@pytest.mark.verl
def test_fsdp1_untied_lm_head_with_fused_kernels_trains_as_the_logits_path(tmp_path) -> None:
    """FSDP1 (``actor.strategy=fsdp``, verl's default) and an untied lm_head: the same batch
    (predmask_kl_exact) through ActorRolloutRefWorker.update_actor with verl's fused kernels off, then on, over two
    ranks (Ulysses sequence parallel 2, data parallel 1), so FSDP1 shards every unit (FULL_SHARD; one rank would
    be NO_SHARD) and the lm_head weight is the root unit's, separate from the input embedding. At every response
    token of every micro-batch the support log-probs gathered from the hidden states and lm_head (fused) equal the
    logits path's, and so do verl's log-probs, the exact tail, the micro-batch losses and each rank's gradient shard
    of every FSDP1 flat parameter (float32).

    A stand-in beyond the module docstring's: FSDP1's refusal of CPU parameters under ``sync_module_states`` is
    dropped in the spawned processes (verl_cpu_worker.allow_fsdp1_on_cpu); the broadcast itself runs on gloo."""
    import torch.multiprocessing as mp
    from transformers import AutoModelForCausalLM
    from verl_helpers import require_verl

    require_verl("verl.plugin.platform")
    import verl_cpu_worker as cpu_worker

    model_dir = cpu_worker.save_tiny_qwen3(tmp_path / "model", tied=False)
    saved = AutoModelForCausalLM.from_pretrained(model_dir)
    head, embedding = saved.get_output_embeddings().weight, saved.get_input_embeddings().weight
    assert not saved.config.tie_word_embeddings and head.data_ptr() != embedding.data_ptr()
    assert not torch.allclose(head, embedding)  # a gather that read the input embedding would differ
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(cpu_worker.run_rank, nprocs=2, start_method="spawn", join=True,
                       args=(2, port, 2, (True,), str(model_dir), str(tmp_path), (False, True),
                             len(cpu_worker.PROMPT_LENS), "fsdp"))
    vocab, dim = embedding.shape
    root = 0
    for rank in range(2):
        ref, fused = (torch.load(tmp_path / f"rank{rank}-rmpad1{tag}.pt", weights_only=False) for tag in ("", "-fused"))
        for run in (ref, fused):
            assert run["module_cls"] == "FullyShardedDataParallel" and run["engine_cls"] == "FSDPEngineWithLMHead"
        # FSDP1 flat parameters: the root unit, then one per decoder layer; each rank holds half of each
        assert len(ref["grads"]) == 1 + cpu_worker.LAYERS
        root += ref["grads"]["_fsdp_wrapped_module._flat_param"].numel()
        gaps = check_same_update(ref, fused, min_params=1 + cpu_worker.LAYERS)
        print(f"FSDP1 rank {rank}: max |fused - logits| support {gaps['pi']:.2e}, loss {gaps['loss']:.2e}, "
              f"gradient {gaps['grad']:.2e}")
    # the root unit holds the input embedding, the untied lm_head and the final norm, sharded over the two ranks
    assert root == 2 * vocab * dim + dim
