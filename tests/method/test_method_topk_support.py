"""The top-K methods' two supports: TopK(mu) ∪ {k} (the paper's, the default) and TopK(mu) alone (the DPPO reference
code's), against an independent float64 numpy implementation of the reference's aggregated top-K KL and TV.

The reference (sail-sg/Stable-RL, ``compute_topk_kl``) takes the rollout's top-K log-probs and the training logits:
the KL sums ``p_i (log p_i - log q_i)`` over the top-K ids and adds one aggregated "rest" bucket with the masses
``1 - sum p`` and ``1 - sum q`` (each floored at 1e-12); its TV is half the absolute differences over the same
buckets. A sampled token outside the top-K has no bucket of its own there.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import predmask as pm
from predmask import metrics as M
from predmask.config import compose, to_container
from predmask.methods import TOPK_SUPPORTS, MethodParams, method_config, method_params
from predmask.support import build_support, gather_support_logprobs, topk_only_valid

K, V = 6, 40


def _log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def reference_topk(train_logits: np.ndarray, topk_ids: np.ndarray, topk_logprobs: np.ndarray) -> tuple:
    """(KL, TV) per token, the reference's aggregation over the top-K ids plus one rest bucket, in float64."""
    log_q = np.take_along_axis(_log_softmax(train_logits), topk_ids, -1)
    p, q = np.exp(topk_logprobs), np.exp(log_q)
    rest_p = np.maximum(1.0 - p.sum(-1), 1e-12)
    rest_q = np.maximum(1.0 - q.sum(-1), 1e-12)
    kl = (p * (topk_logprobs - log_q)).sum(-1) + rest_p * (np.log(rest_p) - np.log(rest_q))
    tv = (np.abs(p - q).sum(-1) + np.abs(rest_p - rest_q)) / 2.0
    return kl, tv


def _case(seed: int = 0, b: int = 4, r: int = 7):
    """Rollout and training logits [b, r, V], the rollout's top-K, sampled tokens with about half outside the
    top-K, the K+1 support and the training log-probs on it (float64)."""
    g = np.random.default_rng(seed)
    mu_logits = g.normal(0, 2.0, (b, r, V))
    train_logits = mu_logits + g.normal(0, 0.6, (b, r, V))
    mu_lp = _log_softmax(mu_logits)
    order = np.argsort(-mu_lp, -1)
    topk_ids = order[..., :K]
    off = g.random((b, r)) < 0.5
    rank = np.where(off, K + g.integers(0, V - K, (b, r)), g.integers(0, K, (b, r)))
    sampled = np.take_along_axis(order, rank[..., None], -1)[..., 0]
    t = torch.from_numpy
    support = build_support(t(topk_ids), t(np.take_along_axis(mu_lp, topk_ids, -1)), t(sampled),
                            t(np.take_along_axis(mu_lp, sampled[..., None], -1)[..., 0]))
    pi = gather_support_logprobs(t(train_logits), support.ids, support.valid)
    return train_logits, mu_lp, topk_ids, sampled, support, pi, t(off)


def test_the_top_k_only_divergence_is_the_references_aggregated_top_k_kl_and_tv() -> None:
    train_logits, mu_lp, topk_ids, _, support, pi, off = _case()
    ref_kl, ref_tv = reference_topk(train_logits, topk_ids, np.take_along_axis(mu_lp, topk_ids, -1))
    only = topk_only_valid(support.valid)
    for name, ref in (("kl", ref_kl), ("tv", ref_tv)):
        ours = pm.topk_divergence(support.mu_logprobs, pi, only, divergence=name).numpy()
        np.testing.assert_allclose(ours, ref, rtol=1e-10, atol=1e-12)
        # the paper's support differs exactly where the sampled token lies outside the top-K
        plus = pm.topk_divergence(support.mu_logprobs, pi, support.valid, divergence=name).numpy()
        np.testing.assert_allclose(plus[~off.numpy()], ref[~off.numpy()], rtol=1e-10, atol=1e-12)
        # a bucket split off the tail never lowers D (KL strictly raises it, TV where the two parts' signs differ)
        gap = plus[off.numpy()] - ref[off.numpy()]
        assert np.all(gap > -1e-12) and (np.all(gap > 1e-9) if name == "kl" else np.any(gap > 1e-9))
    assert bool(off.any()) and bool((~off).any())


@pytest.mark.parametrize(("method", "col"), [("dppo_topk_kl", 0), ("dppo_topk_tv", 1)])
@pytest.mark.parametrize("support", TOPK_SUPPORTS)
def test_the_loss_masks_on_the_chosen_support(method: str, col: int, support: str) -> None:
    """policy_loss's mask under each support: dropped = (D > delta) & A (r - 1) > 0, with D the reference's for
    support=topk and the reference's extended by the sampled token's own bucket for the default."""
    train_logits, mu_lp, topk_ids, _, s, pi, off = _case(seed=1)
    g = np.random.default_rng(2)
    adv = torch.from_numpy(g.choice([-1.0, 1.0], size=off.shape))
    log_prob = s.sampled_logprob(pi).clone().requires_grad_(True)
    old = s.sampled_logprob(s.mu_logprobs)
    mask = torch.ones(off.shape, dtype=torch.bool)
    delta = 0.05
    _, metrics = pm.policy_loss(method, log_prob=log_prob, old_log_prob=old, advantages=adv, response_mask=mask,
                                mu_logprobs=s.mu_logprobs, pi_logprobs=pi, valid=s.valid,
                                sampled_index=s.sampled_index, params=MethodParams(delta=delta, support=support))
    if support == "topk":
        d = reference_topk(train_logits, topk_ids, np.take_along_axis(mu_lp, topk_ids, -1))[col]
    else:  # the K+1 buckets: the sampled token's own bucket where it lies outside the top-K
        ids = s.ids.numpy()
        valid = s.valid.numpy()
        lq = np.take_along_axis(_log_softmax(train_logits), ids, -1)
        lp = np.take_along_axis(mu_lp, ids, -1)
        p, q = np.where(valid, np.exp(lp), 0.0), np.where(valid, np.exp(lq), 0.0)
        rp, rq = np.maximum(1 - p.sum(-1), 1e-12), np.maximum(1 - q.sum(-1), 1e-12)
        d = ((np.where(valid, p * (lp - lq), 0.0)).sum(-1) + rp * np.log(rp / rq)) if col == 0 else \
            (np.abs(p - q).sum(-1) + np.abs(rp - rq)) / 2
    r = np.exp(log_prob.detach().numpy() - old.numpy())
    dropped = (d > delta) & (adv.numpy() * (r - 1) > 0)
    assert 0 < dropped.sum() < dropped.size
    assert metrics[M.CLIPFRAC] == pytest.approx(dropped.mean(), abs=1e-6)
    assert metrics[M.MASK_DIVERGENCE_MEAN] == pytest.approx(d.mean(), rel=1e-6)
    assert metrics[M.MASK_OUTSIDE_FRAC] == pytest.approx((d > delta).mean(), abs=1e-6)


def test_the_support_is_recorded_only_when_not_the_default_and_refused_where_it_cannot_apply() -> None:
    """Run ids stay: the default adds no key; the top-K-only support is recorded and read back; a binary or clipping
    method, or the predictive direction (its Ddot takes the sampled token on the support), refuses it in one line."""
    assert TOPK_SUPPORTS[0] == "topk_plus_sampled"
    assert method_config({"name": "dppo_topk_kl", "support": "topk_plus_sampled"}) == \
        method_config({"name": "dppo_topk_kl"})
    rec = method_config({"name": "dppo_topk_tv", "support": "topk"})
    assert rec["support"] == "topk" and method_params(rec).support == "topk"
    for name, match in (("dppo_binary_kl", "takes no support=topk"), ("grpo_clip_higher", "takes no support=topk"),
                        ("predmask_kl_agg", "support=topk needs the ratio direction")):
        with pytest.raises(ValueError, match=match) as err:
            method_config({"name": name, "support": "topk"})
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="unknown support 'all'; allowed: topk_plus_sampled, topk"):
        MethodParams(support="all")


def test_the_cpu_engine_takes_the_support_from_its_method_section() -> None:
    """The CPU engine's resolved run config carries support=topk, and the parameters its loss reads have it."""
    from predmask.rl.engine import prepare_config

    c = prepare_config(compose("train", ["method=dppo_topk_kl", "+method.support=topk"]))
    assert c["method"]["support"] == "topk" and method_params(c["method"]).support == "topk"
    default = prepare_config(compose("train", ["method=dppo_topk_kl"]))
    assert "support" not in default["method"] and method_params(default["method"]).support is None
    assert to_container(compose("train", []))["method"]["name"] == "dppo_topk_kl"
