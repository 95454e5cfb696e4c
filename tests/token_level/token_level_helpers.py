"""Shared helpers of the token-level study tests: tiny random Qwen3 policies and scored rollout batches.

The policies are randomly initialised (no pretraining, nothing downloaded); their rollouts earn no task reward, so
tests that need advantages give the batch synthetic 0/1 rewards drawn from a fixed generator.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from analysis.token_level.compute.backend import CpuEngineBackend, problems_for_seed
from analysis.token_level.compute.study import StudySettings
from analysis.token_level.compute.study_config import compose_study, settings_of
from predmask.precisions import get_precision
from predmask.rl.model import build_policy
from predmask.rl.rollout import RolloutBatch
from predmask.rl.tokenizer import ArithmeticTokenizer
from predmask.schemas.task_schema import TaskConfig

TINY_TASK = TaskConfig(
    max_number=20, operand_max=9, train_ops=(1, 1), pretrain_ops=(1, 1), eval_ops=(2, 2), eval_size=4
)
TINY_VOCAB = ArithmeticTokenizer(TINY_TASK.max_number).vocab_size
TINY_MODEL = {
    "name": "tiny",
    "backend": "cpu",
    "arch": "qwen3",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "max_position_embeddings": 64,
    "tie_word_embeddings": True,
}


def tiny_backend(
    precision: str = "bf16", top_k: int = 5, max_new_tokens: int = 6, seed: int = 0, sharpness: float = 4.0
) -> CpuEngineBackend:
    """The CPU engine backend on a tiny random policy, sharpened so that its distributions are peaked."""
    tok = ArithmeticTokenizer(TINY_TASK.max_number)
    model = sharpen(build_policy(TINY_MODEL, tok.vocab_size, seed=seed), sharpness)
    return CpuEngineBackend(
        model, tok, precision=get_precision(precision), top_k=top_k, max_new_tokens=max_new_tokens
    )


def synthetic_rewards(batch: RolloutBatch, seed: int) -> RolloutBatch:
    """Fill ``batch.rewards`` with fixed 0/1 draws (a random policy never earns the task reward)."""
    g = torch.Generator().manual_seed(1000 + seed)
    batch.rewards = (torch.rand(batch.batch_size, generator=g) < 0.5).float()
    return batch


def scored_batch(backend: CpuEngineBackend, seed: int, sequences: int = 32, group: int = 4) -> RolloutBatch:
    problems = problems_for_seed(TINY_TASK, seed, sequences // group)
    return synthetic_rewards(backend.rollout(problems, group, seed), seed)


def sharpen(model: torch.nn.Module, scale: float = 10.0) -> torch.nn.Module:
    """Scale the weight matrices so the random policy is peaked (a fresh init is almost uniform)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.mul_(scale if "embed" in name else scale**0.5)
    return model


def perturbed(model: torch.nn.Module, scale: float, seed: int) -> torch.nn.Module:
    """A copy of ``model`` with Gaussian noise on every weight: a training policy far from the rollout's."""
    import copy

    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * (p.abs().mean() + 1e-3))
    return out


@functools.cache
def _study_settings() -> StudySettings:
    return settings_of(compose_study([]), TINY_VOCAB)


def settings(**changes: Any) -> StudySettings:
    """The study's settings as conf/ composes them, on the tiny vocabulary with fp32 training, with ``changes``."""
    return dataclasses.replace(_study_settings(), **{"precision": get_precision("fp32"), **changes})


#: the tiny policy's architecture and task as study overrides (conftest's ``checkpoint`` is this model, pretrained)
ARCH = [f"model.{k}={v}" for k, v in TINY_MODEL.items() if k not in ("name", "backend", "arch")]
TASK = [
    "task.max_number=20",
    "task.operand_max=9",
    "task.train_ops=[1,1]",
    "task.pretrain_ops=[1,1]",
    "task.eval_ops=[2,2]",
    "task.eval_size=4",
]
#: a seed of a few seconds: 16 sequences, a strong drift and a low threshold (so that there are studied tokens)
SMALL = [
    "sequences=16",
    "group_size=4",
    "minibatches=2",
    "staleness=2",
    "lr=0.05",
    "delta=0.01",
    "max_new_tokens=6",
    "top_k=5",
]


def tiny_study_overrides(checkpoint: Any, without: tuple[str, ...] = ()) -> list[str]:
    """The study overrides of a tiny study on ``checkpoint``, leaving out the keys in ``without``."""
    small = [ov for ov in SMALL if ov.split("=", 1)[0] not in without]
    return [f"checkpoint={checkpoint}", *ARCH, *TASK, *small]
