"""Per-token ground truths of the token-level study: what each token's own update does to its D (docs/math.md §5.1).

For a scored rollout batch at the studied parameters θ = π_pre and a set of tokens (the outside tokens),
``ground_truths`` returns each token's ground truths; docs/math.md §5.1 defines them and gives the defaults'
reasons. The counterfactual's G is the gradient of the study's unmasked reference step and
c_t = ∂loss/∂ℓ_t (``loss_weights``), so ``c_t ∇ℓ_t`` is exactly the token's share of G; both steps clip their
own gradient as torch's ``clip_grad_norm_`` does. Modes: ``adam_carried`` (AdamW from the optimiser's state: the step the study takes),
``adam_reset`` (AdamW from a fresh state), ``sgd`` (θ − lr·κ·G', no weight decay). The counterfactual forwards run
in float64 (``_FullPrecision`` lifts the models' float32 casts); gradients and optimiser updates stay in the
model's dtype (the float64 parameters are θ minus a model-dtype update): as accurate, and cheaper.

How. One forward/backward of the whole batch gives G and the logits of the studied tokens (or, with
``gradient``, the caller's G and a forward of only the rows holding them); from those logits, ∂D_t/∂z and
∂ℓ_t/∂z. Tokens with the same context, support and loss weight are one computation (a GRPO group shares its
prompt, so its first response tokens repeat). Per chunk of ``chunk_size`` such tokens, sorted by context
length, ``torch.func.vmap`` over a VJP of each token's row gives ∇D_t and ∇ℓ_t for all of them at once; the
inner products, G − c_t∇ℓ_t, each token's clip factor and its AdamW update follow as batched elementwise work,
and a vmapped forward with each token's own parameters gives the counterfactual logits. Rows are left-aligned
(the prompt's left padding moved to the end), so a causal model needs no attention mask. The model runs in
eval mode (deterministic) and, for the vmapped passes, with eager attention, both restored afterwards.

The policy is any causal LM called as ``model(input_ids=ids).logits`` (a Hugging Face causal LM, the CPU engine's
Qwen3 included), on the device it lives on. The forward is the plain training forward: FP8 training emulation
(``fp8_e2e``) quantises activations per tensor, which couples the rows of a forward, so it has no per-token ground
truth here and the study should leave these columns empty for it.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, vjp, vmap
from torch.overrides import TorchFunctionMode

from analysis.token_columns import CONTEXT_ID, OWN_UPDATE, OWN_UPDATE_ADAM, counterfactual_column
from analysis.token_level.compute.step_settings import CF_MODES
from predmask.divergence import topk_divergence
from predmask.methods import MethodParams
from predmask.rl.algo import TrainLogprobs, rollout_policy_loss
from predmask.rl.rollout import RolloutBatch
from predmask.support import TopKSupport, gather_support_logprobs

#: torch.nn.utils.clip_grad_norm_'s guard: clip factor = max_norm / (total_norm + 1e-6), at most 1
_CLIP_GUARD = 1e-6
_DTYPES = (torch.float32, torch.float64)

Params = dict[str, Tensor]


def loss_weights(
    method: str,
    batch: RolloutBatch,
    support: TopKSupport,
    lp: TrainLogprobs,
    advantages: Tensor,
    params: MethodParams,
    **loss_kwargs: Any,
) -> Tensor:
    """Each response token's weight c_t = ∂loss/∂ℓ_t [B, R] in ``method``'s loss on every response token.

    Every predmask loss reaches θ only through ℓ_t (its mask and ratio weight are computed without gradient), so
    the loss gradient is exactly ``Σ_t c_t ∇ℓ_t``. ``lp`` are the training log-probs at θ (the study's), and
    ``loss_kwargs`` go to ``rollout_policy_loss`` (``global_batch_info``, the reference step's overrides).
    """
    log_prob = lp.log_prob.detach().clone().requires_grad_(True)
    leaf = TrainLogprobs(lp.pi.detach(), lp.pi_tail_sq.detach(), log_prob)
    loss, _ = rollout_policy_loss(
        method, batch, support, leaf, advantages, batch.response_mask, params, **loss_kwargs
    )
    (grad,) = torch.autograd.grad(loss, log_prob, allow_unused=True)
    return torch.zeros_like(log_prob) if grad is None else grad.detach()


@dataclass(frozen=True)
class StepRule:
    """The studied step's optimiser settings: AdamW's (lr, betas, eps, decoupled weight decay) and the clip norm."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    grad_clip: float | None

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer, grad_clip: float | None) -> StepRule:
        """The rule of a torch Adam/AdamW with one parameter group (the study's ``make_optimizer``)."""
        if (
            not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW)
            or len(optimizer.param_groups) != 1
        ):
            raise ValueError(
                f"the optimiser must be torch.optim.AdamW (or Adam) with one parameter group, got "
                f"{type(optimizer).__name__} with {len(optimizer.param_groups)} groups"
            )
        g = optimizer.param_groups[0]
        decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(g.get("decoupled_weight_decay", False))
        if g.get("amsgrad") or g.get("maximize") or (g["weight_decay"] and not decoupled):
            raise ValueError(
                "the optimiser must be plain AdamW: amsgrad, maximize and coupled weight decay are off"
            )
        if grad_clip is not None and not grad_clip > 0:
            raise ValueError(f"grad_clip must be a number > 0 or None, got {grad_clip!r}")
        return cls(
            float(g["lr"]),
            float(g["betas"][0]),
            float(g["betas"][1]),
            float(g["eps"]),
            float(g["weight_decay"]),
            grad_clip,
        )

    def clip_factor(self, sq_norm: Tensor) -> Tensor:
        """torch's clip_grad_norm_ factor for a gradient of squared norm ``sq_norm``."""
        if self.grad_clip is None:
            return torch.ones_like(sq_norm)
        return (self.grad_clip / (sq_norm.sqrt() + _CLIP_GUARD)).clamp(max=1.0)


@dataclass(frozen=True)
class _AdamState:
    """First and second moments per trainable parameter (zeros when fresh) and the steps taken."""

    m: Params
    v: Params
    steps: int


def _adam_state(
    optimizer: torch.optim.Optimizer, named: Mapping[str, nn.Parameter], dtype: torch.dtype
) -> _AdamState:
    """The optimiser's moments by parameter name, in ``dtype``; a parameter never stepped gets zeros."""
    m, v, steps = {}, {}, set()
    for name, p in named.items():
        st = optimizer.state.get(p, {})
        if "exp_avg" in st:
            m[name], v[name] = st["exp_avg"].detach().to(dtype), st["exp_avg_sq"].detach().to(dtype)
            steps.add(int(st["step"]))
        else:
            m[name] = v[name] = torch.zeros_like(p, dtype=dtype)
            steps.add(0)
    if len(steps) > 1:
        raise ValueError(f"the optimiser's parameters have taken different numbers of steps: {sorted(steps)}")
    return _AdamState(m, v, steps.pop() if steps else 0)


@dataclass(frozen=True)
class _StepConstants:
    """What one step of a mode needs besides the gradient, precomputed once so that the per-token work is a few
    fused elementwise passes. ``base`` (in the evaluation dtype) is θ·(1 − lr·wd) for Adam, θ for SGD; the update
    is computed in the gradient's dtype from β1·m, β2·v and AdamW's step size and ε rescaled by sqrt(1 − β2^t):
    lr/(1 − β1^t) · m'/(sqrt(v'/(1 − β2^t)) + ε) = s·m'/(sqrt(v') + ε'), s = lr·sqrt(1 − β2^t)/(1 − β1^t),
    ε' = ε·sqrt(1 − β2^t)."""

    mode: str
    rule: StepRule
    theta: Params
    base: Params
    beta_m: Params
    beta_v: Params
    step_size: float
    eps: float


def _constants(mode: str, rule: StepRule, theta: Params, state: _AdamState) -> _StepConstants:
    t = state.steps + 1
    root = math.sqrt(1.0 - rule.beta2**t)
    if mode == "sgd":
        return _StepConstants(mode, rule, theta, theta, {}, {}, rule.lr, 0.0)
    return _StepConstants(
        mode,
        rule,
        theta,
        {k: v * (1.0 - rule.lr * rule.weight_decay) for k, v in theta.items()},
        {k: rule.beta1 * v for k, v in state.m.items()},
        {k: rule.beta2 * v for k, v in state.v.items()},
        rule.lr * root / (1.0 - rule.beta1**t),
        rule.eps * root,
    )


def _step(k: _StepConstants, grad: Mapping[str, Tensor | None]) -> Params:
    """Parameters [C, ...] after one step with each of C unclipped gradients ``grad`` [C, ...] (None: the parameter
    has no gradient and is left alone, as torch's optimisers do). Each gradient has its own clip factor; the update
    is computed in the gradient's dtype and subtracted from ``k.base`` in the evaluation dtype."""
    present = {n: g for n, g in grad.items() if g is not None}
    size = next(iter(present.values())).shape[0]
    kappa = k.rule.clip_factor(sum(torch.linalg.vecdot(g.flatten(1), g.flatten(1)) for g in present.values()))
    out = {n: t.expand(size, *t.shape) for n, t in k.theta.items()}
    for n, g in present.items():
        kap = kappa.view(-1, *([1] * (g.ndim - 1)))
        if k.mode == "sgd":
            update = g * kap
        else:
            q = g * (kap * math.sqrt(1.0 - k.rule.beta2))
            den = torch.addcmul(k.beta_v[n], q, q).sqrt_().add_(k.eps)
            update = torch.addcmul(k.beta_m[n], g, kap * (1.0 - k.rule.beta1)).div_(den)
        out[n] = torch.sub(k.base[n], update.to(k.base[n].dtype), alpha=k.step_size)
    return out


def _preconditioner(rule: StepRule, state: _AdamState) -> Params:
    """Adam's current diagonal 1/(sqrt(v̂) + ε) (v̂ bias-corrected by the steps taken)."""
    if state.steps == 0:
        raise ValueError(
            "the Adam preconditioner needs an optimiser state that has taken a step (staleness >= 1)"
        )
    bc2 = 1.0 - rule.beta2**state.steps
    return {k: 1.0 / ((v / bc2).sqrt() + rule.eps) for k, v in state.v.items()}


class _FullPrecision(TorchFunctionMode):
    """Every cast to float32 becomes a cast to float64 (``x.float()``, ``x.to(torch.float32)``, ``dtype=torch.float32``
    arguments such as ``softmax(..., dtype=torch.float32)``). Hugging Face models cast to float32 for stability
    (RMSNorm, rotary angles, attention softmax); in a float64 evaluation those casts would round every hidden
    state to float32 and hide the differences the counterfactual measures."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = dict(kwargs or {})
        if func is Tensor.float:
            return func(*args, **kwargs).double()
        if kwargs.get("dtype") is torch.float32:
            kwargs["dtype"] = torch.float64
        if func is Tensor.to:
            args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        return func(*args, **kwargs)


def _precision(dtype: torch.dtype) -> contextlib.AbstractContextManager[object]:
    """Computations in ``dtype``: float64 throughout (``_FullPrecision``), else the model's own casts."""
    return _FullPrecision() if dtype == torch.float64 else contextlib.nullcontext()


@contextlib.contextmanager
def _evaluation_mode(model: nn.Module) -> Iterator[None]:
    """Eval mode (no dropout: the ground truths are deterministic), restored afterwards."""
    training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(training)


@contextlib.contextmanager
def _eager_attention(model: nn.Module) -> Iterator[None]:
    """Eager attention where the model has a choice (sdpa has no vmap batching rule on CPU, so vmap would loop
    over the tokens, and no forward-mode derivative), restored afterwards."""
    attn = getattr(getattr(model, "config", None), "_attn_implementation", None)
    switch = attn not in (None, "eager") and hasattr(model, "set_attn_implementation")
    if switch:
        model.set_attn_implementation("eager")
    try:
        yield
    finally:
        if switch:
            model.set_attn_implementation(attn)


@dataclass(frozen=True)
class _Rows:
    """Rows left-aligned: prompt tokens, then response tokens, then the padding (``ids`` [B, P+R]);
    ``logit_index`` [B, R]: the position whose logits predict each response token."""

    ids: Tensor
    logit_index: Tensor


def _left_aligned(batch: RolloutBatch) -> _Rows:
    p, r = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    n_pad = (~batch.prompt_mask).sum(-1)
    expected = torch.arange(p, device=n_pad.device)[None, :] >= n_pad[:, None]
    if not torch.equal(batch.prompt_mask, expected) or bool((n_pad >= p).any()):
        raise ValueError(
            "prompts must be left-padded with at least one token per row (RolloutBatch's layout)"
        )
    ids = torch.cat([batch.prompt_ids, batch.response_ids], 1)
    cols = (torch.arange(p + r, device=ids.device)[None, :] + n_pad[:, None]) % (p + r)
    index = (p - n_pad)[:, None] - 1 + torch.arange(r, device=ids.device)[None, :]
    return _Rows(ids.gather(1, cols), index)


def _logits_fn(model: nn.Module, frozen: Params) -> Callable[[Params, Tensor, Tensor], Tensor]:
    """(trainable params, ids [L], index []) -> the logits [V] at ``index`` of one row (vmap-able)."""
    keep = "logits_to_keep" in inspect.signature(model.forward).parameters
    extra = _forward_kwargs(model)

    def logits_at(params: Params, ids: Tensor, index: Tensor) -> Tensor:
        kwargs: dict[str, Any] = {"input_ids": ids.unsqueeze(0), **extra}
        if keep:
            kwargs["logits_to_keep"] = index.reshape(1)
        logits = _logits_of(functional_call(model, {**frozen, **params}, (), kwargs))
        return logits[0, 0] if keep else logits[0].index_select(0, index.reshape(1))[0]

    return logits_at


def _token_terms(
    logits: Tensor, sup: TopKSupport, temperature: float, divergence: str
) -> tuple[Tensor, Tensor]:
    """(D_t, ℓ_t) per token from its logits [N, V] and support [N, K+1]."""
    pi = gather_support_logprobs(logits, sup.ids, sup.valid, temperature=temperature)
    assert isinstance(pi, Tensor)
    return topk_divergence(sup.mu_logprobs, pi, sup.valid, divergence=divergence), sup.sampled_logprob(pi)


def _forward_kwargs(model: nn.Module) -> dict[str, Any]:
    return {"use_cache": False} if hasattr(model, "config") else {}


def _logits_of(out: Any) -> Tensor:
    return out.logits if hasattr(out, "logits") else out


def _logits_at(model: nn.Module, ids: Tensor, index: Tensor) -> Tensor:
    """The logits [n, m, V] at positions ``index`` [n, m] of rows ``ids`` [n, L], cut after the last."""
    logits = _logits_of(model(input_ids=ids[:, : int(index.max()) + 1], **_forward_kwargs(model)))
    return logits.gather(1, index[..., None].expand(-1, -1, logits.shape[-1]))


def _gradient_pass(
    model: nn.Module,
    rows: _Rows,
    batch: RolloutBatch,
    support: TopKSupport,
    weights: Tensor,
    tokens: Tensor,
    temperature: float,
    micro_batch: int | None,
) -> tuple[dict[str, Tensor | None], Tensor]:
    """G = Σ_t c_t ∇ℓ_t over every response token (the trainable parameters' names -> gradient, None where the
    loss does not reach a parameter), and the logits [N, V] of ``tokens``; the model's own forward and dtype,
    ``micro_batch`` rows at a time. G is the same in both steps of a counterfactual, so its own rounding cancels there."""
    named = {k: p for k, p in model.named_parameters() if p.requires_grad}
    grad: dict[str, Tensor | None] = dict.fromkeys(named)
    picked = []
    chunk = batch.batch_size if micro_batch is None else micro_batch
    for start in range(0, batch.batch_size, chunk):
        sel = slice(start, start + chunk)
        z = _logits_at(model, rows.ids[sel], rows.logit_index[sel].clamp_min(0))
        sup = support.select(sel)
        pi = gather_support_logprobs(z, sup.ids, sup.valid, temperature=temperature)
        assert isinstance(pi, Tensor)
        mask = batch.response_mask[sel]
        ell = torch.where(mask, sup.sampled_logprob(pi), torch.zeros((), dtype=pi.dtype, device=pi.device))
        loss = (weights[sel].to(ell.dtype) * ell).sum()
        if loss.requires_grad:
            parts = torch.autograd.grad(loss, list(named.values()), allow_unused=True)
            for k, g in zip(named, parts):
                if g is not None:
                    grad[k] = g if grad[k] is None else grad[k] + g
        picked.append(z.detach()[tokens[sel]])
    return grad, torch.cat(picked)


def _given_gradient(gradient: Mapping[str, Tensor | None], theta: Params) -> dict[str, Tensor | None]:
    """A caller's gradient by trainable-parameter name, checked against the parameters."""
    if set(gradient) != set(theta):
        raise ValueError(
            "gradient must name every trainable parameter and nothing else; "
            f"missing {sorted(set(theta) - set(gradient))[:3]}, unknown {sorted(set(gradient) - set(theta))[:3]}"
        )
    bad = [k for k, g in gradient.items() if g is not None and g.shape != theta[k].shape]
    if bad:
        raise ValueError(
            f"gradient of {bad[0]} has shape {tuple(gradient[bad[0]].shape)}, "  # type: ignore[union-attr]
            f"the parameter {tuple(theta[bad[0]].shape)}"
        )
    return {k: None if g is None else g.detach().to(theta[k].dtype) for k, g in gradient.items()}


@torch.no_grad()
def _token_logits(model: nn.Module, rows: _Rows, tokens: Tensor, micro_batch: int | None) -> Tensor:
    """The logits [N, V] of ``tokens`` from a forward of only the rows holding them, each cut after its last one."""
    held = tokens.any(-1).nonzero(as_tuple=True)[0]
    chunk = int(held.numel()) if micro_batch is None else micro_batch
    picked = []
    for start in range(0, int(held.numel()), chunk):
        sel = held[start : start + chunk]
        index = torch.where(tokens[sel], rows.logit_index[sel], torch.zeros_like(rows.logit_index[sel]))
        picked.append(_logits_at(model, rows.ids[sel], index)[tokens[sel]])
    return torch.cat(picked)


#: the context hash: two 31-bit polynomial hashes (bases below the prime 2^31 - 1) joined into one 62-bit id
_HASH_PRIME = 2**31 - 1
_HASH_BASES = (1_000_003, 998_244_353)


def _context_ids(rows: _Rows, seq: Tensor, pos: Tensor) -> Tensor:
    """An int64 id per token of its (context, sampled token) pair, from the token ids alone: equal pairs get equal ids
    in any batch or seed, different pairs collide with probability about n² / 2^63 for n distinct pairs."""
    index = rows.logit_index[seq, pos] + 1  # the sampled token's column in the left-aligned row
    halves = []
    for base in _HASH_BASES:
        h = torch.zeros_like(index)
        for col in range(int(index.max()) + 1):
            step = (h * base + rows.ids[seq, col] + 1) % _HASH_PRIME
            h = torch.where(col <= index, step, h)
        halves.append(h)
    return halves[0] * 2**31 + halves[1]


def _distinct(
    rows: _Rows, support: TopKSupport, weights: Tensor, seq: Tensor, pos: Tensor
) -> tuple[Tensor, Tensor]:
    """Tokens whose ground truths are the same computation: the same context and sampled token, the same support
    (ids, μ, validity, sampled slot) and the same loss weight c_t. Returns the first token of each distinct kind
    (indices into ``seq``/``pos``, ascending) and, per token, the position of its kind in that list."""
    index = rows.logit_index[seq, pos]
    width = int(index.max()) + 2
    ctx = torch.where(
        torch.arange(width, device=seq.device)[None, :] <= index[:, None] + 1, rows.ids[seq, :width], -1
    )

    def bits(x: Tensor) -> Tensor:
        return x.to(torch.float64).view(torch.int64).reshape(x.shape[0], -1)

    key = torch.cat(
        [
            ctx,
            support.ids[seq, pos],
            bits(support.mu_logprobs[seq, pos]),
            support.valid[seq, pos].long(),
            support.sampled_index[seq, pos].long()[:, None],
            bits(weights[seq, pos]),
        ],
        1,
    )
    _, kind = torch.unique(key, dim=0, return_inverse=True)
    n = int(seq.numel())
    first = torch.full((int(kind.max()) + 1,), n, device=seq.device).scatter_reduce(
        0, kind, torch.arange(n, device=seq.device), "amin"
    )
    order = torch.argsort(first)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    return first[order], rank[kind]


@dataclass(frozen=True)
class _Pass:
    """What the per-token pass reads: the parameters at θ (model dtype, for the gradients) and the forwards, G, each
    mode's step constants and parameters after the full step, and the Adam preconditioner (or None)."""

    theta: Params
    logits_work: Callable[[Params, Tensor, Tensor], Tensor]
    logits_eval: Callable[[Params, Tensor, Tensor], Tensor]
    grad: Mapping[str, Tensor | None]
    consts: Mapping[str, _StepConstants]
    full: Mapping[str, Params]
    precond: Params | None
    work: torch.dtype
    dtype: torch.dtype


def _chunk(p: _Pass, ids: Tensor, index: Tensor, u: Tensor, w: Tensor, c: Tensor) -> dict[str, Tensor]:
    """One chunk of tokens (rows ``ids`` [C, L], logit positions ``index`` [C], cotangents ``u``/``w`` [C, V], loss
    weights ``c`` [C]): the two inner products and, per mode, the logits [C, V] after the step without each
    token's share (``z_<mode>``) and after the full step (``zf_<mode>``)."""

    def token_gradients(ids_t: Tensor, idx: Tensor, u_t: Tensor, w_t: Tensor) -> tuple[Params, Params]:
        _, pullback = vjp(lambda q: p.logits_work(q, ids_t, idx), p.theta)
        return pullback(u_t)[0], pullback(w_t)[0]

    def logits_pair(without: Params, full: Params, ids_t: Tensor, idx: Tensor) -> tuple[Tensor, Tensor]:
        return p.logits_eval(without, ids_t, idx), p.logits_eval(full, ids_t, idx)

    with _precision(p.work):
        g_d, g_l = vmap(token_gradients)(ids, index, u, w)
    flat_d = {k: g.flatten(1) for k, g in g_d.items()}
    flat_l = {k: g.flatten(1) for k, g in g_l.items()}
    out = {OWN_UPDATE: sum(torch.linalg.vecdot(flat_d[k], flat_l[k]) for k in p.theta)}
    if p.precond is not None:
        out[OWN_UPDATE_ADAM] = sum(
            torch.linalg.vecdot(flat_d[k] * p.precond[k].reshape(-1), flat_l[k]) for k in p.theta
        )
    del g_d, flat_d, flat_l
    without = {
        k: None if g is None else torch.addcmul(g, g_l[k], c.view(-1, *([1] * g.ndim)), value=-1.0)
        for k, g in p.grad.items()
    }
    del g_l
    for m, consts in p.consts.items():
        with _precision(p.dtype):
            out[f"z_{m}"], out[f"zf_{m}"] = vmap(logits_pair, in_dims=(0, None, 0, 0))(
                _step(consts, without), p.full[m], ids, index
            )
    return out


def _chunked(p: _Pass, rows: _Rows, seq: Tensor, pos: Tensor, u: Tensor, w: Tensor, c: Tensor,
             chunk_size: int) -> dict[str, Tensor]:
    """``_chunk`` over the tokens (``seq``, ``pos``) in chunks of ``chunk_size``, its results in the tokens' order."""
    index = rows.logit_index[seq, pos]
    order = torch.argsort(index)  # chunks of similar context length: little padding per chunk
    parts: dict[str, list[Tensor]] = {}
    for start in range(0, int(seq.numel()), chunk_size):
        sel = order[start : start + chunk_size]
        ids = rows.ids[seq[sel], : int(index[sel].max()) + 1]
        for k, v in _chunk(p, ids, index[sel], u[sel], w[sel], c[sel]).items():
            parts.setdefault(k, []).append(v.detach())
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return {k: torch.cat(v)[inverse] for k, v in parts.items()}


def _check_arguments(tokens: Tensor, response: Tensor, cf_modes: Sequence[str], dtype: torch.dtype,
                     chunk_size: int, micro_batch: int | None) -> None:
    """One ValueError line naming the first bad argument of ``ground_truths`` and what is allowed."""
    bad = [m for m in cf_modes if m not in CF_MODES]
    if bad:
        raise ValueError(f"cf_modes {bad} unknown; allowed: {', '.join(CF_MODES)}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be an integer >= 1, got {chunk_size}")
    if micro_batch is not None and micro_batch < 1:
        raise ValueError(f"micro_batch must be an integer >= 1 or None, got {micro_batch}")
    if tokens.dtype != torch.bool or tokens.shape != response.shape or bool((tokens & ~response).any()):
        raise ValueError(f"tokens must be a bool mask of response tokens of shape {tuple(response.shape)}")


def ground_truths(
    model: nn.Module,
    batch: RolloutBatch,
    support: TopKSupport,
    advantages: Tensor,
    weights: Tensor,
    tokens: Tensor,
    optimizer: torch.optim.Optimizer,
    *,
    grad_clip: float | None,
    temperature: float = 1.0,
    divergence: str = "kl",
    cf_modes: Sequence[str] = ("adam_carried",),
    adam_preconditioner: bool = False,
    gradient: Mapping[str, Tensor | None] | None = None,
    chunk_size: int = 64,
    micro_batch: int | None = None,
    dtype: torch.dtype = torch.float64,
) -> dict[str, Tensor]:
    """The ground truths of ``tokens`` (bool [B, R]) at the model's current parameters θ.

    advantages [B, R]:   the tokens' A (``predmask.rl.algo.token_advantages``)
    weights [B, R]:      each response token's c_t in the reference loss (``loss_weights``)
    optimizer:           the studied step's AdamW with its state (read, never stepped); ``grad_clip`` its clip norm
    cf_modes:            the counterfactuals to compute (``CF_MODES``)
    adam_preconditioner: also ``ddot_net_adam`` (needs a state that has taken a step)
    gradient:            the reference step's unclipped gradient G by trainable-parameter name (None where it does
                         not reach a parameter), when the caller has it; else computed here from ``weights`` with
                         one forward/backward of the whole batch
    chunk_size:          tokens per vectorised pass (memory: about 8 parameter copies per token)
    micro_batch:         rows per forward of the whole-batch passes (None: all at once)
    dtype:               of the counterfactual forwards and of the results (float64: see the module docstring)

    Returns tensors [n] on the model's device, in the order of ``tokens.nonzero()``: ``context_id`` (int64, the
    (context, sampled token) pair's id) and, in ``dtype``, ``d`` (D_t at θ, this module's forward), ``ddot_net``,
    ``ddot_net_adam`` (with ``adam_preconditioner``) and ``dd_cf_<mode>`` per mode of ``cf_modes``. The model and
    the optimiser are left as they were.
    """
    response = batch.response_mask
    _check_arguments(tokens, response, cf_modes, dtype, chunk_size, micro_batch)
    rule = StepRule.of(optimizer, grad_clip)
    named = dict(model.named_parameters())
    trainable = {k: p for k, p in named.items() if p.requires_grad}
    work = next(iter(trainable.values())).dtype  # per-token gradients and optimiser updates: the model's dtype
    theta = {k: p.detach() for k, p in trainable.items()}
    carried = _adam_state(optimizer, trainable, work)
    fresh = _AdamState(*({k: torch.zeros_like(t) for k, t in m.items()} for m in (carried.m, carried.v)), 0)
    states = {"adam_carried": carried, "adam_reset": fresh, "sgd": carried}
    precond = _preconditioner(rule, carried) if adam_preconditioner else None
    names = ["d", OWN_UPDATE, *([OWN_UPDATE_ADAM] if precond else []), *map(counterfactual_column, cf_modes)]
    all_seq, all_pos = tokens.nonzero(as_tuple=True)
    if all_seq.numel() == 0:
        empty = {k: torch.zeros(0, dtype=dtype, device=response.device) for k in names}
        return {CONTEXT_ID: torch.zeros(0, dtype=torch.int64, device=response.device), **empty}
    rows = _left_aligned(batch)
    reps, kind = _distinct(rows, support, weights, all_seq, all_pos)
    seq, pos = all_seq[reps], all_pos[reps]
    picked = torch.zeros_like(tokens)
    picked[seq, pos] = True
    sup = TopKSupport(
        support.ids[seq, pos],
        support.mu_logprobs[seq, pos],
        support.valid[seq, pos],
        support.sampled_index[seq, pos],
    )
    with _evaluation_mode(model), _precision(work):
        if gradient is None:
            grad, z_pre = _gradient_pass(
                model, rows, batch, support, weights, picked, temperature, micro_batch
            )
        else:
            grad = _given_gradient(gradient, theta)
            z_pre = _token_logits(model, rows, picked, micro_batch)
        z = z_pre.to(dtype).requires_grad_(True)
        d_pre, ell = _token_terms(z, sup, temperature, divergence)
        u = torch.autograd.grad(d_pre.sum(), z, retain_graph=True)[0].to(work)
        w = torch.autograd.grad(ell.sum(), z)[0].to(work)
        theta_eval = {k: t.to(dtype) for k, t in theta.items()}
        consts = {m: _constants(m, rule, theta_eval, states[m]) for m in cf_modes}
        batched = {k: None if g is None else g[None] for k, g in grad.items()}
        frozen = {k: p.detach() for k, p in named.items() if not p.requires_grad}
        setup = _Pass(
            theta,
            _logits_fn(model, frozen),
            _logits_fn(model, {k: t.to(dtype) for k, t in frozen.items()}),
            grad,
            consts,
            {m: {k: t[0] for k, t in _step(consts[m], batched).items()} for m in cf_modes},
            precond,
            work,
            dtype,
        )
        c = weights[seq, pos].to(work)
        with _eager_attention(model):
            res = {k: v.to(dtype) for k, v in _chunked(setup, rows, seq, pos, u, w, c, chunk_size).items()}
    a = advantages[all_seq, all_pos].to(dtype)
    out = {
        CONTEXT_ID: _context_ids(rows, all_seq, all_pos),
        "d": d_pre.detach()[kind],
        OWN_UPDATE: a * res[OWN_UPDATE][kind],
    }
    if precond is not None:
        out[OWN_UPDATE_ADAM] = a * res[OWN_UPDATE_ADAM][kind]
    shared = c != 0  # a token without a share of G (A = 0) leaves the step unchanged: its counterfactual is 0
    with torch.no_grad():
        for m in cf_modes:
            d_full, _ = _token_terms(res[f"zf_{m}"], sup, temperature, divergence)
            d_without, _ = _token_terms(res[f"z_{m}"], sup, temperature, divergence)
            out[counterfactual_column(m)] = torch.where(shared, d_full - d_without, 0.0)[kind]
    return out
