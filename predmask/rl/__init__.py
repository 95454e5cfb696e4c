"""predmask.rl: the CPU-scale GRPO engine (tiny Qwen3 policy, synthetic verifiable arithmetic, emulated precision).

Modules: ``task`` (data, reward), ``tokenizer``, ``model`` (Qwen3 / Qwen3-MoE policy), ``emulated_precision`` (bf16 / FP8
emulation of ``predmask.precisions``' settings), ``base`` (cached pretrained base model), ``rollout`` (KV-cache
sampling with top-K log-probs), ``algo`` (support log-probs, GRPO advantages, masked update), ``engine`` (everything
of a run as one object), ``train`` (``python -m predmask.rl.train``), ``bench`` (``python scripts/benchmark.py engine``)
and ``vr_runner`` (the variational family's stages: ``python -m predmask.rl.vr_runner RUN_DIR``). Their config
sections are the dataclasses of ``predmask.schemas``.

Imports are lazy so that ``import predmask`` stays light; the names below are the public API.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Problem": "task",
    "EVAL_SPLITS": "task",
    "STANDIN_LABEL": "task",
    "make_split": "task",
    "iter_train_prompts": "task",
    "extract_answer": "task",
    "reward": "task",
    "ArithmeticTokenizer": "tokenizer",
    "build_policy": "model",
    "precision_of": "emulated_precision",
    "make_rollout_model": "emulated_precision",
    "sync_rollout_model": "emulated_precision",
    "fake_quant_e4m3": "emulated_precision",
    "load_base_model": "base",
    "RolloutBatch": "rollout",
    "generate": "rollout",
    "rollout_problems": "rollout",
    "TrainLogprobs": "algo",
    "support_logprobs": "algo",
    "grpo_advantages": "algo",
    "token_advantages": "algo",
    "policy_update": "algo",
    "mismatch_metrics": "algo",
    "Engine": "engine",
    "resolve_cpu_model": "engine",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"predmask.rl.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'predmask.rl' has no attribute {name!r}")
