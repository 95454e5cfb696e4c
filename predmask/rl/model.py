"""The CPU policy: a small Qwen3 (or Qwen3-MoE) causal LM from ``transformers``, built from a ``conf/model`` entry.

The model config names the cluster model it stands in for (``stands_in_for``); every output of the engine
repeats that it is a CPU stand-in.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from transformers import PreTrainedModel, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from predmask.config import cpu_models

ARCHS: tuple[str, ...] = ("qwen3", "qwen3_moe")
#: keys of a conf/model entry that are architecture fields (passed to the transformers config)
ARCH_KEYS: tuple[str, ...] = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rope_theta",
    "rms_norm_eps",
    "tie_word_embeddings",
    "max_position_embeddings",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
)


def check_cpu_model_config(model_cfg: Mapping[str, Any]) -> None:
    """One-line errors for a model config the CPU engine cannot build."""
    if model_cfg.get("backend") != "cpu":
        raise ValueError(
            f"model {model_cfg.get('name')!r} has backend {model_cfg.get('backend')!r}; the CPU engine needs a "
            f"conf/model entry with backend: cpu ({', '.join(cpu_models())})"
        )
    if model_cfg.get("arch") not in ARCHS:
        raise ValueError(f"model arch {model_cfg.get('arch')!r} unknown; allowed: {', '.join(ARCHS)}")


def hf_config(model_cfg: Mapping[str, Any], vocab_size: int) -> Qwen3Config | Qwen3MoeConfig:
    """The transformers config of a conf/model entry (architecture fields only)."""
    check_cpu_model_config(model_cfg)
    kw = {k: model_cfg[k] for k in ARCH_KEYS if k in model_cfg and model_cfg[k] is not None}
    kw.update(vocab_size=vocab_size, bos_token_id=1, eos_token_id=2, pad_token_id=0, use_cache=True)
    if model_cfg["arch"] == "qwen3":
        for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob"):
            kw.pop(k, None)
        cfg = Qwen3Config(**kw)
    else:
        kw.setdefault("decoder_sparse_step", 1)
        kw.setdefault("mlp_only_layers", [])
        cfg = Qwen3MoeConfig(**kw)
    cfg._attn_implementation = str(model_cfg.get("attn_implementation", "sdpa"))
    return cfg


def build_policy(model_cfg: Mapping[str, Any], vocab_size: int, seed: int) -> PreTrainedModel:
    """A randomly initialised float32 policy (deterministic for ``seed``), in train mode."""
    cfg = hf_config(model_cfg, vocab_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: PreTrainedModel
        model = Qwen3ForCausalLM(cfg) if model_cfg["arch"] == "qwen3" else Qwen3MoeForCausalLM(cfg)
    return model.float().train()
