"""GRPO pieces of the CPU engine: training log-probs on the rollout support, group advantages, one masked update.

Reusable by the trainer, the token-level study and the GPU check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from predmask import metrics as M
from predmask.divergence import topk_divergence
from predmask.methods import Method, MethodParams, get_method, policy_loss
from predmask.precisions import Precision, get_precision
from predmask.rl.emulated_precision import training_precision
from predmask.rl.rollout import RolloutBatch
from predmask.support import TopKSupport, gather_support_logprobs


@dataclass
class TrainLogprobs:
    """Training-side log-probs of one batch: ``pi`` [B, R, K+1], ``pi_tail_sq`` [B, R] (None where not computed),
    ``log_prob`` [B, R]."""

    pi: Tensor
    pi_tail_sq: Tensor | None
    log_prob: Tensor

    def detach(self) -> TrainLogprobs:
        return TrainLogprobs(self.pi.detach(), None if self.pi_tail_sq is None else self.pi_tail_sq.detach(),
                             self.log_prob.detach())


def reads_tail_sq(method: str | Method) -> bool:
    """Whether ``method``'s loss reads ``pi_tail_sq``: its direction's tail estimator is the exact tail."""
    return (method if isinstance(method, Method) else get_method(method)).reads_tail_sq


def response_logits(model: nn.Module, batch: RolloutBatch, precision: Precision | None = None) -> Tensor:
    """Logits [B, R, V] predicting each response token, from one teacher-forced forward of prompt + response,
    in the training precision (fp32, or FP8 fake-quant for ``fp8_e2e``), with the autograd graph."""
    ids = torch.cat([batch.prompt_ids, batch.response_ids], 1)
    attn = torch.cat([batch.prompt_mask, batch.response_mask], 1).long()
    pos = (attn.cumsum(-1) - 1).clamp_min(0)
    p, r = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    with training_precision(model, precision or get_precision("fp32")):
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos,
                       logits_to_keep=slice(p - 1, p + r - 1)).logits
    return logits.float()


def support_logprobs(
    model: nn.Module,
    batch: RolloutBatch,
    support: TopKSupport | None = None,
    *,
    temperature: float = 1.0,
    precision: Precision | None = None,
    tail_sq: bool = True,
) -> TrainLogprobs:
    """Training log-probs on the rollout support [B, R, K+1] (``gather_support_logprobs``; the exact tail of
    math.md §3.1 only with ``tail_sq``) and of the sampled token, with grad."""
    s = support if support is not None else batch.support()
    logits = response_logits(model, batch, precision)
    out = gather_support_logprobs(logits, s.ids, s.valid, temperature=temperature, return_tail_sq=tail_sq)
    pi, tail = out if tail_sq else (out, None)
    return TrainLogprobs(pi=pi, pi_tail_sq=tail, log_prob=s.sampled_logprob(pi))


def grpo_advantages(rewards: Tensor, group_size: int, eps: float = 1e-6, norm_by_std: bool = True,
                    dtype: torch.dtype = torch.float32) -> Tensor:
    """GRPO outcome advantages [B] (in ``dtype``, float32 as verl): ``(r - mean_group) / (std_group + eps)``; rows
    ``g*n .. g*n+n-1`` form group g (``n = group_size``), so ``B`` must be a multiple of ``n``.

    ``std`` is the unbiased sample std (as verl's GRPO). A group of one has no baseline but itself: its advantage
    is 0, not NaN (the unbiased std of one value is undefined). A group whose rewards are all equal gets 0 too.
    """
    if group_size < 1 or rewards.ndim != 1 or rewards.shape[0] % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} cannot be split into groups of {group_size}")
    g = rewards.to(dtype).view(-1, group_size)
    if group_size == 1:
        return torch.zeros_like(rewards, dtype=dtype)
    centred = g - g.mean(-1, keepdim=True)
    if norm_by_std:
        centred = centred / (g.std(-1, keepdim=True) + eps)
    return centred.reshape(-1)


def token_advantages(advantages: Tensor, response_mask: Tensor) -> Tensor:
    """Broadcast sequence advantages [B] to response tokens [B, R] (zero on padding)."""
    return advantages.unsqueeze(-1) * response_mask.to(torch.float32)


def mismatch_metrics(batch: RolloutBatch, support: TopKSupport, pi_logprobs: Tensor) -> dict[str, float]:
    """Rollout-vs-training mismatch on one batch, before any update (pure precision mismatch): the mean and
    largest top-K KL(mu || pi) over response tokens (math.md §2) and verl's sampled-token estimate (mean log
    mu_k - log pi_k).
    """
    with torch.no_grad():
        pi = pi_logprobs.detach()
        d = topk_divergence(support.mu_logprobs, pi, support.valid, divergence="kl")
        m = batch.response_mask
        d_tok = d[m]
        lp_pi = support.sampled_logprob(pi)
        return {
            M.MISMATCH_TOPK_KL: float(d_tok.mean()) if d_tok.numel() else 0.0,
            M.MISMATCH_TOPK_KL_MAX: float(d_tok.max()) if d_tok.numel() else 0.0,
            M.MISMATCH_KL: float((batch.sampled_logprobs - lp_pi)[m].mean()) if d_tok.numel() else 0.0,
        }


def rollout_policy_loss(
    method: str | Method,
    batch: RolloutBatch,
    support: TopKSupport,
    lp: TrainLogprobs,
    advantages: Tensor,
    response_mask: Tensor,
    params: MethodParams,
    anchor_logprobs: Tensor | None = None,
    **kwargs: Any,
) -> tuple[Tensor, dict[str, float]]:
    """``predmask.policy_loss`` on a rollout batch: ratio anchored on ``anchor_logprobs`` [B, R] (pi_old of
    the sampled token) when given, else on the rollout's log mu; ``kwargs`` go to policy_loss (e.g.
    global_batch_info)."""
    return policy_loss(
        method,
        log_prob=lp.log_prob,
        old_log_prob=batch.sampled_logprobs if anchor_logprobs is None else anchor_logprobs,
        advantages=advantages,
        response_mask=response_mask,
        mu_logprobs=support.mu_logprobs,
        pi_logprobs=lp.pi,
        valid=support.valid,
        sampled_index=support.sampled_index,
        pi_tail_sq=lp.pi_tail_sq,
        params=params,
        **kwargs,
    )


def policy_update(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: RolloutBatch,
    support: TopKSupport,
    advantages: Tensor,
    *,
    method: str | Method,
    params: MethodParams,
    temperature: float = 1.0,
    precision: Precision | None = None,
    grad_clip: float | None = 1.0,
    step: bool = True,
    overrides: dict[str, Any] | None = None,
    anchor_logprobs: Tensor | None = None,
    tail_sq: bool | None = True,
) -> tuple[dict[str, float], TrainLogprobs]:
    """One optimiser step of ``rollout_policy_loss(method)`` on ``batch``; ``advantages`` is [B] (sequence) or
    [B, R] (token). With ``step=False`` only the gradient is computed. ``tail_sq``: compute the exact tail
    always (True, for callers that read it back), only where ``method`` reads it (None), or never (False).
    Returns ``(metrics, train_logprobs)``: the loss's metrics plus grad norm and pg loss; the log-probs before
    the step (detached)."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    with_tail = reads_tail_sq(method) if tail_sq is None else tail_sq
    lp = support_logprobs(model, batch, support, temperature=temperature, precision=precision, tail_sq=with_tail)
    adv = advantages if advantages.ndim == 2 else token_advantages(advantages, batch.response_mask)
    loss, metrics = rollout_policy_loss(method, batch, support, lp, adv, batch.response_mask, params,
                                        anchor_logprobs, **(overrides or {}))
    loss.backward()
    clip = float("inf") if grad_clip is None else grad_clip
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    if step:
        optimizer.step()
    metrics[M.ACTOR_PG_LOSS] = float(loss.detach())
    metrics[M.ACTOR_GRAD_NORM] = float(grad_norm)
    return metrics, lp.detach()
