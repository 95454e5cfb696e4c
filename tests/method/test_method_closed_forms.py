"""Closed forms of math.md §1-3 against an independent reference, on hundreds of random float64 cases.

The reference never calls predmask's gather or divergence code: training log-probs are ``torch.log_softmax(z / T)``
gathered with ``torch.gather``, D is written out as the KL / TV of the coarse distributions ``S ∪ {T}``, and Ddot is
the forward-mode derivative (``torch.func.jvp``) of that explicit D along the unit step ``e_k - pi`` of the scaled
logits ``u = z / T`` (temperature T != 1 included: the step of the policy gradient on z is ``(e_k - pi) / T``, the
same direction). The custom support log-softmax is also checked with ``torch.autograd.gradcheck`` in backward and
forward mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import jvp

import predmask as pm

EXAMPLES = settings(max_examples=150, deadline=None)
#: the jvp-based checks cost more per example
JVP_EXAMPLES = settings(max_examples=100, deadline=None)


pytestmark = pytest.mark.usefixtures("float64_default")  # tests/conftest.py: float64, then restored


# ----------------------------------------------------------------------------------------------- the reference
def ref_logprobs(u: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """log_softmax(u) gathered at ``ids``, -inf on invalid slots."""
    lp = torch.log_softmax(u, -1).gather(-1, ids)
    return torch.where(valid, lp, torch.full_like(lp, -torch.inf))


def ref_divergence(mu_lp: torch.Tensor, pi_lp: torch.Tensor, valid: torch.Tensor, divergence: str) -> torch.Tensor:
    """Explicit KL(mu‖pi) or TV over the valid slots plus one tail bucket."""
    mu = torch.where(valid, mu_lp.exp(), torch.zeros_like(mu_lp))
    pi = torch.where(valid, pi_lp.exp(), torch.zeros_like(pi_lp))
    mu_t, pi_t = 1.0 - mu.sum(-1), 1.0 - pi.sum(-1)
    if divergence == "kl":
        log_ratio = torch.where(valid, mu_lp - pi_lp, torch.zeros_like(mu_lp))
        return (mu * log_ratio).sum(-1) + mu_t * torch.log(mu_t / pi_t)
    return 0.5 * ((mu - pi).abs().sum(-1) + (mu_t - pi_t).abs())


def ref_ddot(u: torch.Tensor, case: Case, divergence: str) -> torch.Tensor:
    """Forward-mode derivative of the explicit D along e_k - softmax(u)."""
    step = torch.nn.functional.one_hot(case.sampled, u.shape[-1]).to(u.dtype) - torch.softmax(u, -1)
    _, ddot = jvp(lambda x: ref_divergence(case.mu_lp, ref_logprobs(x, case.ids, case.valid), case.valid, divergence),
                  (u,), (step,))
    return ddot


@dataclass
class Case:
    """A random token batch: logits z, temperature T, a rollout distribution near softmax(z / T), its support."""

    z: torch.Tensor
    temperature: float
    mu_full: torch.Tensor
    sampled: torch.Tensor
    ids: torch.Tensor
    mu_lp: torch.Tensor
    valid: torch.Tensor
    sampled_index: torch.Tensor

    @property
    def u(self) -> torch.Tensor:
        return self.z / self.temperature


def make_case(seed: int, vocab: int, k: int, tokens: int, shift: float, temperature: float) -> Case:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(tokens, vocab, generator=g) * 1.5
    mu_full = torch.log_softmax(z / temperature + shift * torch.randn(tokens, vocab, generator=g), -1)
    sampled = torch.multinomial(mu_full.exp(), 1, generator=g).squeeze(-1)
    top = mu_full.topk(k, -1)
    # the support built by hand: TopK(mu) ∪ {sampled}; the extra slot is valid only when k is not in the top-K
    in_top = (top.indices == sampled[:, None]).any(-1)
    ids = torch.cat([top.indices, sampled[:, None]], -1)
    mu_lp = torch.cat([top.values, mu_full.gather(-1, sampled[:, None])], -1)
    valid = torch.cat([torch.ones_like(top.indices, dtype=torch.bool), ~in_top[:, None]], -1)
    slot = torch.where(in_top, (top.indices == sampled[:, None]).long().argmax(-1), torch.full_like(sampled, k))
    return Case(z, temperature, mu_full, sampled, ids, mu_lp, valid, slot)


cases = st.builds(
    make_case,
    seed=st.integers(0, 2**31 - 1),
    vocab=st.integers(12, 40),
    k=st.integers(1, 8),
    tokens=st.integers(1, 6),
    shift=st.floats(0.05, 1.5),
    temperature=st.sampled_from([1.0, 0.6, 0.85, 1.3, 2.0]),
)
divergences = st.sampled_from(["kl", "tv"])


def _on_support(case: Case) -> torch.Tensor:
    """bool [tokens, V]: the vocabulary entries on the valid support slots."""
    return torch.zeros_like(case.z).scatter_add(-1, case.ids, case.valid.to(case.z.dtype)) > 0


def _lib_logprobs(case: Case, return_tail_sq: bool = False):
    return pm.gather_support_logprobs(case.z, case.ids, case.valid, temperature=case.temperature,
                                      return_tail_sq=return_tail_sq)


# ----------------------------------------------------------------------------------------------- the tests
@EXAMPLES
@given(case=cases)
def test_support_gather_and_exact_tail_match_log_softmax(case: Case) -> None:
    pi_lp, tail_sq = _lib_logprobs(case, return_tail_sq=True)
    torch.testing.assert_close(pi_lp, ref_logprobs(case.u, case.ids, case.valid), rtol=1e-12, atol=1e-12)
    on_support = _on_support(case)
    pi = torch.softmax(case.u, -1)
    torch.testing.assert_close(tail_sq, torch.where(on_support, 0.0, pi**2).sum(-1), rtol=1e-9, atol=1e-13)


@EXAMPLES
@given(case=cases, divergence=divergences)
def test_topk_divergence_is_the_explicit_kl_or_tv(case: Case, divergence: str) -> None:
    pi_lp = ref_logprobs(case.u, case.ids, case.valid)
    lib = pm.topk_divergence(case.mu_lp, pi_lp, case.valid, divergence=divergence)
    torch.testing.assert_close(lib, ref_divergence(case.mu_lp, pi_lp, case.valid, divergence), rtol=1e-9, atol=1e-12)


@JVP_EXAMPLES
@given(case=cases, divergence=divergences)
def test_exact_tail_ddot_is_the_derivative_of_d(case: Case, divergence: str) -> None:
    pi_lp, tail_sq = _lib_logprobs(case, return_tail_sq=True)
    closed = pm.predicted_divergence_change(case.mu_lp, pi_lp, case.valid, case.sampled_index,
                                            divergence=divergence, tail="exact", pi_tail_sq=tail_sq)
    torch.testing.assert_close(closed, ref_ddot(case.u, case, divergence), rtol=1e-6, atol=1e-10)


@JVP_EXAMPLES
@given(case=cases, divergence=divergences)
def test_aggregated_tail_is_exact_for_a_one_token_tail(case: Case, divergence: str) -> None:
    """With the off-support mass as one real token, the aggregated estimator is the exact derivative."""
    pi_lp = _lib_logprobs(case)
    pi_support = torch.where(case.valid, ref_logprobs(case.u, case.ids, case.valid).exp(), 0.0)
    tail = 1.0 - pi_support.sum(-1, keepdim=True)
    # a categorical over [support slots (invalid ones at ~0 mass), tail token] with the same probabilities
    coarse = torch.cat([torch.where(case.valid, pi_support.log(), torch.full_like(pi_support, -1e4)), tail.log()], -1)
    n = coarse.shape[-1]
    one_token_tail = Case(coarse, 1.0, case.mu_full, case.sampled_index,
                          torch.arange(n).expand(coarse.shape[0], n), torch.cat([case.mu_lp, case.mu_lp[:, :1]], -1),
                          torch.cat([case.valid, torch.zeros_like(case.valid[:, :1])], -1), case.sampled_index)
    want = ref_ddot(coarse, one_token_tail, divergence)
    closed = pm.predicted_divergence_change(case.mu_lp, pi_lp, case.valid, case.sampled_index,
                                            divergence=divergence, tail="aggregated")
    torch.testing.assert_close(closed, want, rtol=1e-6, atol=1e-9)


@JVP_EXAMPLES
@given(case=cases, divergence=divergences, level=st.floats(-2.0, 1.0))
def test_uniform_tail_is_exact_for_an_even_tail(case: Case, divergence: str, level: float) -> None:
    """When pi spreads its off-support mass evenly, the uniform estimator is the exact derivative."""
    on_support = _on_support(case)
    even = Case(torch.where(on_support, case.z, torch.full_like(case.z, level)), case.temperature, case.mu_full,
                case.sampled, case.ids, case.mu_lp, case.valid, case.sampled_index)
    if int(on_support.sum(-1).max()) >= case.z.shape[-1]:
        return  # the support covers the vocabulary: no tail to spread
    closed = pm.predicted_divergence_change(even.mu_lp, _lib_logprobs(even), even.valid, even.sampled_index,
                                            divergence=divergence, tail="uniform", vocab_size=case.z.shape[-1])
    torch.testing.assert_close(closed, ref_ddot(even.u, even, divergence), rtol=1e-6, atol=1e-10)


@settings(max_examples=50, deadline=None)
@given(case=cases)
def test_full_vocabulary_kl_derivative(case: Case) -> None:
    """math.md §3.2: with the whole vocabulary as support the formula is the full-KL derivative."""
    vocab = case.z.shape[-1]
    ids = torch.arange(vocab).expand(case.z.shape[0], vocab)
    valid = torch.ones_like(ids, dtype=torch.bool)

    def full_kl(u: torch.Tensor) -> torch.Tensor:
        return (case.mu_full.exp() * (case.mu_full - torch.log_softmax(u, -1))).sum(-1)

    step = torch.nn.functional.one_hot(case.sampled, vocab).to(case.z.dtype) - torch.softmax(case.u, -1)
    _, want = jvp(full_kl, (case.u,), (step,))
    pi_lp = pm.gather_support_logprobs(case.z, ids, valid, temperature=case.temperature)
    closed = pm.predicted_divergence_change(case.mu_full, pi_lp, valid, case.sampled, tail="exact",
                                            pi_tail_sq=torch.zeros(case.z.shape[0]))
    torch.testing.assert_close(closed, want, rtol=1e-6, atol=1e-9)


@EXAMPLES
@given(case=cases)
def test_binary_reductions(case: Case) -> None:
    """Appendix C / math.md §3.1, §3.3: with S = {k} and the aggregated tail."""
    pi_lp = _lib_logprobs(case)
    binary = torch.nn.functional.one_hot(case.sampled_index, case.ids.shape[-1]).bool()
    pi_k = torch.softmax(case.u, -1).gather(-1, case.sampled[:, None]).squeeze(-1)
    mu_k = case.mu_full.exp().gather(-1, case.sampled[:, None]).squeeze(-1)
    kl = pm.predicted_divergence_change(case.mu_lp, pi_lp, binary, case.sampled_index)
    torch.testing.assert_close(kl, 2 * (1 - pi_k) * (pi_k - mu_k), rtol=1e-9, atol=1e-12)
    tv = pm.predicted_divergence_change(case.mu_lp, pi_lp, binary, case.sampled_index, divergence="tv")
    torch.testing.assert_close(tv, 2 * torch.sign(pi_k - mu_k) * pi_k * (1 - pi_k) ** 2, rtol=1e-9, atol=1e-12)


@EXAMPLES
@given(case=cases)
def test_aggregated_and_uniform_differ_by_the_stated_correction(case: Case) -> None:
    """math.md §3.1: the two estimators differ by pi_T (pi_T - mu_T)(1 - 1/(V - |S|))."""
    vocab = case.z.shape[-1]
    pi_lp = _lib_logprobs(case)
    args = (case.mu_lp, pi_lp, case.valid, case.sampled_index)
    agg = pm.predicted_divergence_change(*args)
    uni = pm.predicted_divergence_change(*args, tail="uniform", vocab_size=vocab)
    pi_t = 1.0 - torch.where(case.valid, torch.softmax(case.u, -1).gather(-1, case.ids), 0.0).sum(-1)
    mu_t = 1.0 - torch.where(case.valid, case.mu_lp.exp(), 0.0).sum(-1)
    expected = pi_t * (pi_t - mu_t) * (1 - 1 / (vocab - case.valid.sum(-1)))
    torch.testing.assert_close(uni - agg, expected, rtol=1e-7, atol=1e-12)


@EXAMPLES
@given(case=cases, divergence=divergences)
def test_the_exact_tail_lies_between_the_uniform_and_the_aggregated(case: Case, divergence: str) -> None:
    """docs/math.md §3.1: pi_T**2 / (V - |S|) <= q_T <= pi_T**2 and Ddot is linear in q_T, so the exact tail's Ddot
    lies between the two estimators'."""
    pi_lp, tail_sq = _lib_logprobs(case, return_tail_sq=True)
    args = (case.mu_lp, pi_lp, case.valid, case.sampled_index)
    agg = pm.predicted_divergence_change(*args, divergence=divergence)
    uni = pm.predicted_divergence_change(*args, divergence=divergence, tail="uniform", vocab_size=case.z.shape[-1])
    exact = pm.predicted_divergence_change(*args, divergence=divergence, tail="exact", pi_tail_sq=tail_sq)
    low, high = torch.minimum(agg, uni), torch.maximum(agg, uni)
    assert bool((exact >= low - 1e-12).all() and (exact <= high + 1e-12).all())


@EXAMPLES
@given(case=cases)
def test_the_top_k_kl_is_at_most_the_full_kl(case: Case) -> None:
    """docs/math.md §2: merging the tail into one bucket can only lower the KL (the full KL written out here)."""
    d = pm.topk_divergence(case.mu_lp, _lib_logprobs(case), case.valid)
    full = (case.mu_full.exp() * (case.mu_full - torch.log_softmax(case.u, -1))).sum(-1)
    assert bool((d <= full + 1e-12).all())


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
def test_support_log_softmax_passes_gradcheck_backward_and_forward(temperature: float) -> None:
    """The hand-written backward and jvp of the support log-softmax against finite differences."""
    case = make_case(3, vocab=17, k=4, tokens=5, shift=0.5, temperature=temperature)
    z = case.z.clone().requires_grad_()

    def support_logprobs(x: torch.Tensor) -> torch.Tensor:
        return pm.gather_support_logprobs(x, case.ids, temperature=temperature)

    def valid_slots(x: torch.Tensor) -> torch.Tensor:  # with invalid slots (-inf, no gradient) masked out
        return pm.gather_support_logprobs(x, case.ids, case.valid, temperature=temperature)[case.valid]

    for fn in (support_logprobs, valid_slots):
        assert torch.autograd.gradcheck(fn, (z,), check_forward_ad=True, check_backward_ad=True)
