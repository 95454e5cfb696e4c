"""The per-token ground truths (analysis.token_level.compute.ground_truth) against independent computations, in
float64, on the CPU engine's Qwen3 and on a Hugging Face GPT-2 built from a config (nothing downloaded):

- ddot_net (and ddot_net_adam) against a central finite difference of D_t along the token's own step θ ± h·P·g_t,
  with g_t from plain autograd on the padded batch forward and P read from the optimiser's state;
- each counterfactual against two explicit steps on copies of the model: the study's reference loss on every
  response token, and the same loss with token t left out (its normalisation unchanged), each through
  clip_grad_norm_ and torch.optim.AdamW (carried state, fresh) or torch.optim.SGD;
- chunking, micro-batching and a caller's gradient change nothing.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
from token_level_helpers import TINY_MODEL, TINY_VOCAB, perturbed, scored_batch, tiny_backend

from analysis.token_level.compute.ground_truth import CF_MODES, ground_truths, loss_weights
from predmask import MethodParams, topk_divergence
from predmask.rl.algo import (
    TrainLogprobs,
    grpo_advantages,
    policy_update,
    rollout_policy_loss,
    support_logprobs,
    token_advantages,
)
from predmask.rl.model import build_policy
from predmask.support import gather_support_logprobs

LR, BETAS, EPS, WD, CLIP = 0.05, (0.9, 0.999), 1e-8, 0.01, 0.5
REFERENCE = ("dppo_topk_kl", {"delta": float("inf")})  # the study's unmasked reference step
PARAMS = MethodParams.from_mapping({"vocab_size": TINY_VOCAB})


def _gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=TINY_VOCAB,
        n_positions=64,
        n_embd=32,
        n_layer=1,
        n_head=2,
        bos_token_id=1,
        eos_token_id=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    model.transformer.wpe.weight.requires_grad_(False)  # a frozen parameter stays out of every step
    return model


def _qwen3() -> torch.nn.Module:
    return build_policy(TINY_MODEL, TINY_VOCAB, seed=1)


def _optimizer(model: torch.nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD
    )


@pytest.fixture(scope="module", params=["qwen3", "gpt2"])
def case(request: pytest.FixtureRequest) -> dict:
    """A scored batch, a float64 policy off the rollout's, its AdamW after two stale steps, and the inputs."""
    torch.set_num_threads(1)
    batch = scored_batch(tiny_backend(sharpness=4.0), seed=3, sequences=16, group=4)
    model = perturbed(_qwen3() if request.param == "qwen3" else _gpt2(), 0.3, seed=5).double().eval()
    support = batch.support()
    adv_tok = token_advantages(grpo_advantages(batch.rewards, 4), batch.response_mask)
    opt = _optimizer(model)
    for _ in range(2):
        policy_update(
            model, opt, batch, support, adv_tok, method="dppo_topk_kl", params=PARAMS, grad_clip=CLIP
        )
    model.eval()
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        _float64_reference(mp)  # the loss weights of the explicit steps below, to the last bit
        lp = _logprobs(model, batch, support)
    weights = loss_weights(REFERENCE[0], batch, support, lp, adv_tok, PARAMS, **REFERENCE[1])
    return {
        "batch": batch,
        "model": model,
        "support": support,
        "adv": adv_tok,
        "opt": opt,
        "weights": weights,
        "d": topk_divergence(support.mu_logprobs, lp.pi, support.valid),
        "name": request.param,
    }


def _studied(case: dict, k: int = 6) -> torch.Tensor:
    """The k response tokens of largest D (several share a group's prompt, so duplicates are among them)."""
    d = torch.where(case["batch"].response_mask, case["d"], -1.0)
    top = d.flatten().topk(k).indices
    tokens = torch.zeros_like(case["batch"].response_mask)
    tokens.view(-1)[top] = True
    return tokens


def _run(case: dict, tokens: torch.Tensor, **kw) -> dict[str, torch.Tensor]:
    return ground_truths(
        case["model"],
        case["batch"],
        case["support"],
        case["adv"],
        case["weights"],
        tokens,
        case["opt"],
        grad_clip=CLIP,
        **kw,
    )


def _logits(model: torch.nn.Module, batch) -> torch.Tensor:
    """Logits [B, R, V] predicting each response token in the model's dtype: the padded batch with its attention
    mask (the engine's response_logits returns float32, which would round the float64 differences away)."""
    ids = torch.cat([batch.prompt_ids, batch.response_ids], 1)
    att = torch.cat([batch.prompt_mask, batch.response_mask], 1).long()
    out = model(input_ids=ids, attention_mask=att, position_ids=(att.cumsum(-1) - 1).clamp_min(0)).logits
    return out[:, batch.prompt_ids.shape[1] - 1 : -1]


def _logprobs(model: torch.nn.Module, batch, support) -> TrainLogprobs:
    pi, tail = gather_support_logprobs(_logits(model, batch), support.ids, support.valid, return_tail_sq=True)
    return TrainLogprobs(pi, tail, support.sampled_logprob(pi))


def _d_at(model: torch.nn.Module, case: dict) -> torch.Tensor:
    sup = case["support"]
    with torch.no_grad():
        pi = _logprobs(model, case["batch"], sup).pi
    return topk_divergence(sup.mu_logprobs, pi, sup.valid)


def _shifted(model: torch.nn.Module, direction: dict[str, torch.Tensor], h: float) -> torch.nn.Module:
    out = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in out.named_parameters():
            if name in direction:
                p.add_(h * direction[name])
    return out


def _rms_norm_float64(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Qwen3's RMSNorm without its float32 cast, so that the reference forward is float64 throughout."""
    return self.weight * (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.variance_epsilon))


def _rotary_float64(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
    """Qwen3's rotary tables without their float32 cast."""
    freqs = (self.inv_freq.double()[None, :, None] @ position_ids[:, None, :].double()).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def _float64_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """From here on Qwen3 runs in float64 throughout (transformers casts its norms and rotary tables to float32),
    so that the test's reference forwards are exact to float64 rounding, as the module's are."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding

    monkeypatch.setattr(Qwen3RMSNorm, "forward", _rms_norm_float64)
    monkeypatch.setattr(Qwen3RotaryEmbedding, "forward", _rotary_float64)


def test_ddot_net_is_the_central_difference_along_the_tokens_own_step(
    case: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, batch, support = case["model"], case["batch"], case["support"]
    tokens = _studied(case, 3)
    got = _run(case, tokens, cf_modes=(), adam_preconditioner=True)
    assert torch.allclose(got["d"], _d_at(model, case)[tokens], rtol=1e-6)
    _float64_reference(monkeypatch)
    state = case["opt"].state
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    adam_p = {}
    for n, p in trainable.items():
        st = state[p]
        v_hat = st["exp_avg_sq"] / (1 - BETAS[1] ** int(st["step"]))
        adam_p[n] = 1.0 / (v_hat.sqrt() + EPS)
    for i, (b, t) in enumerate(tokens.nonzero().tolist()):
        lp = support_logprobs(model, batch, support)
        a = float(case["adv"][b, t])
        g = torch.autograd.grad(a * lp.log_prob[b, t], list(trainable.values()))
        for col, precond in (("ddot_net", None), ("ddot_net_adam", adam_p)):
            direction = {n: gi * (precond[n] if precond else 1.0) for n, gi in zip(trainable, g)}
            norm = math.sqrt(sum(float(x.square().sum()) for x in direction.values()))
            h = 1e-4 / norm
            up, down = _d_at(_shifted(model, direction, h), case), _d_at(_shifted(model, direction, -h), case)
            fd = float(up[b, t] - down[b, t]) / (2 * h)
            assert float(got[col][i]) == pytest.approx(fd, rel=2e-5), (case["name"], col, b, t)


def _explicit_step(case: dict, mode: str, leave_out: tuple[int, int] | None) -> torch.nn.Module:
    """One step of the reference loss on every response token (but ``leave_out``), the whole batch's
    normalisation kept, through clip_grad_norm_ and torch's own optimiser."""
    model = copy.deepcopy(case["model"])
    if mode == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(
            [p for p in model.parameters() if p.requires_grad], lr=LR
        )
    else:
        opt = _optimizer(model)
        if mode == "adam_carried":
            opt.load_state_dict(copy.deepcopy(case["opt"].state_dict()))
    batch, support = case["batch"], case["support"]
    mask = batch.response_mask.clone()
    if leave_out is not None:
        mask[leave_out] = False
    info = {
        "batch_num_tokens": float(batch.response_mask.sum()),
        "global_batch_size": float((batch.response_mask.sum(-1) > 0).sum()),
    }
    lp = _logprobs(model, batch, support)
    loss, _ = rollout_policy_loss(
        REFERENCE[0], batch, support, lp, case["adv"], mask, PARAMS, global_batch_info=info, **REFERENCE[1]
    )
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    opt.step()
    return model


@pytest.mark.parametrize("mode", CF_MODES)
def test_counterfactual_is_two_explicit_optimizer_steps(
    case: dict, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = _studied(case, 6)
    got = _run(case, tokens, cf_modes=(mode,))
    _float64_reference(monkeypatch)
    d_with = _d_at(_explicit_step(case, mode, None), case)
    checked = 0
    for i, (b, t) in enumerate(tokens.nonzero().tolist()):
        want = float(d_with[b, t] - _d_at(_explicit_step(case, mode, (b, t)), case)[b, t])
        assert float(got[f"dd_cf_{mode}"][i]) == pytest.approx(want, rel=1e-6, abs=1e-15), (
            case["name"],
            mode,
            b,
            t,
        )
        checked += want != 0.0
    assert checked >= 4  # the tokens carry a loss weight, so removing one changes the step


def test_the_reference_gradient_is_clipped_in_these_cases(case: dict) -> None:
    m = copy.deepcopy(case["model"])
    lp = support_logprobs(m, case["batch"], case["support"])
    loss, _ = rollout_policy_loss(
        REFERENCE[0],
        case["batch"],
        case["support"],
        lp,
        case["adv"],
        case["batch"].response_mask,
        PARAMS,
        **REFERENCE[1],
    )
    loss.backward()
    assert float(torch.nn.utils.clip_grad_norm_(m.parameters(), float("inf"))) > CLIP


def test_chunks_micro_batches_and_a_given_gradient_change_nothing(
    case: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = _studied(case, 8)
    base = _run(case, tokens, cf_modes=CF_MODES, adam_preconditioner=True)
    _float64_reference(monkeypatch)
    m = copy.deepcopy(case["model"])
    lp = _logprobs(m, case["batch"], case["support"])
    loss = (case["weights"] * torch.where(case["batch"].response_mask, lp.log_prob, 0.0)).sum()
    trainable = {n: p for n, p in m.named_parameters() if p.requires_grad}
    grad = dict(zip(trainable, torch.autograd.grad(loss, list(trainable.values()))))
    for kw in ({"chunk_size": 1}, {"chunk_size": 3, "micro_batch": 5}, {"gradient": grad, "chunk_size": 2}):
        other = _run(case, tokens, cf_modes=CF_MODES, adam_preconditioner=True, **kw)
        for k, v in base.items():
            assert torch.allclose(other[k], v, rtol=1e-7, atol=1e-14), (case["name"], kw.keys(), k)


def _with_repeats(case: dict, rows: slice = slice(1, 3)) -> dict:
    """The case's batch with ``rows`` copies of row 0 (same group, prompt, response, rollout and reward): their
    tokens are the same computation. Advantages and loss weights recomputed; the optimiser state is the case's."""
    batch = copy.deepcopy(case["batch"])
    for f in dataclasses.fields(batch):
        getattr(batch, f.name)[rows] = getattr(batch, f.name)[0]
    support = batch.support()
    adv_tok = token_advantages(grpo_advantages(batch.rewards, 4), batch.response_mask)
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        _float64_reference(mp)
        lp = _logprobs(case["model"], batch, support)
    weights = loss_weights(REFERENCE[0], batch, support, lp, adv_tok, PARAMS, **REFERENCE[1])
    return {**case, "batch": batch, "support": support, "adv": adv_tok, "weights": weights}


def test_repeated_tokens_computed_once_match_each_token_computed_alone(case: dict) -> None:
    """Tokens with one context, sampled token, support and loss weight are computed once; the results, mapped back
    to every token, equal each token's own run (and the repeats' own advantages scale their ddot_net)."""
    rep = _with_repeats(case)
    tokens = rep["batch"].response_mask.clone()
    tokens[:, 2:] = False
    together = _run(rep, tokens, cf_modes=CF_MODES, adam_preconditioner=True)
    where = tokens.nonzero().tolist()
    firsts = [where.index([r, 0]) for r in range(3)]
    assert torch.equal(together["dd_cf_adam_carried"][firsts], together["dd_cf_adam_carried"][firsts[:1] * 3])
    b = rep["batch"]
    pairs = [
        tuple(b.prompt_ids[r][b.prompt_mask[r]].tolist() + b.response_ids[r, : t + 1].tolist())
        for r, t in where
    ]
    ids = together["context_id"].tolist()
    assert len(set(ids)) == len(set(pairs)) < len(pairs)
    assert all((ids[i] == ids[j]) == (pairs[i] == pairs[j]) for i in range(len(ids)) for j in range(len(ids)))
    for i, (r, t) in enumerate(where):
        alone = torch.zeros_like(tokens)
        alone[r, t] = True
        one = _run(rep, alone, cf_modes=CF_MODES, adam_preconditioner=True)
        for k, v in one.items():
            assert float(together[k][i]) == pytest.approx(float(v[0]), rel=1e-9, abs=1e-15), (
                case["name"],
                k,
                r,
                t,
            )
        assert int(one["context_id"][0]) == ids[i]  # from the ids alone, whatever else the batch holds


def test_a_token_without_advantage_changes_nothing(case: dict) -> None:
    """A group whose rows are equal has A = 0 on every token: no share of G, so both truths are exactly 0."""
    flat = _with_repeats(case, slice(1, 4))
    tokens = flat["batch"].response_mask.clone()
    tokens[4:] = False
    assert float(flat["weights"][tokens].abs().max()) == 0.0
    got = _run(flat, tokens, cf_modes=CF_MODES, adam_preconditioner=True)
    for k in ("ddot_net", "ddot_net_adam", *(f"dd_cf_{m}" for m in CF_MODES)):
        assert torch.equal(got[k], torch.zeros_like(got[k])), k


def test_the_model_and_the_optimiser_are_left_as_they_were(case: dict) -> None:
    model, opt = case["model"], case["opt"]
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = copy.deepcopy(opt.state_dict())
    attn = model.config._attn_implementation
    _run(case, _studied(case, 3), cf_modes=CF_MODES, adam_preconditioner=True)
    assert model.training and model.config._attn_implementation == attn
    model.eval()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    after = opt.state_dict()
    assert all(
        torch.equal(state["state"][i][k], after["state"][i][k]) for i in state["state"] for k in state["state"][i]
    )


def test_bad_inputs_are_refused_in_one_line(case: dict) -> None:
    tokens = _studied(case, 2)
    with pytest.raises(ValueError, match="cf_modes .*unknown; allowed: adam_carried, adam_reset, sgd"):
        _run(case, tokens, cf_modes=("adam",))
    with pytest.raises(ValueError, match="tokens must be a bool mask of response tokens"):
        _run(case, tokens.long())
    with pytest.raises(ValueError, match="dtype must be torch.float32 or torch.float64"):
        _run(case, tokens, dtype=torch.float16)
    with pytest.raises(ValueError, match="gradient must name every trainable parameter"):
        _run(case, tokens, gradient={"x": None})
    fresh = _optimizer(case["model"])
    with pytest.raises(ValueError, match="needs an optimiser state that has taken a step"):
        ground_truths(
            case["model"],
            case["batch"],
            case["support"],
            case["adv"],
            case["weights"],
            tokens,
            fresh,
            grad_clip=CLIP,
            adam_preconditioner=True,
        )
    with pytest.raises(ValueError, match="must be torch.optim.AdamW"):
        ground_truths(
            case["model"],
            case["batch"],
            case["support"],
            case["adv"],
            case["weights"],
            tokens,
            torch.optim.SGD(case["model"].parameters(), lr=0.1),
            grad_clip=CLIP,
        )
