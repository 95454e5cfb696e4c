"""Emulated precision mismatch on CPU: bf16 rollouts against fp32 training, and e4m3 FP8 fake-quantisation.

Settings (``conf/precision/<name>.yaml`` -> ``PrecisionConfig``), all labelled as emulation in every output:

- ``bf16``:        rollout model in bfloat16 (weights and compute); training in float32.
- ``fp8_rollout``: rollout model in bfloat16 with e4m3 fake-quantised linear layers (W8A8 as vLLM's online
                   ``quantization=fp8``: per-tensor weight scale, dynamic per-token activation scale); training fp32.
- ``fp8_e2e``:     the same FP8 rollout, and training forward passes also fake-quantise the linear layers
                   (per-tensor weight scale, dynamic per-tensor activation scale, as a current-scaling FP8 recipe;
                   straight-through gradients), in float32 compute.

Embeddings, norms and the LM head stay unquantised (vLLM and Megatron keep them in high precision).
Fake-quantisation means ``dequant(quant(x))``: values are rounded onto the e4m3 grid (``torch.float8_e4m3fn``)
after scaling the tensor's absolute maximum to 448, then scaled back.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "E4M3_MAX",
    "PRECISIONS",
    "PrecisionConfig",
    "fake_quant_e4m3",
    "make_rollout_model",
    "quantizable_linears",
    "sync_rollout_model",
    "training_precision",
]

PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp8_rollout", "fp8_e2e")
E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class PrecisionConfig:
    """How rollout and training differ numerically.

    name:            the setting's name (bf16, fp8_rollout, fp8_e2e; fp32 = no mismatch, for tests)
    rollout_dtype:   compute/weight dtype of the rollout model
    rollout_fp8:     e4m3 fake-quantise the rollout's linear layers
    train_fp8:       e4m3 fake-quantise the training forward's linear layers (straight-through gradients)
    fp8_activations: also fake-quantise the linear layers' inputs (W8A8) wherever FP8 is on
    """

    name: str = "bf16"
    rollout_dtype: str = "bfloat16"
    rollout_fp8: bool = False
    train_fp8: bool = False
    fp8_activations: bool = True

    def __post_init__(self) -> None:
        if self.name not in PRECISIONS:
            raise ValueError(f"unknown precision {self.name!r}; allowed: {', '.join(PRECISIONS)}")
        if self.rollout_dtype not in _DTYPES:
            raise ValueError(f"unknown rollout_dtype {self.rollout_dtype!r}; allowed: {', '.join(_DTYPES)}")

    @property
    def torch_rollout_dtype(self) -> torch.dtype:
        return _DTYPES[self.rollout_dtype]

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> PrecisionConfig:
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in values.items() if k in known})

    @classmethod
    def named(cls, name: str) -> PrecisionConfig:
        """The built-in settings by name (the same values as conf/precision/*.yaml)."""
        table = {
            "fp32": cls("fp32", "float32", False, False),
            "bf16": cls("bf16", "bfloat16", False, False),
            "fp8_rollout": cls("fp8_rollout", "bfloat16", True, False),
            "fp8_e2e": cls("fp8_e2e", "bfloat16", True, True),
        }
        if name not in table:
            raise ValueError(f"unknown precision {name!r}; allowed: {', '.join(table)}")
        return table[name]

    @property
    def label(self) -> str:
        parts = [f"rollout {self.rollout_dtype}" + (" + e4m3 fake-quant" if self.rollout_fp8 else "")]
        parts.append("training float32" + (" + e4m3 fake-quant" if self.train_fp8 else ""))
        return f"{self.name} (CPU emulation: " + ", ".join(parts) + ")"


def fake_quant_e4m3(x: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Round ``x`` onto the e4m3 grid with an absmax scale (per tensor, or per slice along ``dim``), then back.

    The result has ``x``'s dtype. Zeros stay zero; an all-zero slice is returned unchanged.
    """
    xf = x.float()
    if dim is None:
        amax = xf.abs().amax()
    else:
        amax = xf.abs().amax(dim=dim, keepdim=True)
    scale = (amax / E4M3_MAX).clamp_min(1e-12)
    q = (xf / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return (q.float() * scale).to(x.dtype)


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


def make_rollout_model(train_model: nn.Module, precision: PrecisionConfig) -> nn.Module:
    """A separate inference copy of the policy for the rollout engine, in the precision's dtype, eval mode.

    With ``rollout_fp8`` and ``fp8_activations`` its linear layers fake-quantise their inputs per token.
    Call ``sync_rollout_model`` to load the training weights (done here once).
    """
    roll = copy.deepcopy(train_model).to(precision.torch_rollout_dtype).eval()
    for p in roll.parameters():
        p.requires_grad_(False)
    if precision.rollout_fp8 and precision.fp8_activations:
        for mod in _act_quant_modules(roll):
            mod.register_forward_pre_hook(_act_quant_hook(per_token=True))
    sync_rollout_model(roll, train_model, precision)
    return roll


@torch.no_grad()
def sync_rollout_model(rollout_model: nn.Module, train_model: nn.Module, precision: PrecisionConfig) -> None:
    """Copy the training weights into the rollout model (the weight sync of a real RL system).

    FP8 weights are fake-quantised per tensor (per expert for fused MoE experts) before the cast.
    """
    src = dict(train_model.named_parameters())
    quant = set()
    if precision.rollout_fp8:
        quant = {f"{n}.weight" for n, _ in quantizable_linears(train_model)} | {n for n, _ in _experts_weights(train_model)}
    for name, p in rollout_model.named_parameters():
        w = src[name].detach()
        if name in quant:
            w = fake_quant_e4m3(w, dim=(1, 2) if w.ndim == 3 else None)
        p.copy_(w.to(p.dtype))


@contextlib.contextmanager
def training_precision(model: nn.Module, precision: PrecisionConfig) -> Iterator[None]:
    """Context in which the training model's forward runs in the training precision.

    For ``train_fp8`` it fake-quantises linear weights (per tensor; fused MoE experts per expert) and, with
    ``fp8_activations``, their inputs (per tensor), with straight-through gradients, through temporary forward
    hooks that swap the quantised weight in for the duration of each module's forward; otherwise a no-op.
    """
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
