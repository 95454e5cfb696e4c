"""Support building, the logits gather, and bad or edge input: each gets a clear error or a tested handling."""

from __future__ import annotations

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import predmask as pm


def test_build_support_sampled_inside_and_outside_topk() -> None:
    topk_ids = torch.tensor([[5, 2, 9], [5, 2, 9]])
    topk_lp = torch.tensor([[-0.5, -1.5, -2.5], [-0.5, -1.5, -2.5]])
    s = pm.build_support(topk_ids, topk_lp, torch.tensor([2, 7]), torch.tensor([-1.5, -4.0]))
    assert s.ids.tolist() == [[5, 2, 9, 2], [5, 2, 9, 7]]
    assert s.valid.tolist() == [[True, True, True, False], [True, True, True, True]]
    assert s.sampled_index.tolist() == [1, 3]
    assert s.sampled_logprob(s.mu_logprobs).tolist() == [-1.5, -4.0]


def test_build_support_ignores_invalid_topk_entries() -> None:
    s = pm.build_support(torch.tensor([[4, 0]]), torch.tensor([[-0.1, -30.0]]), torch.tensor([0]),
                         torch.tensor([-3.0]), topk_valid=torch.tensor([[True, False]]))
    assert s.sampled_index.tolist() == [2] and s.valid.tolist() == [[True, False, True]]


def test_build_support_shape_mismatch() -> None:
    with pytest.raises(ValueError, match="sampled_ids"):
        pm.build_support(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3), torch.zeros(3, dtype=torch.long),
                         torch.zeros(3))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_matches_log_softmax_and_tail_square(temperature: float, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 4, 100, generator=g) * 3).to(dtype)
    ids = torch.randint(0, 100, (3, 4, 6), generator=g)
    ids[..., 1] = (ids[..., 0] + 1) % 100  # distinct ids in the two first slots
    valid = torch.rand(3, 4, 6, generator=g) > 0.3
    valid[..., 2:] = False  # only the two distinct slots may be valid
    lp, tail = pm.gather_support_logprobs(logits, ids, valid, temperature=temperature, return_tail_sq=True)
    full = torch.log_softmax(logits.double() / temperature, -1)
    want = torch.where(valid, full.gather(-1, ids), torch.full(ids.shape, -torch.inf, dtype=torch.float64))
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp.double(), want, rtol=1e-5, atol=1e-5)
    off = torch.zeros_like(full, dtype=torch.long).scatter_add(-1, ids, valid.long()) == 0
    want_tail = torch.where(off, full.exp() ** 2, 0).sum(-1)
    torch.testing.assert_close(tail.double(), want_tail, rtol=1e-4, atol=1e-6)


def test_gather_rejects_out_of_range_ids_and_bad_temperature() -> None:
    with pytest.raises(ValueError, match=r"\[0, 10\)"):
        pm.gather_support_logprobs(torch.zeros(2, 10), torch.tensor([[3], [10]]))
    with pytest.raises(ValueError, match="temperature"):
        pm.gather_support_logprobs(torch.zeros(2, 10), torch.tensor([[3], [1]]), temperature=0)


def _support(width: int = 4):
    mu = torch.log(torch.tensor([[0.5, 0.2, 0.1, 0.05]]))[:, :width]
    pi = torch.log(torch.tensor([[0.4, 0.3, 0.1, 0.02]]))[:, :width]
    return mu, pi, torch.ones_like(mu, dtype=torch.bool), torch.tensor([1])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("which", ["mu", "pi"])
def test_nan_or_inf_logprobs_raise(bad: float, which: str) -> None:
    mu, pi, valid, k = _support()
    (mu if which == "mu" else pi)[0, 2] = bad
    with pytest.raises(ValueError, match="NaN or \\+inf"):
        pm.topk_divergence(mu, pi, valid)
    with pytest.raises(ValueError, match="NaN or \\+inf"):
        pm.predicted_divergence_change(mu, pi, valid, k)


def test_nan_on_an_invalid_slot_is_ignored() -> None:
    mu, pi, valid, _ = _support()
    ref = pm.topk_divergence(mu[:, :3], pi[:, :3], valid[:, :3])
    mu[0, 3], pi[0, 3], valid[0, 3] = float("nan"), float("nan"), False
    torch.testing.assert_close(pm.topk_divergence(mu, pi, valid), ref)


def test_minus_inf_logprob_is_probability_zero() -> None:
    mu, pi, valid, k = _support()
    mu[0, 3] = -torch.inf
    d = pm.topk_divergence(mu, pi, valid)
    assert torch.isfinite(d).all() and (d > 0).all()
    assert torch.isfinite(pm.predicted_divergence_change(mu, pi, valid, k)).all()


def test_bf16_mass_above_one_is_clamped_and_counted() -> None:
    """bf16 rounding can make the reported top-K sum above 1: the tail clamps at the floor and the metric counts it."""
    mu = torch.log(torch.tensor([[0.6, 0.3, 0.1004]])).to(torch.bfloat16)
    assert float(mu.float().exp().sum()) > 1.0
    pi = torch.log(torch.tensor([[0.5, 0.3, 0.1]]))
    valid = torch.ones(1, 3, dtype=torch.bool)
    c = pm.coarse_distributions(mu, pi, valid)
    assert bool(c.mu_T_clamped[0]) and float(c.mu_T[0]) == pytest.approx(pm.MASS_FLOOR)
    assert torch.isfinite(pm.topk_divergence(mu, pi, valid)).all()
    lp = pi.gather(-1, torch.zeros(1, 1, dtype=torch.long))[:, 0]
    _, metrics = pm.policy_loss("predmask_kl_agg", log_prob=lp, old_log_prob=mu.float()[:, 0],
                                advantages=torch.ones(1), response_mask=torch.ones(1), mu_logprobs=mu,
                                pi_logprobs=pi, valid=valid, sampled_index=torch.zeros(1, dtype=torch.long))
    assert metrics["actor/mask/mu_tail_clamped"] == 1.0 and metrics["actor/mask/pi_tail_clamped"] == 0.0


def test_all_invalid_support_is_padding() -> None:
    """A row without any valid slot (a padded token) has D = 0 and Ddot = 0, whatever its sampled slot says."""
    mu, pi, valid, k = _support()
    valid[:] = False
    assert pm.topk_divergence(mu, pi, valid).item() == 0.0
    assert pm.predicted_divergence_change(mu, pi, valid, k).item() == 0.0


def test_sampled_slot_on_an_invalid_slot_raises() -> None:
    mu, pi, valid, k = _support()
    valid[0, 1] = False
    with pytest.raises(ValueError, match="invalid support slot"):
        pm.predicted_divergence_change(mu, pi, valid, k)
    with pytest.raises(ValueError, match=r"must lie in \[0, 4\)"):
        pm.predicted_divergence_change(mu, pi, torch.ones_like(valid), torch.tensor([4]))


def test_shape_mismatches_raise() -> None:
    mu, pi, valid, _ = _support()
    with pytest.raises(ValueError, match="one shape"):
        pm.topk_divergence(mu, pi[:, :3], valid)
    with pytest.raises(ValueError, match="leading shape"):
        pm.predicted_divergence_change(mu, pi, valid, torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="share one shape"):
        pm.policy_loss("grpo_clip_higher", log_prob=torch.zeros(2, 3), old_log_prob=torch.zeros(2, 3),
                       advantages=torch.zeros(2, 4), response_mask=torch.ones(2, 3))


def test_tail_estimator_arguments() -> None:
    mu, pi, valid, k = _support()
    with pytest.raises(ValueError, match="vocab_size=4 must exceed the support width 4"):
        pm.predicted_divergence_change(mu, pi, valid, k, tail="uniform", vocab_size=4)
    with pytest.raises(ValueError, match="needs vocab_size"):
        pm.predicted_divergence_change(mu, pi, valid, k, tail="uniform")
    with pytest.raises(ValueError, match="needs pi_tail_sq"):
        pm.predicted_divergence_change(mu, pi, valid, k, tail="exact")
    with pytest.raises(ValueError, match="allowed: aggregated, uniform, exact"):
        pm.predicted_divergence_change(mu, pi, valid, k, tail="gaussian")
    with pytest.raises(ValueError, match="allowed: kl, tv"):
        pm.topk_divergence(mu, pi, valid, divergence="js")


def _support_mass(lp: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Probability mass on the valid slots, log-probs clamped at 0 as the library does."""
    return torch.where(valid, lp.double().clamp(max=0.0).exp(), 0.0).sum(-1)


logprob_arrays = hnp.arrays(
    np.float32, (3, 5),
    elements=st.one_of(st.floats(-40, 0.0078125, width=32), st.just(-np.inf), st.just(np.nan), st.just(np.inf)),
)


@settings(max_examples=200, deadline=None)
@given(mu=logprob_arrays, pi=logprob_arrays, valid=hnp.arrays(np.bool_, (3, 5)), k=st.integers(0, 4),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
       divergence=st.sampled_from(["kl", "tv"]), tail=st.sampled_from(["aggregated", "uniform"]))
def test_any_input_gives_a_finite_answer_or_a_clear_error(mu, pi, valid, k, dtype, divergence, tail) -> None:
    """Property: never a silent NaN. Either ValueError, or finite D and Ddot (D >= 0 and TV <= 1 on rows whose
    inputs are distributions: rows whose support mass exceeds 1 are not, their tails are clamped)."""
    mu_t, pi_t = torch.from_numpy(mu).to(dtype), torch.from_numpy(pi).to(dtype)
    valid_t, k_t = torch.from_numpy(valid), torch.full((3,), k)
    try:
        d = pm.topk_divergence(mu_t, pi_t, valid_t, divergence=divergence)
        ddot = pm.predicted_divergence_change(mu_t, pi_t, valid_t, k_t, divergence=divergence, tail=tail,
                                              vocab_size=1000)
    except ValueError as err:
        msg = str(err)
        bad_values = bool((valid & (np.isnan(mu) | np.isnan(pi) | (mu == np.inf) | (pi == np.inf))).any())
        bad_slot = bool((valid.any(-1) & ~valid[:, k]).any())
        assert ("NaN or +inf" in msg and bad_values) or ("invalid support slot" in msg and bad_slot), msg
        return
    assert torch.isfinite(d).all() and torch.isfinite(ddot).all()
    # the bounds of a divergence hold where both inputs are (sub-)distributions on the support
    proper = (_support_mass(mu_t, valid_t) <= 1.0) & (_support_mass(pi_t, valid_t) <= 1.0)
    assert (d[proper] >= -1e-6).all()
    if divergence == "tv":
        assert (d[proper] <= 1 + 1e-6).all()
