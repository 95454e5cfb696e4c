"""The base model: short supervised pretraining of the CPU policy on the task's (noisy) worked solutions, cached.

The first ``load_base_model`` builds it (with a progress display) and caches it under
``results/cache/base-<model>-<key>.pt`` (``base_cache_key``); later calls, from any process, load the file. A
file lock makes racing processes build it once. Pretraining is deterministic for ``base_cfg.seed`` (one CPU
thread while it runs). Its corpus is noisy (``predmask.rl.task.noisy_steps``): a fraction of the written steps
are arithmetic slips, so the base model samples wrong steps at temperature 1 where its most likely step is
right — the gap RL closes, as on real base models.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import random
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from predmask.io import atomic_write
from predmask.progress import progress as show_progress
from predmask.progress import waiting
from predmask.rl.algo import response_logits
from predmask.rl.model import build_policy, hf_config
from predmask.rl.rollout import encode_prompts, pad_rows, rollout_problems
from predmask.rl.task import (
    EVAL_SPLITS,
    Problem,
    format_solution,
    guess_solution,
    iter_train_prompts,
    make_split,
    noisy_steps,
)
from predmask.rl.tokenizer import ArithmeticTokenizer
from predmask.rundir import hold_lock, holder_stamp
from predmask.schemas.task_schema import TaskConfig
from predmask.schemas.train_schema import BaseConfig

#: bump when pretraining code changes in a way that changes the weights (invalidates every cache entry)
CACHE_VERSION = 1
DEFAULT_CACHE_DIR = "results/cache"


@dataclass
class SequenceBatch:
    """Teacher-forcing batch: prompts left-padded [B, P], responses right-padded [B, R]."""

    prompt_ids: Tensor
    prompt_mask: Tensor
    response_ids: Tensor
    response_mask: Tensor


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """Run the block with one torch thread (bitwise-reproducible CPU results), then restore."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def training_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The model, optimiser and RNG states of a training checkpoint."""
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}}


def load_training_state(blob: Mapping[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Restore what ``training_state`` saved."""
    model.load_state_dict(blob["model"])
    optimizer.load_state_dict(blob["optimizer"])
    torch.set_rng_state(blob["rng"]["torch"])
    random.setstate(blob["rng"]["python"])


def sft_batch(tokenizer: ArithmeticTokenizer, prompts: Sequence[str], responses: Sequence[str]) -> SequenceBatch:
    """Tokenise prompt/response pairs (response ends with <eos>) into a teacher-forcing batch."""
    prompt_ids, prompt_mask = encode_prompts(tokenizer, prompts)
    ids, mask = pad_rows([tokenizer.encode(r, eos=True) for r in responses], tokenizer.pad_id, left=False)
    return SequenceBatch(prompt_ids, prompt_mask, ids, mask)


def _corpus_solution(problem: Problem, rng: random.Random, cfg: BaseConfig, max_number: int) -> str:
    if cfg.guess_frac > 0 and rng.random() < cfg.guess_frac:
        return guess_solution(problem, rng, cfg.guess_spread, max_number)
    return format_solution(noisy_steps(problem, rng, cfg.noise, max_number))


def _lr_factor(step: int, cfg: BaseConfig) -> float:
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))


@torch.no_grad()
def evaluate_accuracy(
    model: nn.Module,
    tokenizer: ArithmeticTokenizer,
    problems: Sequence[Problem],
    *,
    n: int,
    max_new_tokens: int,
    seed: int,
    temperature: float = 1.0,
) -> dict[str, float]:
    """avg@n of ``n`` samples per problem at ``temperature`` with a fixed sampling seed: ``acc`` (mean
    reward), ``guess_rate`` (responses that box an answer without working) and ``worked_acc`` (accuracy of the
    others)."""
    was_training = model.training
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    batch = rollout_problems(model, tokenizer, problems, n=n, max_new_tokens=max_new_tokens,
                             temperature=temperature, generator=gen)
    model.train(was_training)
    guess = batch.response_ids[:, 0] == tokenizer.token_id("\\boxed{")
    worked = ~guess
    return {
        "acc": float(batch.rewards.mean()),
        "guess_rate": float(guess.float().mean()),
        "worked_acc": float(batch.rewards[worked].mean()) if bool(worked.any()) else 0.0,
    }


def pretrain(
    model: nn.Module,
    tokenizer: ArithmeticTokenizer,
    task: TaskConfig,
    cfg: BaseConfig,
    *,
    progress: bool = True,
    description: str = "pretraining base model",
) -> dict[str, float]:
    """Supervised training on the noisy ``pretrain`` stream; returns ``{"final_loss", "seconds"}``."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, cfg))
    stream = iter_train_prompts(task, split="pretrain")
    noise_rng = random.Random(cfg.seed * 7_919 + 17)
    t0 = time.perf_counter()
    loss_ema = float("nan")
    with show_progress(description, total=cfg.steps, unit="steps", bar=None if progress else False) as bar:
        for _step in range(cfg.steps):
            problems = [next(stream) for _ in range(cfg.batch_size)]
            solutions = [_corpus_solution(p, noise_rng, cfg, task.max_number) for p in problems]
            batch = sft_batch(tokenizer, [p.prompt for p in problems], solutions)
            mask = batch.response_mask
            loss = nn.functional.cross_entropy(response_logits(model, batch)[mask], batch.response_ids[mask])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            lv = float(loss.detach())
            loss_ema = lv if math.isnan(loss_ema) else 0.95 * loss_ema + 0.05 * lv
            bar.advance(status=f"loss {loss_ema:.3f}")
    return {"final_loss": loss_ema, "seconds": time.perf_counter() - t0}


def _arch_fields(model_cfg: Mapping[str, Any], vocab_size: int) -> dict[str, Any]:
    cfg = hf_config(model_cfg, vocab_size).to_dict()
    for k in ("transformers_version", "_name_or_path", "architectures", "dtype", "torch_dtype"):
        cfg.pop(k, None)
    return {"arch": model_cfg["arch"], "hf": cfg}


def task_response_budget(task: TaskConfig) -> int:
    """New tokens the longest worked solution of the task needs (steps, commas, box, <eos>) plus slack."""
    most = max(task.train_ops[1], task.pretrain_ops[1], *task.eval_ops)
    return 2 * most + 4


def base_cache_key(model_cfg: Mapping[str, Any], task: TaskConfig, cfg: BaseConfig) -> str:
    """Stable hash of everything that determines the base model (weights and reported accuracies)."""
    tok = ArithmeticTokenizer(task.max_number)
    payload = {
        "version": CACHE_VERSION,
        "model": _arch_fields(model_cfg, tok.vocab_size),
        "task": task.to_dict(),
        "base": asdict(cfg),
    }
    blob = json.dumps(payload, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def base_cache_path(model_cfg: Mapping[str, Any], task: TaskConfig, cfg: BaseConfig,
                    cache_dir: str | os.PathLike[str] = DEFAULT_CACHE_DIR) -> Path:
    key = base_cache_key(model_cfg, task, cfg)
    return Path(cache_dir) / f"base-{model_cfg.get('name', 'model')}-{key}.pt"


def _build(model_cfg: Mapping[str, Any], task: TaskConfig, cfg: BaseConfig,
           progress: bool) -> tuple[nn.Module, dict[str, Any]]:
    tok = ArithmeticTokenizer(task.max_number)
    response_len = task_response_budget(task)
    with single_thread():
        model = build_policy(model_cfg, tok.vocab_size, cfg.seed)
        torch.manual_seed(cfg.seed)
        stats = pretrain(model, tok, task, cfg, progress=progress,
                         description=f"pretraining base model {model_cfg.get('name')}")
        train_problems = make_split(task, "train", cfg.eval_problems)
        info: dict[str, Any] = {
            "model": model_cfg.get("name"),
            "stands_in_for": model_cfg.get("stands_in_for"),
            "pretrain_seconds": stats["seconds"],
            "final_loss": stats["final_loss"],
        }
        for temp in (1.0, 0.3):
            r = evaluate_accuracy(model, tok, train_problems, n=4, max_new_tokens=response_len, seed=cfg.seed,
                                  temperature=temp)
            sfx = "" if temp == 1.0 else f"@t{temp}"
            info.update({f"train_{k}{sfx}": v for k, v in r.items()})
        for split in EVAL_SPLITS:
            r = evaluate_accuracy(model, tok, make_split(task, split), n=16, max_new_tokens=response_len,
                                  seed=cfg.seed)
            info[f"{split}_acc_mean@16"] = r["acc"]
            info[f"{split}_worked_acc"] = r["worked_acc"]
    model.train()
    return model, info


def load_base_model(
    model_cfg: Mapping[str, Any],
    task: TaskConfig,
    cfg: BaseConfig,
    *,
    response_len: int | None = None,
    cache_dir: str | os.PathLike[str] = DEFAULT_CACHE_DIR,
    progress: bool = True,
) -> tuple[nn.Module, dict[str, Any]]:
    """The pretrained float32 base policy of ``model_cfg`` and its info dict (its measured accuracies); built
    once, then loaded from cache. ``response_len`` is accepted for callers that pass their own budget and
    changes nothing (the accuracies are measured with ``task_response_budget``)."""
    del response_len
    path = base_cache_path(model_cfg, task, cfg, cache_dir)
    tok = ArithmeticTokenizer(task.max_number)
    phase = f"waiting for base model {model_cfg.get('name')} (another run builds it)"
    with hold_lock(path.with_suffix(".lock"), holder_stamp(), lambda _holder: waiting(phase)):
        if not path.exists():
            model, info = _build(model_cfg, task, cfg, progress)
            blob = {"state_dict": model.state_dict(), "info": info}
            atomic_write(path, lambda tmp: torch.save(blob, tmp))
            return model, dict(info, cache_path=str(path), built=True)
    blob = torch.load(path, map_location="cpu", weights_only=True)
    model = build_policy(model_cfg, tok.vocab_size, cfg.seed)
    model.load_state_dict(blob["state_dict"])
    return model.train(), dict(blob["info"], cache_path=str(path), built=False)
