"""The precision catalogue: each rollout/training precision setting by name, what it is on the cluster, and what the
CPU engine emulates for it (``predmask.rl.emulated_precision`` implements the emulation by the matrix-product
rule of math.md §10, ``predmask.verl`` the real thing). ``conf/precision/<name>.yaml`` selects an entry by
name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from predmask.registry import Registry


@dataclass(frozen=True)
class Precision:
    """One precision setting (``rollout_dtype``: compute/weight dtype of the rollout model).

    rollout_fp8:     FP8 rollout: vLLM ``quantization=fp8`` on the cluster; e4m3 fake-quantised linear layers on CPU
    train_fp8:       FP8 training: Megatron FP8 on the cluster; e4m3 fake-quantised training forwards on CPU
                     (straight-through gradients)
    fp8_activations: where FP8 is on, the linear layers' inputs are quantised too (W8A8), not only the weights
    cluster:         a setting of the paper that runs on the GPU cluster (fp32, no mismatch, is a CPU reference)
    emulates:        what the CPU engine does for it, in words (shown in logs and run configs)"""

    name: str
    rollout_dtype: Literal["float32", "bfloat16"]
    rollout_fp8: bool
    train_fp8: bool
    fp8_activations: bool
    cluster: bool
    emulates: str


PRECISIONS: Registry[Precision] = Registry("precision")
for _p in (
    Precision("fp32", "float32", rollout_fp8=False, train_fp8=False, fp8_activations=True, cluster=False,
              emulates="no mismatch: rollout and training both in float32 (a CPU reference for tests)"),
    Precision("bf16", "bfloat16", rollout_fp8=False, train_fp8=False, fp8_activations=True, cluster=True,
              emulates="rollout model in bfloat16, training in float32"),
    Precision("fp8_rollout", "bfloat16", rollout_fp8=True, train_fp8=False, fp8_activations=True, cluster=True,
              emulates="bf16 rollout with e4m3 fake-quant W8A8 linears (per-tensor weight, per-token activation "
                       "scales, as vLLM's online fp8); float32 training"),
    Precision("fp8_e2e", "bfloat16", rollout_fp8=True, train_fp8=True, fp8_activations=True, cluster=True,
              emulates="bf16 rollout with e4m3 W8A8 per-token scales; float32 training with e4m3 W8A8 per-tensor "
                       "scales (a current-scaling FP8 recipe), straight-through gradients"),
):
    PRECISIONS.add(_p.name, _p)

#: the precisions of the paper's settings, which also run on the cluster (in catalogue order)
CLUSTER_PRECISIONS: tuple[str, ...] = tuple(name for name, p in PRECISIONS.items() if p.cluster)
#: the catalogue entry of a name; unknown names raise a one-line ValueError listing the known ones
get_precision = PRECISIONS.lookup
