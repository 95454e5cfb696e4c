"""Shared helpers of the verl tests: the verl import gate, a tiny transformers model, mock vLLM log-prob entries."""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
import torch

FIXTURES = Path(__file__).parent / "fixtures"
GOLDEN = Path(__file__).parent / "golden"


def require_verl(module: str = "verl.trainer.ppo.core_algos") -> ModuleType:
    """Import ``module`` from verl; skip with the reason when verl is missing, fail instead when CI=true."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if os.environ.get("CI", "").lower() == "true":
            raise
        pytest.skip(f"verl is not importable ({exc}); install the 'verl' extra", allow_module_level=True)
        raise  # unreachable


def tiny_causal_lm(vocab: int = 48, layers: int = 1, seed: int = 0) -> torch.nn.Module:
    """A randomly initialised Qwen3 causal LM small enough for CPU tests (no download)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    return Qwen3ForCausalLM(cfg).eval()


@dataclass(frozen=True)
class MockLogprob:
    """Stand-in for ``vllm.logprobs.Logprob`` (vLLM cannot be installed on the CPU machines)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def vllm_position(logprobs: torch.Tensor, sampled: int, k: int) -> dict[int, MockLogprob]:
    """The documented vLLM structure for one generated token: the sampled token first (with its 1-based rank),
    then the top-``k`` tokens of ``logprobs`` [V] by rank (the sampled one not repeated): k or k+1 entries."""
    order = torch.argsort(logprobs, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(1, len(order) + 1)
    out = {sampled: MockLogprob(float(logprobs[sampled]), int(rank[sampled]), f"<{sampled}>")}
    for t in order[:k].tolist():
        out.setdefault(t, MockLogprob(float(logprobs[t]), int(rank[t]), f"<{t}>"))
    return out
