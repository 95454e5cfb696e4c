"""Emulated precisions (predmask.rl.emulated_precision): e4m3 fake-quantisation and the rollout-vs-training mismatch."""

from __future__ import annotations

import pytest
import torch
from rl_helpers import TINY_MODEL, peaked_policy

from predmask.config import group_entry, group_options
from predmask.divergence import topk_divergence
from predmask.precisions import PRECISIONS, get_precision
from predmask.rl.algo import support_logprobs
from predmask.rl.emulated_precision import (
    E4M3_MAX,
    fake_quant_e4m3,
    make_rollout_model,
    precision_of,
    quantizable_linears,
    sync_rollout_model,
    training_precision,
)
from predmask.rl.rollout import rollout_problems
from predmask.rl.task import make_split
from predmask.schemas.task_schema import TaskConfig


def _e4m3_grid() -> torch.Tensor:
    """Every finite e4m3 value, from the 256 bit patterns (independent of the quantiser)."""
    vals = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return vals[torch.isfinite(vals)].unique()


def test_fake_quant_lands_on_the_scaled_e4m3_grid() -> None:
    x = torch.randn(64, 32) * 3
    q = fake_quant_e4m3(x)
    scale = x.abs().max() / E4M3_MAX
    on_grid = torch.isin((q / scale).float(), _e4m3_grid()) | torch.isclose(
        (q / scale).unsqueeze(-1), _e4m3_grid(), rtol=1e-6, atol=0).any(-1)
    assert on_grid.all()
    assert torch.allclose(q.abs().max(), x.abs().max(), rtol=1e-6)   # the absmax maps to 448 exactly
    rel = ((q - x).abs() / x.abs().clamp_min(scale * 2.0 ** -6)).max()
    assert 0 < rel <= 2.0 ** -3 + 1e-6                                 # 3 mantissa bits: half-ulp <= 2^-4 .. 2^-3
    assert torch.equal(fake_quant_e4m3(torch.zeros(3, 3)), torch.zeros(3, 3))


def test_fake_quant_per_row_scale() -> None:
    x = torch.stack([torch.linspace(-1, 1, 50), torch.linspace(-1000, 1000, 50)])
    q = fake_quant_e4m3(x, dim=-1)
    assert torch.allclose(q[0].abs().max(), torch.tensor(1.0)) and torch.allclose(q[1].abs().max(), torch.tensor(1000.0))
    # per-row scaling keeps the small row accurate; a per-tensor scale would flush it
    assert ((q[0] - x[0]).abs().max() < 0.07)


def test_rollout_model_weights(tokenizer) -> None:
    model = peaked_policy(tokenizer)
    bf16 = make_rollout_model(model, get_precision("bf16"))
    fp8 = make_rollout_model(model, get_precision("fp8_rollout"))
    name, lin = next(iter(quantizable_linears(model)))
    w = lin.weight.detach()
    w_bf16 = bf16.get_submodule(name).weight
    w_fp8 = fp8.get_submodule(name).weight
    assert w_bf16.dtype == torch.bfloat16 and torch.equal(w_bf16, w.to(torch.bfloat16))
    assert torch.equal(w_fp8, fake_quant_e4m3(w).to(torch.bfloat16))
    # embeddings / lm head stay unquantised (bf16 copy only)
    emb = model.get_input_embeddings().weight.detach()
    assert torch.equal(fp8.get_input_embeddings().weight, emb.to(torch.bfloat16))
    # a sync after an update copies the new weights
    with torch.no_grad():
        lin.weight.add_(1.0)
    sync_rollout_model(bf16, model, get_precision("bf16"))
    assert torch.equal(bf16.get_submodule(name).weight, lin.weight.detach().to(torch.bfloat16))


def _mismatch(model, tokenizer, name: str) -> float:
    prec = get_precision(name)
    roll = make_rollout_model(model, prec)
    problems = make_split(TaskConfig(), "train", 16)
    b = rollout_problems(roll, tokenizer, problems, n=4, max_new_tokens=8, generator=torch.Generator().manual_seed(0))
    s = b.support()
    with torch.no_grad():
        lp = support_logprobs(model, b, s, precision=prec)
    d = topk_divergence(s.mu_logprobs, lp.pi, s.valid)
    return float(d[b.response_mask].mean())


def test_emulated_precisions_differ_from_fp32_and_bf16_is_closest(tokenizer) -> None:
    model = peaked_policy(tokenizer)
    d = {name: _mismatch(model, tokenizer, name) for name in ("fp32", "bf16", "fp8_rollout", "fp8_e2e")}
    assert d["fp32"] < 1e-6                       # same weights, same dtype: only summation-order noise
    assert d["bf16"] > 10 * max(d["fp32"], 1e-9)  # D > 0 from the precision
    assert d["fp8_rollout"] > 3 * d["bf16"]       # e4m3 (3 mantissa bits) >> bf16 (7 bits)
    assert d["fp8_e2e"] > 3 * d["bf16"]


def test_fp8_training_forward_is_quantised_with_straight_through_gradients(tokenizer) -> None:
    model = peaked_policy(tokenizer).train()
    ids = torch.tensor([tokenizer.encode("1 + 2 - 3 =", bos=True)])
    ref = model(input_ids=ids).logits
    fp8 = get_precision("fp8_e2e")
    with training_precision(model, fp8):
        out = model(input_ids=ids).logits
    assert not torch.allclose(out, ref, atol=1e-4)
    out.logsumexp(-1).sum().backward()
    for _name, lin in quantizable_linears(model):
        assert lin.weight.grad is not None and lin.weight.grad.abs().sum() > 0
    # hooks are gone after the block: the plain forward is back
    assert torch.equal(model(input_ids=ids).logits, ref)
    assert all(isinstance(p, torch.nn.Parameter) for p in model.parameters())


def test_moe_rollout_and_fp8(tokenizer) -> None:
    moe = dict(TINY_MODEL, arch="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    from predmask.rl.model import build_policy

    model = build_policy(moe, tokenizer.vocab_size, 0)
    roll = make_rollout_model(model, get_precision("fp8_e2e"))
    experts = [n for n, p in model.named_parameters() if ".experts." in n and p.ndim == 3]
    assert experts
    w = dict(model.named_parameters())[experts[0]].detach()
    got = dict(roll.named_parameters())[experts[0]]
    expected = torch.stack([fake_quant_e4m3(w[e]) for e in range(w.shape[0])]).to(torch.bfloat16)
    assert torch.equal(got, expected)                                  # per-expert scales
    b = rollout_problems(roll, tokenizer, make_split(TaskConfig(), "train", 4), n=2, max_new_tokens=4,
                         generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(b.sampled_logprobs[b.response_mask]).all()
    # FP8 training forward of the MoE: experts quantised per expert, straight-through gradients reach them
    model.train()
    ids = torch.tensor([tokenizer.encode("1 + 2 - 3 =", bos=True)])
    ref = model(input_ids=ids).logits
    with training_precision(model, get_precision("fp8_e2e")):
        out = model(input_ids=ids).logits
    assert not torch.allclose(out, ref, atol=1e-5)
    out.logsumexp(-1).sum().backward()
    expert_param = dict(model.named_parameters())[experts[0]]
    assert expert_param.grad is not None and expert_param.grad.abs().sum() > 0
    assert torch.equal(model(input_ids=ids).logits, ref)


def test_unknown_precision_is_one_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown precision 'fp4'"):
        get_precision("fp4")
    with pytest.raises(ValueError, match=r"unknown precision keys \['rollout_dtype'\]"):
        precision_of({"name": "bf16", "rollout_dtype": "int8"})
    with pytest.raises(ValueError, match="unknown precision 'fp4'; allowed: fp32, bf16, fp8_rollout, fp8_e2e"):
        precision_of({"name": "fp4"})


@pytest.mark.parametrize("name", group_options("precision"))
def test_each_precision_option_only_selects_a_catalogue_entry(name: str) -> None:
    """conf/precision/<name>.yaml names its catalogue entry and gives a label; every fact is the catalogue's."""
    entry = group_entry("precision", name)
    assert entry["name"] == name and set(entry) == {"name", "label"}
    assert precision_of(entry) is PRECISIONS[name]
