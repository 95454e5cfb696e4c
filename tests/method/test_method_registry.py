"""The catalogues: methods and their conf/method files, registries of behaviour, metrics, precisions."""

from __future__ import annotations

import pytest
import torch

import predmask as pm
from predmask import divergence as dv
from predmask import methods
from predmask.config import group_entry, group_options
from predmask.metrics import METRICS, metric, reduce_metrics, val_acc, wall_clock
from predmask.precisions import CLUSTER_PRECISIONS, PRECISIONS, get_precision


def test_every_registered_method_has_a_config_file_and_every_file_a_method() -> None:
    assert set(group_options("method")) == set(pm.METHODS)


@pytest.mark.parametrize("name", sorted(set(group_options("method")) | set(pm.METHODS)))
def test_a_method_file_selects_its_method_and_repeats_no_default(name: str) -> None:
    """conf/method/<name>.yaml: its name, its label, and (for methods that read delta) the link to the top-level
    delta; the parameter defaults are MethodParams' only."""
    entry = group_entry("method", name)
    method = pm.get_method(entry["name"])
    assert entry["name"] == name and isinstance(entry["label"], str) and entry["label"]
    expected = {"name", "label"} | ({"delta"} if "delta" in method.params else set())
    assert set(entry) == expected
    if "delta" in entry:
        assert entry["delta"] == "${delta}"


def test_method_config_completes_a_section_with_the_parameters_the_method_reads() -> None:
    clip = pm.method_config({"name": "grpo_clip_higher", "label": "x"})
    assert clip == {"name": "grpo_clip_higher", "label": "x", "eps_low": 0.2, "eps_high": 0.28, "anchor": "old",
                    "loss_agg_mode": "token-mean"}
    div = pm.method_config({"name": "dppo_topk_kl", "delta": 0.05})
    assert div == {"name": "dppo_topk_kl", "delta": 0.05, "ratio_cap": 10.0, "loss_agg_mode": "token-mean"}


def test_the_anchor_is_recorded_where_it_is_not_the_papers_default() -> None:
    """grpo_clip_higher records its anchor (verl's pi_old by default); a divergence method's config carries it only
    when it is not the rollout's mu (so the run ids of default divergence runs stay what they were)."""
    from predmask.methods import ANCHORS, method_anchor

    assert ANCHORS == ("old", "rollout")
    assert pm.method_config({"name": "grpo_clip_higher", "anchor": "rollout"})["anchor"] == "rollout"
    assert "anchor" not in pm.method_config({"name": "dppo_topk_kl", "anchor": "rollout"})
    assert pm.method_config({"name": "predmask_kl_agg", "anchor": "old"})["anchor"] == "old"
    assert [method_anchor({"name": n}) for n in ("grpo_clip_higher", "dppo_topk_kl", "predmask_kl_agg")] == [
        "old", "rollout", "rollout"]
    assert method_anchor(pm.method_config({"name": "predmask_kl_agg", "anchor": "old"})) == "old"
    assert {m: pm.get_method(m).default_anchor for m in pm.METHODS} == {
        m: "old" if pm.get_method(m).kind == "clip" else "rollout" for m in pm.METHODS}
    with pytest.raises(ValueError, match="unknown anchor 'pi'; allowed: old, rollout"):
        pm.MethodParams(anchor="pi")


def _batch(seed: int = 0, bs: int = 4, length: int = 6, vocab: int = 30, k: int = 5):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(bs, length, vocab, generator=g, dtype=torch.float64) * 1.5
    mu_full = torch.log_softmax(z + 0.8 * torch.randn(z.shape, generator=g, dtype=torch.float64), -1)
    sampled = torch.multinomial(mu_full.exp().reshape(-1, vocab), 1, generator=g).reshape(bs, length)
    top = mu_full.topk(k, -1)
    sup = pm.build_support(top.indices, top.values, sampled, mu_full.gather(-1, sampled[..., None])[..., 0])
    pi = torch.log_softmax(z, -1).gather(-1, sup.ids)
    pi = torch.where(sup.valid, pi, torch.full_like(pi, -torch.inf))
    adv = torch.randn(bs, 1, generator=g, dtype=torch.float64).expand(bs, length).clone()
    return {"log_prob": sup.sampled_logprob(pi), "old_log_prob": sup.sampled_logprob(sup.mu_logprobs),
            "advantages": adv, "response_mask": torch.ones(bs, length, dtype=torch.bool),
            "mu_logprobs": sup.mu_logprobs, "pi_logprobs": pi, "valid": sup.valid, "sampled_index": sup.sampled_index}


def test_a_new_direction_criterion_is_one_registered_function(monkeypatch: pytest.MonkeyPatch) -> None:
    """A criterion that never predicts an increase keeps every token, whatever D says."""
    monkeypatch.setitem(methods.DIRECTIONS, "never", lambda x: torch.zeros_like(x.advantages, dtype=torch.bool))
    method = methods.Method("dppo_topk_kl_never", "divergence", "kl", "topk", "never")
    monkeypatch.setitem(pm.METHODS, method.name, method)
    loss, m = pm.policy_loss(method.name, **_batch(), delta=1e-6)
    _, ratio = pm.policy_loss("dppo_topk_kl", **_batch(), delta=1e-6)
    assert m[pm.metrics.CLIPFRAC] == 0.0 and ratio[pm.metrics.CLIPFRAC] > 0.0
    assert m[pm.metrics.MASK_OUTSIDE_FRAC] == 1.0 and m[pm.metrics.MASK_DIRECTION_DISAGREE] > 0
    assert torch.isfinite(loss)


def test_a_method_missing_a_part_is_refused_in_one_line_naming_it() -> None:
    with pytest.raises(ValueError, match=r"method 'half': a 'divergence' loss needs support, direction$"):
        methods.Method("half", "divergence", "kl")
    no_tail = methods.Method("no_tail", "divergence", "kl", "topk", "predictive")
    with pytest.raises(ValueError, match="method 'no_tail': the predictive direction needs a tail estimator"):
        pm.policy_loss(no_tail, **_batch(), delta=1e-6)


def test_a_new_divergence_is_one_registered_function(monkeypatch: pytest.MonkeyPatch) -> None:
    """Twice the TV, registered with twice its derivative, masks at 2 delta exactly as TV masks at delta."""
    tv = dv.get_divergence("tv")
    twice = dv.Divergence("tv2", lambda c: 2 * tv.value(c), lambda c, k, q: 2 * tv.change(c, k, q))
    monkeypatch.setitem(dv.DIVERGENCES, "tv2", twice)
    for direction in ("ratio", "predictive"):
        mine = methods.Method(f"tv2_{direction}", "divergence", "tv2", "topk", direction, "aggregated")
        monkeypatch.setitem(pm.METHODS, mine.name, mine)
        reference = "dppo_topk_tv" if direction == "ratio" else "predmask_tv_agg"
        a, ma = pm.policy_loss(mine.name, **_batch(1), delta=0.2)
        b, mb = pm.policy_loss(reference, **_batch(1), delta=0.1)
        torch.testing.assert_close(a, b)
        assert ma[pm.metrics.CLIPFRAC] == mb[pm.metrics.CLIPFRAC] > 0


def test_a_method_must_name_registered_parts() -> None:
    with pytest.raises(ValueError, match="unknown direction criterion 'sideways'; allowed: ratio, predictive"):
        methods.Method("x", "divergence", "kl", "topk", "sideways")
    with pytest.raises(ValueError, match="unknown divergence 'js'; allowed: kl, tv"):
        methods.Method("x", "divergence", "js", "topk", "ratio")
    with pytest.raises(ValueError, match="unknown loss kind 'dpo'; allowed: clip, divergence"):
        methods.Method("x", "dpo")
    with pytest.raises(ValueError, match="unknown support 'full'; allowed: topk, binary$"):
        methods.Method("x", "divergence", "kl", "full", "ratio")
    with pytest.raises(ValueError, match="already registered"):
        pm.register_method(pm.get_method("dppo_topk_kl"))


def test_policy_loss_metrics_are_catalogue_names() -> None:
    for name in pm.METHODS:
        _, m = pm.policy_loss(name, **_batch(), pi_tail_sq=torch.full((4, 6), 0.01, dtype=torch.float64),
                              vocab_size=30)
        assert all(metric(k).name == k for k in m), name


def test_reduce_metrics_follows_the_catalogue() -> None:
    per_mb = [
        {"actor/mask/tokens": 3.0, "actor/ppo_kl": 1.0, "actor/mask/divergence_max": 0.5, "critic/score/min": 0.2},
        {"actor/mask/tokens": 4.0, "actor/ppo_kl": 2.0, "actor/mask/divergence_max": 0.25},
    ]
    out = reduce_metrics(per_mb)
    assert out == {"actor/mask/divergence_max": 0.5, "actor/mask/tokens": 7.0, "actor/ppo_kl": 1.5,
                   "critic/score/min": 0.2}
    assert list(out) == sorted(out)
    with pytest.raises(ValueError, match="unknown metric 'actor/nope'"):
        reduce_metrics([{"actor/nope": 1.0}])


def test_weighted_means_name_a_count_of_the_catalogue() -> None:
    from predmask.metrics import merge_micro_batches

    weighted = {m.name: m.weight for m in METRICS.values() if m.weight is not None}
    assert weighted == {"actor/ppo_kl": "actor/mask/tokens", "actor/mask/divergence_mean": "actor/mask/tokens",
                        "actor/mask/outside_frac": "actor/mask/tokens", "actor/pg_clipfrac": "actor/mask/adv_tokens",
                        "actor/pg_clipfrac_lower": "actor/mask/adv_tokens"}
    assert all(METRICS[m.name].reduce == "mean" and METRICS[w].reduce == "sum" for m in METRICS.values()
               if (w := m.weight) is not None)
    parts = [{"actor/mask/tokens": 1.0, "actor/ppo_kl": 0.4, "actor/mask/divergence_max": 0.2},
             {"actor/mask/tokens": 3.0, "actor/ppo_kl": 0.0, "actor/mask/divergence_max": 0.5},
             {"actor/mask/tokens": 0.0, "actor/ppo_kl": 0.0}]
    assert merge_micro_batches(parts) == {"actor/mask/divergence_max": 0.5, "actor/mask/tokens": 4.0,
                                          "actor/ppo_kl": 0.1}
    assert merge_micro_batches([{"actor/mask/tokens": 0.0, "actor/ppo_kl": 0.0}])["actor/ppo_kl"] == 0.0


def test_metric_families_and_wall_clock() -> None:
    assert val_acc("math-ai/aime24", 32) == "val-core/math-ai/aime24/acc/mean@32"
    assert metric("val-core/math-ai/aime24/acc/mean@32") is METRICS["val-core/{source}/acc/mean@{n}"]
    assert wall_clock("timing_s/step") and not wall_clock("critic/score/mean")
    with pytest.raises(ValueError, match="unknown metric"):
        metric("val-core/x/acc/mean@n")


def test_precision_catalogue() -> None:
    assert list(PRECISIONS) == ["fp32", "bf16", "fp8_rollout", "fp8_e2e"]
    assert set(group_options("precision")) == {n for n, p in PRECISIONS.items() if p.cluster}
    assert CLUSTER_PRECISIONS == ("bf16", "fp8_rollout", "fp8_e2e")
    assert get_precision("fp8_e2e").train_fp8 and not get_precision("fp8_rollout").train_fp8
    with pytest.raises(ValueError, match="unknown precision 'fp4'; allowed: fp32, bf16, fp8_rollout, fp8_e2e"):
        get_precision("fp4")
