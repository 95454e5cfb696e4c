"""The loss from hidden states against the loss from logits: time ratio and peak extra memory of one step.

Run by ``python scripts/benchmark.py loss`` next to the logits-path benchmark (predmask/bench.py). A step is
the predictive mask's loss (``HIDDEN_METHOD``) from hidden states ``h`` [tokens, D] and the lm_head weight
``W`` [V, D], and its backward to ``h`` and ``W``, by each of ``PATHS``. Times run on one torch thread
(``THREADS``): on shared cores each parallel operation waits for its slowest thread, which costs the streaming
path's many small per-chunk operations far more than their work. Peak extra memory is in units of one [tokens,
V] float32 tensor; the target is on the hidden-states path's peak less the gradients of ``h`` and ``W``, which
it holds through its whole backward.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.profiler import ProfilerActivity, profile

from predmask.bench import (
    loss_inputs,
    median_times,
    rollout_support,
    sampled_token_loss,
    support_loss,
    target,
)
from predmask.hidden_gather import gather_support_logprobs_from_hidden
from predmask.support import gather_support_logprobs

#: the method whose loss both paths compute
HIDDEN_METHOD = "predmask_kl_agg"
#: the steps timed: the plain sampled-token loss from logits, the method from logits, the method from hidden states
PATHS = ("logits_log_softmax_gather", "logits", "hidden")
#: the hidden-states path may cost at most 1.5 x the logits path's time: its backward recomputes the logits
#: (one more [tokens, D] x [D, V] product on top of the three a step already has)
HIDDEN_TIME_RATIO_MAX = 1.5
#: its peak extra memory, in [tokens, V] float32 tensors: the logits path holds the logits and their gradient
#: (2.0); the streaming path holds a few [tokens, chunk] buffers
HIDDEN_PEAK_EXTRA_MAX = 0.25
#: hidden size of the benchmark (a small model's; the time ratio moves towards 4/3 as D grows)
DEFAULT_HIDDEN_SIZE = 512
#: torch threads of the timed steps (see the module docstring)
THREADS = 1
#: rows of logits built at once when drawing the rollout support
_CHUNK_ROWS = 1024


def make_hidden_inputs(tokens: int, vocab: int, dim: int, topk: int, *, seed: int = 0) -> dict[str, Tensor]:
    """Float32 hidden states and lm_head weight whose logits ``h Wᵀ`` have per-token sharpness drawn from [1, 6]
    (flat to peaked), and a rollout support drawn from those logits plus noise of scale 0.3 (built in row chunks)."""
    g = torch.Generator().manual_seed(seed)
    sharp = 1.0 + 5.0 * torch.rand(tokens, 1, generator=g)
    hidden = torch.randn(tokens, dim, generator=g) * sharp / dim ** 0.5
    weight = torch.randn(vocab, dim, generator=g)
    chunks = (hidden[s:s + _CHUNK_ROWS] @ weight.T for s in range(0, tokens, _CHUNK_ROWS))
    sup, sampled_ids = rollout_support(chunks, topk, g)
    return {"hidden": hidden, "weight": weight, "ids": sup.ids, "mu": sup.mu_logprobs, "valid": sup.valid,
            "sampled_index": sup.sampled_index, "sampled": sampled_ids, "adv": torch.randn(tokens, generator=g)}


def step_fn(path: str, x: dict[str, Tensor]) -> Callable[[], tuple[Tensor, Tensor]]:
    """One forward and backward of ``path`` (one of ``PATHS``); returns the gradients of ``h`` and ``W``."""
    if path not in PATHS:
        raise ValueError(f"unknown path {path!r}; allowed: {', '.join(PATHS)}")
    inputs = loss_inputs(x, x["weight"].shape[0])

    def step() -> tuple[Tensor, Tensor]:
        h, w = x["hidden"].detach().requires_grad_(), x["weight"].detach().requires_grad_()
        if path == "logits_log_softmax_gather":
            loss = sampled_token_loss(h @ w.T, x, inputs[2])
        else:
            pi = gather_support_logprobs(h @ w.T, x["ids"], x["valid"]) if path == "logits" else \
                gather_support_logprobs_from_hidden(h, w, x["ids"], x["valid"])
            loss = support_loss(HIDDEN_METHOD, pi, x, inputs)
        grad_h, grad_w = torch.autograd.grad(loss, (h, w))
        return grad_h, grad_w

    return step


def peak_extra_bytes_profiled(fn: Callable[[], Any]) -> int:
    """The most bytes the CPU allocator held at once during ``fn()`` above what was live when it began
    (``torch.profiler``'s memory events, their "Total Allocated" counter)."""
    fn()  # warm-up: first-call allocations (kernel set-up, caches) are not the step's memory
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory(prefix="predmask-hidden-bench-") as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    totals = [int(e["args"]["Total Allocated"]) for e in events
              if e.get("name") == "[memory]" and "Total Allocated" in e.get("args", {})]
    if not totals:
        raise RuntimeError("torch.profiler recorded no memory events (profile_memory=True on CPU)")
    return max(totals)


def bench_hidden(tokens: int, *, vocab: int, dim: int, topk: int, repeats: int, memory: bool) -> dict[str, Any]:
    """Times, the hidden/logits time ratio, peak extra memory of both paths and the targets at one size."""
    x = make_hidden_inputs(tokens, vocab, dim, topk)
    fns = {p: step_fn(p, x) for p in PATHS}
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        med = median_times(fns, repeats, torch.device("cpu"), warmup=1)
    finally:
        torch.set_num_threads(threads)
    unit = tokens * vocab * 4
    grads = (x["hidden"].numel() + x["weight"].numel()) * 4
    peak = {p: peak_extra_bytes_profiled(fns[p]) / unit for p in ("logits", "hidden")} if memory else {}
    record: dict[str, Any] = {
        "tokens": tokens, "vocab": vocab, "hidden_size": dim, "topk": topk, "method": HIDDEN_METHOD, "threads": THREADS,
        "unit_bytes": unit, "grad_bytes": grads, "median_s": med, "time_ratio": med["hidden"] / med["logits"],
        "peak_extra": peak,
    }
    rows = [target(f"time {HIDDEN_METHOD} from hidden states / from logits", record["time_ratio"],
                   HIDDEN_TIME_RATIO_MAX)]
    if memory:
        rows.append(target(f"peak extra memory {HIDDEN_METHOD} from hidden states beyond the h and W gradients "
                           "(x [tokens, vocab] float32)", peak["hidden"] - grads / unit, HIDDEN_PEAK_EXTRA_MAX))
    record["targets"] = rows
    return record
