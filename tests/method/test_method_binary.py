"""Appendix C as decisions: predmask_binary_kl drops exactly dppo_binary_kl's tokens when r is anchored on mu.

On the binary support S = {k} the predictive direction A·Ḋ has the sign of A·(π_k − μ_k) (math.md §3.1), which is
the sign of A·(r − 1) when r = π_k / μ_k. The per-token decisions are read from outside the loss: with token-sum
aggregation the gradient of the loss with respect to log π_k is −A·min(r, c)·keep, so a response token with A ≠ 0
is dropped exactly where that gradient is 0. The reference decision is computed from the full distributions
(softmax of the logits, the rollout's distribution) without predmask code.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import predmask as pm
from predmask import metrics as M

DTYPE = torch.float64
RATIO_CAP = 10.0


@dataclass(frozen=True)
class Batch:
    """Random tokens: training logits [B, R, V], the rollout's full log-probs, its top-K support, advantages, mask."""

    logits: torch.Tensor
    mu_lp_full: torch.Tensor
    sampled: torch.Tensor
    support: pm.TopKSupport
    adv: torch.Tensor
    mask: torch.Tensor


def make_batch(seed: int, bs: int, length: int, vocab: int, k: int, shift: float) -> Batch:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(bs, length, vocab, generator=g, dtype=DTYPE) * 1.5
    mu_lp_full = torch.log_softmax(logits + shift * torch.randn(logits.shape, generator=g, dtype=DTYPE), -1)
    sampled = torch.multinomial(mu_lp_full.exp().reshape(-1, vocab), 1, generator=g).reshape(bs, length)
    top = mu_lp_full.topk(k, -1)
    support = pm.build_support(top.indices, top.values, sampled, mu_lp_full.gather(-1, sampled[..., None])[..., 0])
    adv = torch.randn(bs, length, generator=g, dtype=DTYPE)
    adv[torch.rand(bs, length, generator=g) < 0.2] = 0.0
    mask = torch.rand(bs, length, generator=g) < 0.85
    return Batch(logits, mu_lp_full, sampled, support, adv, mask)


@dataclass(frozen=True)
class Outcome:
    loss: torch.Tensor
    grad_logits: torch.Tensor
    dropped: torch.Tensor
    metrics: dict[str, float]


def run(name: str, b: Batch, delta: float, anchor_logprob: torch.Tensor | None = None) -> Outcome:
    """The method's loss on ``b``, its gradient on the logits, and the tokens it dropped (read from the gradient
    of log π_k). ``anchor_logprob`` None anchors r on the rollout's μ_k, else on the given log-probs."""
    z = b.logits.clone().requires_grad_()
    pi_lp = pm.gather_support_logprobs(z, b.support.ids, b.support.valid)
    log_prob = b.support.sampled_logprob(pi_lp)
    anchor = b.support.sampled_logprob(b.support.mu_logprobs) if anchor_logprob is None else anchor_logprob
    loss, metrics = pm.policy_loss(
        name, log_prob=log_prob, old_log_prob=anchor, advantages=b.adv, response_mask=b.mask,
        mu_logprobs=b.support.mu_logprobs, pi_logprobs=pi_lp, valid=b.support.valid,
        sampled_index=b.support.sampled_index, delta=delta, ratio_cap=RATIO_CAP, loss_agg_mode="token-sum",
    )
    grad_logits, grad_log_prob = torch.autograd.grad(loss, (z, log_prob))
    dropped = b.mask & (b.adv != 0) & (grad_log_prob == 0)
    return Outcome(loss.detach(), grad_logits, dropped, metrics)


def reference_drop(b: Batch, delta: float) -> torch.Tensor:
    """Binary KL(μ_k‖π_k) > δ and A·(π_k − μ_k) > 0, from the full distributions (no predmask code)."""
    pi_k = torch.softmax(b.logits, -1).gather(-1, b.sampled[..., None])[..., 0]
    mu_k = b.mu_lp_full.exp().gather(-1, b.sampled[..., None])[..., 0]
    d = mu_k * torch.log(mu_k / pi_k) + (1 - mu_k) * torch.log((1 - mu_k) / (1 - pi_k))
    return b.mask & (d > delta) & (b.adv * (pi_k - mu_k) > 0)


batches = st.builds(
    make_batch,
    seed=st.integers(0, 2**31 - 1),
    bs=st.integers(1, 4),
    length=st.integers(1, 8),
    vocab=st.integers(8, 40),
    k=st.integers(1, 5),
    shift=st.floats(0.05, 2.0),
)


@settings(max_examples=150, deadline=None)
@given(b=batches, delta=st.floats(1e-3, 1.0))
def test_predictive_binary_kl_decides_as_dppo_binary_kl_when_anchored_on_mu(b: Batch, delta: float) -> None:
    ours = run("predmask_binary_kl", b, delta)
    dppo = run("dppo_binary_kl", b, delta)
    assert torch.equal(ours.dropped, dppo.dropped)
    assert torch.equal(ours.dropped, reference_drop(b, delta))
    torch.testing.assert_close(ours.loss, dppo.loss, rtol=0, atol=0)
    torch.testing.assert_close(ours.grad_logits, dppo.grad_logits, rtol=0, atol=0)
    assert ours.metrics[M.CLIPFRAC] == dppo.metrics[M.CLIPFRAC]
    assert ours.metrics[M.MASK_DIRECTION_DISAGREE] == 0.0


@pytest.mark.parametrize("seed", range(4))
def test_the_equality_is_not_vacuous(seed: int) -> None:
    """At δ = 0.05 these batches have tokens dropped and tokens outside the trust region but kept."""
    b = make_batch(seed, bs=4, length=8, vocab=30, k=5, shift=1.5)
    ours, dppo = run("predmask_binary_kl", b, 0.05), run("dppo_binary_kl", b, 0.05)
    assert torch.equal(ours.dropped, dppo.dropped) and int(ours.dropped.sum()) > 0
    outside_frac, dropped_frac = ours.metrics[M.MASK_OUTSIDE_FRAC], float(ours.dropped.sum() / b.mask.sum())
    assert outside_frac > dropped_frac


def test_recomputed_old_log_probs_separate_the_two_rules() -> None:
    """anchor=old: r = π_k / π_old,k. Where it and π_k / μ_k fall on different sides of 1, the ratio rule reads
    the staleness side and the predictive rule the μ side, so the decisions differ; anchored on μ they agree.

    Three tokens, each sampling token 0 of a 4-token vocabulary with μ = (0.3, 0.4, 0.2, 0.1) and
    π = (0.6, 0.2, 0.1, 0.1), so the binary KL(0.3‖0.6) = 0.184 > δ = 0.1 and π_k / μ_k = 2:
    token 0 (A = +1, π_old,k = 0.8, π_k / π_old,k = 0.75): the predictive rule drops, the ratio rule keeps;
    token 1 (A = −1, π_old,k = 0.8): the predictive rule keeps, the ratio rule drops;
    token 2 (A = +1, π_old,k = 0.5, π_k / π_old,k = 1.2): both drop.
    """
    mu = torch.tensor([0.3, 0.4, 0.2, 0.1], dtype=DTYPE)
    pi = torch.tensor([0.6, 0.2, 0.1, 0.1], dtype=DTYPE)
    pi_old_k = torch.tensor([[0.8, 0.8, 0.5]], dtype=DTYPE)
    assert float(mu[0] * (mu[0] / pi[0]).log() + (1 - mu[0]) * ((1 - mu[0]) / (1 - pi[0])).log()) > 0.1
    assert bool(((pi[0] / mu[0] - 1) > 0).item()) and bool(((pi[0] / pi_old_k[0, :2] - 1) < 0).all())
    logits = pi.log().expand(1, 3, 4).clone()
    mu_lp_full = mu.log().expand(1, 3, 4).clone()
    sampled = torch.zeros(1, 3, dtype=torch.long)
    top = mu_lp_full.topk(2, -1)
    support = pm.build_support(top.indices, top.values, sampled, mu_lp_full[..., 0])
    b = Batch(logits, mu_lp_full, sampled, support, torch.tensor([[1.0, -1.0, 1.0]], dtype=DTYPE),
              torch.ones(1, 3, dtype=torch.bool))

    old = pi_old_k.log()
    ours, dppo = run("predmask_binary_kl", b, 0.1, old), run("dppo_binary_kl", b, 0.1, old)
    assert ours.dropped.tolist() == [[True, False, True]]
    assert dppo.dropped.tolist() == [[False, True, True]]
    assert ours.metrics[M.MASK_DIRECTION_DISAGREE] == 2.0
    assert not torch.equal(ours.grad_logits, dppo.grad_logits)

    on_mu = [run(name, b, 0.1).dropped.tolist() for name in ("predmask_binary_kl", "dppo_binary_kl")]
    assert on_mu == [[[True, False, True]]] * 2
    assert torch.equal(run("predmask_binary_kl", b, 0.1).dropped, reference_drop(b, 0.1))


@settings(max_examples=100, deadline=None)
@given(b=batches, tail=st.sampled_from(["aggregated", "uniform", "exact"]))
def test_on_the_binary_support_every_tail_gives_ddot_the_sign_of_pi_k_minus_mu_k(b: Batch, tail: str) -> None:
    """math.md §3.1: with S = {k} the tail term is (q_T / π_T)(π_k − μ_k), so no tail estimator changes the sign."""
    binary = pm.binary_support_valid(b.support.valid, b.support.sampled_index)
    pi_lp, tail_sq = pm.gather_support_logprobs(b.logits, b.support.ids, binary, return_tail_sq=True)
    ddot = pm.predicted_divergence_change(b.support.mu_logprobs, pi_lp, binary, b.support.sampled_index, tail=tail,
                                          vocab_size=b.logits.shape[-1], pi_tail_sq=tail_sq)
    pi_k = torch.softmax(b.logits, -1).gather(-1, b.sampled[..., None])[..., 0]
    mu_k = b.mu_lp_full.exp().gather(-1, b.sampled[..., None])[..., 0]
    clear = (pi_k - mu_k).abs() > 1e-9  # away from rounding ties
    assert torch.equal(torch.sign(ddot)[clear], torch.sign(pi_k - mu_k)[clear])
