"""Unbiased pass@k and its curve over k = 1..n (math.md §8); a split's evaluation metrics built on them."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from predmask import metrics as M


def check_int(what: str, value: object, low: int, high: int | None = None) -> int:
    """``value`` when it is an integer in ``[low, high]`` (no bool); else one ValueError line naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        allowed = f"an integer in [{low}, {high}]" if high is not None else f"an integer >= {low}"
        raise ValueError(f"{what} = {value!r} is not allowed; allowed: {allowed}")
    return value


def check_binary(correct: Tensor) -> None:
    """One ValueError line unless ``correct`` holds bool or 0/1 values."""
    if correct.dtype != torch.bool and bool(((correct != 0) & (correct != 1)).any()):
        raise ValueError("correct must hold 0/1 or bool values; allowed: 0, 1, False, True")


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate 1 − C(n−c, k) / C(n, k) of P(at least one of k draws is correct).

    It is the chance that k of the n samples drawn without replacement include a correct one; computed as
    1 − Π_{i=n−c+1..n} (1 − k/i), which never forms a binomial coefficient (1 when n − c < k)."""
    n = check_int("n (samples per question)", n, 1)
    c = check_int("c (correct samples)", c, 0, n)
    k = check_int("k", k, 1, n)
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def pass_at_k_table(n: int) -> Tensor:
    """pass@k for every c = 0..n and k = 1..n: float64 [n + 1, n], entry [c, k − 1]."""
    n = check_int("n (samples per question)", n, 1)
    return torch.tensor([[pass_at_k(n, c, k) for k in range(1, n + 1)] for c in range(n + 1)], dtype=torch.float64)


def pass_at_k_curve(correct: Tensor | Sequence[Sequence[bool]]) -> dict[int, float]:
    """The mean over questions of pass@k for k = 1..n, from ``correct`` [Q, n] (bool or 0/1): ``{k: mean}``."""
    correct = torch.as_tensor(correct)
    if correct.ndim != 2 or correct.shape[0] < 1 or correct.shape[1] < 1:
        raise ValueError(f"correct must be [Q, n] with Q, n >= 1, got shape {tuple(correct.shape)}")
    check_binary(correct)
    n = int(correct.shape[1])
    hits = correct.to(torch.long).sum(-1)
    means = pass_at_k_table(n)[hits].mean(0)
    return {k: float(means[k - 1]) for k in range(1, n + 1)}


def split_metrics(split: str, correct: Tensor, lengths: Tensor) -> dict[str, float]:
    """One split's evaluation from ``correct`` [problems, n] (bool or 1/0) and the responses' token ``lengths``:
    avg@n accuracy, pass@k for k = 1..n and the mean response length (means in ``lengths``' dtype)."""
    n = int(correct.shape[1])
    out = {M.val_acc(split, n): float(correct.to(lengths.dtype).mean())}
    out.update({M.val_pass(split, k): v for k, v in pass_at_k_curve(correct).items()})
    out[M.val_response_length(split)] = float(lengths.mean())
    return out
