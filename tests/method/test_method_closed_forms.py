"""Closed forms of math.md §2-3 checked against autograd (torch.func.jvp) of the divergence, in float64."""

from __future__ import annotations

import pytest
import torch
from torch.func import jvp

import predmask as pm



@pytest.fixture(autouse=True)
def _float64_default():
    """These checks run in float64; restore the default afterwards so no other test inherits it."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


def _random_case(seed: int, vocab: int = 40, k: int = 6, tokens: int = 16, shift: float = 0.7):
    """Random training logits z, a behaviour distribution mu near softmax(z), sampled tokens and the support."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(tokens, vocab, generator=g) * 1.5
    mu_logits = z + shift * torch.randn(tokens, vocab, generator=g)
    mu_lp_full = torch.log_softmax(mu_logits, -1)
    sampled = torch.multinomial(mu_lp_full.exp(), 1, generator=g).squeeze(-1)
    top = mu_lp_full.topk(k, -1)
    support = pm.build_support(top.indices, top.values, sampled, mu_lp_full.gather(-1, sampled[:, None]).squeeze(-1))
    return z, mu_lp_full, sampled, support


def _coarse_d_of_logits(z: torch.Tensor, support: pm.TopKSupport, divergence: str) -> torch.Tensor:
    pi_lp = pm.gather_support_logprobs(z, support.ids, support.valid)
    return pm.topk_divergence(support.mu_logprobs, pi_lp, support.valid, divergence=divergence)


def _direction(z: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
    """The unit logit step v = e_k - pi of math.md §3."""
    pi = torch.softmax(z, -1)
    return torch.nn.functional.one_hot(sampled, z.shape[-1]).to(z.dtype) - pi


@pytest.mark.parametrize("divergence", ["kl", "tv"])
@pytest.mark.parametrize("seed", range(6))
def test_exact_tail_matches_jvp_of_topk_divergence(seed: int, divergence: str) -> None:
    z, _, sampled, support = _random_case(seed)
    _, autograd_ddot = jvp(lambda x: _coarse_d_of_logits(x, support, divergence), (z,), (_direction(z, sampled),))
    pi_lp, tail_sq = pm.gather_support_logprobs(z, support.ids, support.valid, return_tail_sq=True)
    closed = pm.predicted_divergence_change(
        support.mu_logprobs, pi_lp, support.valid, support.sampled_index,
        divergence=divergence, tail="exact", pi_tail_sq=tail_sq,
    )
    torch.testing.assert_close(closed, autograd_ddot, rtol=1e-7, atol=1e-10)


@pytest.mark.parametrize("divergence", ["kl", "tv"])
@pytest.mark.parametrize("seed", range(4))
def test_aggregated_tail_is_exact_for_a_one_token_tail(seed: int, divergence: str) -> None:
    """With the tail treated as one real token, the aggregated estimator is the exact derivative."""
    z, _, sampled, support = _random_case(seed)
    pi_lp, _ = pm.gather_support_logprobs(z, support.ids, support.valid, return_tail_sq=True)
    # Coarse categorical over the valid support slots + one tail token, built as real logits.
    coarse_logits = torch.cat([torch.where(support.valid, pi_lp, torch.full_like(pi_lp, -torch.inf)),
                               torch.log1p(-torch.where(support.valid, pi_lp.exp(), 0).sum(-1, keepdim=True))], -1)
    ids = torch.arange(coarse_logits.shape[-1]).expand_as(coarse_logits)
    valid_full = torch.cat([support.valid, torch.zeros_like(support.valid[:, :1])], -1)

    def d_of(x: torch.Tensor) -> torch.Tensor:
        lp = torch.log_softmax(x, -1)
        lp = torch.where(valid_full, lp, torch.full_like(lp, -torch.inf))
        mu = torch.cat([support.mu_logprobs, torch.full_like(support.mu_logprobs[:, :1], -torch.inf)], -1)
        return pm.topk_divergence(mu, lp, valid_full, divergence=divergence)

    # softmax of -inf slots is 0; the step direction is e_k - pi on the coarse categorical.
    safe = torch.where(torch.isfinite(coarse_logits), coarse_logits, torch.full_like(coarse_logits, -1e4))
    pi_c = torch.softmax(safe, -1)
    v = torch.nn.functional.one_hot(support.sampled_index, ids.shape[-1]).to(z.dtype) - pi_c
    _, autograd_ddot = jvp(d_of, (safe,), (v,))
    closed = pm.predicted_divergence_change(
        support.mu_logprobs, pi_lp, support.valid, support.sampled_index, divergence=divergence, tail="aggregated"
    )
    torch.testing.assert_close(closed, autograd_ddot, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("divergence", ["kl", "tv"])
def test_uniform_tail_is_exact_for_an_even_tail(divergence: str) -> None:
    """When pi spreads its off-support mass evenly, the uniform estimator is the exact derivative."""
    z, _, sampled, support = _random_case(11, vocab=30, k=5)
    on_support = torch.zeros_like(z, dtype=torch.bool)
    on_support.scatter_(-1, torch.where(support.valid, support.ids, support.ids[:, :1]), True)
    # Replace off-support logits by one common value: the tail becomes uniform, the support unchanged in shape.
    z_even = torch.where(on_support, z, torch.full_like(z, -0.5))
    _, autograd_ddot = jvp(lambda x: _coarse_d_of_logits(x, support, divergence), (z_even,),
                           (_direction(z_even, sampled),))
    pi_lp = pm.gather_support_logprobs(z_even, support.ids, support.valid)
    closed = pm.predicted_divergence_change(
        support.mu_logprobs, pi_lp, support.valid, support.sampled_index,
        divergence=divergence, tail="uniform", vocab_size=z.shape[-1],
    )
    torch.testing.assert_close(closed, autograd_ddot, rtol=1e-7, atol=1e-10)


def test_full_vocabulary_kl_derivative() -> None:
    """math.md §3.2: with the whole vocabulary as support the formula is the full-KL derivative."""
    z, mu_lp_full, sampled, _ = _random_case(3, vocab=25)
    ids = torch.arange(25).expand(z.shape[0], 25)
    valid = torch.ones_like(ids, dtype=torch.bool)

    def full_kl(x: torch.Tensor) -> torch.Tensor:
        return (mu_lp_full.exp() * (mu_lp_full - torch.log_softmax(x, -1))).sum(-1)

    _, autograd_ddot = jvp(full_kl, (z,), (_direction(z, sampled),))
    pi_lp = pm.gather_support_logprobs(z, ids, valid)
    closed = pm.predicted_divergence_change(mu_lp_full, pi_lp, valid, sampled, tail="exact",
                                            pi_tail_sq=torch.zeros(z.shape[0]))
    torch.testing.assert_close(closed, autograd_ddot, rtol=1e-6, atol=1e-9)


def test_topk_divergences_match_direct_computation() -> None:
    z, _, _, support = _random_case(5)
    pi_lp = pm.gather_support_logprobs(z, support.ids, support.valid)
    mu = torch.where(support.valid, support.mu_logprobs.exp(), 0)
    pi = torch.where(support.valid, pi_lp.exp(), 0)
    mu_t, pi_t = 1 - mu.sum(-1), 1 - pi.sum(-1)
    kl = torch.where(support.valid, mu * (support.mu_logprobs - pi_lp), 0).sum(-1) + mu_t * torch.log(mu_t / pi_t)
    tv = 0.5 * ((mu - pi).abs().sum(-1) + (mu_t - pi_t).abs())
    torch.testing.assert_close(pm.topk_divergence(support.mu_logprobs, pi_lp, support.valid), kl)
    torch.testing.assert_close(pm.topk_divergence(support.mu_logprobs, pi_lp, support.valid, divergence="tv"), tv)


def test_binary_reductions() -> None:
    """Appendix C / math.md §3.1, §3.3: with S = {k} and the aggregated tail."""
    z, _, sampled, support = _random_case(7)
    pi_lp = pm.gather_support_logprobs(z, support.ids, support.valid)
    binary = pm.binary_support_valid(support.valid, support.sampled_index)
    pi_k = support.sampled_logprob(pi_lp).exp()
    mu_k = support.sampled_logprob(support.mu_logprobs).exp()
    kl = pm.predicted_divergence_change(support.mu_logprobs, pi_lp, binary, support.sampled_index)
    torch.testing.assert_close(kl, 2 * (1 - pi_k) * (pi_k - mu_k))
    assert torch.equal(torch.sign(kl), torch.sign(pi_k / mu_k - 1))
    tv = pm.predicted_divergence_change(support.mu_logprobs, pi_lp, binary, support.sampled_index, divergence="tv")
    torch.testing.assert_close(tv, 2 * torch.sign(pi_k - mu_k) * pi_k * (1 - pi_k) ** 2)


def test_aggregated_and_uniform_differ_by_the_stated_correction() -> None:
    """math.md §3.1: the two estimators differ by pi_T (pi_T - mu_T)(1 - 1/(V - |S|))."""
    z, _, _, support = _random_case(9)
    vocab = z.shape[-1]
    pi_lp = pm.gather_support_logprobs(z, support.ids, support.valid)
    args = (support.mu_logprobs, pi_lp, support.valid, support.sampled_index)
    agg = pm.predicted_divergence_change(*args)
    uni = pm.predicted_divergence_change(*args, tail="uniform", vocab_size=vocab)
    c = pm.coarse_distributions(support.mu_logprobs, pi_lp, support.valid)
    expected = c.pi_T * (c.pi_T - c.mu_T) * (1 - 1 / (vocab - c.n_support))
    torch.testing.assert_close(uni - agg, expected)
