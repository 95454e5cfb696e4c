"""Closed forms of the weight w(p) each training objective puts on g = ∇ log p(x) (docs/math.md §9).

``predicted_weight(method, p, group_size=None)`` is the limit of infinitely many samples; ``group_size=G`` the
exact expectation over batches of G samples. ``batch_weight`` is what one batch with a correct sample gets at
its own accuracy p̂ (the per-batch identities of reinforce, rft and vr; GRPO's finite-group expectation).
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy.stats import binom

#: the objectives of the analysis, in display order
METHODS: tuple[str, ...] = ("rft", "reinforce", "grpo", "vr")
#: the engine's GRPO epsilon (``predmask.rl.algo.grpo_advantages``'s default)
DEFAULT_EPS = 1e-6


def check_method(method: str) -> str:
    """``method`` if it is one of METHODS, else one ValueError line naming it and the allowed ones."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; allowed: {', '.join(METHODS)}")
    return method


def check_eps(eps: float) -> float:
    """``eps`` if it is a finite number >= 0 (GRPO's std epsilon), else one ValueError line naming it."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < math.inf:
        raise ValueError(f"eps = {eps!r} is not allowed; allowed: a finite number >= 0")
    return eps


def _accuracy(p: ArrayLike) -> NDArray[np.float64]:
    arr = np.asarray(p, dtype=np.float64)
    if arr.size and (not np.all(np.isfinite(arr)) or arr.min() < 0.0 or arr.max() > 1.0):
        raise ValueError(f"accuracy p must lie in [0, 1], got {arr.min() if arr.size else arr}..{arr.max()}")
    return arr


def _group(group_size: int | None) -> int | None:
    if group_size is None:
        return None
    if isinstance(group_size, bool) or int(group_size) != group_size or group_size < 1:
        raise ValueError(f"group_size = {group_size!r} is not allowed; allowed: an integer >= 1 or None (the limit)")
    return int(group_size)


def _group_std(k: NDArray[np.float64], g: int) -> NDArray[np.float64]:
    """Unbiased std of a 0/1 group of size g holding k ones: √(k(g − k) / (g(g − 1)))."""
    return np.sqrt(k * (g - k) / (g * (g - 1.0)))


def grpo_weight(p: ArrayLike, group_size: int | None, eps: float = DEFAULT_EPS) -> NDArray[np.float64]:
    """GRPO's weight on g (docs/math.md §9.5): the exact finite-group form for ``group_size`` G, the
    large-group limit for None."""
    pa = _accuracy(p)
    g = _group(group_size)
    check_eps(eps)
    if g is None:
        with np.errstate(divide="ignore"):
            return pa / (np.sqrt(pa * (1.0 - pa)) + eps)
    if g == 1:
        return np.zeros_like(pa)
    s = np.arange(g, dtype=np.float64)  # correct samples among the other G − 1
    pmf = binom.pmf(s[:, None], g - 1, pa.reshape(1, -1))  # [G, P]
    sigma_with = _group_std(s + 1.0, g)  # the sample is correct: k = s + 1
    sigma_without = _group_std(s, g)  # the sample is wrong: k = s
    with np.errstate(divide="ignore", invalid="ignore"):
        correct = np.where(s + 1 < g, (g - 1 - s) / (g * (sigma_with + eps)), 0.0)
        wrong = np.where(s > 0, s / (g * (sigma_without + eps)), 0.0)
    bracket = (pmf * (correct + wrong)[:, None]).sum(0)
    return (pa.reshape(-1) * bracket).reshape(pa.shape)


def predicted_weight(
    method: str, p: ArrayLike, *, group_size: int | None = None, eps: float = DEFAULT_EPS
) -> NDArray[np.float64]:
    """The expected weight of ``method``'s gradient on g = ∇ log p at accuracy ``p`` (vectorised over p).

    ``group_size``: samples per question (None: the limit of infinitely many); ``eps``: GRPO's std epsilon."""
    check_method(method)
    pa = _accuracy(p)
    g = _group(group_size)
    if method in ("rft", "reinforce"):
        return pa.copy()
    if method == "vr":
        return np.ones_like(pa) if g is None else 1.0 - (1.0 - pa) ** g
    return grpo_weight(pa, g, eps)


def batch_weight(
    method: str, p_hat: ArrayLike, *, group_size: int, eps: float = DEFAULT_EPS
) -> NDArray[np.float64]:
    """The weight predicted for one batch of ``group_size`` samples with accuracy ``p_hat`` > 0 (a correct
    sample): the per-batch identities of reinforce, rft (p̂) and vr (1); grpo's finite-group expectation."""
    check_method(method)
    if method == "vr":
        return np.ones_like(_accuracy(p_hat))
    return predicted_weight(method, p_hat, group_size=group_size, eps=eps)
