"""The token-level study's backends, the policy and rollouts it studies: the CPU engine's (a base model or a
training run's checkpoint, with the precision-emulating rollout) or a Hugging Face model's (``HFBackend``)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from itertools import islice
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from analysis.token_level.compute.study import SeedStudy, StudySettings, study_batch
from analysis.token_level.compute.study_config import StudyInputError, model_label, precision_of, task_of
from predmask.precisions import Precision
from predmask.rl.emulated_precision import make_rollout_model
from predmask.rl.rollout import RolloutBatch, rollout_problems
from predmask.rl.task import Problem, iter_train_prompts
from predmask.rl.tokenizer import ArithmeticTokenizer
from predmask.rundir import first_line
from predmask.schemas.task_schema import TaskConfig


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
        precision: Precision,
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
    from predmask.rl.base import load_base_model
    from predmask.schemas.train_schema import BaseConfig

    return load_base_model(
        cfg["model"],
        task_of(cfg),
        BaseConfig.from_mapping(dict(cfg["base"])),
        response_len=cfg["max_new_tokens"],
        cache_dir=cfg["paths"]["cache_dir"],
        progress=progress,
    )


def make_backend(cfg: Mapping[str, Any]) -> Backend:
    """The backend of a composed, validated study config."""
    m = cfg["model"]
    common = {"precision": precision_of(cfg), "top_k": cfg["top_k"], "max_new_tokens": cfg["max_new_tokens"],
              "temperature": cfg["temperature"], "label": model_label(cfg)}  # what both backends take
    if m.get("backend") == "hf":
        from analysis.token_level.compute.hf import HFBackend

        # the hf: block's keys are HFBackend's options (config.HFSettings)
        return HFBackend(cfg["checkpoint"] or m.get("path"), device=cfg["device"], **common, **cfg["hf"])
    tokenizer = ArithmeticTokenizer(task_of(cfg).max_number)
    model = _checkpoint_policy(cfg, tokenizer.vocab_size) if cfg["checkpoint"] else base_model(cfg)[0]
    return CpuEngineBackend(model, tokenizer, **common)


def _checkpoint_policy(cfg: Mapping[str, Any], vocab_size: int) -> nn.Module:
    """The CPU engine's policy with a training run's weights (``cfg.checkpoint``): the architecture comes from
    the model entry."""
    from predmask.rl.model import build_policy

    model = build_policy(cfg["model"], vocab_size, seed=0)
    load_checkpoint_weights(model, Path(str(cfg["checkpoint"])))
    return model


def run_seed(backend: Backend, cfg: Mapping[str, Any], settings: StudySettings, seed: int) -> SeedStudy:
    """One seed: its prompts, a fresh scored rollout, then the study on that batch."""
    t0 = time.perf_counter()
    n_prompts = cfg["sequences"] // settings.group_size
    problems = problems_for_seed(task_of(cfg), seed, n_prompts)
    batch = backend.rollout(problems, settings.group_size, seed)
    t_roll = time.perf_counter() - t0
    result = study_batch(backend.policy(), batch, settings)
    result.facts["seconds_rollout"] = t_roll
    return result


def check_checkpoint(cfg: Mapping[str, Any]) -> None:
    """Load a CPU-engine study's ``checkpoint`` into the configured architecture (cheap for CPU models); a one-line
    StudyInputError when it does not fit. Nothing to check without a checkpoint or for a Hugging Face model."""
    if cfg.get("checkpoint") is None or cfg["model"].get("backend") != "cpu":
        return
    try:
        _checkpoint_policy(cfg, ArithmeticTokenizer(task_of(cfg).max_number).vocab_size)
    except Exception as err:  # noqa: BLE001 - any load failure is bad input, reported in one line
        raise StudyInputError(
            f"checkpoint {cfg['checkpoint']} cannot be loaded into model "
            f"{cfg['model'].get('name')!r}: {first_line(err)}"
        ) from None
