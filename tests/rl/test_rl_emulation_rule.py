"""The matrix-product rule of the emulated precisions (predmask.precisions) against an independent numpy reference.

The reference rounds onto the bf16 and e4m3 grids by hand in float64 (round half to even on the format's spacing),
multiplies the rounded operands in float64 and rounds the exact result to bf16. The emulation accumulates in
float32, so it may differ from the reference only where float32's accumulation error reaches a bf16 rounding
boundary: the tests assert the exact agreement everywhere else and the error bound everywhere.
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from predmask.precisions import get_precision
from predmask.rl.emulated_precision import (
    E4M3_MAX,
    RoundedLinear,
    emulated_linear,
    format_weight,
    make_rollout_model,
    sync_rollout_model,
)

U32 = 2.0 ** -24  # float32 unit roundoff


def _round_grid(v: np.ndarray, mantissa_bits: int, min_exp: int) -> np.ndarray:
    """Round float64 ``v`` to the nearest value with ``mantissa_bits`` explicit bits (ties to even), exponents below
    ``min_exp`` on the subnormal spacing."""
    a = np.abs(v)
    e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    step = np.exp2(np.maximum(e, min_exp) - mantissa_bits)
    return np.where(a > 0, np.rint(v / step) * step, 0.0)


def _bf16(v: np.ndarray) -> np.ndarray:
    return _round_grid(v, 7, -126)


def _e4m3_scaled(x32: np.ndarray, axis: int | None) -> np.ndarray:
    """Absmax-scaled e4m3 values of float32 ``x32`` (per tensor, or per slice along ``axis``), scaled back, float64.
    The scale and the scaled values are float32 arithmetic, as the quantiser's."""
    amax = np.abs(x32).max(axis=axis, keepdims=axis is not None).astype(np.float32)
    scale = np.maximum(amax / np.float32(E4M3_MAX), np.float32(1e-12)).astype(np.float32)
    scaled = np.clip((x32 / scale).astype(np.float32), -E4M3_MAX, E4M3_MAX).astype(np.float64)
    return _round_grid(scaled, 3, -6) * scale.astype(np.float64)


def _spacing_below(v: np.ndarray) -> np.ndarray:
    """A lower bound on the bf16 spacing around ``v`` (half the spacing of its binade)."""
    a = np.maximum(np.abs(v), 2.0 ** -126)
    return np.exp2(np.floor(np.log2(a)) - 8)


def _check(got: torch.Tensor, exact: np.ndarray, abs_products: np.ndarray, k: int) -> None:
    """``got`` (bf16) is the bf16 rounding of a float32 accumulation of ``exact``: equal to the reference rounding
    wherever the accumulation error cannot cross a rounding boundary, within the bound everywhere."""
    g = got.float().double().numpy()
    ref = _bf16(exact)
    err32 = (k + 3) * U32 * abs_products * 1.01
    half_ulp = np.exp2(np.floor(np.log2(np.maximum(np.maximum(np.abs(g), np.abs(exact)), 2.0 ** -126))) - 8)
    assert (np.abs(g - exact) <= half_ulp + err32).all()
    safe = np.abs(exact - ref) + err32 < 0.5 * _spacing_below(ref)
    np.testing.assert_array_equal(g[safe], ref[safe])


shapes = st.tuples(st.integers(1, 9), st.integers(1, 300), st.integers(1, 12))


@settings(max_examples=40, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2 ** 31 - 1), scale=st.sampled_from([1e-3, 1.0, 37.0]),
       bias=st.booleans())
def test_bf16_products_match_float64_products_of_rounded_operands(shape, seed, scale, bias) -> None:
    m, k, n = shape
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * scale
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    prec = get_precision("bf16")
    got = emulated_linear(x, format_weight(w, prec), b, out_dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16
    xr, wr = _bf16(x.double().numpy()), _bf16(w.double().numpy())
    exact = xr @ wr.T
    abs_products = np.abs(xr) @ np.abs(wr).T
    if b is not None:
        br = _bf16(b.double().numpy())
        exact, abs_products = exact + br, abs_products + np.abs(br)
    _check(got, exact, abs_products, k)


@settings(max_examples=40, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2 ** 31 - 1), scale=st.sampled_from([1e-2, 1.0, 300.0]))
def test_fp8_w8a8_products_match_float64_products_of_e4m3_operands(shape, seed, scale) -> None:
    """FP8 rollout (W8A8): e4m3 weight with a per-tensor scale, bf16 input then e4m3 with a per-token scale."""
    m, k, n = shape
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=gen) * scale).to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen) * 0.05
    prec = get_precision("fp8_rollout")
    got = emulated_linear(x, format_weight(w, prec, fp8=True), out_dtype=torch.bfloat16, fp8_inputs=True)
    xr = _e4m3_scaled(x.float().numpy(), axis=-1)
    wr = _e4m3_scaled(w.numpy(), axis=None)
    _check(got, xr @ wr.T, np.abs(xr) @ np.abs(wr).T, k)


def test_the_rollout_model_applies_the_rule_to_its_linear_layers(policy, tokenizer) -> None:
    """Every linear layer of a bf16 rollout model is a RoundedLinear whose output is the rule's on its input; the
    product weight follows a weight sync."""
    prec = get_precision("bf16")
    roll = make_rollout_model(policy, prec)
    linears = {n: m for n, m in roll.named_modules() if isinstance(m, torch.nn.Linear)}
    assert linears and all(isinstance(m, RoundedLinear) for m in linears.values())
    assert "lm_head" in linears
    name, lin = next(iter(linears.items()))
    x = torch.randn(3, lin.in_features).to(torch.bfloat16)
    w = policy.get_submodule(name).weight.detach()
    expected = _bf16(_bf16(x.double().numpy()) @ _bf16(w.double().numpy()).T)
    got = lin(x)
    assert got.dtype == torch.bfloat16
    assert np.abs(got.double().numpy() - expected).max() <= np.abs(expected).max() * 2.0 ** -7
    train = copy.deepcopy(policy)
    with torch.no_grad():
        train.get_submodule(name).weight.add_(0.3)
    sync_rollout_model(roll, train, prec)
    w_new = train.get_submodule(name).weight.detach()
    assert torch.equal(lin.product_weight, torch.from_numpy(_bf16(w_new.double().numpy())).float())
    fp32 = make_rollout_model(policy, get_precision("fp32"))
    assert not any(isinstance(m, RoundedLinear) for m in fp32.modules())
