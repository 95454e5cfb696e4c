"""Measured accuracy weights: the projection of each method's real gradient on the estimate of ∇ log p
(docs/math.md §9.6), on the exact softmax bandit (source ``bandit``) and on real batches of a model
(``model``).

The losses (one question, n samples y_i, s_i = Σ_t log π(y_i,t | ...) the sequence log-prob, r_i ∈ {0, 1}):
reinforce −(1/n) Σ r_i s_i; rft the same on the reference model's samples, at θ = θ_ref; grpo −(1/n) Σ min(ρ_i A_i,
clip(ρ_i, 1 ± 0.2) A_i) with ρ_i = exp(s_i − sg(s_i)) (PPO at θ = θ_old) and A = ``predmask.rl.algo.grpo_advantages``
over groups of G; vr ``predmask.vr_weights.weighted_sft_loss`` with the normalised weights of the acc estimator
(each sample's own correctness) and a zero log ratio (the samples come from the model itself: q = π), normaliser 1.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from analysis.accuracy_weighting.theory import (
    DEFAULT_EPS,
    METHODS,
    batch_weight,
    check_method,
    predicted_weight,
)

#: PPO clip range of the grpo method (0.2 / 0.2, as the engine's grpo)
CLIP = 0.2


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class BanditCase:
    """One bandit: ``arms`` arms, the first ``correct`` of them right, exact accuracy ``p``, batches of ``group_size``.

    Construction checks every value (the one place of these checks; the command line builds its cases to check its
    config): one ValueError line naming the bad value and what is allowed."""

    p: float
    group_size: int
    arms: int = 4
    correct: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.p, bool) or not isinstance(self.p, (int, float)) or not 0.0 < self.p < 1.0:
            raise ValueError(f"bandit p = {self.p!r} is not allowed; allowed: 0 < p < 1 (∇ log p is 0 at p = 1)")
        if not _whole(self.group_size) or self.group_size < 1:
            raise ValueError(f"bandit group_size = {self.group_size!r} is not allowed; allowed: an integer >= 1")
        if not _whole(self.arms) or self.arms < 2:
            raise ValueError(f"bandit arms = {self.arms!r} is not allowed; allowed: an integer >= 2")
        if not _whole(self.correct) or not 1 <= self.correct < self.arms:
            raise ValueError(f"bandit correct = {self.correct!r} is not allowed; allowed: 1 .. arms - 1 = {self.arms - 1}")
        if self.arms ** self.group_size > 2_000_000:
            raise ValueError(f"arms^group_size = {self.arms}^{self.group_size} batches is too many to enumerate; "
                             "allowed: at most 2,000,000")


def check_sampling(questions: int, samples: int, group_size: int) -> None:
    """One ValueError line for the first bad value of the real-model measurement's sizes."""
    for key, value in (("questions", questions), ("samples", samples), ("group_size", group_size)):
        if not _whole(value) or value < 1:
            raise ValueError(f"{key} = {value!r} is not allowed; allowed: an integer >= 1")
    if samples % group_size:
        raise ValueError(f"samples = {samples} is not a multiple of group_size = {group_size}; allowed: k * group_size")


def method_loss(
    method: str,
    token_logp: Tensor,
    mask: Tensor,
    rewards: Tensor,
    *,
    group_size: int,
    eps: float = DEFAULT_EPS,
    batch_index: Tensor | None = None,
    batch_weight_of_row: Tensor | None = None,
) -> Tensor:
    """The loss of ``method`` on rows of samples (token log-probs [B, T] under the model, with grad; 0/1 rewards [B]).

    ``batch_index`` [B] names each row's batch, the samples of one question (default: all rows one batch); the loss
    is the mean over a batch's samples, summed over batches, each row scaled by the detached ``batch_weight_of_row``
    [B] (the batch's probability in the bandit's exact expectation; default 1). GRPO's groups are rows
    ``j*G .. j*G + G - 1`` (G = ``group_size``, inside a batch). Sequence log-probs throughout."""
    from predmask.rl.algo import grpo_advantages
    from predmask.vr_weights import (
        log_correct_estimate,
        normalise_weights,
        sequence_logprob,
        trace_log_ratio,
        trace_log_weights,
        weighted_sft_loss,
    )

    check_method(method)
    b = token_logp.shape[0]
    if b % group_size:
        raise ValueError(f"{b} samples cannot be split into groups of {group_size}; allowed: a multiple of it")
    if batch_index is None:
        batch_index = torch.zeros(b, dtype=torch.long)
    per_batch = torch.bincount(batch_index)[batch_index].to(token_logp.dtype)  # samples in the row's batch
    factor = torch.ones(b, dtype=token_logp.dtype) if batch_weight_of_row is None else batch_weight_of_row
    factor = factor / per_batch
    seq = sequence_logprob(token_logp, mask)
    r = rewards.to(token_logp.dtype)
    if method in ("reinforce", "rft"):
        return -(factor * r * seq).sum()
    if method == "grpo":
        adv = grpo_advantages(rewards, group_size, eps=eps, dtype=token_logp.dtype)
        ratio = torch.exp(seq - seq.detach())
        surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - CLIP, 1 + CLIP) * adv)
        return -(factor * surrogate).sum()
    lengths = mask.sum(-1)
    log_ratio = trace_log_ratio(seq.detach(), seq.detach(), lengths)  # q = π: samples from the model itself
    log_correct = log_correct_estimate("acc", correct=(rewards > 0.5).view(-1, 1))
    weights = normalise_weights(trace_log_weights(log_ratio, log_correct), batch_index)
    scale = factor * per_batch  # the weights already sum to 1 per batch: no mean over its samples
    return weighted_sft_loss(token_logp, mask, weights.to(token_logp.dtype) * scale, 1.0)


def _flat(grads: Sequence[Tensor | None], params: Sequence[Tensor]) -> Tensor:
    return torch.cat([
        (g if g is not None else torch.zeros_like(p)).reshape(-1).to(torch.float64) for g, p in zip(grads, params)
    ])


def projection(direction: Tensor, target: Tensor) -> float:
    """<direction, target> / <target, target> (float64)."""
    return float(direction.double() @ target.double() / (target.double() @ target.double()))


def bandit_logits(case: BanditCase) -> Tensor:
    """float64 logits [arms] with exactly P(correct arm) = case.p (seeded shape within the right and wrong arms)."""
    gen = torch.Generator().manual_seed(case.seed)
    base = torch.randn(case.arms, generator=gen, dtype=torch.float64)
    right, wrong = base[: case.correct], base[case.correct:]
    shift = math.log(case.p / (1 - case.p)) + torch.logsumexp(wrong, 0) - torch.logsumexp(right, 0)
    return torch.cat([right + shift, wrong])


def _all_batches(arms: int, g: int) -> Tensor:
    grids = torch.meshgrid(*([torch.arange(arms)] * g), indexing="ij")
    return torch.stack([x.reshape(-1) for x in grids], -1)  # [arms^g, g]


def bandit_weights(
    case: BanditCase, methods: Sequence[str] = METHODS, eps: float = DEFAULT_EPS
) -> dict[str, tuple[float, float]]:
    """Exact expected weight of each method on ∇ log p for the bandit ``case``: method -> (weight, residual), the
    residual being |E[−∇L] − w·∇log p| / |∇log p| (0 when the expected gradient is along ∇ log p)."""
    theta = bandit_logits(case).requires_grad_(True)
    logp = torch.log_softmax(theta, 0)
    g_true = torch.autograd.grad(torch.logsumexp(logp[: case.correct], 0), theta, retain_graph=True)[0]
    batches = _all_batches(case.arms, case.group_size)  # [T, G]
    sample_logp = logp[batches]  # [T, G]
    prob = sample_logp.sum(-1).exp().detach()  # P(batch), exact
    rewards = (batches < case.correct).to(torch.float64).reshape(-1)
    token_logp = sample_logp.reshape(-1, 1)
    mask = torch.ones_like(token_logp, dtype=torch.bool)
    index = torch.arange(batches.shape[0]).repeat_interleave(case.group_size)
    out: dict[str, tuple[float, float]] = {}
    for method in methods:
        loss = method_loss(method, token_logp, mask, rewards, group_size=case.group_size, eps=eps,
                           batch_index=index, batch_weight_of_row=prob.repeat_interleave(case.group_size))
        grad = -torch.autograd.grad(loss, theta, retain_graph=True)[0]
        w = projection(grad, g_true)
        out[method] = (w, float((grad - w * g_true).norm() / g_true.norm()))
    return out


def bandit_rows(
    accuracies: Sequence[float],
    group_sizes: Sequence[int],
    *,
    arms: int = 4,
    correct: int = 2,
    seed: int = 0,
    eps: float = DEFAULT_EPS,
    methods: Sequence[str] = METHODS,
    on_case: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """accuracy_weighting rows (source 'bandit') for every (G, p): measured = the exact expectation, predicted =
    ``theory.predicted_weight(method, p, group_size=G)``; ``question`` numbers the cases."""
    rows: list[dict[str, Any]] = []
    label = f"softmax bandit ({arms} arms, {correct} correct)"
    for case_no, (g, p) in enumerate(itertools.product(group_sizes, accuracies)):
        case = BanditCase(p=float(p), group_size=int(g), arms=arms, correct=correct, seed=seed)
        measured = {m: w for m, (w, _residual) in bandit_weights(case, methods, eps).items()}
        rows += _rows("bandit", case_no, float(p), measured, predicted_weight, eps,
                      n_samples=int(g), group_size=int(g), model=label)
        if on_case is not None:
            on_case(f"G={g} p={p:g}")
    return rows


def _rows(source: str, question: int, accuracy: float, measured: Mapping[str, float | None],
          predict: Callable[..., Any], eps: float, *, n_samples: int, group_size: int,
          model: str) -> list[dict[str, Any]]:
    """The accuracy_weighting rows of one bandit case or question: one per method of ``measured``, predicted by
    ``predict(method, accuracy, group_size=, eps=)``."""
    return [{"source": source, "method": method, "question": question, "accuracy": accuracy,
             "measured_weight": weight,
             "predicted_weight": float(predict(method, accuracy, group_size=group_size, eps=eps)),
             "n_samples": n_samples, "group_size": group_size, "model": model} for method, weight in measured.items()]


@dataclass
class ModelMeasurement:
    """model_rows' result: the rows and how many questions had no correct sample (weights NULL)."""

    rows: list[dict[str, Any]]
    no_correct: int


def _token_logp(model: nn.Module, batch: Any, temperature: float) -> Tensor:
    from predmask.rl.algo import response_logits

    logits = response_logits(model, batch) / temperature
    return torch.log_softmax(logits, -1).gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)


def question_weights(
    model: nn.Module,
    batch: Any,
    *,
    group_size: int,
    temperature: float = 1.0,
    eps: float = DEFAULT_EPS,
    methods: Sequence[str] = METHODS,
) -> dict[str, float | None]:
    """Measured weight of each method on one question's batch (a RolloutBatch of its samples, 0/1 ``rewards``):
    <−∇L_m, ĝ> / <ĝ, ĝ> with ĝ the mean score of the correct samples; None for every method when none is correct."""
    rewards = batch.rewards.to(torch.float64)
    c = int(rewards.sum())
    if c == 0:
        return dict.fromkeys(methods)
    params = [p for p in model.parameters() if p.requires_grad]
    token_logp = _token_logp(model, batch, temperature)
    mask = batch.response_mask
    seq = (token_logp * mask).sum(-1)
    target = _flat(torch.autograd.grad((batch.rewards.float() * seq).sum() / c, params, retain_graph=True,
                                       allow_unused=True), params)
    out: dict[str, float | None] = {}
    for method in methods:
        loss = method_loss(method, token_logp, mask, batch.rewards, group_size=group_size, eps=eps)
        grad = _flat(torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True), params)
        out[method] = projection(-grad, target)
    return out


def model_rows(
    model: nn.Module,
    task: Any,
    *,
    questions: int,
    samples: int,
    group_size: int,
    temperature: float = 1.0,
    seed: int = 0,
    eps: float = DEFAULT_EPS,
    label: str = "model",
    methods: Sequence[str] = METHODS,
    on_question: Callable[[int], None] | None = None,
) -> ModelMeasurement:
    """accuracy_weighting rows (source 'model'): ``samples`` responses per each of the first ``questions`` train
    problems from ``model`` (a question's rows form GRPO groups of ``group_size``), the real gradient of each
    method's loss, its projection on ĝ, and ``theory.batch_weight`` at p̂ as the prediction."""
    from predmask.rl.base import task_response_budget
    from predmask.rl.rollout import rollout_problems
    from predmask.rl.task import make_split
    from predmask.rl.tokenizer import ArithmeticTokenizer

    check_sampling(questions, samples, group_size)
    tok = ArithmeticTokenizer(task.max_number)
    problems = make_split(task, "train", questions)
    was_training = model.training
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    batch = rollout_problems(model, tok, problems, n=samples, max_new_tokens=task_response_budget(task),
                             temperature=temperature, generator=gen)
    rows: list[dict[str, Any]] = []
    no_correct = 0
    try:
        for q in range(questions):
            part = batch.select(slice(q * samples, (q + 1) * samples))
            c = int(part.rewards.sum())
            p_hat = c / samples
            measured = question_weights(model, part, group_size=group_size, temperature=temperature, eps=eps,
                                        methods=methods)
            no_correct += c == 0
            predict = batch_weight if c else predicted_weight  # p̂ = 0: the closed form at 0
            rows += _rows("model", q, p_hat, measured, predict, eps, n_samples=samples, group_size=group_size,
                          model=label)
            if on_question is not None:
                on_question(q)
    finally:
        model.train(was_training)
    return ModelMeasurement(rows=rows, no_correct=no_correct)


def summarise(rows: Sequence[Mapping[str, Any]], bins: int = 5) -> list[dict[str, Any]]:
    """Per (source, method, accuracy bin): the bin, its rows with a measured weight, mean measured and mean predicted."""
    out: list[dict[str, Any]] = []
    keys = sorted({(r["source"], r["method"]) for r in rows}, key=lambda k: (k[0], METHODS.index(k[1])))
    for source, method in keys:
        sel = [r for r in rows if r["source"] == source and r["method"] == method]
        for i in range(bins):
            lo, hi = i / bins, (i + 1) / bins
            inside = [r for r in sel if lo <= r["accuracy"] < hi or (i == bins - 1 and r["accuracy"] == 1.0)]
            have = [r for r in inside if r["measured_weight"] is not None]
            if not inside:
                continue
            out.append({
                "source": source, "method": method, "bin": f"[{lo:.1f}, {hi:.1f}{']' if i == bins - 1 else ')'}",
                "rows": len(inside), "measured_rows": len(have),
                "measured": sum(r["measured_weight"] for r in have) / len(have) if have else None,
                "predicted": sum(r["predicted_weight"] for r in have) / len(have) if have else None,
            })
    return out
