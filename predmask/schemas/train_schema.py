"""The engine's config sections as dataclasses: the Hydra schemas of conf/train.yaml's ``base``, ``rollout`` and
``trainer``, and the tracker names ``trainer.logger`` takes (``predmask.rl.trackers`` writes them)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from predmask.schemas.unknown_keys import check_known_keys

#: the ``trainer.logger`` names both engines honour (verl's names; verl knows more, the CPU engine only these)
LOGGERS: tuple[str, ...] = ("console", "file", "tensorboard", "wandb")
DEFAULT_LOGGERS: tuple[str, ...] = ("console", "file")


def check_loggers(value: str | Iterable[str]) -> tuple[str, ...]:
    """``trainer.logger`` as a tuple (a single name allowed, as in verl; duplicates dropped, order kept); one
    ValueError line for an unknown name or a list without ``file``."""
    names = (value,) if isinstance(value, str) else tuple(value)
    bad = [n for n in names if n not in LOGGERS]
    if bad:
        raise ValueError(f"unknown trainer.logger {', '.join(map(repr, bad))}; allowed: {', '.join(LOGGERS)}")
    if "file" not in names:
        raise ValueError(
            f"trainer.logger={list(names)} lacks 'file': metrics.jsonl is the run's record (ingest, reports, resume "
            "read it); add file, e.g. trainer.logger=[console,file,tensorboard]"
        )
    return tuple(dict.fromkeys(names))


@dataclass(frozen=True)
class RolloutConfig:
    """n responses per prompt at ``temperature`` (top-p 1), at most ``response_length`` new tokens."""

    n: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    response_length: int = 16

    def __post_init__(self) -> None:
        if self.n < 2:
            raise ValueError(
                f"rollout.n must be >= 2: GRPO's advantage is a reward minus the mean of its group of n responses, "
                f"so n=1 makes every advantage 0 and the run learns nothing; got {self.n}"
            )
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
    logger: tuple[str, ...] = DEFAULT_LOGGERS

    def __post_init__(self) -> None:
        object.__setattr__(self, "logger", check_loggers(self.logger))
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


@dataclass(frozen=True)
class BaseConfig:
    """Supervised pretraining of the base model: AdamW with linear warmup and cosine decay to ``lr *
    min_lr_ratio``; ``noise``: probability of an arithmetic slip per written step of a worked solution;
    ``guess_frac``: fraction of corpus solutions that are bare guesses (``task.guess_solution``, off by up to
    ``guess_spread``); ``eval_problems``: train problems in the reported accuracy."""

    seed: int = 0
    steps: int = 1000
    batch_size: int = 64
    lr: float = 5e-3
    warmup: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    noise: float = 0.0
    guess_frac: float = 0.5
    guess_spread: int = 10
    eval_problems: int = 256

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError(f"base.steps and base.batch_size must be >= 1, got {self.steps}, {self.batch_size}")
        if not self.lr > 0:
            raise ValueError(f"base.lr must be > 0, got {self.lr}")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> BaseConfig:
        check_known_keys(cls, values, "base")
        return cls(**values)
