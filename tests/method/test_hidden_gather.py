"""The support gather from hidden states (predmask.gather_support_logprobs_from_hidden) against the logits path
``gather_support_logprobs(hidden @ W.T, ...)`` in float64: values, the exact tail, gradients (``gradcheck`` on small
shapes, and autograd of the logits path), temperature != 1, invalid slots, chunks that do not divide the
vocabulary, and a vocabulary split over two ranks whose all-reduce is faked by two threads of this process (no
process group can be set up in a unit test; the two-rank gloo test of the logits path is in tests/verl)."""

from __future__ import annotations

import threading

import pytest
import torch

from predmask import gather_support_logprobs, gather_support_logprobs_from_hidden


def case(seed: int, tokens: int = 6, dim: int = 5, vocab: int = 23, width: int = 4,
         dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, ...]:
    """Hidden states, an lm_head weight, support ids (distinct per token) and validity with invalid slots."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, dim, generator=g, dtype=torch.float64).to(dtype)
    weight = (2.0 * torch.randn(vocab, dim, generator=g, dtype=torch.float64)).to(dtype)
    ids = torch.stack([torch.randperm(vocab, generator=g)[:width] for _ in range(tokens)])
    valid = torch.rand(tokens, width, generator=g) > 0.3
    valid[:, 0] = True
    valid[1] = False  # a token with no valid slot
    valid[1, 0] = True
    return hidden, weight, ids, valid


def logits_path(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor,
                temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    return gather_support_logprobs(hidden @ weight.T, ids, valid, temperature=temperature,  # type: ignore[return-value]
                                   return_tail_sq=True)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
@pytest.mark.parametrize("chunk", [1, 5, 23, 64])
def test_values_and_tail_equal_the_logits_path(temperature: float, chunk: int) -> None:
    hidden, weight, ids, valid = case(seed=int(10 * temperature) + chunk)
    ref, ref_tail = logits_path(hidden, weight, ids, valid, temperature)
    out, tail = gather_support_logprobs_from_hidden(hidden, weight, ids, valid, temperature=temperature,
                                                    return_tail_sq=True, chunk=chunk)
    assert torch.equal(torch.isinf(out), ~valid)
    torch.testing.assert_close(out[valid], ref[valid], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(tail, ref_tail, rtol=1e-10, atol=1e-13)
    alone = gather_support_logprobs_from_hidden(hidden, weight, ids, valid, temperature=temperature, chunk=chunk)
    torch.testing.assert_close(alone, out, rtol=0, atol=0)


def test_leading_dimensions_and_no_valid_mask() -> None:
    hidden, weight, ids, _ = case(seed=3, tokens=12)
    out = gather_support_logprobs_from_hidden(hidden.view(3, 4, -1), weight, ids.view(3, 4, -1), chunk=7)
    ref = torch.log_softmax(hidden @ weight.T, -1).gather(-1, ids)
    torch.testing.assert_close(out, ref.view(3, 4, -1), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_gradcheck_of_the_support_logprobs(temperature: float) -> None:
    hidden, weight, ids, valid = case(seed=5, tokens=4, dim=3, vocab=11, width=3)
    hidden.requires_grad_()
    weight.requires_grad_()

    def fn(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = gather_support_logprobs_from_hidden(h, w, ids, valid, temperature=temperature, chunk=4)
        return torch.where(valid, out, torch.zeros_like(out))  # finite differences of -inf are NaN

    assert torch.autograd.gradcheck(fn, (hidden, weight), eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 1.3])
def test_gradients_equal_the_logits_path_for_every_output(temperature: float) -> None:
    """The same weighted sum of the support log-probs and the tail, backward through both paths: the tail's
    gradient flows through the slots' squares on both."""
    hidden, weight, ids, valid = case(seed=7, tokens=8, vocab=31)
    g = torch.Generator().manual_seed(1)
    w_lp, w_tail = torch.randn(ids.shape, generator=g, dtype=torch.float64), torch.randn(8, generator=g,
                                                                                         dtype=torch.float64)
    grads = []
    for path in ("logits", "hidden"):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if path == "logits":
            lp, tail = logits_path(h, w, ids, valid, temperature)
        else:
            lp, tail = gather_support_logprobs_from_hidden(h, w, ids, valid, temperature=temperature,
                                                           return_tail_sq=True, chunk=6)
        loss = (torch.where(valid, lp, torch.zeros_like(lp)) * w_lp).sum() + (tail * w_tail).sum()
        grads.append(torch.autograd.grad(loss, (h, w)))
    for ref, got in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


def test_only_the_hidden_gradient_when_the_weight_is_frozen() -> None:
    hidden, weight, ids, valid = case(seed=8)
    h = hidden.clone().requires_grad_()
    lp = gather_support_logprobs_from_hidden(h, weight, ids, valid, chunk=4)
    (grad,) = torch.autograd.grad(torch.where(valid, lp, 0.0).sum(), h)
    h_ref = hidden.clone().requires_grad_()
    ref = gather_support_logprobs(h_ref @ weight.T, ids, valid)
    (expect,) = torch.autograd.grad(torch.where(valid, ref, 0.0).sum(), h_ref)
    torch.testing.assert_close(grad, expect, rtol=1e-10, atol=1e-12)


def test_bfloat16_inputs_match_the_logits_path_from_bfloat16_logits() -> None:
    """bf16 hidden states and weight: each chunk's logits are the lm_head's bf16 product, then float32, as the
    logits path's bf16 logits are; the log-probs agree to float32 rounding of the log-sum-exp."""
    hidden, weight, ids, valid = case(seed=9, tokens=16, dim=32, vocab=300, width=6, dtype=torch.bfloat16)
    ref, ref_tail = gather_support_logprobs(hidden @ weight.T, ids, valid, temperature=0.9, return_tail_sq=True)
    out, tail = gather_support_logprobs_from_hidden(hidden, weight, ids, valid, temperature=0.9,
                                                    return_tail_sq=True, chunk=64)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out[valid], ref[valid], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tail, ref_tail, rtol=1e-4, atol=1e-6)


class FakeGroup:
    """An all-reduce over ``world`` threads of this process: each rank deposits its tensor, all wait, each reads
    the reduction (max or sum, in rank order) into its own tensor in place."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=30)
        self.slots: list[torch.Tensor | None] = [None] * world
        self.calls: list[list[str]] = [[] for _ in range(world)]

    def reduce_for(self, rank: int):  # type: ignore[no-untyped-def]
        def all_reduce(t: torch.Tensor, op: str) -> None:
            self.calls[rank].append(op)
            self.slots[rank] = t.clone()
            self.barrier.wait()
            stacked = torch.stack([s for s in self.slots if s is not None])
            result = stacked.amax(0) if op == "max" else stacked.sum(0)
            self.barrier.wait()
            t.copy_(result)

        return all_reduce


@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_sharded_vocabulary_with_a_fake_all_reduce_equals_the_whole(temperature: float) -> None:
    hidden, weight, ids, valid = case(seed=11, tokens=7, vocab=29, width=5)
    bounds = [(0, 13), (13, 29)]  # uneven shards, ids of a token in both
    group = FakeGroup(len(bounds))
    g = torch.Generator().manual_seed(2)
    w_lp = torch.randn(ids.shape, generator=g, dtype=torch.float64)
    results: list[dict[str, torch.Tensor]] = [{} for _ in bounds]
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            start, stop = bounds[r]
            h, w = hidden.clone().requires_grad_(), weight[start:stop].clone().requires_grad_()
            lp, tail = gather_support_logprobs_from_hidden(
                h, w, ids, valid, temperature=temperature, return_tail_sq=True, chunk=4, vocab_start=start,
                vocab_size=29, all_reduce=group.reduce_for(r))
            grad_h, grad_w = torch.autograd.grad((torch.where(valid, lp, 0.0) * w_lp).sum(), (h, w))
            results[r].update(lp=lp.detach(), tail=tail, grad_h=grad_h, grad_w=grad_w)
        except BaseException as err:  # noqa: BLE001 - re-raised in the main thread
            errors.append(err)
            group.barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(bounds))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert group.calls[0] == ["max", "sum", "sum"]  # two forward, one backward
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref, ref_tail = logits_path(h, w, ids, valid, temperature)
    ref_gh, ref_gw = torch.autograd.grad((torch.where(valid, ref, 0.0) * w_lp).sum(), (h, w))
    for r, (start, stop) in enumerate(bounds):
        res = results[r]
        torch.testing.assert_close(res["lp"][valid], ref.detach()[valid], rtol=1e-12, atol=1e-12)
        assert torch.equal(torch.isinf(res["lp"]), ~valid)
        torch.testing.assert_close(res["tail"], ref_tail.detach(), rtol=1e-10, atol=1e-13)
        torch.testing.assert_close(res["grad_h"], ref_gh, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(res["grad_w"], ref_gw[start:stop], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"temperature": 0.0}, "temperature must be > 0, got 0.0"),
    ({"chunk": 0}, "chunk must be a positive number of vocabulary columns, got 0"),
    ({"vocab_start": 20, "vocab_size": 30},
     "vocab_start 20 with 23 weight rows does not fit a vocabulary of 30: allowed 0 <= vocab_start <= 7"),
])
def test_bad_arguments_name_the_value(kwargs: dict, message: str) -> None:
    hidden, weight, ids, valid = case(seed=12)
    with pytest.raises(ValueError) as err:
        gather_support_logprobs_from_hidden(hidden, weight, ids, valid, **kwargs)
    assert message in str(err.value)


def test_ids_outside_the_vocabulary_are_refused_on_valid_slots_only() -> None:
    hidden, weight, ids, valid = case(seed=13)
    bad = ids.clone()
    bad[0, 0] = 23
    with pytest.raises(ValueError, match=r"support ids must lie in \[0, 23\)"):
        gather_support_logprobs_from_hidden(hidden, weight, bad, valid)
    valid = valid.clone()
    valid[0, 0] = False
    valid[0, 1] = True
    assert gather_support_logprobs_from_hidden(hidden, weight, bad, valid)[0, 0] == float("-inf")
