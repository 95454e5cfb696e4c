"""The CPU RL engine as one object: task, tokenizer, base policy, rollout model, optimiser, GRPO step, validation.

``Engine(cfg)`` builds everything a run (``predmask.rl.train``) or the token-level study needs from a composed
``conf/train.yaml`` (``predmask.config.compose("train", overrides)``). ``prepare_config`` turns a composed
train config into the resolved, validated config of a run (the trainer's ``config.yaml``; ``python -m sweeps``
prepares every run of a grid with it before anything is written).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from predmask import metrics as M
from predmask.config import cpu_standin, to_container
from predmask.evaluation import split_metrics
from predmask.io import atomic_write_text
from predmask.methods import get_method, method_config, method_params
from predmask.metrics import reduce_metrics
from predmask.rl.algo import TrainLogprobs, grpo_advantages, mismatch_metrics, policy_update, support_logprobs
from predmask.rl.base import base_cache_key, load_base_model
from predmask.rl.emulated_precision import make_rollout_model, precision_of, sync_rollout_model
from predmask.rl.model import check_cpu_model_config
from predmask.rl.rollout import RolloutBatch, rollout_problems
from predmask.rl.task import EVAL_SPLITS, Problem, make_split
from predmask.rl.tokenizer import ArithmeticTokenizer
from predmask.schemas.task_schema import TaskConfig
from predmask.schemas.train_schema import BaseConfig, RolloutConfig, TrainerConfig
from predmask.support import TopKSupport


def resolve_cpu_model(model_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The CPU model config to train for a model entry (itself, or its CPU stand-in), checked."""
    resolved = cpu_standin(model_cfg)
    check_cpu_model_config(resolved)
    return resolved


def prepare_config(cfg: DictConfig | Mapping[str, Any]) -> dict[str, Any]:
    """The resolved config of a run: a cluster model mapped to its CPU stand-in, every parameter of the method and
    what the precision emulates recorded, every section validated (ValueError, one line)."""
    c = to_container(cfg)
    c["model"] = resolve_cpu_model(c["model"])
    c["method"] = method_config(c["method"])
    c["precision"] = {**c["precision"], "emulates": precision_of(c["precision"]).emulates}
    validate_config(c)
    return c


def _sections(c: Mapping[str, Any]) -> tuple[TaskConfig, BaseConfig, RolloutConfig, TrainerConfig]:
    return (TaskConfig.from_mapping(c.get("task", {})), BaseConfig.from_mapping(c.get("base", {})),
            RolloutConfig(**c.get("rollout", {})), TrainerConfig.from_mapping(c.get("trainer", {})))


def validate_config(c: Mapping[str, Any]) -> None:
    """Check every section of a resolved train config; the first problem raises a one-line ValueError."""
    for key in ("method", "model", "precision", "seed", "delta", "top_k", "run_dir"):
        if key not in c:
            raise ValueError(f"config has no {key!r}; compose conf/train.yaml (python -m predmask.rl.train)")
    check_cpu_model_config(c["model"])
    get_method(str(c["method"].get("name")))
    method_params(dict(c["method"]))
    precision_of(c["precision"])
    task, *_ = _sections(c)
    vocab = ArithmeticTokenizer(task.max_number).vocab_size
    if not 1 <= int(c["top_k"]) <= vocab:
        raise ValueError(f"top_k must lie in [1, vocab_size={vocab}], got {c['top_k']}")


class Engine:
    """Everything of one CPU RL run, built from a composed train config (see the module docstring)."""

    def __init__(self, cfg: DictConfig | Mapping[str, Any], *, progress: bool = True) -> None:
        c = to_container(cfg)
        self.cfg = c
        self.model_cfg = resolve_cpu_model(c["model"])
        self.task, self.base_cfg, self.rollout_cfg, self.trainer_cfg = _sections(c)
        self.precision = precision_of(c["precision"])
        self.top_k = int(c.get("top_k", 20))
        self.seed = int(c.get("seed", 0))
        self.tokenizer = ArithmeticTokenizer(self.task.max_number)
        if not 1 <= self.top_k <= self.tokenizer.vocab_size:
            raise ValueError(f"top_k must lie in [1, {self.tokenizer.vocab_size}], got {self.top_k}")
        self.method_name = str(c["method"]["name"])
        self.method = get_method(self.method_name)
        self.params = method_params({**c["method"], "vocab_size": self.tokenizer.vocab_size})
        self.model, self.base_info = load_base_model(
            self.model_cfg, self.task, self.base_cfg, cache_dir=c.get("cache_dir", "results/cache"), progress=progress,
        )
        self.rollout_model = make_rollout_model(self.model, self.precision)
        #: benchmark-only switches back to the previous path (``predmask.rl.bench``): every sample's prompt
        #: prefilled apart, the exact tail computed for every method
        self.prefill_once = True
        self.tail_where_read = True
        self.optimizer = self.make_optimizer()
        self.eval_problems = {s: make_split(self.task, s) for s in EVAL_SPLITS}

    @property
    def n_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def make_optimizer(self) -> torch.optim.AdamW:
        t = self.trainer_cfg
        return torch.optim.AdamW(self.model.parameters(), lr=t.lr, betas=t.betas, eps=t.eps,
                                 weight_decay=t.weight_decay)

    def sync_rollout(self) -> None:
        sync_rollout_model(self.rollout_model, self.model, self.precision)

    def sample(self, problems: Sequence[Problem], n: int | None = None,
               generator: torch.Generator | None = None) -> RolloutBatch:
        """``n`` (default rollout.n) responses per problem from the rollout model, with top-K and rewards."""
        return rollout_problems(
            self.rollout_model, self.tokenizer, problems, n=n or self.rollout_cfg.n,
            max_new_tokens=self.rollout_cfg.response_length, temperature=self.rollout_cfg.temperature,
            top_k=self.top_k, generator=generator, prefill_once=self.prefill_once,
        )

    def train_logprobs(self, batch: RolloutBatch, support: TopKSupport | None = None, *,
                       grad: bool = False, tail_sq: bool = True) -> TrainLogprobs:
        """``algo.support_logprobs`` in the training precision (no graph unless ``grad``)."""
        with torch.set_grad_enabled(grad):
            return support_logprobs(self.model, batch, support, temperature=self.rollout_cfg.temperature,
                                    precision=self.precision, tail_sq=tail_sq)

    def update(self, batch: RolloutBatch, support: TopKSupport, advantages: torch.Tensor, *,
               method: str | None = None, anchor_logprobs: torch.Tensor | None = None,
               **param_overrides: Any) -> tuple[dict[str, float], TrainLogprobs]:
        """One optimiser step with ``method`` (default: the run's) on ``batch``; see ``algo.policy_update``."""
        return policy_update(
            self.model, self.optimizer, batch, support, advantages,
            method=method or self.method, params=self.params, temperature=self.rollout_cfg.temperature,
            precision=self.precision, grad_clip=self.trainer_cfg.grad_clip, overrides=param_overrides or None,
            anchor_logprobs=anchor_logprobs, tail_sq=None if self.tail_where_read else True,
        )

    def old_logprobs(self, batch: RolloutBatch, support: TopKSupport) -> torch.Tensor | None:
        """pi_old [B, R] of the sampled tokens when the run's anchor is ``old`` (one no-grad forward), else None."""
        if self.method.anchor(self.params) != "old":
            return None
        return self.train_logprobs(batch, support, tail_sq=False).log_prob

    def train_step(self, problems: Sequence[Problem], generator: torch.Generator) -> dict[str, float]:
        """One GRPO step on ``problems``: rollout, advantages, mini-batch updates, weight sync; verl metrics.

        With the anchor ``old`` (``MethodParams.anchor``; grpo_clip_higher's default) the ratio is anchored on
        pi_old: one no-grad forward of the training policy over the rollout batch before its first update, as
        verl's ``compute_log_prob``; else on the rollout's log mu."""
        t0 = time.perf_counter()
        batch = self.sample(problems, generator=generator)
        t_gen = time.perf_counter() - t0
        n = self.rollout_cfg.n
        adv = grpo_advantages(batch.rewards, n)
        support = batch.support()
        old = self.old_logprobs(batch, support)
        rows = self.trainer_cfg.ppo_mini_batch_size * n
        per_mb: list[dict[str, float]] = []
        mismatch: dict[str, float] = {}
        t1 = time.perf_counter()
        for _epoch in range(self.trainer_cfg.ppo_epochs):
            for start in range(0, batch.batch_size, rows):
                idx = slice(start, start + rows)
                metrics, lp = self.update(batch.select(idx), support.select(idx), adv[idx],
                                          anchor_logprobs=None if old is None else old[idx])
                if not mismatch:
                    mismatch = mismatch_metrics(batch.select(idx), support.select(idx), lp.pi)
                per_mb.append(metrics)
        self.sync_rollout()
        t_upd = time.perf_counter() - t1
        out = reduce_metrics(per_mb)
        out.update(mismatch)
        out.update(batch_metrics(batch, adv, self.rollout_cfg.response_length))
        out[M.ACTOR_LR] = float(self.optimizer.param_groups[0]["lr"])
        out[M.TIMING_GEN] = t_gen
        out[M.TIMING_UPDATE_ACTOR] = t_upd
        out[M.PERF_TOTAL_NUM_TOKENS] = float(batch.response_mask.sum())
        return out

    def validate(self, seed: int) -> dict[str, float]:
        """``validation_metrics`` of val_n samples per problem of both stand-in splits, sampling seeded by
        ``seed`` (independent of training)."""
        out: dict[str, float] = {}
        n = self.trainer_cfg.val_n
        for i, (split, problems) in enumerate(self.eval_problems.items()):
            gen = torch.Generator().manual_seed(seed * 1_000_003 + 7 + i)
            out.update(validation_metrics(split, self.sample(problems, n=n, generator=gen), n))
        return out

    def validate_base(self, seed: int) -> dict[str, float]:
        """:meth:`validate` of the base policy (call it before any update), shared by the runs whose inputs are the
        same (the methods of a setting and seed): read from ``<cache_dir>/validation/base-<key>.json`` when an earlier
        run wrote it, else computed and written there atomically (JSON only)."""
        key = base_validation_key(self, seed)
        path = Path(str(self.cfg.get("cache_dir", "results/cache"))) / "validation" / f"base-{key}.json"
        try:
            cached = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(cached, dict) and all(isinstance(v, float) for v in cached.values()):
                return cached
        except (OSError, ValueError):
            pass  # absent or unreadable: computed again and rewritten
        out = self.validate(seed)
        atomic_write_text(path, json.dumps(out))
        return out


#: the sources whose code computes a validation (sampling, models, precisions, task, metrics): part of its cache key
_VALIDATION_SOURCES = ("rl/engine.py", "rl/rollout.py", "rl/model.py", "rl/emulated_precision.py", "rl/task.py",
                       "rl/tokenizer.py", "precisions.py", "evaluation.py")


def base_validation_key(engine: Engine, seed: int) -> str:
    """The content key of the base policy's validation: everything it depends on, the code that computes it
    included; the method is not in it."""
    package = Path(__file__).resolve().parents[1]
    code = hashlib.sha256(b"".join((package / name).read_bytes() for name in _VALIDATION_SOURCES)).hexdigest()
    payload = {
        "base": base_cache_key(engine.model_cfg, engine.task, engine.base_cfg), "precision": asdict(engine.precision),
        "rollout": asdict(engine.rollout_cfg), "val_n": engine.trainer_cfg.val_n, "top_k": engine.top_k,
        "seed": seed, "torch": torch.__version__, "code": code,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def validation_metrics(split: str, batch: RolloutBatch, n: int) -> dict[str, float]:
    """:func:`split_metrics` of ``n`` scored samples per problem (rows ``i*n .. i*n+n-1`` = problem ``i``)."""
    return split_metrics(split, batch.rewards.view(-1, n), batch.response_lengths.float())


def batch_metrics(batch: RolloutBatch, advantages: torch.Tensor, max_response_length: int) -> dict[str, float]:
    """verl's data metrics of one rollout batch (score, advantages, lengths) plus the rollout's top-K tail mass."""
    lengths = batch.response_lengths.float()
    mask = batch.response_mask
    tail = (1.0 - batch.topk_logprobs.exp().sum(-1)).clamp_min(0.0)[mask]
    prompt_len = batch.prompt_mask.sum(-1).float()
    return {
        M.SCORE_MEAN: float(batch.rewards.mean()),
        M.SCORE_MAX: float(batch.rewards.max()),
        M.SCORE_MIN: float(batch.rewards.min()),
        M.REWARDS_MEAN: float(batch.rewards.mean()),
        M.ADVANTAGES_MEAN: float(advantages.mean()),
        M.ADVANTAGES_MAX: float(advantages.max()),
        M.ADVANTAGES_MIN: float(advantages.min()),
        M.RESPONSE_LENGTH_MEAN: float(lengths.mean()),
        M.RESPONSE_LENGTH_MAX: float(lengths.max()),
        M.RESPONSE_LENGTH_MIN: float(lengths.min()),
        M.RESPONSE_LENGTH_CLIP_RATIO: float((lengths >= max_response_length).float().mean()),
        M.PROMPT_LENGTH_MEAN: float(prompt_len.mean()),
        M.TOPK_TAIL_MASS_MEAN: float(tail.mean()) if tail.numel() else 0.0,
        M.TOPK_TAIL_MASS_MAX: float(tail.max()) if tail.numel() else 0.0,
    }
