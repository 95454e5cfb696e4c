"""The CPU RL engine as one object: task, tokenizer, base policy, rollout model, optimiser, GRPO step, validation.

``Engine.from_config(cfg)`` builds everything a run (``predmask.rl.train``) or the token-level study needs from a
composed ``conf/train.yaml`` (``compose_train_config(overrides)`` composes one with Hydra's compose API):

- ``engine.model`` (float32 training policy, starts as the cached base model), ``engine.rollout_model`` (the
  precision-emulating inference copy), ``engine.optimizer`` (AdamW), ``engine.tokenizer``, ``engine.task``.
- ``engine.sample(problems, n, generator)`` -> ``RolloutBatch`` (top-K support, rewards) from the rollout model.
- ``engine.train_logprobs(batch, support)`` -> ``TrainLogprobs`` (log pi on the support, pi_tail_sq, log pi_k).
- ``engine.update(batch, support, advantages, method=None, **param_overrides)`` -> metrics: one optimiser step.
- ``engine.sync_rollout()``: copy the training weights into the rollout model (after updates).
- ``engine.train_step(problems, generator)``: one GRPO step (rollout, group advantages, mini-batch updates,
  weight sync) -> verl-named metrics.
- ``engine.validate(seed)``: avg@``val_n`` accuracy on both stand-in splits -> ``val-core/<split>/acc/mean@16``.

``resolve_cpu_model`` maps a cluster model entry (``backend: hf`` with ``cpu_standin``) to its CPU stand-in.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

import conf as conf_pkg
from predmask.methods import MethodParams, get_method
from predmask.rl._config import check_known_keys
from predmask.rl.algo import TrainLogprobs, grpo_advantages, mismatch_metrics, policy_update, support_logprobs
from predmask.rl.base import BaseConfig, load_base_model
from predmask.rl.model import check_cpu_model_config, count_parameters
from predmask.rl.precision import PrecisionConfig, make_rollout_model, sync_rollout_model
from predmask.rl.rollout import RolloutBatch, rollout_problems
from predmask.rl.task import EVAL_SPLITS, Problem, TaskConfig, make_split
from predmask.rl.tokenizer import ArithmeticTokenizer
from predmask.support import TopKSupport

__all__ = [
    "CONF_DIR",
    "Engine",
    "RolloutConfig",
    "TrainerConfig",
    "compose_train_config",
    "resolve_cpu_model",
    "select_support",
    "to_container",
    "validate_config",
]

CONF_DIR = Path(conf_pkg.__file__).resolve().parent
#: mask metrics that add up over mini-batches (counts); the others are averaged, divergence_max is maxed
_SUM_KEYS = ("actor/mask/tokens", "actor/mask/mu_tail_clamped", "actor/mask/pi_tail_clamped",
             "actor/mask/direction_disagree")


def compose_train_config(overrides: Sequence[str] = ()) -> DictConfig:
    """Compose ``conf/train.yaml`` with Hydra overrides (e.g. ``["method=predmask_kl_agg", "seed=1"]``)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None, job_name="train"):
        return compose(config_name="train", overrides=list(overrides))


def to_container(cfg: DictConfig | Mapping[str, Any]) -> dict[str, Any]:
    """A resolved plain-dict copy of a config (without the ``hydra`` node)."""
    if isinstance(cfg, DictConfig):
        out = OmegaConf.to_container(cfg, resolve=True)
    else:
        out = OmegaConf.to_container(OmegaConf.create(dict(cfg)), resolve=True)
    assert isinstance(out, dict)
    out.pop("hydra", None)
    return out  # type: ignore[return-value]


def resolve_cpu_model(model_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The CPU model config to train: itself when ``backend: cpu``, else its ``cpu_standin`` from conf/model."""
    if model_cfg.get("backend") == "cpu":
        check_cpu_model_config(model_cfg)
        return dict(model_cfg)
    standin = model_cfg.get("cpu_standin")
    if not standin:
        raise ValueError(
            f"model {model_cfg.get('name')!r} is not a CPU model and names no cpu_standin; "
            "use model=cpu_s, cpu_m or cpu_moe"
        )
    path = CONF_DIR / "model" / f"{standin}.yaml"
    if not path.exists():
        raise ValueError(f"cpu_standin {standin!r} of model {model_cfg.get('name')!r} has no conf/model/{standin}.yaml")
    resolved = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    assert isinstance(resolved, dict)
    check_cpu_model_config(resolved)
    resolved["resolved_from"] = model_cfg.get("name")
    return resolved  # type: ignore[return-value]


@dataclass(frozen=True)
class RolloutConfig:
    """n responses per prompt at ``temperature`` (top-p 1), at most ``response_length`` new tokens."""

    n: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    response_length: int = 16

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"rollout.n must be >= 1, got {self.n}")
        if not self.temperature > 0:
            raise ValueError(f"rollout.temperature must be > 0, got {self.temperature}")
        if self.top_p != 1.0:
            raise ValueError(f"rollout.top_p must be 1.0 (the engine samples the full softmax), got {self.top_p}")
        if self.response_length < 1:
            raise ValueError(f"rollout.response_length must be >= 1, got {self.response_length}")


@dataclass(frozen=True)
class TrainerConfig:
    """GRPO trainer settings (see conf/train.yaml ``trainer``)."""

    steps: int = 200
    train_batch_size: int = 16
    ppo_mini_batch_size: int = 4
    ppo_epochs: int = 1
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    eps: float = 1e-8
    grad_clip: float = 1.0
    val_every: int = 25
    val_before_train: bool = True
    val_n: int = 16
    save_every: int = 25
    keep_checkpoints: int = 2
    threads: int = 1
    progress: str | bool = "auto"
    log_every: int = 10

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"trainer.steps must be >= 1, got {self.steps}")
        if self.train_batch_size < 1 or self.ppo_mini_batch_size < 1:
            raise ValueError("trainer.train_batch_size and trainer.ppo_mini_batch_size must be >= 1")
        if self.train_batch_size % self.ppo_mini_batch_size:
            raise ValueError(
                f"trainer.train_batch_size ({self.train_batch_size}) must be a multiple of "
                f"trainer.ppo_mini_batch_size ({self.ppo_mini_batch_size})"
            )
        if self.ppo_epochs < 1 or self.val_n < 1 or self.threads < 1 or self.keep_checkpoints < 1:
            raise ValueError("trainer.ppo_epochs, val_n, threads and keep_checkpoints must be >= 1")
        if self.val_every < 0 or self.save_every < 0:
            raise ValueError("trainer.val_every and trainer.save_every must be >= 0 (0 = only at the end)")
        if not self.lr > 0:
            raise ValueError(f"trainer.lr must be > 0, got {self.lr}")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> TrainerConfig:
        check_known_keys(cls, values, "trainer")
        v = dict(values)
        if "betas" in v:
            v["betas"] = tuple(float(b) for b in v["betas"])
        return cls(**v)


def validate_config(c: Mapping[str, Any]) -> None:
    """Check every section of a resolved train config; the first problem raises a one-line ValueError."""
    for key in ("method", "model", "precision", "seed", "delta", "top_k", "run_dir"):
        if key not in c:
            raise ValueError(f"config has no {key!r}; compose conf/train.yaml (python -m predmask.rl.train)")
    check_cpu_model_config(c["model"])
    get_method(str(c["method"].get("name")))
    MethodParams.from_mapping(dict(c["method"]))
    PrecisionConfig.from_mapping(c["precision"])
    task = TaskConfig.from_mapping(c.get("task", {}))
    BaseConfig.from_mapping(c.get("base", {}))
    RolloutConfig(**c.get("rollout", {}))
    TrainerConfig.from_mapping(c.get("trainer", {}))
    vocab = ArithmeticTokenizer(task.max_number).vocab_size
    if not 1 <= int(c["top_k"]) <= vocab:
        raise ValueError(f"top_k must lie in [1, vocab_size={vocab}], got {c['top_k']}")


def select_support(support: TopKSupport, index: slice | torch.Tensor) -> TopKSupport:
    """Rows ``index`` of a support."""
    return TopKSupport(support.ids[index], support.mu_logprobs[index], support.valid[index],
                       support.sampled_index[index])


def _aggregate(per_mb: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for m in per_mb for k in m})
    out: dict[str, float] = {}
    for k in keys:
        vals = [m[k] for m in per_mb if k in m]
        if k in _SUM_KEYS:
            out[k] = float(sum(vals))
        elif k.endswith("divergence_max"):
            out[k] = float(max(vals))
        else:
            out[k] = float(sum(vals) / len(vals))
    return out


class Engine:
    """Everything of one CPU RL run, built from a composed train config (see the module docstring)."""

    def __init__(self, cfg: DictConfig | Mapping[str, Any], *, progress: bool = True) -> None:
        c = to_container(cfg)
        self.cfg = c
        self.model_cfg = resolve_cpu_model(c["model"])
        self.task = TaskConfig.from_mapping(c.get("task", {}))
        self.base_cfg = BaseConfig.from_mapping(c.get("base", {}))
        self.rollout_cfg = RolloutConfig(**c.get("rollout", {}))
        self.trainer_cfg = TrainerConfig.from_mapping(c.get("trainer", {}))
        self.precision = PrecisionConfig.from_mapping(c["precision"])
        self.top_k = int(c.get("top_k", 20))
        self.seed = int(c.get("seed", 0))
        self.tokenizer = ArithmeticTokenizer(self.task.max_number)
        if not 1 <= self.top_k <= self.tokenizer.vocab_size:
            raise ValueError(f"top_k must lie in [1, {self.tokenizer.vocab_size}], got {self.top_k}")
        self.method_name = str(c["method"]["name"])
        self.method = get_method(self.method_name)
        self.params = MethodParams.from_mapping({**c["method"], "vocab_size": self.tokenizer.vocab_size})
        self.model, self.base_info = load_base_model(
            self.model_cfg, self.task, self.base_cfg, cache_dir=c.get("cache_dir", "results/cache"), progress=progress,
        )
        self.rollout_model = make_rollout_model(self.model, self.precision)
        self.optimizer = self.make_optimizer()
        self.eval_problems = {s: make_split(self.task, s) for s in EVAL_SPLITS}

    @classmethod
    def from_config(cls, cfg: DictConfig | Mapping[str, Any], *, progress: bool = True) -> Engine:
        return cls(cfg, progress=progress)

    @property
    def n_parameters(self) -> int:
        return count_parameters(self.model)

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
            top_k=self.top_k, generator=generator,
        )

    def train_logprobs(self, batch: RolloutBatch, support: TopKSupport | None = None, *,
                       grad: bool = False) -> TrainLogprobs:
        """Training log-probs on the support, in the training precision (no graph unless ``grad``)."""
        with torch.set_grad_enabled(grad):
            return support_logprobs(self.model, batch, support, temperature=self.rollout_cfg.temperature,
                                    precision=self.precision)

    def update(self, batch: RolloutBatch, support: TopKSupport, advantages: torch.Tensor, *,
               method: str | None = None, **param_overrides: Any) -> tuple[dict[str, float], TrainLogprobs]:
        """One optimiser step with ``method`` (default: the run's) on ``batch``; see ``algo.policy_update``."""
        return policy_update(
            self.model, self.optimizer, batch, support, advantages,
            method=method or self.method, params=self.params, temperature=self.rollout_cfg.temperature,
            precision=self.precision, grad_clip=self.trainer_cfg.grad_clip, overrides=param_overrides or None,
        )

    def train_step(self, problems: Sequence[Problem], generator: torch.Generator) -> dict[str, float]:
        """One GRPO step on ``problems``: rollout, advantages, mini-batch updates, weight sync; verl metrics."""
        t0 = time.perf_counter()
        batch = self.sample(problems, generator=generator)
        t_gen = time.perf_counter() - t0
        n = self.rollout_cfg.n
        adv = grpo_advantages(batch.rewards, n)
        support = batch.support()
        rows = self.trainer_cfg.ppo_mini_batch_size * n
        per_mb: list[dict[str, float]] = []
        mismatch: dict[str, float] = {}
        t1 = time.perf_counter()
        for _epoch in range(self.trainer_cfg.ppo_epochs):
            for start in range(0, batch.batch_size, rows):
                idx = slice(start, start + rows)
                metrics, lp = self.update(batch.select(idx), select_support(support, idx), adv[idx])
                if not mismatch:
                    mismatch = mismatch_metrics(batch.select(idx), select_support(support, idx), lp.pi)
                per_mb.append(metrics)
        self.sync_rollout()
        t_upd = time.perf_counter() - t1
        out = _aggregate(per_mb)
        out.update(mismatch)
        out.update(batch_metrics(batch, adv, self.rollout_cfg.response_length))
        out["actor/lr"] = float(self.optimizer.param_groups[0]["lr"])
        gen_tokens = float(batch.response_mask.sum())
        out["timing_s/gen"] = t_gen
        out["timing_s/update_actor"] = t_upd
        out["perf/total_num_tokens"] = gen_tokens
        return out

    def validate(self, seed: int) -> dict[str, float]:
        """avg@val_n accuracy on both stand-in splits, sampling seeded by ``seed`` (independent of training)."""
        out: dict[str, float] = {}
        n = self.trainer_cfg.val_n
        for i, (split, problems) in enumerate(self.eval_problems.items()):
            gen = torch.Generator().manual_seed(seed * 1_000_003 + 7 + i)
            b = self.sample(problems, n=n, generator=gen)
            out[f"val-core/{split}/acc/mean@{n}"] = float(b.rewards.mean())
            out[f"val-aux/{split}/response_length/mean"] = float(b.response_lengths.float().mean())
        return out


def batch_metrics(batch: RolloutBatch, advantages: torch.Tensor, max_response_length: int) -> dict[str, float]:
    """verl's data metrics of one rollout batch (score, advantages, lengths) plus the rollout's top-K tail mass."""
    lengths = batch.response_lengths.float()
    mask = batch.response_mask
    tail = (1.0 - batch.topk_logprobs.exp().sum(-1)).clamp_min(0.0)[mask]
    prompt_len = batch.prompt_mask.sum(-1).float()
    return {
        "critic/score/mean": float(batch.rewards.mean()),
        "critic/score/max": float(batch.rewards.max()),
        "critic/score/min": float(batch.rewards.min()),
        "critic/rewards/mean": float(batch.rewards.mean()),
        "critic/advantages/mean": float(advantages.mean()),
        "critic/advantages/max": float(advantages.max()),
        "critic/advantages/min": float(advantages.min()),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/min": float(lengths.min()),
        "response_length/clip_ratio": float((lengths >= max_response_length).float().mean()),
        "prompt_length/mean": float(prompt_len.mean()),
        "rollout/topk_tail_mass/mean": float(tail.mean()) if tail.numel() else 0.0,
        "rollout/topk_tail_mass/max": float(tail.max()) if tail.numel() else 0.0,
    }
