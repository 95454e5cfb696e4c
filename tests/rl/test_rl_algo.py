"""GRPO pieces (predmask.rl.algo): group advantages, support log-probs, and the direction of one masked update."""

from __future__ import annotations

import statistics

import pytest
import torch
from rl_helpers import peaked_policy

from predmask.methods import MethodParams
from predmask.rl.algo import (
    grpo_advantages,
    mismatch_metrics,
    policy_update,
    support_logprobs,
    token_advantages,
)
from predmask.rl.rollout import rollout_problems
from predmask.rl.task import make_split
from predmask.schemas.task_schema import TaskConfig
from predmask.support import gather_support_logprobs


def test_advantages_are_normalised_per_group() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0])
    adv = grpo_advantages(rewards, group_size=4)
    for g in range(3):
        grp = rewards[4 * g: 4 * g + 4].tolist()
        mean, sd = statistics.mean(grp), statistics.stdev(grp)   # unbiased std, as verl's GRPO
        expected = [(r - mean) / (sd + 1e-6) for r in grp]
        assert adv[4 * g: 4 * g + 4].tolist() == pytest.approx(expected, abs=1e-5)
    assert (adv[4:8] == 0).all()                                 # all-correct group: no signal
    # group order matters: the same rewards grouped differently give different advantages
    assert not torch.allclose(grpo_advantages(rewards, 2), adv)
    singles = grpo_advantages(rewards, 1)                       # a group of one: advantage 0, never NaN
    assert torch.equal(singles, torch.zeros(12)) and singles.dtype == torch.float32
    with pytest.raises(ValueError, match="groups of 5"):
        grpo_advantages(rewards, 5)


def test_token_advantages_broadcast_and_mask() -> None:
    adv = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    assert token_advantages(adv, mask).tolist() == [[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]]


@pytest.fixture(scope="module")
def rollout(tokenizer):
    model = peaked_policy(tokenizer, scale=6.0)
    batch = rollout_problems(model, tokenizer, make_split(TaskConfig(), "train", 8), n=4, max_new_tokens=8,
                             generator=torch.Generator().manual_seed(0))
    return model, batch


def test_support_logprobs_match_a_direct_log_softmax(rollout) -> None:
    model, b = rollout
    s = b.support()
    with torch.no_grad():
        lp = support_logprobs(model, b, s)
        ids = torch.cat([b.prompt_ids, b.response_ids], 1)
        attn = torch.cat([b.prompt_mask, b.response_mask], 1).long()
        logits = model(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp_min(0)).logits
        p = b.prompt_ids.shape[1]
        full = torch.log_softmax(logits[:, p - 1:-1].float(), -1)
    m = b.response_mask
    direct = full.gather(-1, s.ids.clamp_min(0))
    assert torch.allclose(lp.pi[s.valid & m.unsqueeze(-1)], direct[s.valid & m.unsqueeze(-1)], atol=1e-5)
    assert torch.allclose(lp.log_prob[m], full.gather(-1, b.response_ids.unsqueeze(-1)).squeeze(-1)[m], atol=1e-5)
    probs = full.exp()
    on_support = torch.zeros_like(probs).scatter_add(-1, s.ids.clamp_min(0), s.valid.float()) > 0
    tail_sq = (probs.pow(2) * (~on_support)).sum(-1)
    assert torch.allclose(lp.pi_tail_sq[m], tail_sq[m], rtol=1e-4, atol=1e-7)
    # and the library's own gatherer agrees (same function the engine calls)
    ref = gather_support_logprobs(logits[:, p - 1:-1], s.ids, s.valid)
    assert torch.allclose(lp.pi[m], ref[m], atol=1e-5)
    mm = mismatch_metrics(b, s, lp.pi)
    assert abs(mm["rollout_corr/topk_kl"]) < 1e-5 and abs(mm["rollout_corr/kl"]) < 1e-5   # same model, fp32


@pytest.mark.parametrize("method", ["grpo_clip_higher", "dppo_topk_kl", "predmask_kl_agg", "predmask_kl_exact",
                                    "predmask_kl_uniform", "dppo_binary_tv"])
def test_update_raises_logprob_of_positive_advantage_sequences(rollout, tokenizer, method: str) -> None:
    """After one small SGD step, sequences with A > 0 gain log-probability relative to those with A < 0."""
    _, b = rollout
    model = peaked_policy(tokenizer, scale=6.0).train()
    adv = torch.linspace(-1, 1, b.batch_size)
    s = b.support()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with torch.no_grad():
        before = support_logprobs(model, b, s).log_prob
    metrics, lp = policy_update(model, opt, b, s, adv, method=method,
                                params=MethodParams(vocab_size=tokenizer.vocab_size), grad_clip=None)
    with torch.no_grad():
        after = support_logprobs(model, b, s).log_prob
    assert torch.allclose(lp.log_prob, before)
    gain = ((after - before) * b.response_mask).sum(-1)
    assert gain[adv > 0].mean() > gain[adv < 0].mean()
    assert torch.corrcoef(torch.stack([adv, gain]))[0, 1] > 0.2
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/ppo_kl", "actor/pg_clipfrac"):
        assert key in metrics


def test_update_with_step_false_leaves_weights(rollout, tokenizer) -> None:
    _, b = rollout
    model = peaked_policy(tokenizer, scale=6.0).train()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    policy_update(model, opt, b, b.support(), torch.ones(b.batch_size), method="dppo_topk_kl",
                  params=MethodParams(vocab_size=tokenizer.vocab_size), step=False)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_the_anchor_old_is_pi_old_and_the_rollout_anchor_is_todays_path(rollout, tokenizer) -> None:
    """anchor_logprobs replaces the rollout's log mu as the ratio's anchor; without it the update is exactly the
    rollout-anchored one (the loss written out with predmask.policy_loss on old_log_prob = log mu)."""
    from predmask.methods import policy_loss
    from predmask.rl.algo import token_advantages

    _, b = rollout
    s = b.support()
    adv = torch.linspace(-1, 1, b.batch_size)
    params = MethodParams(vocab_size=tokenizer.vocab_size)

    def update(method: str, anchor=None):
        model = peaked_policy(tokenizer, scale=6.0).train()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        return policy_update(model, opt, b, s, adv, method=method, params=params, grad_clip=None,
                             anchor_logprobs=anchor)[0]

    pi = support_logprobs(peaked_policy(tokenizer, scale=6.0), b, s)
    ref = {}
    for name in ("dppo_topk_kl", "grpo_clip_higher"):
        loss, m = policy_loss(name, log_prob=pi.log_prob, old_log_prob=b.sampled_logprobs,
                              advantages=token_advantages(adv, b.response_mask), response_mask=b.response_mask,
                              mu_logprobs=s.mu_logprobs, pi_logprobs=pi.pi, valid=s.valid,
                              sampled_index=s.sampled_index, pi_tail_sq=pi.pi_tail_sq, params=params)
        ref[name] = {**m, "actor/pg_loss": float(loss.detach())}
    for name in ("dppo_topk_kl", "grpo_clip_higher"):
        got = update(name)
        assert {k: got[k] for k in ref[name]} == ref[name], name
    # anchored on pi_old = the policy's own log-prob before the update: the first update sees r = 1 exactly
    with torch.no_grad():
        old = support_logprobs(peaked_policy(tokenizer, scale=6.0), b, s).log_prob
    on_old = update("grpo_clip_higher", anchor=old)
    assert on_old["actor/ppo_kl"] == 0.0 and on_old["actor/pg_clipfrac"] == 0.0
    assert ref["grpo_clip_higher"]["actor/ppo_kl"] != 0.0  # the rollout anchor differs (mu is the rollout's)


def test_engine_computes_pi_old_only_when_the_anchor_is_old(rollout, tokenizer) -> None:
    """Engine.old_logprobs: one no-grad forward of the training policy for anchor=old (grpo_clip_higher's
    default), None for the rollout anchor (every divergence method's default: their steps are unchanged). The
    engine is assembled from its parts here (a full Engine pretrains a base model)."""
    from predmask.methods import get_method
    from predmask.precisions import get_precision
    from predmask.rl.engine import Engine
    from predmask.schemas.train_schema import RolloutConfig

    _, b = rollout
    s = b.support()
    engine = Engine.__new__(Engine)
    engine.model = peaked_policy(tokenizer, scale=6.0)
    engine.rollout_cfg, engine.precision = RolloutConfig(), get_precision("fp32")
    for name, anchor, expect_old in (("grpo_clip_higher", None, True), ("grpo_clip_higher", "rollout", False),
                                     ("dppo_topk_kl", None, False), ("predmask_kl_agg", "old", True)):
        engine.method, engine.params = get_method(name), MethodParams(anchor=anchor)
        old = engine.old_logprobs(b, s)
        if not expect_old:
            assert old is None, (name, anchor)
            continue
        assert old is not None and not old.requires_grad
        with torch.no_grad():
            direct = support_logprobs(engine.model, b, s).log_prob
        assert torch.equal(old, direct)


def test_reads_tail_sq_names_exactly_the_methods_whose_loss_needs_the_exact_tail(rollout) -> None:
    """Independent truth: a method's loss without ``pi_tail_sq`` raises exactly when it reads it."""
    from predmask.methods import METHODS, policy_loss
    from predmask.rl.algo import reads_tail_sq

    _, b = rollout
    s = b.support()
    inputs = {"log_prob": b.sampled_logprobs, "old_log_prob": b.sampled_logprobs - 0.1,
              "advantages": torch.ones_like(b.sampled_logprobs), "response_mask": b.response_mask,
              "mu_logprobs": s.mu_logprobs, "pi_logprobs": s.mu_logprobs - 0.2, "valid": s.valid,
              "sampled_index": s.sampled_index, "params": MethodParams(vocab_size=s.ids.shape[-1] + 40)}
    readers = set()
    for name in METHODS:
        try:
            policy_loss(name, **inputs)
        except ValueError as err:
            assert "needs pi_tail_sq" in str(err), (name, err)
            readers.add(name)
    assert readers and readers == {name for name in METHODS if reads_tail_sq(name)}


@pytest.mark.parametrize("method", ["predmask_kl_exact", "predmask_kl_agg", "dppo_topk_kl", "grpo_clip_higher"])
def test_the_exact_tail_is_computed_only_where_the_method_reads_it(rollout, tokenizer, method: str,
                                                                    monkeypatch) -> None:
    """``tail_sq=None`` (the engine's update): the same loss, metrics and gradient as the tail always computed
    (``tail_sq=True``, the previous path); the gather is asked for the tail only by a method that reads it."""
    from predmask.rl import algo

    asked: list[bool] = []
    real = algo.gather_support_logprobs

    def spy(*args, **kwargs):
        asked.append(bool(kwargs.get("return_tail_sq", False)))
        return real(*args, **kwargs)

    monkeypatch.setattr(algo, "gather_support_logprobs", spy)
    _, b = rollout
    s = b.support()
    adv = torch.linspace(-1, 1, b.batch_size)
    out = {}
    for flag in (True, None):
        model = peaked_policy(tokenizer, scale=6.0).train()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        metrics, lp = policy_update(model, opt, b, s, adv, method=method, grad_clip=None,
                                    params=MethodParams(vocab_size=tokenizer.vocab_size), tail_sq=flag)
        out[flag] = metrics, lp, [p.grad.clone() for p in model.parameters() if p.grad is not None]
    reads = algo.reads_tail_sq(method)
    assert asked == [True, reads]
    assert out[None][0] == out[True][0]
    assert all(torch.equal(g, h) for g, h in zip(out[None][2], out[True][2]))
    if reads:
        assert torch.equal(out[None][1].pi_tail_sq, out[True][1].pi_tail_sq)
    else:
        assert out[None][1].pi_tail_sq is None and out[True][1].pi_tail_sq is not None
