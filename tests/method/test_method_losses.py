"""Masked losses of math.md §4: gradients against autograd, mask rules against an independent computation."""

from __future__ import annotations

import pytest
import torch

import predmask as pm

DTYPE = torch.float64


def _batch(seed: int = 0, bs: int = 6, length: int = 9, vocab: int = 50, k: int = 8, shift: float = 0.8):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(bs, length, vocab, generator=g, dtype=DTYPE) * 1.5
    mu_lp_full = torch.log_softmax(logits + shift * torch.randn(logits.shape, generator=g, dtype=DTYPE), -1)
    sampled = torch.multinomial(mu_lp_full.exp().reshape(-1, vocab), 1, generator=g).reshape(bs, length)
    top = mu_lp_full.topk(k, -1)
    support = pm.build_support(top.indices, top.values, sampled, mu_lp_full.gather(-1, sampled[..., None])[..., 0])
    adv = torch.randn(bs, 1, generator=g, dtype=DTYPE).expand(bs, length).clone()
    adv[0] = 0.0
    mask = torch.ones(bs, length, dtype=torch.bool)
    mask[1, 6:] = False
    return logits, mu_lp_full, sampled, support, adv, mask


def _independent_keep(method: pm.Method, logits, mu_lp_full, sampled, support, adv, mask, delta, vocab):
    """The keep decision of math.md §4 recomputed from full distributions with plain loops (no predmask code)."""
    pi_full = torch.softmax(logits, -1)
    mu_full = mu_lp_full.exp()
    keep = torch.zeros_like(mask)
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if not mask[b, t]:
                continue
            k = int(sampled[b, t])
            ids = [int(i) for i, ok in zip(support.ids[b, t], support.valid[b, t]) if ok]
            if method.support == "binary":
                ids = [k]
            mu_s, pi_s = mu_full[b, t, ids], pi_full[b, t, ids]
            mu_t, pi_t = 1 - mu_s.sum(), 1 - pi_s.sum()
            if method.divergence == "kl":
                d = (mu_s * (mu_s / pi_s).log()).sum() + mu_t * (mu_t / pi_t).log()
            else:
                d = 0.5 * ((mu_s - pi_s).abs().sum() + (mu_t - pi_t).abs())
            r = pi_full[b, t, k] / mu_full[b, t, k]
            a = adv[b, t]
            if method.direction == "ratio":
                increases = a * (r - 1) > 0
            else:
                off = [j for j in range(vocab) if j not in ids]
                q = {"aggregated": pi_t**2, "uniform": pi_t**2 / (vocab - len(ids)),
                     "exact": (pi_full[b, t, off] ** 2).sum()}[method.tail]
                kk = ids.index(k)
                if method.divergence == "kl":
                    ddot = (pi_s[kk] - mu_s[kk]) + (pi_s * (mu_s - pi_s)).sum() - q * (1 - mu_t / pi_t)
                else:
                    s, s_t = torch.sign(pi_s - mu_s), torch.sign(pi_t - mu_t)
                    gg = pi_s[kk] - (pi_s**2).sum() - q
                    ddot = 0.5 * (s[kk] * pi_s[kk] - (s * pi_s**2).sum() - s_t * q
                                  - gg * ((s * pi_s).sum() + s_t * pi_t))
                increases = a * ddot > 0
            keep[b, t] = not (d > delta and increases)
    return keep


DIVERGENCE_METHODS = [n for n, m in pm.METHODS.items() if m.kind == "divergence"]


@pytest.mark.parametrize("name", DIVERGENCE_METHODS)
def test_divergence_loss_gradient_is_minus_a_r_grad_logpi_on_kept_tokens(name: str) -> None:
    logits, mu_lp_full, sampled, support, adv, mask = _batch()
    vocab = logits.shape[-1]
    method = pm.get_method(name)
    delta = 0.05
    z = logits.clone().requires_grad_()
    pi_lp, tail_sq = pm.gather_support_logprobs(z, support.ids, support.valid, return_tail_sq=True)
    log_prob = support.sampled_logprob(pi_lp)
    old = support.sampled_logprob(support.mu_logprobs)
    loss, metrics = pm.policy_loss(
        name, log_prob=log_prob, old_log_prob=old, advantages=adv, response_mask=mask,
        mu_logprobs=support.mu_logprobs, pi_logprobs=pi_lp, valid=support.valid,
        sampled_index=support.sampled_index, pi_tail_sq=tail_sq.detach(),
        params=pm.MethodParams(delta=delta, vocab_size=vocab),
    )
    (grad,) = torch.autograd.grad(loss, z)

    keep = _independent_keep(method, logits, mu_lp_full, sampled, support, adv, mask, delta, vocab)
    # Independent truth: -A * r * grad(log pi_k) per kept token, token-mean over the response mask.
    z2 = logits.clone().requires_grad_()
    lp_k = torch.log_softmax(z2, -1).gather(-1, sampled[..., None])[..., 0]
    r = (lp_k - old).exp().detach()
    expected_obj = (-(adv * r * lp_k) * keep).sum() / mask.sum()
    (expected,) = torch.autograd.grad(expected_obj, z2)
    torch.testing.assert_close(grad, expected)
    dropped = mask & ~keep & (adv != 0)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(float(dropped.sum()) / float((mask & (adv != 0)).sum()))
    assert 0 < dropped.sum() < (mask & (adv != 0)).sum(), "the case must exercise both kept and dropped tokens"


def test_predictive_and_ratio_masks_disagree_somewhere_and_report_it() -> None:
    logits, _, _, support, adv, mask = _batch(seed=3, bs=16, length=12)
    pi_lp = pm.gather_support_logprobs(logits, support.ids, support.valid)
    common = {"log_prob": support.sampled_logprob(pi_lp), "old_log_prob": support.sampled_logprob(support.mu_logprobs),
              "advantages": adv, "response_mask": mask, "mu_logprobs": support.mu_logprobs, "pi_logprobs": pi_lp,
              "valid": support.valid, "sampled_index": support.sampled_index, "delta": 0.05}
    _, pred = pm.policy_loss("predmask_kl_agg", **common)
    _, ratio = pm.policy_loss("dppo_topk_kl", **common)
    assert pred["actor/mask/direction_disagree"] > 0
    assert pred["actor/pg_clipfrac"] != ratio["actor/pg_clipfrac"]
    assert pred["actor/mask/divergence_mean"] == ratio["actor/mask/divergence_mean"]


def test_grpo_clip_higher_drops_exactly_the_clipped_tokens() -> None:
    logits, _, sampled, support, adv, mask = _batch(seed=1)
    z = logits.clone().requires_grad_()
    log_prob = torch.log_softmax(z, -1).gather(-1, sampled[..., None])[..., 0]
    old = support.sampled_logprob(support.mu_logprobs)
    loss, metrics = pm.policy_loss("grpo_clip_higher", log_prob=log_prob, old_log_prob=old, advantages=adv,
                                   response_mask=mask)
    (grad_lp,) = torch.autograd.grad(loss, log_prob)
    r = (log_prob - old).exp().detach()
    dropped = ((adv > 0) & (r > 1.28)) | ((adv < 0) & (r < 0.8))
    expected = torch.where(mask & ~dropped, -adv * r, torch.zeros_like(r)) / mask.sum()
    torch.testing.assert_close(grad_lp, expected)
    assert (dropped & mask).any() and (~dropped & mask & (adv != 0)).any()
    assert metrics["actor/pg_clipfrac"] == pytest.approx(float((dropped & mask).sum()) / float((mask & (adv != 0)).sum()))


def test_ratio_cap_limits_the_weight() -> None:
    log_prob = torch.tensor([[0.0, -0.1]], dtype=DTYPE, requires_grad=True)
    old = torch.tensor([[-3.0, -0.1]], dtype=DTYPE)  # r = e^3 on the first token
    mu = torch.stack([old, torch.full_like(old, -5.0)], -1)
    pi = torch.stack([log_prob.detach(), torch.full_like(old, -5.0)], -1)
    valid = torch.ones(1, 2, 2, dtype=torch.bool)
    loss, _ = pm.policy_loss("dppo_topk_kl", log_prob=log_prob, old_log_prob=old, advantages=-torch.ones(1, 2),
                             response_mask=torch.ones(1, 2), mu_logprobs=mu, pi_logprobs=pi, valid=valid,
                             sampled_index=torch.zeros(1, 2, dtype=torch.long), ratio_cap=2.0, delta=100.0)
    (g,) = torch.autograd.grad(loss, log_prob)
    torch.testing.assert_close(g, torch.tensor([[2.0, 1.0]], dtype=DTYPE) / 2)


@pytest.mark.parametrize("mode", pm.LOSS_AGG_MODES)
def test_agg_loss_modes(mode: str) -> None:
    g = torch.Generator().manual_seed(0)
    loss = torch.randn(4, 5, generator=g, dtype=DTYPE)
    mask = torch.rand(4, 5, generator=g) > 0.3
    mask[2] = False
    got = pm.agg_loss(loss, mask, mode)
    rows = [loss[i][mask[i]] for i in range(4) if mask[i].any()]
    expected = {
        "token-mean": torch.cat(rows).mean(),
        "seq-mean-token-sum": torch.stack([r.sum() for r in rows]).mean(),
        "seq-mean-token-mean": torch.stack([r.mean() for r in rows]).mean(),
        "seq-mean-token-sum-norm": torch.stack([r.sum() for r in rows]).mean() / 5,
        "token-sum": torch.cat(rows).sum(),
    }[mode]
    torch.testing.assert_close(got, expected)
    # With verl's global batch info the loss is normalised by the global counts instead.
    if mode == "token-mean":
        torch.testing.assert_close(pm.agg_loss(loss, mask, mode, batch_num_tokens=100, dp_size=2),
                                   torch.cat(rows).sum() / 100 * 2)


def test_unknown_names_list_the_known_ones() -> None:
    with pytest.raises(ValueError, match="known methods: .*dppo_topk_kl.*predmask_kl_agg"):
        pm.get_method("predmask_kl_typo")
    with pytest.raises(ValueError, match="allowed: token-mean"):
        pm.MethodParams(loss_agg_mode="mean")
    with pytest.raises(ValueError, match="delta must be a finite number > 0"):
        pm.MethodParams(delta=0)


def test_registry_holds_every_method_of_the_spec() -> None:
    assert set(pm.METHODS) == {
        "grpo", "grpo_clip_higher", "dppo_topk_kl", "dppo_topk_tv", "dppo_binary_kl", "dppo_binary_tv",
        "predmask_kl_agg", "predmask_kl_uniform", "predmask_kl_exact", "predmask_binary_kl", "predmask_tv_agg",
        "predmask_tv_uniform",
    }


def test_divergence_method_without_support_is_refused() -> None:
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="needs the top-K support; missing: mu_logprobs"):
        pm.policy_loss("predmask_kl_agg", log_prob=x, old_log_prob=x, advantages=x, response_mask=x)
