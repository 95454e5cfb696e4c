"""One seed of the token-level study (docs/math.md §5): staleness, one masked optimiser step per mask, ΔD per token.

Every masked step starts from the same ``pi_pre`` and optimiser state (restored from a snapshot). The losses
and updates are the CPU engine's (``predmask.rl.algo.policy_update`` with ``predmask.policy_loss``), so the
study measures exactly the masks the trainer applies; a run-time check compares the number of tokens each loss
dropped with the keep decisions recorded here.
"""

from __future__ import annotations

import copy
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

import polars as pl
import torch
from torch import Tensor, nn

from analysis import token_columns
from analysis.token_columns import CRITERIA, PREDICTIVE, RATIO, REFERENCE_MASK, TAIL_COLUMNS
from analysis.token_level.compute.ground_truth import ground_truths, loss_weights
from analysis.token_level.compute.step_settings import CF_MODES, UPDATE_PATHS, StepSettings, require
from predmask import MethodParams, get_method, predicted_divergence_change, topk_divergence
from predmask.metrics import CLIPFRAC
from predmask.precisions import Precision
from predmask.rl.algo import (
    TrainLogprobs,
    grpo_advantages,
    policy_update,
    rollout_policy_loss,
    support_logprobs,
    token_advantages,
)
from predmask.rl.rollout import RolloutBatch
from predmask.support import TopKSupport

log = logging.getLogger(__name__)


#: mask name -> the predmask method whose loss makes the studied step with that mask
MASKS: dict[str, str] = {
    RATIO: "dppo_topk_kl",
    **{token_columns.predictive_mask(tail): f"predmask_kl_{tail}" for tail in token_columns.TAILS},
}


def reference_step() -> tuple[str, dict[str, Any]]:
    """(method, loss overrides) of the unmasked reference step: the ratio mask's loss with an infinite threshold."""
    return MASKS[RATIO], {"delta": float("inf")}


#: keep column (``keep_<mask>``) -> Ddot column (predictive) or None (ratio)
_KEEP_COLUMNS: dict[str, str | None] = {
    CRITERIA[RATIO][0]: None,
    **{CRITERIA[crit][0]: ddot for crit, (ddot, _suffix) in PREDICTIVE.items()},
}


@dataclass(frozen=True, kw_only=True)
class StudySettings(StepSettings):
    """Everything ``study_batch`` needs besides the model and the batch: the step settings
    (``study_config.settings_of``), V (the uniform tail estimator needs it), the training precision, and
    whether to check each loss's dropped-token count against the recorded keep decisions. Construction checks
    every range of the step settings (the one place of these checks; some through MethodParams).
    """

    vocab_size: int
    precision: Precision
    check_masks: bool = True

    def __post_init__(self) -> None:
        _ = self.method_params  # MethodParams checks delta, ratio_cap and loss_agg_mode
        get_method(self.stale_method)
        require(self.group_size >= 2, "group_size", self.group_size, "an integer >= 2")
        require(self.staleness >= 0, "staleness", self.staleness, "an integer >= 0")
        require(self.minibatches >= 1, "minibatches", self.minibatches, "an integer >= 1")
        require(self.lr > 0, "lr", self.lr, "a number > 0")
        require(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "betas", self.betas, "two numbers in [0, 1)"
        )
        require(self.temperature > 0, "temperature", self.temperature, "a number > 0")
        require(
            self.micro_batch is None or self.micro_batch >= 1, "micro_batch", self.micro_batch, "an integer >= 1 or null"
        )
        require(self.update_path in UPDATE_PATHS, "update_path", self.update_path, f"one of {', '.join(UPDATE_PATHS)}")
        require(self.cf_mode in CF_MODES, "cf_mode", self.cf_mode, f"one of {', '.join(CF_MODES)}")
        require(
            self.ground_truth_chunk >= 1, "ground_truth_chunk", self.ground_truth_chunk, "an integer >= 1"
        )
        if self.update_path == "split" and self._split_needs:
            raise ValueError(f"update_path=split needs {self._split_needs} (use update_path=direct)")

    @property
    def _split_needs(self) -> str | None:
        """What the split path needs and these settings lack (a row's gradient independent of the other
        rows of its forward), or None."""
        if self.loss_agg_mode == "seq-mean-token-mean":
            return "a loss aggregation linear in the kept tokens; seq-mean-token-mean is not"
        if self.precision.train_fp8:
            return (f"a training forward independent of the batch's other rows; precision "
                    f"{self.precision.name} quantises activations per tensor")
        return None

    @property
    def update_path_resolved(self) -> str:
        """``auto`` is ``split`` unless these settings lack what it needs."""
        if self.update_path != "auto":
            return self.update_path
        return "direct" if self._split_needs else "split"

    @property
    def method_params(self) -> MethodParams:
        return MethodParams.from_mapping({
            "delta": self.delta,
            "ratio_cap": self.ratio_cap,
            "loss_agg_mode": self.loss_agg_mode,
            "vocab_size": self.vocab_size,
        })

    def masks(self) -> dict[str, tuple[str, dict[str, Any]]]:
        """mask name -> (method, loss overrides) of every studied step."""
        out: dict[str, tuple[str, dict[str, Any]]] = {k: (v, {}) for k, v in MASKS.items()}
        if self.reference_update:
            out[REFERENCE_MASK] = reference_step()
        return out


@dataclass
class SeedStudy:
    """What one seed produced: the token rows (outside tokens), batch facts and timings."""

    tokens: pl.DataFrame
    n_tokens: int
    facts: dict[str, float] = field(default_factory=dict)


def make_optimizer(model: nn.Module, s: StudySettings) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters."""
    return torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=s.lr,
        betas=(s.betas[0], s.betas[1]),
        eps=s.adam_eps,
        weight_decay=s.weight_decay,
    )


def _chunks(n: int, size: int | None) -> list[slice]:
    if size is None or size >= n:
        return [slice(0, n)]
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def sub_batch(
    batch: RolloutBatch, support: TopKSupport, rows: Tensor, width: int
) -> tuple[RolloutBatch, TopKSupport]:
    """Rows ``rows`` with their responses cut to the first ``width`` positions (causal: nothing earlier changes)."""
    b, sup = batch.select(rows), support.select(rows)
    responses = ("response_ids", "response_mask", "sampled_logprobs", "topk_ids", "topk_logprobs")
    cut = replace(b, **{name: getattr(b, name)[:, :width] for name in responses})
    return cut, TopKSupport(*(getattr(sup, f.name)[:, :width] for f in fields(sup)))


def _rows_and_width(tokens: Tensor) -> tuple[Tensor, int]:
    """Rows holding any True token and the width up to the last one."""
    rows = tokens.any(-1).nonzero(as_tuple=True)[0]
    if rows.numel() == 0:
        return rows, 0
    cols = tokens.any(0).nonzero(as_tuple=True)[0]
    return rows, int(cols.max()) + 1


def _batch_info(batch: RolloutBatch) -> dict[str, float]:
    """verl's global_batch_info of the whole batch, so that a part's loss is its share of the whole-batch loss."""
    m = batch.response_mask
    return {
        "batch_num_tokens": float(m.sum()),
        "global_batch_size": float((m.sum(-1) > 0).sum()),
        "loss_scale_factor": float(m.shape[-1]),
    }


def accumulate_gradient(
    model: nn.Module,
    batch: RolloutBatch,
    support: TopKSupport,
    adv_tok: Tensor,
    method: str,
    s: StudySettings,
    *,
    tokens: Tensor | None = None,
    tokens_fn: Callable[[slice, TrainLogprobs], Tensor] | None = None,
    info: Mapping[str, float] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> tuple[TrainLogprobs, int]:
    """Add the gradient of ``method``'s loss on ``tokens`` (default: every response token) to ``.grad``.

    Micro-batched; ``info`` (``global_batch_info``) normalises every part by the whole batch. ``tokens_fn`` may
    pick the tokens of each micro-batch from its training log-probs. Returns the detached log-probs before the step
    and the number of presented tokens the loss dropped.
    """
    model.train()
    parts, dropped = [], 0
    for rows in _chunks(batch.batch_size, s.micro_batch):
        mb, sup = batch.select(rows), support.select(rows)
        lp = support_logprobs(model, mb, sup, temperature=s.temperature, precision=s.precision)
        detached = lp.detach()
        mask = mb.response_mask if tokens is None else tokens[rows]
        if tokens_fn is not None:
            mask = tokens_fn(rows, detached)
        loss, metrics = rollout_policy_loss(
            method,
            mb,
            sup,
            lp,
            adv_tok[rows],
            mask,
            s.method_params,
            global_batch_info=dict(info or _batch_info(batch)),
            **dict(overrides or {}),
        )
        if bool(mask.any()):
            loss.backward()
        dropped += round(metrics[CLIPFRAC] * int((mask & (adv_tok[rows] != 0)).sum()))
        parts.append(detached)
    return _cat_logprobs(parts), dropped


def _clip_and_step(model: nn.Module, optimizer: torch.optim.Optimizer, s: StudySettings) -> None:
    clip = float("inf") if s.grad_clip is None else s.grad_clip
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()


def masked_update(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: RolloutBatch,
    support: TopKSupport,
    advantages: Tensor,
    method: str,
    s: StudySettings,
    overrides: Mapping[str, Any] | None = None,
) -> TrainLogprobs:
    """One optimiser step of ``method``'s masked loss on the whole batch; returns log pi before the step.

    Without micro-batching this is the engine's ``policy_update``; with ``micro_batch`` the gradient of the same
    whole-batch loss is accumulated over micro-batches, then clipped and applied once.
    """
    adv = advantages if advantages.ndim == 2 else token_advantages(advantages, batch.response_mask)
    if len(_chunks(batch.batch_size, s.micro_batch)) == 1:
        _, lp = policy_update(
            model,
            optimizer,
            batch,
            support,
            adv,
            method=method,
            params=s.method_params,
            temperature=s.temperature,
            precision=s.precision,
            grad_clip=s.grad_clip,
            overrides=dict(overrides or {}),
        )
        return lp
    optimizer.zero_grad(set_to_none=True)
    lp, _ = accumulate_gradient(model, batch, support, adv, method, s, overrides=overrides)
    _clip_and_step(model, optimizer, s)
    return lp


def _cat_logprobs(parts: list[TrainLogprobs]) -> TrainLogprobs:
    if len(parts) == 1:
        return parts[0]
    return TrainLogprobs(*(torch.cat([getattr(p, f.name) for p in parts]) for f in fields(TrainLogprobs)))


def minibatch_slices(batch_size: int, group_size: int, minibatches: int) -> list[slice]:
    """Contiguous, group-aligned mini-batches (verl splits a rollout batch the same way)."""
    groups = batch_size // group_size
    if groups < minibatches:
        raise ValueError(f"{groups} prompt groups cannot be split into {minibatches} mini-batches")
    bounds = [round(i * groups / minibatches) * group_size for i in range(minibatches + 1)]
    return [slice(a, b) for a, b in itertools.pairwise(bounds)]


def stale_updates(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: RolloutBatch,
    advantages: Tensor,
    s: StudySettings,
) -> None:
    """``s.staleness`` mini-batch updates with ``s.stale_method`` (mini-batch j mod ``s.minibatches``)."""
    if s.staleness == 0:
        return
    support = batch.support()
    slices = minibatch_slices(batch.batch_size, s.group_size, s.minibatches)
    for j in range(s.staleness):
        rows = slices[j % len(slices)]
        masked_update(
            model,
            optimizer,
            batch.select(rows),
            support.select(rows),
            advantages[rows],
            s.stale_method,
            s,
        )


def _to_cpu(value: Any) -> Any:
    """A CPU copy of a (nested) state: tensors copied, containers rebuilt."""
    if isinstance(value, Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return copy.deepcopy(value)


#: model weights and optimiser state, on the host
Snapshot = tuple[dict[str, Tensor], dict[str, Any]]


def _snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> Snapshot:
    """Model weights and optimiser state, copied to host memory (a GPU keeps room for the steps)."""
    return _to_cpu(model.state_dict()), _to_cpu(optimizer.state_dict())


def _restore(model: nn.Module, optimizer: torch.optim.Optimizer, snap: Snapshot) -> None:
    model.load_state_dict(snap[0])
    optimizer.load_state_dict(_to_cpu(snap[1]))  # a fresh copy: the optimiser steps its state in place


@dataclass(frozen=True)
class _Seed:
    """What every studied step of one seed reads: the model and optimiser with their snapshot at ``pi_pre``, the
    batch, its support and token advantages, and the settings."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    batch: RolloutBatch
    support: TopKSupport
    adv_tok: Tensor
    s: StudySettings
    snap: Snapshot

    def restore(self) -> None:
        _restore(self.model, self.optimizer, self.snap)


def token_quantities(
    batch: RolloutBatch, support: TopKSupport, lp: TrainLogprobs, adv_tok: Tensor, s: StudySettings
) -> dict[str, Tensor]:
    """Per-token [B, R] D_pre, r, A, Ddot per tail and the keep decisions of docs/math.md §5 item 2."""
    mu, pi, valid = support.mu_logprobs, lp.pi, support.valid
    out: dict[str, Tensor] = {"d_pre": topk_divergence(mu, pi, valid, divergence="kl")}
    out["pi"], out["pi_tail_sq"], out["log_prob"] = lp.pi, lp.pi_tail_sq, lp.log_prob
    out["r"] = (lp.log_prob - batch.sampled_logprobs).exp()
    out["a"] = adv_tok
    for col, tail in TAIL_COLUMNS.items():
        out[col] = predicted_divergence_change(
            mu,
            pi,
            valid,
            support.sampled_index,
            divergence="kl",
            tail=tail,
            vocab_size=s.vocab_size,
            pi_tail_sq=lp.pi_tail_sq,
        )
    outside = (out["d_pre"] > s.delta) & batch.response_mask
    for keep, ddot in _KEEP_COLUMNS.items():
        direction = out["r"] - 1.0 if ddot is None else out[ddot]
        out[keep] = ~(outside & (adv_tok * direction > 0))
    out["outside"] = outside
    return out


def _keep_of(name: str, q: Mapping[str, Tensor], mask: Tensor) -> Tensor:
    return mask if name == REFERENCE_MASK else q[token_columns.keep_column(name)] & mask


def _kept_by_all(names: Iterable[str], q: Mapping[str, Tensor], mask: Tensor) -> Tensor:
    """The tokens of ``mask`` that every mask of ``names`` keeps."""
    keep = mask.clone()
    for name in names:
        keep &= _keep_of(name, q, mask)
    return keep


def _d_post_on(
    model: nn.Module, batch: RolloutBatch, support: TopKSupport, tokens: Tensor, s: StudySettings
) -> Tensor:
    """D under the current model on the rows holding ``tokens`` (cut after the last one); 0 elsewhere, [B, R]."""
    out = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
    rows, width = _rows_and_width(tokens)
    if rows.numel() == 0:
        return out
    sub, sup = sub_batch(batch, support, rows, width)
    with torch.no_grad():  # micro-batched like the steps
        pi = [support_logprobs(model, sub.select(r), sup.select(r), temperature=s.temperature,
                               precision=s.precision).pi for r in _chunks(sub.batch_size, s.micro_batch)]
    out[rows, :width] = topk_divergence(sup.mu_logprobs, torch.cat(pi), sup.valid, divergence="kl").float()
    return out


class SplitMismatch(RuntimeError):
    """A sub-batch forward of the split path decided a token's keep differently from the whole-batch forward.

    The two forwards agree up to float rounding, so a token whose decision statistic (A·Ḋ, A·(r−1)) sits at
    rounding level of zero can flip; the exact tail, read from pi's squared tail mass, is the most sensitive.
    """


def _steps_direct(seed: _Seed) -> tuple[dict[str, Tensor], dict[str, Tensor], None]:
    """Each mask's step taken on its own (restore, forward, backward, step); D_post on every response token."""
    model, batch, support, s = seed.model, seed.batch, seed.support, seed.s
    lp_pre: TrainLogprobs | None = None
    d_post: dict[str, Tensor] = {}
    for name, (method, overrides) in s.masks().items():
        seed.restore()
        lp = masked_update(model, seed.optimizer, batch, support, seed.adv_tok, method, s, overrides)
        lp_pre = lp if lp_pre is None else lp_pre
        d_post[name] = _d_post_on(model, batch, support, batch.response_mask, s)
    assert lp_pre is not None
    return token_quantities(batch, support, lp_pre, seed.adv_tok, s), d_post, None


def _gradients(params: Mapping[str, nn.Parameter]) -> dict[str, Tensor | None]:
    """A copy of each parameter's gradient, by name."""
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in params.items()}


def _steps_split(seed: _Seed) -> tuple[dict[str, Tensor], dict[str, Tensor], dict[str, Tensor | None] | None]:
    """The same steps, sharing work: the loss is linear in the keep mask, so each mask's gradient is the gradient
    on the tokens every mask keeps (one whole-batch backward) plus the gradient on that mask's other kept tokens
    (a backward over the few rows holding them). D_post is evaluated on the rows holding outside tokens only.
    Also returns the unmasked reference step's unclipped gradient by parameter name (None without that step), which
    the ground truths reuse.
    """
    model, batch, support, adv_tok, s = seed.model, seed.batch, seed.support, seed.adv_tok, seed.s
    masks = s.masks()
    info = _batch_info(batch)
    seed.optimizer.zero_grad(set_to_none=True)

    def common_tokens(rows: slice, lp: TrainLogprobs) -> Tensor:
        mb, sup = batch.select(rows), support.select(rows)
        return _kept_by_all(masks, token_quantities(mb, sup, lp, adv_tok[rows], s), mb.response_mask)

    lp_pre, dropped = accumulate_gradient(
        model, batch, support, adv_tok, MASKS[RATIO], s, tokens_fn=common_tokens, info=info
    )
    if dropped:
        raise RuntimeError(f"the common-token loss dropped {dropped} tokens that every mask keeps")
    q = token_quantities(batch, support, lp_pre, adv_tok, s)
    mask = batch.response_mask
    common = _kept_by_all(masks, q, mask)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    g_common = _gradients(params)
    d_post: dict[str, Tensor] = {}
    g_ref: dict[str, Tensor | None] | None = None
    for name, (method, overrides) in masks.items():
        seed.restore()
        for p, g in zip(params.values(), g_common.values()):
            p.grad = None if g is None else g.clone()
        extra = _keep_of(name, q, mask) & ~common
        rows, width = _rows_and_width(extra)
        if rows.numel():
            sub, sup = sub_batch(batch, support, rows, width)
            _, dropped = accumulate_gradient(
                model,
                sub,
                sup,
                adv_tok[rows, :width],
                method,
                s,
                tokens=extra[rows, :width],
                info=info,
                overrides=overrides,
            )
            if dropped:
                raise SplitMismatch(
                    f"mask {name}: the loss dropped {dropped} tokens this study records as kept"
                )
        if name == REFERENCE_MASK:
            g_ref = _gradients(params)
        _clip_and_step(model, seed.optimizer, s)
        d_post[name] = _d_post_on(model, batch, support, q["outside"], s)
    return q, d_post, g_ref


def _check_masks(seed: _Seed, q: Mapping[str, Tensor]) -> None:
    """Each method's own loss, on the same log-probs, drops exactly the tokens recorded here as not kept."""
    lp = TrainLogprobs(q["pi"], q["pi_tail_sq"], q["log_prob"])
    mask = seed.batch.response_mask
    nonzero = int((mask & (seed.adv_tok != 0)).sum())
    for name, (method, overrides) in seed.s.masks().items():
        _, metrics = rollout_policy_loss(
            method, seed.batch, seed.support, lp, seed.adv_tok, mask, seed.s.method_params, **overrides
        )
        theirs = round(metrics[CLIPFRAC] * nonzero)
        mine = int((mask & ~_keep_of(name, q, mask)).sum())
        if theirs != mine:
            raise RuntimeError(
                f"mask {name}: {method}'s loss drops {theirs} tokens, the study recorded {mine}"
            )


def _ground_truth_columns(
    seed: _Seed, q: Mapping[str, Tensor], g_ref: Mapping[str, Tensor | None] | None
) -> dict[str, Tensor]:
    """The outside tokens' own-update ground truths (docs/math.md §5.1) at ``pi_pre`` with the stale optimiser
    state: ``ddot_net``, ``ddot_net_adam`` (after a stale update), ``dd_cf`` (mode ``s.cf_mode``), ``context_id``.
    The counterfactual's base step is the unmasked reference step (every response token kept), so both criteria
    are judged against one truth per token."""
    batch, support, adv_tok, s = seed.batch, seed.support, seed.adv_tok, seed.s
    method, overrides = reference_step()
    lp = TrainLogprobs(q["pi"], q["pi_tail_sq"], q["log_prob"])
    weights = loss_weights(
        method, batch, support, lp, adv_tok, s.method_params, global_batch_info=_batch_info(batch), **overrides
    )
    gt = ground_truths(
        seed.model,
        batch,
        support,
        adv_tok,
        weights,
        q["outside"],
        seed.optimizer,
        grad_clip=s.grad_clip,
        temperature=s.temperature,
        cf_modes=(s.cf_mode,),
        adam_preconditioner=s.staleness > 0,
        gradient=g_ref,
        chunk_size=s.ground_truth_chunk,
        micro_batch=s.micro_batch,
    )
    out = {truth: gt[truth].double() for truth in token_columns.NETWORK_TRUTHS if truth in gt}
    out[token_columns.COUNTERFACTUAL] = gt[token_columns.counterfactual_column(s.cf_mode)].double()
    out[token_columns.CONTEXT_ID] = gt[token_columns.CONTEXT_ID].long()
    return out


def study_batch(model: nn.Module, batch: RolloutBatch, s: StudySettings) -> SeedStudy:
    """The study on one scored rollout batch (``batch.rewards`` filled); ``model`` is left at ``pi_pre``.

    Returns one row per response token with ``D_pre > delta`` (columns of ``analysis.store.TOKEN_COLUMNS`` without
    ``study_id``/``seed``, plus ``dd_all`` when ``s.reference_update`` and the ground truths ``ddot_net``,
    ``ddot_net_adam``, ``dd_cf`` and ``context_id`` when ``s.ground_truth``).
    """
    t0 = time.perf_counter()
    support = batch.support()
    adv = grpo_advantages(batch.rewards, s.group_size).to(batch.sampled_logprobs.device)
    adv_tok = token_advantages(adv, batch.response_mask)
    optimizer = make_optimizer(model, s)
    stale_updates(model, optimizer, batch, adv, s)
    t_stale = time.perf_counter()
    seed = _Seed(model, optimizer, batch, support, adv_tok, s, _snapshot(model, optimizer))
    steps = _steps_split if s.update_path_resolved == "split" else _steps_direct
    try:
        q, d_post, g_ref = steps(seed)
    except SplitMismatch as err:  # every step again on the whole batch: decisions and loss share a forward
        log.warning("%s; taking this seed's steps on the direct path", err)
        q, d_post, g_ref = _steps_direct(seed)
    seed.restore()
    if s.check_masks:
        _check_masks(seed, q)
    outside = q["outside"]
    seq_idx, pos_idx = outside.nonzero(as_tuple=True)
    cols: dict[str, Any] = {"sequence": seq_idx.int(), "position": pos_idx.long()}
    for name in ("d_pre", "r", "a", *TAIL_COLUMNS):
        cols[name] = q[name][outside].double()
    for keep in _KEEP_COLUMNS:
        cols[keep] = q[keep][outside]
    for name, d in d_post.items():
        cols[token_columns.dd_column(name)] = (d - q["d_pre"])[outside].double()
    t_steps = time.perf_counter()
    if s.ground_truth and not s.precision.train_fp8:
        cols.update(_ground_truth_columns(seed, q, g_ref))
    frame = pl.DataFrame({k: v.cpu().numpy() for k, v in cols.items()})
    mask = batch.response_mask
    t_end = time.perf_counter()
    facts = {
        "reward_mean": float(batch.rewards.float().mean()),
        "d_pre_mean": float(q["d_pre"][mask].mean()) if bool(mask.any()) else 0.0,
        "nonzero_adv_frac": float((adv_tok != 0)[mask].float().mean()) if bool(mask.any()) else 0.0,
        "seconds_stale": t_stale - t0,
        "seconds_masks": t_steps - t_stale,
        "seconds_ground_truth": t_end - t_steps,
    }
    return SeedStudy(tokens=frame, n_tokens=int(mask.sum()), facts=facts)
