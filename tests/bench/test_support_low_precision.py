"""The support log-softmax on low-precision (bf16) logits, computed in float32 row chunks: values, exact tail and
logits gradient against autograd of a plain ``torch.log_softmax`` + gather, across chunk boundaries; the float32
path stays the one whole-tensor expression."""

from __future__ import annotations

import pytest
import torch

from predmask import support
from predmask.support import gather_support_logprobs

VOCAB, WIDTH = 96, 7


def case(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits [2, 37, V] of mixed sharpness, support ids with invalid slots, and weights for the output."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(2, 37, VOCAB, generator=g) * (1 + 5 * torch.rand(2, 37, 1, generator=g))).to(dtype)
    ids = torch.rand(2, 37, VOCAB, generator=g).argsort(-1)[..., :WIDTH]  # distinct ids per row, as a support has
    valid = torch.rand(2, 37, WIDTH, generator=g) > 0.2
    weight = torch.randn(2, 37, WIDTH, generator=g)
    return logits, ids, valid, weight


def reference(logits: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor, temperature: float) -> torch.Tensor:
    lp = torch.log_softmax(logits.float() / temperature, -1).gather(-1, ids)
    return torch.where(valid, lp, torch.full_like(lp, float("-inf")))


def grad_of(fn, logits: torch.Tensor, valid: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    z = logits.clone().requires_grad_()
    out = fn(z)
    torch.where(valid, out * weight, torch.zeros_like(out)).sum().backward()
    return out.detach(), z.grad


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunks", [15, 1])  # 15: 74 rows in chunks of 5, the last one short; 1: one chunk
def test_bf16_values_tail_and_gradient_match_log_softmax(monkeypatch, temperature: float, chunks: int) -> None:
    monkeypatch.setattr(support, "LOW_PRECISION_CHUNKS", chunks)
    logits, ids, valid, weight = case(torch.bfloat16)
    ours, grad = grad_of(lambda z: gather_support_logprobs(z, ids, valid, temperature=temperature), logits, valid,
                         weight)
    ref, ref_grad = grad_of(lambda z: reference(z, ids, valid, temperature), logits, valid, weight)
    assert ours.dtype == torch.float32 and grad.dtype == torch.bfloat16
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(grad, ref_grad)  # bf16 tolerances: both are float32 rounded once to bf16
    _, tail = gather_support_logprobs(logits, ids, valid, temperature=temperature, return_tail_sq=True)
    p = torch.softmax(logits.double() / temperature, -1)
    expect = p.square().sum(-1) - torch.where(valid, p.gather(-1, ids).square(), 0.0).sum(-1)
    torch.testing.assert_close(tail.double(), expect, rtol=1e-4, atol=1e-6)  # a difference of O(1) sums in float32


def test_chunking_does_not_change_bf16_results(monkeypatch) -> None:
    logits, ids, valid, weight = case(torch.bfloat16, seed=1)
    fn = lambda z: gather_support_logprobs(z, ids, valid)
    monkeypatch.setattr(support, "LOW_PRECISION_CHUNKS", 25)  # chunks of 3 rows
    small, small_grad = grad_of(fn, logits, valid, weight)
    monkeypatch.setattr(support, "LOW_PRECISION_CHUNKS", 1)
    whole, whole_grad = grad_of(fn, logits, valid, weight)
    torch.testing.assert_close(small, whole, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(small_grad.float(), whole_grad.float(), rtol=0, atol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_float32_path_is_the_whole_tensor_expression(temperature: float) -> None:
    logits, ids, valid, weight = case(torch.float32)
    ours, grad = grad_of(lambda z: gather_support_logprobs(z, ids, valid, temperature=temperature), logits, valid,
                         weight)
    lse = torch.logsumexp(logits, -1, keepdim=True) if temperature == 1.0 else \
        torch.logsumexp(logits / temperature, -1, keepdim=True)
    expect = torch.where(valid, logits.gather(-1, ids) / temperature - lse, float("-inf"))
    assert torch.equal(ours, expect)
    _, ref_grad = grad_of(lambda z: reference(z, ids, valid, temperature), logits, valid, weight)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)
