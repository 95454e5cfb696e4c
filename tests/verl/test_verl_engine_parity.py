"""The first update on one batch: verl's real actor worker through the plugin against the CPU engine's own code
path, on the same model and the same batch, for every method of the smoke sweep and both top-K support
conventions a method takes.

verl: ``ActorRolloutRefWorker(role="actor")`` with its FSDP2 engine and the plugin (``PredmaskTrainingWorker``,
``TopKPolicyLoss``, the registered loss), ``compute_log_prob`` then ``update_actor`` as verl's trainer calls them
(tests/verl/verl_cpu_worker.py: one spawned process, no Ray), the batch as the trainer holds it after generation
(padded prompts/responses, verl's own GRPO advantages from ``compute_grpo_outcome_advantage``, one top-K record
per sample parsed by ``predmask.verl.records`` from vLLM-shaped log-prob entries). The engine: ``predmask.rl.algo``
as ``Engine.train_step`` calls it (``grpo_advantages``, pi_old by ``support_logprobs`` when the anchor is
``old``, ``policy_update`` -> ``rollout_policy_loss`` -> ``predmask.policy_loss``) on a ``RolloutBatch`` holding
the same tokens, rollout log-probs and top-K, and the same weights loaded with transformers.

Compared, in float32: the advantages; verl's pi_old and the engine's; per response token, verl's log-prob and the
support log-probs of the plugin's gather against the engine's (slots matched by token id); the loss (verl's summed
over its micro-batches) and the gradient on every parameter before the optimizer step (verl records it where its
engine clips and steps; the engine's is taken with ``step=False`` and no clipping); the merged per-micro-batch
loss statistics of the plugin against the engine's metrics.

Set to the same on both sides (each side's own setting, none patched): one mini-batch holding the whole batch
(verl: ``ppo_mini_batch_size`` = the batch; the engine: one ``policy_update``); the aggregation mode
(``loss_agg_mode``: verl's actor key, the engine's ``MethodParams``; verl splits the mini-batch into micro-batches
by its dynamic batch size and normalises each with ``global_batch_info``, the engine computes the loss in one call);
the method parameters (verl's ``clip_ratio_low``/``clip_ratio_high`` as ``predmask.verl.overrides`` writes them,
predmask's settings for ``support``, ``anchor``, ``ratio_cap``; the vocabulary size is the logits' width on both
sides); the temperature. KL loss and entropy bonus are off in verl (as the overrides set them; the engine has
neither). verl runs with remove-padding on (as the overrides set it): its packed forward is compared with the
engine's padded one, so the packed sequences must not attend across each other under ``sdpa`` (transformers finds
the packing from the position ids).

Not compared: the optimizer step (verl clips the gradient norm at 1 and steps AdamW with weight decay 0.01, the
engine's AdamW has its own settings); later updates. ``seq-mean-token-sum-norm`` divides by the padded response
width of the batch both sides are given here; in a real verl run that is ``data.max_response_length`` (the agent
loop pads to it), in the engine the longest response of its batch.

Stand-ins: the rollout is not vLLM's but the test's (mu = a noisy, temperature-scaled copy of the model's own
distribution, tokens sampled from it, vLLM's log-prob entries built from it); a tiny random Qwen3 whose lm_head is
scaled so that pi is peaked; verl's CPU platform (predmask.verl.cpu, gloo) and transformers' ``sdpa`` attention.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from verl_helpers import REPO, require_verl, tiny_causal_lm, vllm_position

require_verl("verl.plugin.platform")

import verl_cpu_worker as cpu_worker

from predmask import metrics as M
from predmask.methods import TOPK_SUPPORTS, get_method, method_config, method_params

pytestmark = [pytest.mark.verl]  # the tests of the update (the fixture ``parity``) are also slow

V, K, T = cpu_worker.VOCAB, cpu_worker.K, cpu_worker.TEMPERATURE
#: 3 prompts x 3 samples (GRPO groups of 3); the last group all correct: zero advantages
PROMPT_LENS, N = (3, 5, 2), 3
RESPONSE_LENS = (6, 4, 1, 5, 3, 7, 2, 4, 5)
REWARDS = (1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0)
#: pi peaked (lm_head x 20: top-1 mass ~0.45) and mu = softmax((logits + 0.6 eps) / T): D around delta, about a
#: third of the sampled tokens outside mu's top-K; the seed one where dppo_topk_kl's two supports drop different
#: tokens (test_the_cases_are_not_vacuous)
HEAD_SCALE, NOISE, SEED = 20.0, 0.6, 28
DEADLINE_S = 900
#: the smoke sweep's methods, read from its config
SMOKE = tuple(yaml.safe_load((REPO / "conf" / "sweep" / "smoke.yaml").read_text())
              ["hydra"]["sweeper"]["params"]["method"].split(","))


@dataclass(frozen=True)
class Case:
    """One update: a method with its support and anchor (None: the method's default) and aggregation mode."""

    method: str
    support: str | None = None
    anchor: str | None = None
    agg: str = "token-mean"
    ratio_cap: float | None = None

    @property
    def tag(self) -> str:
        return "-".join(str(x) for x in (self.method, self.support, self.anchor, self.agg, self.ratio_cap))

    def params(self) -> Any:
        section = {"name": self.method, "loss_agg_mode": self.agg, "vocab_size": V}
        section |= {k: v for k, v in (("support", self.support), ("anchor", self.anchor),
                                      ("ratio_cap", self.ratio_cap)) if v is not None}
        return method_params(section)


def _accepts(method: str, support: str) -> bool:
    """Whether a run config of ``method`` may set ``support`` (the engine's check, ``method_config``)."""
    try:
        method_config({"name": method, "support": support})
    except ValueError:
        return False
    return True


#: the other support conventions (the first, the default, is what a run without ``support`` gets)
OTHER_SUPPORTS = TOPK_SUPPORTS[1:]
#: every smoke method as a run gives it (its default support and anchor), and with every other support convention
#: it takes (dppo_topk_kl: ``topk``; the predictive methods refuse it, grpo_clip_higher has no support);
#: grpo_clip_higher also anchored on the rollout (its clip then binds; on pi_old the first update's ratio is 1);
#: and the verl DPPO recipe's aggregation and ratio cap (conf/cluster/recipe/dppo_verl.yaml) on one method
CASES: tuple[Case, ...] = (
    *(Case(m, s) for m in SMOKE for s in (None, *(s for s in OTHER_SUPPORTS if _accepts(m, s)))),
    Case("grpo_clip_higher", anchor="rollout"),
    Case("predmask_kl_agg", agg="seq-mean-token-sum-norm", ratio_cap=10000.0),
)


def save_model(path: Path) -> Path:
    model = tiny_causal_lm(vocab=V, layers=cpu_worker.LAYERS, seed=SEED)
    model.config.update({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False})
    with torch.no_grad():
        model.lm_head.weight.mul_(HEAD_SCALE)
    model.save_pretrained(path)
    return path


def load_model(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").float()


def rollout(model: torch.nn.Module) -> dict[str, Any]:
    """The batch: prompts (left-padded), responses sampled from mu (right-padded), the full mu per response token."""
    g = torch.Generator().manual_seed(SEED)
    prompts = [torch.randint(3, V, (n,), generator=g) for n in PROMPT_LENS]
    width_p, width_r = max(PROMPT_LENS), max(RESPONSE_LENS)
    b = len(RESPONSE_LENS)
    prompt_ids = torch.zeros(b, width_p, dtype=torch.long)
    prompt_mask = torch.zeros(b, width_p, dtype=torch.bool)
    response_ids = torch.zeros(b, width_r, dtype=torch.long)
    response_mask = torch.zeros(b, width_r, dtype=torch.bool)
    mu = torch.zeros(b, width_r, V)
    model.eval()
    for i, length in enumerate(RESPONSE_LENS):
        prompt = prompts[i // N]
        prompt_ids[i, width_p - len(prompt):], prompt_mask[i, width_p - len(prompt):] = prompt, True
        seq = prompt.clone()
        for t in range(length):
            with torch.no_grad():
                logits = model(input_ids=seq[None]).logits[0, -1]
            mu[i, t] = torch.log_softmax((logits + NOISE * torch.randn(V, generator=g)) / T, -1)
            token = torch.multinomial(mu[i, t].exp(), 1, generator=g)
            response_ids[i, t], response_mask[i, t] = token, True
            seq = torch.cat([seq, token])
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "response_ids": response_ids,
            "response_mask": response_mask, "mu": mu, "rewards": torch.tensor(REWARDS)}


def engine_batch(r: dict[str, Any]) -> Any:
    """The CPU engine's RolloutBatch of the rollout (what ``predmask.rl.rollout.generate`` reports)."""
    from predmask.rl.rollout import RolloutBatch

    top = torch.topk(r["mu"], K, dim=-1, sorted=True)
    return RolloutBatch(prompt_ids=r["prompt_ids"], prompt_mask=r["prompt_mask"], response_ids=r["response_ids"],
                        response_mask=r["response_mask"],
                        sampled_logprobs=r["mu"].gather(-1, r["response_ids"][..., None])[..., 0],
                        topk_ids=top.indices, topk_logprobs=top.values, rewards=r["rewards"])


def verl_batch(r: dict[str, Any]) -> dict[str, Any]:
    """The trainer's batch of the same rollout: verl's tensors, verl's GRPO advantages, the top-K records."""
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    from predmask.verl.records import parse_vllm_logprobs

    mask = r["response_mask"]
    attention = torch.cat([r["prompt_mask"], mask], 1).long()
    lengths = mask.sum(-1)
    scores = torch.zeros(mask.shape)
    scores[torch.arange(len(lengths)), lengths - 1] = r["rewards"]  # verl's token-level reward: at the last token
    uid = np.array([f"p{i // N}" for i in range(len(lengths))], dtype=object)
    advantages, _ = compute_grpo_outcome_advantage(scores, mask.long(), uid)
    records = []
    for i, n in enumerate(lengths.tolist()):
        tokens = r["response_ids"][i, :n].tolist()
        records.append(parse_vllm_logprobs([vllm_position(r["mu"][i, t], tokens[t], K) for t in range(n)],
                                           tokens, K))
    tensors = {"prompts": r["prompt_ids"], "responses": r["response_ids"],
               "input_ids": torch.cat([r["prompt_ids"], r["response_ids"]], 1), "attention_mask": attention,
               "position_ids": (attention.cumsum(-1) - 1).clamp(min=0), "response_mask": mask.long(),
               "advantages": advantages.float()}
    return {"tensors": tensors, "records": records, "temperature": T}


def engine_update(model: torch.nn.Module, batch: Any, case: Case) -> dict[str, Any]:
    """The CPU engine's first update of ``case`` on ``batch`` (Engine.train_step with one mini-batch), gradient
    only: ``policy_update(step=False)`` without clipping."""
    from predmask.rl.algo import grpo_advantages, policy_update, support_logprobs

    method, params = get_method(case.method), case.params()
    support = batch.support()
    adv = grpo_advantages(batch.rewards, N)
    old = None
    if method.anchor(params) == "old":  # Engine.old_logprobs
        with torch.no_grad():
            old = support_logprobs(model, batch, support, temperature=T, tail_sq=False).log_prob
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    metrics, lp = policy_update(model, optimizer, batch, support, adv, method=method, params=params,
                                temperature=T, grad_clip=None, step=False, anchor_logprobs=old, tail_sq=None)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return {"metrics": metrics, "lp": lp, "old": old, "advantages": adv, "support": support, "grads": grads}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def verl_cases(case: Case) -> dict[str, Any]:
    a = "actor_rollout_ref.actor"
    p = case.params()
    extra = [f"{a}.loss_agg_mode={p.loss_agg_mode}", f"{a}.use_kl_loss=false", f"{a}.entropy_coeff=0"]
    if get_method(case.method).kind == "clip":  # verl's PPO clip range, as predmask.verl.overrides writes it
        extra += [f"{a}.clip_ratio_low={p.eps_low}", f"{a}.clip_ratio_high={p.eps_high}"]
    settings = {k: v for k, v in (("support", case.support), ("anchor", case.anchor),
                                  ("ratio_cap", case.ratio_cap)) if v is not None}
    return {"tag": case.tag, "loss_mode": case.method, "settings": settings, "remove_padding": True,
            "mini_batch": len(RESPONSE_LENS), "extra": extra}


@pytest.fixture(scope="module")
def parity(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Both sides of every case: the engine's here, verl's in one spawned process (a fresh worker per case)."""
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("parity")
    model_dir = save_model(out / "model")
    model = load_model(model_dir)
    r = rollout(model)
    saved = verl_batch(r)
    torch.save(saved, out / "batch.pt")
    context = mp.start_processes(cpu_worker.run_cases, nprocs=1, join=False, start_method="spawn",
                                 args=(1, _free_port(), str(model_dir), str(out), str(out / "batch.pt"),
                                       [verl_cases(c) for c in CASES]))
    batch = engine_batch(r)
    engine = {c.tag: engine_update(model, batch, c) for c in CASES}  # while verl runs
    deadline = time.monotonic() + DEADLINE_S
    while not context.join(timeout=max(deadline - time.monotonic(), 1.0)):
        if time.monotonic() >= deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"verl's worker did not finish within {DEADLINE_S} s")
    verl = {c.tag: torch.load(out / f"rank0-{c.tag}.pt", weights_only=False) for c in CASES}
    return {"batch": batch, "verl_batch": saved, "engine": engine, "verl": verl, "out": out}


def _sample_of(responses: torch.Tensor, row: torch.Tensor) -> int:
    width = row.shape[0]
    hits = [i for i in range(len(responses)) if torch.equal(responses[i, :width], row)]
    assert len(hits) == 1, hits
    return hits[0]


def _by_id(ids: torch.Tensor, values: torch.Tensor, valid: torch.Tensor) -> dict[int, float]:
    return {int(i): float(v) for i, v, ok in zip(ids.tolist(), values.tolist(), valid.tolist(), strict=True) if ok}


def test_the_cases_cover_the_smoke_sweep_and_both_supports() -> None:
    assert set(SMOKE) == {"grpo_clip_higher", "dppo_topk_kl", "predmask_kl_agg", "predmask_kl_uniform"}
    plain = {(c.method, c.support) for c in CASES if c.agg == "token-mean" and c.anchor is None}
    assert {(m, None) for m in SMOKE} <= plain  # every method as a run gives it
    assert {(m, s) for m in SMOKE for s in OTHER_SUPPORTS if _accepts(m, s)} <= plain
    assert ("dppo_topk_kl", "topk") in plain  # the ratio-direction top-K method takes both conventions
    assert TOPK_SUPPORTS == ("topk_plus_sampled", "topk")


@pytest.mark.parametrize(("method", "support"), [(m, s) for m in SMOKE for s in OTHER_SUPPORTS
                                                 if not _accepts(m, s)])
def test_a_support_a_method_does_not_take_is_refused(method: str, support: str) -> None:
    """The engine's run config refuses it (method_config), and so does predmask.policy_loss, which both sides
    call, for a top-K method; grpo_clip_higher has no support: its loss ignores the parameter."""
    with pytest.raises(ValueError, match="support"):
        method_config({"name": method, "support": support})
    m = get_method(method)
    if m.needs_support:
        with pytest.raises(ValueError, match="support"):
            m.topk_support(method_params({"name": method, "support": support}))


def grpo_advantages_of(parity: dict[str, Any]) -> torch.Tensor:
    return next(iter(parity["engine"].values()))["advantages"]


@pytest.mark.slow
def test_the_advantages_are_the_same(parity) -> None:
    """verl's GRPO advantages (compute_grpo_outcome_advantage) and the engine's (grpo_advantages), per token."""
    from predmask.rl.algo import token_advantages

    batch = parity["batch"]
    verl_adv = parity["verl_batch"]["tensors"]["advantages"]
    engine_adv = token_advantages(grpo_advantages_of(parity), batch.response_mask)
    torch.testing.assert_close(verl_adv, engine_adv, rtol=0, atol=1e-6)
    nonzero = engine_adv[batch.response_mask] != 0
    assert nonzero.any() and not nonzero.all()  # both signs of groups, and a group with zero advantage
    assert (engine_adv > 0).any() and (engine_adv < 0).any()


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c.tag for c in CASES])
def test_first_update_equals_the_engines(parity, case: Case) -> None:
    batch, engine, verl = parity["batch"], parity["engine"][case.tag], parity["verl"][case.tag]
    assert verl["actor_cls"] == "PredmaskTrainingWorker" and verl["engine_cls"] == "FSDPEngineWithLMHead"
    method, params = get_method(case.method), case.params()
    mask = batch.response_mask
    lp = engine["lp"]
    # pi_old: verl's compute_log_prob against the engine's no-grad forward (the anchor of grpo_clip_higher)
    if engine["old"] is not None:
        torch.testing.assert_close(verl["old_log_probs"][mask], engine["old"][mask], rtol=0, atol=2e-5)
    # per micro-batch and response token: verl's log-prob, the anchor and the gathered support, slot by token id
    micro = verl["micro_batches"]
    assert len(micro) > 1  # verl's dynamic batch size split the mini-batch
    seen: list[int] = []
    gap = {"log_prob": 0.0, "pi": 0.0}
    for mb in micro:
        for row in range(mb["responses"].shape[0]):
            i = _sample_of(batch.response_ids, mb["responses"][row])
            seen.append(i)
            n = int(mask[i].sum())
            assert int(mb["mask"][row].sum()) == n
            torch.testing.assert_close(mb["log_prob"][row, :n], lp.log_prob[i, :n], rtol=0, atol=2e-5)
            gap["log_prob"] = max(gap["log_prob"], float((mb["log_prob"][row, :n] - lp.log_prob[i, :n]).abs().max()))
            if method.anchor(params) == "rollout":
                assert torch.equal(mb["anchor"][row, :n], batch.sampled_logprobs[i, :n])
            if "pi" not in mb:
                continue
            s = engine["support"]
            for t in range(n):
                ours = _by_id(mb["ids"][row, t], mb["pi"][row, t], mb["valid"][row, t])
                theirs = _by_id(s.ids[i, t], lp.pi[i, t], s.valid[i, t])
                assert ours.keys() == theirs.keys(), (i, t)
                for token, value in ours.items():
                    assert abs(value - theirs[token]) <= 2e-5, (i, t, token, value, theirs[token])
                    gap["pi"] = max(gap["pi"], abs(value - theirs[token]))
    assert sorted(seen) == list(range(len(batch.response_ids)))
    # the loss: verl's micro-batch losses (each normalised by global_batch_info) sum to the mini-batch's
    verl_loss = float(sum(mb["loss"] for mb in micro))
    engine_loss = engine["metrics"][M.ACTOR_PG_LOSS]
    assert engine_loss != 0.0
    assert verl_loss == pytest.approx(engine_loss, rel=1e-5, abs=1e-7)
    # the gradient on every parameter before the optimizer step
    assert verl["grads"].keys() == engine["grads"].keys() and len(engine["grads"]) > 10
    for name, grad in engine["grads"].items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(verl["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    grad_gap = max(float((verl["grads"][n] - g).abs().max() / g.abs().max()) for n, g in engine["grads"].items())
    print(f"{case.tag}: {len(micro)} micro-batches; max |diff| log_prob {gap['log_prob']:.2e}, support "
          f"{gap['pi']:.2e}, loss {abs(verl_loss - engine_loss):.2e} (of {abs(engine_loss):.3f}), gradient "
          f"{grad_gap:.2e} of the parameter's largest")
    # the plugin's per-micro-batch statistics, merged as ingest merges them, are the engine's metrics
    from analysis.store.exact_metrics import exact_step_metrics

    steps = exact_step_metrics(Path(verl["run_dir"]))
    assert list(steps) == [1]
    common = sorted(set(steps[1]) & set(engine["metrics"]) - {M.ACTOR_PG_LOSS, M.ACTOR_GRAD_NORM})
    assert {M.MASK_TOKENS, M.CLIPFRAC, M.PPO_KL} <= set(common)
    for key in common:
        assert steps[1][key] == pytest.approx(engine["metrics"][key], rel=1e-5, abs=1e-6), key


@pytest.mark.slow
def test_the_cases_are_not_vacuous(parity) -> None:
    """The masks bind (some tokens dropped, most kept) and the two support conventions of dppo_topk_kl decide
    differently on this batch, so a swapped convention would show in the loss or the gradient."""
    engine = parity["engine"]
    for case in CASES:
        frac = engine[case.tag]["metrics"][M.CLIPFRAC]
        if case.method != "grpo_clip_higher" or case.anchor == "rollout":
            assert 0.0 < frac < 0.9, (case.tag, frac)
    plus, topk = engine[Case("dppo_topk_kl").tag], engine[Case("dppo_topk_kl", "topk").tag]
    assert (plus["support"].sampled_index == K)[parity["batch"].response_mask].any()  # sampled outside the top-K
    assert plus["metrics"][M.CLIPFRAC] != topk["metrics"][M.CLIPFRAC]
    assert abs(plus["metrics"][M.ACTOR_PG_LOSS] - topk["metrics"][M.ACTOR_PG_LOSS]) > 0.01
    assert not torch.allclose(plus["grads"]["lm_head.weight"], topk["grads"]["lm_head.weight"], rtol=1e-2)
