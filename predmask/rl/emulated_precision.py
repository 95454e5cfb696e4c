"""Emulated precision mismatch on CPU: bf16 rollouts against fp32 training, and e4m3 FP8 fake-quantisation.

Implements the settings of ``predmask.precisions`` (the matrix-product rule of the rollout's linear layers:
math.md §10): a rollout model in the setting's ``rollout_dtype``, training always in float32; ``rollout_fp8``:
the rollout's linear layers fake-quantised to e4m3 (W8A8 as vLLM's online ``quantization=fp8``: per-tensor
weight scale, dynamic per-token activation scale); ``train_fp8``: training forwards also fake-quantise the
linear layers (per-tensor weight and activation scales, as a current-scaling FP8 recipe; straight-through
gradients). Embeddings, norms and the LM head stay unquantised (vLLM and Megatron keep them in high
precision). Fake-quantisation is ``dequant(quant(x))``: the tensor's absolute maximum scaled to 448, rounded
onto ``torch.float8_e4m3fn``, scaled back.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from predmask.precisions import PRECISIONS, Precision, get_precision

E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: the keys of a run config's ``precision`` section (conf/precision/<name>.yaml)
#: (``emulates`` is the catalogue's text, which a run records in its config.yaml)
CONFIG_KEYS: tuple[str, ...] = ("name", "label", "emulates")


def precision_of(section: Mapping[str, Any]) -> Precision:
    """The catalogue entry a run config's ``precision`` section selects (its keys: ``CONFIG_KEYS``)."""
    bad = sorted(set(section) - set(CONFIG_KEYS))
    if bad:
        raise ValueError(f"unknown precision keys {bad}; allowed: {list(CONFIG_KEYS)} (the rest is predmask.precisions')")
    if "name" not in section:
        raise ValueError("the precision section has no name; allowed names: " + ", ".join(PRECISIONS))
    return get_precision(str(section["name"]))


def rollout_dtype(precision: Precision) -> torch.dtype:
    """The torch dtype of the rollout model."""
    return _DTYPES[precision.rollout_dtype]


def fake_quant_e4m3(x: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Round ``x`` onto the e4m3 grid with an absmax scale (per tensor, or per slice along ``dim``), then back
    to ``x``'s dtype. Zeros stay zero; an all-zero slice is returned unchanged."""
    xf = x.float()
    amax = xf.abs().amax() if dim is None else xf.abs().amax(dim=dim, keepdim=True)
    scale = (amax / E4M3_MAX).clamp_min(1e-12)
    q = (xf / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return (q.float() * scale).to(x.dtype)


def format_weight(w: Tensor, precision: Precision, *, fp8: bool = False) -> Tensor:
    """A linear layer's weight on the rollout format's grid, as float32 values: e4m3 fake-quantised with a
    per-tensor scale where ``fp8``, else rounded to the rollout dtype."""
    if fp8:
        return fake_quant_e4m3(w.detach().float())
    return w.detach().to(rollout_dtype(precision)).float()


def emulated_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, out_dtype: torch.dtype,
                    fp8_inputs: bool = False) -> Tensor:
    """The matrix-product rule (math.md §10): ``x`` rounded to ``out_dtype`` (with ``fp8_inputs`` then e4m3
    per token) times ``weight`` (already on the format's grid, ``format_weight``) plus ``bias``, in
    float32."""
    xf = x.to(out_dtype).float()
    if fp8_inputs:
        xf = fake_quant_e4m3(xf, dim=-1)
    y = F.linear(xf, weight.float(), None if bias is None else bias.to(out_dtype).float())
    return y.to(out_dtype)


class RoundedLinear(nn.Linear):
    """A rollout ``nn.Linear`` whose forward is ``emulated_linear`` with ``product_weight``: the float32 copy of its
    weight on the format's grid (``format_weight``; ``sync_rollout_model`` refreshes it). Its parameters keep the
    rollout dtype (a tied embedding shares them)."""

    product_weight: Tensor
    fp8_weight: bool
    fp8_inputs: bool

    def forward(self, x: Tensor) -> Tensor:
        return emulated_linear(x, self.product_weight, self.bias, out_dtype=self.weight.dtype,
                               fp8_inputs=self.fp8_inputs)


def _round_linears(model: nn.Module, precision: Precision) -> None:
    """Turn every ``nn.Linear`` of the rollout model into a ``RoundedLinear`` (FP8 on the quantisable ones)."""
    fp8 = {name for name, _ in quantizable_linears(model)} if precision.rollout_fp8 else set()
    for name, mod in list(model.named_modules()):
        if type(mod) is nn.Linear:
            mod.__class__ = RoundedLinear
            mod.fp8_weight = name in fp8
            mod.fp8_inputs = name in fp8 and precision.fp8_activations
            mod.register_buffer("product_weight", torch.zeros(mod.weight.shape, dtype=torch.float32),
                                persistent=False)


def _ste(x: Tensor, xq: Tensor) -> Tensor:
    """Straight-through: forward value ``xq``, gradient of ``x``."""
    return x + (xq - x).detach()


def quantizable_linears(model: nn.Module) -> Iterator[tuple[str, nn.Linear]]:
    """The linear layers FP8 applies to: every ``nn.Linear`` except the LM head and MoE routers."""
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and not name.endswith("lm_head") and not name.endswith("gate"):
            yield name, mod


def _experts_weights(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """Fused MoE expert weights (3-D parameters inside ``experts`` modules), quantised per expert."""
    for name, p in model.named_parameters():
        if ".experts." in name and p.ndim == 3:
            yield name, p


def _act_quant_modules(model: nn.Module) -> Iterator[nn.Module]:
    """Modules whose first input FP8 activations quantise: the quantisable linears and fused MoE expert blocks."""
    for _name, lin in quantizable_linears(model):
        yield lin
    owners = {n.rsplit(".", 1)[0] for n, _ in _experts_weights(model)}
    for owner in sorted(owners):
        yield model.get_submodule(owner)


def _act_quant_hook(per_token: bool):
    def hook(_mod: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x = args[0]
        xq = fake_quant_e4m3(x, dim=-1 if per_token else None)
        return (_ste(x, xq), *args[1:])

    return hook


def make_rollout_model(train_model: nn.Module, precision: Precision, *, native_products: bool = False) -> nn.Module:
    """A separate inference copy of the policy for the rollout engine, in the precision's dtype, eval mode,
    with the training weights loaded (``sync_rollout_model`` after updates). Below float32 (or with
    ``rollout_fp8``) its linear layers are ``RoundedLinear``s; ``native_products`` (benchmark only) keeps
    torch's own products in the rollout dtype, the emulation before the rule."""
    roll = copy.deepcopy(train_model).to(rollout_dtype(precision)).eval()
    for p in roll.parameters():
        p.requires_grad_(False)
    rounded = not native_products and (rollout_dtype(precision) != torch.float32 or precision.rollout_fp8)
    if rounded:
        _round_linears(roll, precision)
    if precision.rollout_fp8 and precision.fp8_activations:
        for mod in _act_quant_modules(roll):
            if not isinstance(mod, RoundedLinear):
                mod.register_forward_pre_hook(_act_quant_hook(per_token=True))
    sync_rollout_model(roll, train_model, precision)
    return roll


@torch.no_grad()
def sync_rollout_model(rollout_model: nn.Module, train_model: nn.Module, precision: Precision) -> None:
    """Copy the training weights into the rollout model (the weight sync of a real RL system); FP8 weights are
    fake-quantised per tensor (per expert for fused MoE experts) before the cast."""
    src = dict(train_model.named_parameters())
    quant = set()
    if precision.rollout_fp8:
        quant = {f"{n}.weight" for n, _ in quantizable_linears(train_model)} | {n for n, _ in _experts_weights(train_model)}
    for name, p in rollout_model.named_parameters():
        w = src[name].detach()
        if name in quant:
            w = fake_quant_e4m3(w, dim=(1, 2) if w.ndim == 3 else None)
        p.copy_(w.to(p.dtype))
    for name, mod in rollout_model.named_modules():
        if isinstance(mod, RoundedLinear):
            w = train_model.get_submodule(name).weight
            mod.product_weight.copy_(format_weight(w, precision, fp8=mod.fp8_weight))


@contextlib.contextmanager
def training_precision(model: nn.Module, precision: Precision) -> Iterator[None]:
    """Context in which the training model's forward runs in the training precision: for ``train_fp8``,
    temporary hooks swap fake-quantised weights in for each module's forward (straight-through gradients);
    else a no-op."""
    if not precision.train_fp8:
        yield
        return
    originals: dict[tuple[int, str], tuple[nn.Module, Tensor]] = {}
    handles = []
    if precision.fp8_activations:
        for mod in _act_quant_modules(model):
            handles.append(mod.register_forward_pre_hook(_act_quant_hook(per_token=False)))
    targets = [(lin, "weight", None) for _name, lin in quantizable_linears(model)]
    for name, _p in _experts_weights(model):
        owner, pname = name.rsplit(".", 1)
        targets.append((model.get_submodule(owner), pname, (1, 2)))
    for mod, pname, dim in targets:
        handles.append(mod.register_forward_pre_hook(_swap_in(pname, dim, originals)))
        handles.append(mod.register_forward_hook(_swap_out(pname, originals)))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for (_, pname), (mod, w) in originals.items():  # a forward that raised midway: put weights back
            mod._parameters[pname] = w  # type: ignore[assignment]
        originals.clear()


def _swap_in(pname: str, dim: int | tuple[int, ...] | None, originals: dict):
    def hook(mod: nn.Module, _args: tuple[Any, ...]) -> None:
        w = mod._parameters[pname]
        assert w is not None
        originals[(id(mod), pname)] = (mod, w)
        mod._parameters[pname] = _ste(w, fake_quant_e4m3(w, dim=dim))  # type: ignore[assignment]

    return hook


def _swap_out(pname: str, originals: dict):
    def hook(mod: nn.Module, _args: tuple[Any, ...], _out: Any) -> None:
        mod._parameters[pname] = originals.pop((id(mod), pname))[1]  # type: ignore[assignment]

    return hook
