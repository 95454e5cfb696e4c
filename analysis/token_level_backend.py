"""Where the token-level study's policy and rollouts come from: the CPU engine, or a Hugging Face checkpoint.

``make_backend(cfg)`` reads the composed study config: a ``conf/model`` entry with ``backend: cpu`` gives the CPU
engine's base model (or ``checkpoint=...``, a training run's saved weights) with the precision-emulating rollout
engine; ``backend: hf`` gives ``analysis.token_level_hf.HFBackend`` (GPU path). ``run_seed`` is one seed of the
study on either: the seed's prompts, a fresh rollout, then ``analysis.token_level_core.study_batch``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from itertools import islice
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from analysis.token_level_core import SeedStudy, StudySettings, study_batch
from predmask.rl.precision import PrecisionConfig, make_rollout_model
from predmask.rl.rollout import RolloutBatch, rollout_problems
from predmask.rl.task import Problem, TaskConfig, iter_train_prompts
from predmask.rl.tokenizer import ArithmeticTokenizer

__all__ = [
    "Backend",
    "CpuEngineBackend",
    "load_checkpoint_weights",
    "make_backend",
    "precision_of",
    "problems_for_seed",
    "run_seed",
    "settings_of",
    "task_of",
]


class Backend(Protocol):
    """What the study needs from a policy source."""

    vocab_size: int
    label: str

    def policy(self) -> nn.Module:
        """The training policy reset to its starting weights (pi before the stale updates)."""
        ...

    def rollout(self, problems: Sequence[Problem], n: int, seed: int) -> RolloutBatch:
        """``n`` scored samples per problem, with the top-K of mu per generated token."""
        ...


def task_of(cfg: Mapping[str, Any]) -> TaskConfig:
    return TaskConfig.from_mapping(dict(cfg.get("task") or {}))


def precision_of(cfg: Mapping[str, Any]) -> PrecisionConfig:
    return PrecisionConfig.from_mapping(dict(cfg["precision"]))


def problems_for_seed(task: TaskConfig, seed: int, n_prompts: int) -> list[Problem]:
    """The seed's prompts: problems ``seed*n .. seed*n+n-1`` of the train stream (disjoint across seeds)."""
    return list(islice(iter_train_prompts(task, "train", start=seed * n_prompts), n_prompts))


def load_checkpoint_weights(model: nn.Module, path: Path) -> None:
    """Load a training run's saved policy weights into ``model``.

    Accepts a file holding a state dict (``torch.save(model.state_dict())``) or a dict with a ``model`` /
    ``state_dict`` entry (the CPU trainer's ``checkpoints/step_XXXXXX.pt``), or a directory: a run directory or its
    ``checkpoints/`` (the newest ``step_*.pt`` is taken), or one holding ``model.safetensors`` / ``model.pt``.
    """
    target = _checkpoint_file(path)
    if target.suffix == ".safetensors":
        from safetensors.torch import load_file

        state: Any = load_file(str(target))
    else:
        state = torch.load(str(target), map_location="cpu", weights_only=True)
    if isinstance(state, Mapping):
        for key in ("model", "state_dict", "policy"):
            if key in state and isinstance(state[key], Mapping):
                state = state[key]
                break
    missing, unexpected = model.load_state_dict(dict(state), strict=False)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {target} does not match the model: missing {list(missing)[:3]}, "
            f"unexpected {list(unexpected)[:3]}"
        )


def _checkpoint_file(path: Path) -> Path:
    """The weights file of ``path``: the file itself, or in a directory (a run directory, its ``checkpoints/``, or
    a step directory) the newest ``step_*.pt`` (the CPU trainer's) or a ``model.safetensors`` / ``model.pt``."""
    if path.is_file():
        return path
    if not path.is_dir():
        raise ValueError(f"checkpoint {path} does not exist")
    folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    steps = sorted(p for p in folder.glob("step_*.pt") if p.stem[5:].isdigit())
    if steps:
        return steps[-1]
    for name in ("model.safetensors", "model.pt"):
        if (folder / name).is_file():
            return folder / name
    raise ValueError(f"checkpoint {path}: no step_*.pt, model.safetensors or model.pt found")


class CpuEngineBackend:
    """The CPU engine: a small Qwen3 on the arithmetic task, rollouts from a precision-emulating copy."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: ArithmeticTokenizer,
        *,
        precision: PrecisionConfig,
        top_k: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        label: str = "",
    ) -> None:
        self.model = model.float()
        self.tokenizer = tokenizer
        self.precision = precision
        self.top_k, self.max_new_tokens, self.temperature = top_k, max_new_tokens, temperature
        self.vocab_size = tokenizer.vocab_size
        self.label = label
        self._base = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self._rollout_model = make_rollout_model(self.model, precision)

    def policy(self) -> nn.Module:
        self.model.load_state_dict(self._base)
        return self.model

    def rollout(self, problems: Sequence[Problem], n: int, seed: int) -> RolloutBatch:
        gen = torch.Generator().manual_seed(seed)
        return rollout_problems(
            self._rollout_model,
            self.tokenizer,
            problems,
            n=n,
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            generator=gen,
        )


def base_model(cfg: Mapping[str, Any], *, progress: bool = False) -> tuple[nn.Module, dict[str, Any]]:
    """The CPU engine's pretrained base policy for ``cfg.model`` (built once, then loaded from the engine's cache)."""
    from predmask.rl.base import BaseConfig, load_base_model

    paths = cfg.get("paths") or {}
    return load_base_model(
        cfg["model"],
        task_of(cfg),
        BaseConfig.from_mapping(dict(cfg.get("base") or {})),
        response_len=int(cfg["max_new_tokens"]),
        cache_dir=str(paths.get("cache_dir", "results/cache")),
        progress=progress,
    )


def model_label(cfg: Mapping[str, Any]) -> str:
    """How outputs name the model: a CPU model says which cluster model it stands in for."""
    m = cfg["model"]
    name = m.get("name")
    if m.get("backend") == "cpu":
        return f"{name} (CPU stand-in for {m.get('stands_in_for', '?')}, not the real model)"
    return str(name)


def make_backend(cfg: Mapping[str, Any]) -> Backend:
    """The backend of a composed, validated study config."""
    precision = precision_of(cfg)
    m = cfg["model"]
    if m.get("backend") == "hf":
        from analysis.token_level_hf import HFBackend

        hf = dict(cfg.get("hf") or {})
        path = cfg.get("checkpoint") or m.get("path")
        return HFBackend(
            path,
            precision=precision,
            top_k=int(cfg["top_k"]),
            max_new_tokens=int(cfg["max_new_tokens"]),
            temperature=float(cfg["temperature"]),
            device=str(cfg.get("device", "auto")),
            train_dtype=str(hf.get("train_dtype", "float32")),
            rollout_engine=str(hf.get("rollout_engine", "auto")),
            prompt_template=str(hf.get("prompt_template", "{prompt}")),
            rollout_chunk=int(hf.get("rollout_chunk", 256)),
            vllm_kwargs=hf.get("vllm_kwargs"),
            label=model_label(cfg),
        )
    task = task_of(cfg)
    tokenizer = ArithmeticTokenizer(task.max_number)
    if cfg.get("checkpoint"):  # a training run's weights: the architecture comes from the model entry
        from predmask.rl.model import build_policy

        model = build_policy(cfg["model"], tokenizer.vocab_size, seed=0)
        load_checkpoint_weights(model, Path(str(cfg["checkpoint"])))
    else:
        model, _info = base_model(cfg)
    return CpuEngineBackend(
        model,
        tokenizer,
        precision=precision,
        top_k=int(cfg["top_k"]),
        max_new_tokens=int(cfg["max_new_tokens"]),
        temperature=float(cfg["temperature"]),
        label=model_label(cfg),
    )


def settings_of(cfg: Mapping[str, Any], vocab_size: int) -> StudySettings:
    """The StudySettings of a composed study config."""
    precision = precision_of(cfg)
    clip = cfg.get("grad_clip")
    mb = cfg.get("micro_batch")
    return StudySettings(
        delta=float(cfg["delta"]),
        group_size=int(cfg["group_size"]),
        vocab_size=int(vocab_size),
        staleness=int(cfg["staleness"]),
        minibatches=int(cfg["minibatches"]),
        stale_method=str(cfg["stale_method"]),
        lr=float(cfg["lr"]),
        betas=tuple(float(b) for b in cfg["betas"]),  # type: ignore[arg-type]
        weight_decay=float(cfg["weight_decay"]),
        adam_eps=float(cfg["adam_eps"]),
        grad_clip=None if clip is None else float(clip),
        ratio_cap=float(cfg["ratio_cap"]),
        loss_agg_mode=str(cfg["loss_agg_mode"]),
        reference_update=bool(cfg["reference_update"]),
        micro_batch=None if mb is None else int(mb),
        temperature=float(cfg["temperature"]),
        precision=precision,
        update_path=str(cfg["update_path"]),
    )


def run_seed(backend: Backend, cfg: Mapping[str, Any], settings: StudySettings, seed: int) -> SeedStudy:
    """One seed: its prompts, a fresh scored rollout, then the study on that batch."""
    t0 = time.perf_counter()
    n_prompts = int(cfg["sequences"]) // settings.group_size
    problems = problems_for_seed(task_of(cfg), seed, n_prompts)
    batch = backend.rollout(problems, settings.group_size, seed)
    t_roll = time.perf_counter() - t0
    result = study_batch(backend.policy(), batch, settings)
    result.facts["seconds_rollout"] = t_roll
    return result
