"""predmask's methods in verl's policy-loss registry: same loss and metrics as predmask.policy_loss, verl's config.

Uses verl's real ``get_policy_loss_fn``, ``ActorConfig`` and ``agg_loss``; nothing is mocked. predmask's own
parameters come from its settings (the environment variable the launcher sets in every process).
"""

from __future__ import annotations

import json
import zlib

import pytest
import torch
from verl_helpers import require_verl

core_algos = require_verl()

import predmask
import predmask.verl.plugin  # installs the hooks: the losses are registered in core_algos
from predmask.support import build_support
from predmask.verl.loss import (
    EXTRA_METRICS,
    RolloutSupport,
    loss_statistics,
    make_policy_loss,
    method_params,
    rollout_support,
)
from predmask.verl.settings import SETTINGS_ENV, PluginSettings

pytestmark = pytest.mark.verl


@pytest.fixture
def settings(monkeypatch):
    """Set predmask's settings of this process, as the launcher does (``settings(delta=0.1, ...)``)."""
    def set_(**values):
        monkeypatch.setenv(SETTINGS_ENV, json.dumps(values))
    return set_


def actor_config(**kwargs):
    from verl.workers.config import FSDPActorConfig

    base = {"strategy": "fsdp", "rollout_n": 4, "ppo_micro_batch_size_per_gpu": 1}
    return FSDPActorConfig(**{**base, **kwargs})


def make_batch(seed: int = 0, b: int = 4, length: int = 7, k: int = 5, vocab: int = 40):
    """Random rollout/training distributions, a sampled token per position, and the support built from them."""
    g = torch.Generator().manual_seed(seed)
    mu_full = torch.log_softmax(torch.randn(b, length, vocab, generator=g) * 2, -1)
    pi_full = torch.log_softmax(mu_full + 0.6 * torch.randn(b, length, vocab, generator=g), -1)
    sampled = torch.distributions.Categorical(logits=mu_full).sample()
    top = mu_full.topk(k, -1)
    mu_k = mu_full.gather(-1, sampled.unsqueeze(-1)).squeeze(-1)
    support = build_support(top.indices, top.values, sampled, mu_k)
    pi_support = torch.where(support.valid, pi_full.gather(-1, support.ids), torch.tensor(float("-inf")))
    tail_sq = (pi_full.exp() ** 2).sum(-1) - torch.where(support.valid, pi_support.exp() ** 2, 0.0).sum(-1)
    log_prob = pi_full.gather(-1, sampled.unsqueeze(-1)).squeeze(-1).requires_grad_(True)
    mask = torch.ones(b, length)
    mask[0, 5:] = 0
    mask[2, 3:] = 0
    advantages = torch.randn(b, 1, generator=g).expand(b, length).contiguous()
    old = mu_k + 0.05 * torch.randn(b, length, generator=g)  # a recomputed old log-prob, not the anchor
    batch = RolloutSupport(anchor_logprobs=mu_k, support=support, pi_logprobs=pi_support,
                           pi_tail_sq=tail_sq.clamp_min(0), vocab_size=vocab)
    return batch, log_prob, old, advantages, mask


def test_every_method_is_registered_under_its_name() -> None:
    for name in predmask.METHODS:
        fn = core_algos.get_policy_loss_fn(name)
        assert getattr(fn, "predmask_method", None) == name
    # verl's own losses are untouched
    assert core_algos.get_policy_loss_fn("vanilla").__module__ == "verl.trainer.ppo.core_algos"


def test_unknown_names_still_fail_in_verl() -> None:
    with pytest.raises(ValueError, match="Unsupported loss mode"):
        core_algos.get_policy_loss_fn("predmask_nope")


@pytest.mark.parametrize("name", sorted(predmask.METHODS))
@pytest.mark.parametrize("mode", predmask.LOSS_AGG_MODES)
def test_registered_loss_equals_predmask_policy_loss(settings, name: str, mode: str) -> None:
    batch, log_prob, old, adv, mask = make_batch(seed=zlib.crc32(f"{name}/{mode}".encode()) % 1000)
    settings(delta=0.1, ratio_cap=10.0)
    # verl's own clip_ratio / clip_ratio_c keep verl's meaning: predmask reads neither
    config = actor_config(clip_ratio=0.5, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                          loss_agg_mode=mode)
    config.global_batch_info.update({"dp_size": 2, "batch_num_tokens": 40, "global_batch_size": 8,
                                     "loss_scale_factor": None})
    fn = core_algos.get_policy_loss_fn(name)
    with rollout_support(batch):
        loss, metrics = fn(old_log_prob=old, log_prob=log_prob, advantages=adv, response_mask=mask,
                           loss_agg_mode=mode, config=config, rollout_is_weights=None)
    method = predmask.get_method(name)
    support_kwargs = {}
    if method.needs_support:
        support_kwargs = {"mu_logprobs": batch.support.mu_logprobs, "pi_logprobs": batch.pi_logprobs,
                          "valid": batch.support.valid, "sampled_index": batch.support.sampled_index,
                          "pi_tail_sq": batch.pi_tail_sq}
    params = predmask.MethodParams(delta=0.1, eps_low=0.2, eps_high=0.28, ratio_cap=10.0, loss_agg_mode=mode,
                                   vocab_size=40)
    anchor = old if method.kind == "clip" else batch.anchor_logprobs  # the methods' default anchors
    ref_loss, ref_metrics = predmask.policy_loss(
        name, log_prob=log_prob, old_log_prob=anchor, advantages=adv, response_mask=mask,
        params=params, global_batch_info={"dp_size": 2, "batch_num_tokens": 40, "global_batch_size": 8,
                                          "loss_scale_factor": None}, **support_kwargs)
    assert torch.equal(loss, ref_loss)
    assert {k: v for k, v in metrics.items() if k not in EXTRA_METRICS} == ref_metrics
    extra = set(metrics) - set(ref_metrics)
    assert extra == (set(EXTRA_METRICS) if method.needs_support else set())
    # gradients flow to the training log-probs like predmask's
    (g_ours,) = torch.autograd.grad(loss, log_prob, retain_graph=True)
    (g_ref,) = torch.autograd.grad(ref_loss, log_prob)
    assert torch.equal(g_ours, g_ref)


def test_pi_sampled_gap_is_zero_when_aligned() -> None:
    batch, log_prob, old, adv, mask = make_batch(seed=3)
    with rollout_support(batch):
        _, metrics = core_algos.get_policy_loss_fn("predmask_kl_agg")(old, log_prob, adv, mask, "token-mean",
                                                                      actor_config(clip_ratio=0.15))
    assert metrics["actor/mask/pi_sampled_gap"] < 1e-6


def test_parameters_come_from_predmask_keys_and_verls_clip_range() -> None:
    config = actor_config(clip_ratio=0.5, clip_ratio_low=0.1, clip_ratio_high=0.3, clip_ratio_c=3.0)
    settings = PluginSettings(delta=0.05, ratio_cap=7.0, anchor="rollout")
    params = method_params(config, "seq-mean-token-mean", vocab_size=123, settings=settings)
    assert (params.delta, params.eps_low, params.eps_high, params.ratio_cap) == (0.05, 0.1, 0.3, 7.0)
    assert params.loss_agg_mode == "seq-mean-token-mean" and params.vocab_size == 123 and params.anchor == "rollout"
    default = method_params(config, "token-mean", settings=PluginSettings())
    assert (default.delta, default.ratio_cap, default.anchor) == (0.15, 10.0, None)  # MethodParams' defaults


def test_delta_from_the_settings_drives_the_mask(settings) -> None:
    batch, log_prob, old, adv, mask = make_batch(seed=5)
    fn = core_algos.get_policy_loss_fn("dppo_topk_kl")
    with rollout_support(batch):
        settings(delta=10.0)
        _, loose = fn(old, log_prob, adv, mask, "token-mean", actor_config(clip_ratio=1e-4))
        settings(delta=1e-4)
        _, tight = fn(old, log_prob, adv, mask, "token-mean", actor_config(clip_ratio=10.0))
    assert loose["actor/mask/outside_frac"] == 0.0 < tight["actor/mask/outside_frac"]


@pytest.mark.parametrize(("name", "anchor", "expected"), [
    ("grpo_clip_higher", None, "old"), ("grpo_clip_higher", "rollout", "rollout"),
    ("dppo_topk_kl", None, "rollout"), ("dppo_topk_kl", "old", "old"),
])
def test_the_ratio_is_anchored_as_the_anchor_says(settings, name: str, anchor: str | None, expected: str) -> None:
    """grpo_clip_higher anchors on verl's old_log_prob by default (verl's GRPO), the divergence methods on the
    rollout's log mu_k (the paper); predmask.anchor chooses the other."""
    batch, log_prob, old, adv, mask = make_batch(seed=7)
    settings(**({"anchor": anchor} if anchor else {}))
    config = actor_config(clip_ratio_low=0.2, clip_ratio_high=0.28)
    with rollout_support(batch):
        loss, metrics = core_algos.get_policy_loss_fn(name)(old, log_prob, adv, mask, "token-mean", config)
    kwargs = {}
    if predmask.get_method(name).needs_support:
        kwargs = {"mu_logprobs": batch.support.mu_logprobs, "pi_logprobs": batch.pi_logprobs,
                  "valid": batch.support.valid, "sampled_index": batch.support.sampled_index}
    refs = {a: predmask.policy_loss(name, log_prob=log_prob, old_log_prob=lp, advantages=adv, response_mask=mask,
                                    **kwargs)
            for a, lp in (("old", old), ("rollout", batch.anchor_logprobs))}
    assert torch.equal(loss, refs[expected][0]) and metrics["actor/ppo_kl"] == refs[expected][1]["actor/ppo_kl"]
    assert not torch.equal(refs["old"][0], refs["rollout"][0])


def test_grpo_runs_on_old_log_prob_without_records(settings) -> None:
    _, log_prob, old, adv, mask = make_batch(seed=8)
    loss, _ = core_algos.get_policy_loss_fn("grpo_clip_higher")(
        old, log_prob, adv, mask, "token-mean", actor_config(clip_ratio_low=0.2, clip_ratio_high=0.28))
    ref, _ = predmask.policy_loss("grpo_clip_higher", log_prob=log_prob, old_log_prob=old, advantages=adv,
                                  response_mask=mask)
    assert torch.equal(loss, ref)
    settings(anchor="rollout")
    with pytest.raises(ValueError, match="predmask.top_k"):
        core_algos.get_policy_loss_fn("grpo_clip_higher")(old, log_prob, adv, mask, "token-mean", actor_config())


def test_divergence_method_without_support_says_how_to_fix() -> None:
    _, log_prob, old, adv, mask = make_batch()
    with pytest.raises(ValueError, match="predmask.top_k"):
        core_algos.get_policy_loss_fn("predmask_kl_agg")(old, log_prob, adv, mask, "token-mean", actor_config())


def test_loss_statistics_receive_each_calls_metrics_and_the_clip_fraction_weight() -> None:
    batch, log_prob, old, adv, mask = make_batch(seed=9)
    adv = adv.clone()
    adv[1] = 0.0  # a row without advantage: not in pg_clipfrac's denominator
    seen: list[dict[str, float]] = []
    with rollout_support(batch), loss_statistics(seen.append):
        _, metrics = core_algos.get_policy_loss_fn("predmask_kl_agg")(old, log_prob, adv, mask, "token-mean",
                                                                      actor_config())
    (record,) = seen
    assert {k: v for k, v in record.items() if k != "actor/mask/adv_tokens"} == metrics
    assert record["actor/mask/adv_tokens"] == float(((mask > 0) & (adv != 0)).sum()) == 15.0


def test_rollout_importance_weights_are_refused() -> None:
    batch, log_prob, old, adv, mask = make_batch()
    with rollout_support(batch), pytest.raises(ValueError, match="rollout_correction"):
        core_algos.get_policy_loss_fn("dppo_topk_kl")(old, log_prob, adv, mask, "token-mean", actor_config(),
                                                      torch.ones_like(old))


def test_registration_refuses_to_shadow_a_foreign_loss() -> None:
    from types import SimpleNamespace

    from predmask.verl.loss import register_all

    registry = {"dppo_topk_kl": lambda *a, **k: None}
    fake = SimpleNamespace(POLICY_LOSS_REGISTRY=registry, register_policy_loss=core_algos.register_policy_loss)
    with pytest.raises(ValueError, match="dppo_topk_kl"):
        register_all(fake)
    assert make_policy_loss("dppo_topk_kl").predmask_method == "dppo_topk_kl"


AGG_MODES_MATCHING_VERL = list(predmask.LOSS_AGG_MODES)


@pytest.mark.parametrize("mode", AGG_MODES_MATCHING_VERL)
@pytest.mark.parametrize("info", [{}, {"dp_size": 4, "batch_num_tokens": 37, "global_batch_size": 9}])
def test_predmask_aggregation_matches_verl_agg_loss(mode: str, info: dict) -> None:
    g = torch.Generator().manual_seed(11)
    loss_mat = torch.randn(5, 8, generator=g)
    mask = (torch.rand(5, 8, generator=g) > 0.3).float()
    ours = predmask.agg_loss(loss_mat, mask, mode, **info)
    theirs = core_algos.agg_loss(loss_mat, mask, mode, **info)
    torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("mode", ["seq-mean-token-sum-norm", "token-sum"])
def test_verl_09_modes_match_verl(mode: str) -> None:
    loss_mat = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    mask = (torch.rand(5, 8, generator=torch.Generator().manual_seed(2)) > 0.3).float()
    torch.testing.assert_close(predmask.agg_loss(loss_mat, mask, mode), core_algos.agg_loss(loss_mat, mask, mode))
