"""The variational family's weighted SFT trainer on the CPU engine: step plan, lr schedule, checkpoints, resume.

The loss is ``predmask.vr_weights.weighted_sft_loss``; metrics lines and checkpoints go to the run directory through
``predmask.rundir``, so a killed stage resumes from its newest checkpoint with the same data order.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from predmask import metrics as M
from predmask import vr_weights as V
from predmask.checkpoints import latest_valid_checkpoint, save_checkpoint
from predmask.progress import progress as show_progress
from predmask.rl.algo import response_logits
from predmask.rl.base import load_training_state, sft_batch, training_state
from predmask.rl.tokenizer import ArithmeticTokenizer
from predmask.rl.train import due
from predmask.rundir import METRICS_FILE, MetricsWriter, cut_metrics, write_status
from predmask.schemas.variational_schema import SFTConfig


@dataclass(frozen=True)
class Row:
    """One supervised example: its question, prompt, response (without <eos>) and loss weight."""

    question: int
    prompt: str
    response: str
    weight: float


def token_logprobs(model: nn.Module, batch: Any) -> Tensor:
    """log p of every response token [B, R] (teacher forcing, with the graph when grad is on)."""
    logits = response_logits(model, batch)
    return torch.log_softmax(logits, -1).gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)


def step_plan(n_questions: int, per_step: int, epochs: int, seed: int) -> list[list[int]]:
    """The question indices of every step: one shuffled pass per epoch (rng from ``seed`` and the epoch), cut into
    batches of ``per_step`` questions (the last one of an epoch may be smaller)."""
    plan: list[list[int]] = []
    for epoch in range(epochs):
        order = list(range(n_questions))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        plan += [order[s:s + per_step] for s in range(0, n_questions, per_step)]
    return plan


def _resume(run_dir: Path, model: nn.Module, opt: torch.optim.Optimizer, plan: list[list[int]],
            log: logging.Logger) -> tuple[int, bool]:
    """Load the run's newest readable checkpoint (model, optimiser, rng; an unreadable newer one is moved aside by
    ``predmask.checkpoints``) and drop the metrics lines past it: (the step it reached, whether there was one);
    a checkpoint of another data order is a ValueError."""
    ckpt = latest_valid_checkpoint(run_dir, log)
    start = 0
    if ckpt is not None:
        blob = ckpt.blob
        if blob["plan"] != plan:
            raise ValueError(f"checkpoint {ckpt.path} was written with another data order; use a fresh run directory")
        load_training_state(blob, model, opt)
        start = ckpt.step
        log.info("resuming from %s (step %d of %d)", ckpt.path, start, len(plan))
    cut_metrics(run_dir, start if ckpt is not None else None, log)
    return start, ckpt is not None


def _sft_step(model: nn.Module, opt: torch.optim.Optimizer, tokenizer: ArithmeticTokenizer, rows: Sequence[Row],
              lr: float, normaliser: float, grad_clip: float) -> dict[str, Any]:
    """One optimiser step on ``rows`` at ``lr`` (none without rows); its loss, lr and gradient norm."""
    for group in opt.param_groups:
        group["lr"] = lr
    data: dict[str, Any] = {M.TRAIN_LOSS: 0.0, M.ACTOR_LR: lr, M.ACTOR_GRAD_NORM: 0.0}
    if rows:
        batch = sft_batch(tokenizer, [r.prompt for r in rows], [r.response for r in rows])
        weights = torch.tensor([r.weight for r in rows], dtype=torch.float32)
        loss = V.weighted_sft_loss(token_logprobs(model, batch), batch.response_mask, weights, normaliser)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        data.update({M.TRAIN_LOSS: float(loss.detach()), M.ACTOR_GRAD_NORM: float(grad_norm)})
    return data


def train_sft(model: nn.Module, rows: Sequence[Row], *, run_dir: Path, sft: SFTConfig, tokenizer: ArithmeticTokenizer,
              seed: int, n_questions: int, epochs: int, title: str, log: logging.Logger,
              final_metrics: Callable[[nn.Module], Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """Weighted SFT of ``model`` on ``rows`` (``predmask.vr_weights.weighted_sft_loss``, normaliser
    sft.normaliser x sft.questions_per_step), resuming from the run's newest checkpoint. ``final_metrics(model)``
    adds its metrics to the last step's line. Returns ``{"step", "resumed", **last metrics}``."""
    by_question: dict[int, list[Row]] = {}
    for r in rows:
        by_question.setdefault(r.question, []).append(r)
    plan = step_plan(n_questions, sft.questions_per_step, epochs, seed)
    total = len(plan)
    normaliser = float(sft.normaliser * sft.questions_per_step)
    opt = torch.optim.AdamW(model.parameters(), lr=sft.lr)
    start, resumed = _resume(run_dir, model, opt, plan, log)
    data: dict[str, Any] = {}
    model.train()
    with (closing(MetricsWriter(run_dir / METRICS_FILE)) as writer,
          show_progress(title, total=total, completed=start, unit="steps", bar=None) as bar):
        for step in range(start + 1, total + 1):
            t0 = time.perf_counter()
            lr = sft.lr * min(1.0, step / sft.warmup) if sft.warmup > 0 else sft.lr  # linear warmup
            batch_rows = [r for q in plan[step - 1] for r in by_question.get(q, [])]
            data = _sft_step(model, opt, tokenizer, batch_rows, lr, normaliser, sft.grad_clip)
            if step == total and final_metrics is not None:
                data.update(final_metrics(model))
            data[M.GLOBAL_STEP] = step
            data[M.TIMING_STEP] = time.perf_counter() - t0
            writer.log(data, step)
            log.info("step %d loss=%.4f lr=%.3g", step, data[M.TRAIN_LOSS], lr, extra={"console": False})
            if due(step, sft.save_every, total):
                save_checkpoint(run_dir, step, {**training_state(model, opt), "plan": plan}, keep=2)
            write_status(run_dir, "running", step, total)
            bar.advance(status=f"loss {data[M.TRAIN_LOSS]:.3f}")
    return {"step": total, "resumed": resumed, **data}
