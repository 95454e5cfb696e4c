"""Helpers shared by the CPU engine tests: a tiny Qwen3 config and a random policy with peaked distributions."""

from __future__ import annotations

import torch

from predmask.rl.model import build_policy
from predmask.rl.tokenizer import ArithmeticTokenizer

TINY_MODEL = {
    "name": "tiny", "backend": "cpu", "arch": "qwen3", "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
    "tie_word_embeddings": True, "max_position_embeddings": 64,
}


def peaked_policy(tokenizer: ArithmeticTokenizer, seed: int = 0, scale: float = 6.0) -> torch.nn.Module:
    """A random tiny policy whose weights are scaled up so that its next-token distributions are peaked
    (a freshly initialised model is nearly uniform, which would make every precision comparison trivial)."""
    model = build_policy(TINY_MODEL, tokenizer.vocab_size, seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(scale)
    return model.eval()
