"""predmask's dppo_binary_kl / dppo_binary_tv against verl 0.9.1's own dppo_kl / dppo_tv policy losses.

Both implement DPPO with the binary approximation of the divergence (the sampled token k against the rest of the
vocabulary) and the ratio direction: a token is dropped when D(mu, pi) > delta and the update moves its ratio
further away (A > 0 and pi_k > mu_k, or A < 0 and pi_k < mu_k); the kept tokens contribute
``-A * sg(min(r, c)) * log pi_k``. On the same random inputs (float64) the two agree in the loss, its gradient
(token by token, so the kept sets agree), ``actor/ppo_kl`` and ``actor/pg_clipfrac``, for every aggregation
mode, when their parameters are set alike. Where they differ (asserted below, and listed in docs/verl-plugin.md):

- **anchor**: verl's losses anchor r and D on the ``old_log_prob`` they are given (verl's recomputed pi_old, or
  the rollout's log-probs in verl's bypass mode); predmask's registered loss anchors on the rollout's log mu_k
  from the top-K records and uses ``old_log_prob`` only where a token has no record.
- **delta**: verl reads ``clip_ratio`` but lets ``clip_ratio_low`` / ``clip_ratio_high`` (both 0.2 by default in
  verl's ActorConfig, so they win unless set to null) give one threshold per side; predmask has one symmetric
  ``delta``, which the plugin reads from its own key ``predmask.delta`` (verl's keys keep verl's meaning). The
  ratio cap c is verl's ``clip_ratio_c`` (ActorConfig default 3.0) and predmask's ``ratio_cap`` (``predmask.ratio_cap``,
  method default 10.0).
- **zero advantages**: verl's ``pg_clipfrac`` counts every response token and applies its A <= 0 branch to
  A = 0 tokens; predmask's counts tokens with a nonzero advantage only (the loss is the same: those tokens
  contribute nothing). ``actor/pg_clipfrac_lower`` means different things: verl's is the fraction of kept tokens
  whose ratio exceeds c (truncated), predmask's the part of ``pg_clipfrac`` with A < 0.
- **numerics of the binary KL**: verl adds 1e-8 to both tail masses inside the logarithm; predmask floors the tail
  masses at 1e-12 (``predmask.divergence.MASS_FLOOR``). The two D differ by about 1e-8 / (1 - pi_k): only a
  token within that distance of delta could be kept by one and dropped by the other.
- **rollout importance weights**: verl multiplies the loss by ``rollout_is_weights``; predmask refuses them.
- the divergence is computed from the training log-probs gathered on the support in predmask (equal to verl's
  ``log_prob`` at the sampled token up to ``actor/mask/pi_sampled_gap``), from ``log_prob`` in verl.
"""

from __future__ import annotations

import pytest
import torch
from verl_helpers import require_verl

core_algos = require_verl()

import predmask
import predmask.verl.plugin  # installs the hooks: predmask's losses are registered in core_algos
from predmask.metrics import CLIPFRAC, PPO_KL
from predmask.verl.loss import RolloutSupport, rollout_support

pytestmark = pytest.mark.verl

#: predmask method -> verl's loss of the same definition
PAIRS = {"dppo_binary_kl": "dppo_kl", "dppo_binary_tv": "dppo_tv"}


def actor_config(delta: float, ratio_cap: float, mode: str, info: dict, *, sided: tuple[float, float] | None = None):
    from verl.workers.config import FSDPActorConfig

    low, high = sided if sided is not None else (delta, delta)
    config = FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio=delta,
                             clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=ratio_cap, loss_agg_mode=mode)
    config.global_batch_info.update(info)
    return config


def random_case(seed: int, b: int = 6, length: int = 24, width: int = 4, zero_adv: bool = False):
    """mu_k, pi_k in (0.001, 0.999) (pi a logit-space perturbation of mu), a support of ``width`` slots whose other
    slots carry some rollout mass (the binary divergence must ignore them), per-sequence advantages, a mask."""
    g = torch.Generator().manual_seed(seed)
    mu = torch.empty(b, length, dtype=torch.float64).uniform_(1e-3, 1 - 1e-3, generator=g)
    pi = torch.sigmoid(torch.logit(mu) + 0.8 * torch.randn(b, length, generator=g, dtype=torch.float64))
    pi = pi.clamp(1e-3, 1 - 1e-3)
    others = (1 - mu).unsqueeze(-1) * torch.rand(b, length, width - 1, generator=g, dtype=torch.float64) / width
    others_pi = (1 - pi).unsqueeze(-1) * torch.rand(b, length, width - 1, generator=g, dtype=torch.float64) / width
    mu_support = torch.cat([mu.unsqueeze(-1), others], -1).log()
    pi_support = torch.cat([pi.unsqueeze(-1), others_pi], -1).log()
    sampled_index = torch.zeros(b, length, dtype=torch.long)
    valid = torch.ones(b, length, width, dtype=torch.bool)
    advantages = torch.randn(b, 1, generator=g, dtype=torch.float64).expand(b, length).contiguous()
    if zero_adv:
        advantages[::2] = 0.0
    mask = (torch.rand(b, length, generator=g) > 0.2).to(torch.float64)
    mask[:, 0] = 1.0
    return {"mu_lp": mu.log(), "log_prob": pi.log(), "mu_support": mu_support, "pi_support": pi_support,
            "valid": valid, "sampled_index": sampled_index, "advantages": advantages, "mask": mask}


def verl_loss(name: str, case: dict, anchor: torch.Tensor, config) -> tuple[torch.Tensor, torch.Tensor, dict]:
    log_prob = case["log_prob"].clone().requires_grad_(True)
    loss, metrics = core_algos.get_policy_loss_fn(name)(
        old_log_prob=anchor, log_prob=log_prob, advantages=case["advantages"], response_mask=case["mask"],
        loss_agg_mode=config.loss_agg_mode, config=config)
    (grad,) = torch.autograd.grad(loss, log_prob)
    return loss.detach(), grad, metrics


def predmask_loss(name: str, case: dict, delta: float, ratio_cap: float, mode: str, info: dict):
    log_prob = case["log_prob"].clone().requires_grad_(True)
    loss, metrics = predmask.policy_loss(
        name, log_prob=log_prob, old_log_prob=case["mu_lp"], advantages=case["advantages"],
        response_mask=case["mask"], mu_logprobs=case["mu_support"], pi_logprobs=case["pi_support"],
        valid=case["valid"], sampled_index=case["sampled_index"],
        params=predmask.MethodParams(delta=delta, ratio_cap=ratio_cap, loss_agg_mode=mode), global_batch_info=info)
    (grad,) = torch.autograd.grad(loss, log_prob)
    return loss.detach(), grad, metrics


INFOS = [{}, {"dp_size": 2, "batch_num_tokens": 150, "global_batch_size": 12}]


@pytest.mark.parametrize("ours", sorted(PAIRS))
@pytest.mark.parametrize("mode", predmask.LOSS_AGG_MODES)
@pytest.mark.parametrize(("delta", "ratio_cap"), [(0.01, 3.0), (0.05, 10.0), (0.2, 1.5)])
def test_binary_dppo_equals_verls_dppo(ours: str, mode: str, delta: float, ratio_cap: float) -> None:
    for seed, info in enumerate(INFOS):
        case = random_case(seed + int(delta * 1000))
        config = actor_config(delta, ratio_cap, mode, info)
        v_loss, v_grad, v_metrics = verl_loss(PAIRS[ours], case, case["mu_lp"], config)
        p_loss, p_grad, p_metrics = predmask_loss(ours, case, delta, ratio_cap, mode, info)
        torch.testing.assert_close(p_loss, v_loss, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(p_grad, v_grad, rtol=1e-10, atol=1e-12)
        # verl's masked means divide by (token count + 1e-8), predmask counts dropped tokens in float32: equal to
        # well below one token in a hundred (1e-6 relative)
        assert p_metrics[PPO_KL] == pytest.approx(v_metrics[PPO_KL], rel=1e-8, abs=1e-15)
        assert p_metrics[CLIPFRAC] == pytest.approx(v_metrics[CLIPFRAC], rel=1e-6, abs=1e-12)
        # not vacuous: some tokens are dropped, some kept
        dropped = (p_grad == 0) & case["mask"].bool()
        assert 0 < int(dropped.sum()) < int(case["mask"].sum())


def test_the_kept_sets_are_verls_token_by_token() -> None:
    """Per-token loss with token-sum aggregation: the gradient of each token is -A * min(r, c) * keep, so equal
    gradients mean equal keep decisions; checked against the keep rule written out here."""
    case = random_case(7, b=16, length=64)
    delta, cap = 0.03, 1.5
    for ours, theirs in PAIRS.items():
        _, v_grad, _ = verl_loss(theirs, case, case["mu_lp"], actor_config(delta, cap, "token-sum", {}))
        _, p_grad, _ = predmask_loss(ours, case, delta, cap, "token-sum", {})
        mu, pi = case["mu_lp"].exp(), case["log_prob"].exp()
        if ours.endswith("kl"):
            d = mu * (mu.log() - pi.log()) + (1 - mu) * ((1 - mu).log() - (1 - pi).log())
        else:
            d = (pi - mu).abs()
        adv = case["advantages"]
        keep = ~((d > delta) & (adv * (pi - mu) > 0))
        expect = -adv * (pi / mu).clamp(max=cap) * keep * case["mask"]
        torch.testing.assert_close(p_grad, expect, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(v_grad, expect, rtol=1e-10, atol=1e-12)
        live = case["mask"].bool() & (adv != 0)
        assert (live & ~keep).any() and (live & keep & (pi / mu > cap)).any()  # drops and truncations both occur


def test_difference_anchor_rollout_mu_versus_old_log_prob(monkeypatch) -> None:
    """predmask's registered loss anchors on the rollout's mu even when verl hands it a different old_log_prob:
    it equals verl's dppo_kl anchored on mu, not verl's dppo_kl anchored on old_log_prob."""
    from predmask.verl.settings import SETTINGS_ENV

    monkeypatch.setenv(SETTINGS_ENV, '{"delta": 0.05, "ratio_cap": 10.0}')  # as the launcher sets predmask.*
    case = random_case(3)
    g = torch.Generator().manual_seed(11)
    old = case["mu_lp"] + 0.3 * torch.randn(case["mu_lp"].shape, generator=g, dtype=torch.float64)
    old = old.clamp(max=-1e-3)
    config = actor_config(0.05, 10.0, "token-mean", {})
    batch = RolloutSupport(anchor_logprobs=case["mu_lp"], support=_support(case), pi_logprobs=case["pi_support"])
    log_prob = case["log_prob"].clone().requires_grad_(True)
    with rollout_support(batch):
        ours, _ = core_algos.get_policy_loss_fn("dppo_binary_kl")(
            old, log_prob, case["advantages"], case["mask"], "token-mean", config)
    on_mu, _, _ = verl_loss("dppo_kl", case, case["mu_lp"], config)
    on_old, _, _ = verl_loss("dppo_kl", case, old, config)
    torch.testing.assert_close(ours.detach(), on_mu, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(on_mu, on_old)


def _support(case: dict):
    from predmask.support import TopKSupport

    ids = torch.arange(case["valid"].shape[-1]).expand(case["valid"].shape)
    return TopKSupport(ids=ids, mu_logprobs=case["mu_support"], valid=case["valid"],
                       sampled_index=case["sampled_index"])


def test_difference_verls_sided_thresholds_win_over_clip_ratio() -> None:
    """verl's dppo losses take delta from clip_ratio_low / clip_ratio_high when set (verl's defaults: 0.2 each);
    predmask has one delta. With clip_ratio=0.02 and the default sides, verl's dppo_kl is
    predmask's at delta=0.2, not at 0.02."""
    from verl.workers.config import FSDPActorConfig

    case = random_case(5)
    config = FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio=0.02,
                             clip_ratio_c=10.0)
    assert (config.clip_ratio_low, config.clip_ratio_high) == (0.2, 0.2)
    v_loss, _, _ = verl_loss("dppo_kl", case, case["mu_lp"], config)
    at_sides, _, _ = predmask_loss("dppo_binary_kl", case, 0.2, 10.0, "token-mean", {})
    at_clip_ratio, _, _ = predmask_loss("dppo_binary_kl", case, 0.02, 10.0, "token-mean", {})
    torch.testing.assert_close(at_sides, v_loss, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(at_clip_ratio, v_loss)
    # and asymmetric sides have no predmask counterpart: they differ from either symmetric delta
    sided, _, _ = verl_loss("dppo_kl", case, case["mu_lp"], actor_config(0.02, 10.0, "token-mean", {},
                                                                          sided=(0.2, 0.02)))
    assert not torch.allclose(sided, at_sides) and not torch.allclose(sided, at_clip_ratio)


def test_difference_zero_advantage_tokens_only_in_the_clip_fraction() -> None:
    """Tokens with A = 0: the same loss and gradient, but verl's pg_clipfrac counts them (its A <= 0 branch)."""
    case = random_case(9, zero_adv=True)
    for ours, theirs in PAIRS.items():
        config = actor_config(0.01, 10.0, "token-mean", {})
        v_loss, v_grad, v_metrics = verl_loss(theirs, case, case["mu_lp"], config)
        p_loss, p_grad, p_metrics = predmask_loss(ours, case, 0.01, 10.0, "token-mean", {})
        torch.testing.assert_close(p_loss, v_loss, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(p_grad, v_grad, rtol=1e-10, atol=1e-12)
        assert p_metrics[CLIPFRAC] != pytest.approx(v_metrics[CLIPFRAC])
