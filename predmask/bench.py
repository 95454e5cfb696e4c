"""The loss benchmark (support gather from logits, mask, backward) of the predictive masks against DPPO-TopK-KL:
time ratio, peak memory, and the closed forms at the benchmark's precision against float64; and the measuring
helpers every benchmark shares (``stopwatch``, the PASS/FAIL ``target`` row).

Run by ``python scripts/benchmark.py loss`` (and ``scripts/device_check.sh`` at Qwen3 scale). Every method runs the path
a trainer runs: gather the training log-probs on the support from the logits
(log-sum-exp), the masked loss, and the backward pass to the logits. Timings interleave the methods in one process
(median of the repeats). Peak memory is the most memory allocated above the inputs during one step, in units of the
logits' own size (numel x element size): on CUDA ``torch.cuda.max_memory_allocated`` in this process, on CPU the
peak RSS of a fresh subprocess per method. The closed forms (D and its predicted change Ddot, both tails) are
computed from the benchmark's logits as the trainer computes them and again with the same logits and rollout
log-probs in float64; their largest absolute and relative differences and the tokens whose mask decision differs
are printed. Each size ends with PASS/FAIL against the targets (``TIME_RATIO_MAX``, ``PEAK_EXTRA_MAX``).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import torch
from torch import Tensor

from predmask.divergence import predicted_divergence_change, topk_divergence
from predmask.methods import MethodParams, policy_loss
from predmask.support import TopKSupport, build_support, gather_support_logprobs

METHODS = ("dppo_topk_kl", "predmask_kl_agg", "predmask_kl_uniform")
#: the method every time ratio is taken against
BASELINE = "dppo_topk_kl"
REFERENCE = "log_softmax_gather"  # the plain sampled-token loss: log_softmax over the vocabulary, gathered
#: the predictive masks may cost at most 2% more time than DPPO-TopK-KL: their extra work is [tokens, K+1]-sized
TIME_RATIO_MAX = 1.02
#: peak extra memory of a step, in logits sizes. The logits gradient itself is 1.00; the per-token tensors add
#: (K+1)/V of it and bounded row-chunk work buffers a little more, while any second [tokens, vocab] tensor adds at
#: least 1.0 (another tensor in the logits' dtype) or 2.0 (a float32 copy of bf16 logits): 1.25 tells them apart
PEAK_EXTRA_MAX = 1.25
#: the trust-region threshold of the timed losses: the paper's tight threshold, so that the mask has work to do
DELTA = 0.05
#: |float64 value| below which the relative error is taken against this floor instead: ulp(1) in float32 is 1.2e-7,
#: so values this small are sums of O(1) probabilities at float32 rounding, where a relative error measures nothing
REL_FLOOR = 1e-6
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: rows of logits generated and compared at once (bounds the float32/float64 work buffers at Qwen3 scale)
_CHUNK_ROWS = 4096
#: glibc's mmap threshold in the CPU memory subprocess, fixed: every buffer above 128 KiB is mapped and
#: unmapped on its own, so the peak RSS follows the live tensors (glibc's default threshold grows after frees
#: and then keeps freed buffers resident)
_MMAP_THRESHOLD = "131072"
#: the closed forms compared against float64: (name in the output, tail estimator or None for D itself)
_CLOSED_FORMS: tuple[tuple[str, str | None], ...] = (("D", None), ("Ddot_aggregated", "aggregated"),
                                                     ("Ddot_uniform", "uniform"))


@contextmanager
def stopwatch() -> Iterator[dict[str, float]]:
    """Wall and CPU seconds of the block (``{"wall", "cpu"}``), filled in when it ends."""
    seconds: dict[str, float] = {}
    wall, cpu = time.perf_counter(), time.process_time()
    yield seconds
    seconds.update(wall=time.perf_counter() - wall, cpu=time.process_time() - cpu)


def target(name: str, value: float, limit: float) -> dict[str, Any]:
    """One PASS/FAIL row: ``value`` passes when it is at most ``limit``."""
    return {"target": name, "value": value, "limit": limit, "pass": bool(value <= limit)}


def rollout_support(logit_chunks: Iterable[Tensor], topk: int, g: torch.Generator) -> tuple[TopKSupport, Tensor]:
    """A rollout's top-K support and sampled ids drawn from row chunks of logits: each chunk plus noise of scale 0.3
    (a stand-in for precision mismatch) is the rollout distribution mu, sampled once per row with ``g``."""
    top_ids, top_lp, sampled, sampled_lp = [], [], [], []
    for z in logit_chunks:
        mu_lp = torch.log_softmax(z.float() + 0.3 * torch.randn(z.shape, generator=g, device=z.device), -1)
        k = torch.multinomial(mu_lp.exp(), 1, generator=g)
        top = mu_lp.topk(topk, -1)
        top_ids.append(top.indices)
        top_lp.append(top.values)
        sampled.append(k.squeeze(-1))
        sampled_lp.append(mu_lp.gather(-1, k).squeeze(-1))
        del mu_lp
    sampled_ids = torch.cat(sampled)
    return build_support(torch.cat(top_ids), torch.cat(top_lp), sampled_ids, torch.cat(sampled_lp)), sampled_ids


def make_inputs(tokens: int, vocab: int, topk: int, *, device: str = "cpu", dtype: torch.dtype = torch.float32,
                seed: int = 0) -> dict[str, Tensor]:
    """Logits [tokens, vocab] in ``dtype`` (standard normal times a per-token sharpness drawn from [1, 6]:
    nearly flat to peaked like a language model's) and a rollout support (``rollout_support``), generated in
    row chunks on ``device`` so that no float32 copy of the whole logits exists."""
    g = torch.Generator(device=device).manual_seed(seed)
    logits = torch.empty(tokens, vocab, dtype=dtype, device=device)
    sharp = 1.0 + 5.0 * torch.rand(tokens, 1, generator=g, device=device)

    def chunks() -> Iterator[Tensor]:
        for s in range(0, tokens, _CHUNK_ROWS):
            e = min(s + _CHUNK_ROWS, tokens)
            logits[s:e] = torch.randn(e - s, vocab, generator=g, device=device) * sharp[s:e]
            yield logits[s:e]

    sup, sampled_ids = rollout_support(chunks(), topk, g)
    adv = torch.randn(tokens, generator=g, device=device)
    return {"logits": logits, "ids": sup.ids, "mu": sup.mu_logprobs, "valid": sup.valid,
            "sampled_index": sup.sampled_index, "sampled": sampled_ids, "adv": adv}


def loss_inputs(x: dict[str, Tensor], vocab: int) -> tuple[MethodParams, Tensor, Tensor]:
    """What every timed step shares, built once outside it: the method parameters, the response mask of one
    sequence of all the tokens and the anchor (the rollout's log-prob of each sampled token) [1, tokens]."""
    params = MethodParams(delta=DELTA, vocab_size=vocab)
    mask = torch.ones(1, x["adv"].shape[0], dtype=torch.bool, device=x["adv"].device)
    old = x["mu"].gather(-1, x["sampled_index"][:, None]).squeeze(-1)[None]
    return params, mask, old


def sampled_token_loss(logits: Tensor, x: dict[str, Tensor], old: Tensor) -> Tensor:
    """The plain sampled-token loss: ``log_softmax`` over the vocabulary, gathered at the sampled tokens."""
    lp = torch.log_softmax(logits, -1).gather(-1, x["sampled"][:, None]).squeeze(-1)
    return -(x["adv"] * (lp - old[0]).exp().detach() * lp).mean()


def support_loss(name: str, pi: Tensor, x: dict[str, Tensor],
                 inputs: tuple[MethodParams, Tensor, Tensor]) -> Tensor:
    """The loss of method ``name`` from the training log-probs on the support ``pi`` [tokens, K+1]."""
    params, mask, old = inputs
    log_prob = pi.gather(-1, x["sampled_index"][:, None]).squeeze(-1)
    loss, _ = policy_loss(name, log_prob=log_prob[None], old_log_prob=old, advantages=x["adv"][None],
                          response_mask=mask, mu_logprobs=x["mu"][None], pi_logprobs=pi[None],
                          valid=x["valid"][None], sampled_index=x["sampled_index"][None], params=params)
    return loss


def step_fn(name: str, x: dict[str, Tensor], vocab: int) -> Callable[[], None]:
    """One forward+backward of ``name`` on the inputs (one sequence of all the tokens)."""
    inputs = loss_inputs(x, vocab)

    def step() -> None:
        z = x["logits"].detach().requires_grad_()
        if name == REFERENCE:
            sampled_token_loss(z, x, inputs[2]).backward()
        else:
            support_loss(name, gather_support_logprobs(z, x["ids"], x["valid"]), x, inputs).backward()

    return step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_times(fns: dict[str, Callable[[], None]], repeats: int, device: torch.device,
                 warmup: int = 2) -> dict[str, float]:
    """Median wall seconds of each step, the steps interleaved so that machine noise hits every one alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {n: [] for n in fns}
    for _ in range(repeats):
        for n, fn in fns.items():
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times[n].append(time.perf_counter() - t0)
    return {n: statistics.median(v) for n, v in times.items()}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak_rss() -> None:
    """Reset the kernel's peak-RSS mark (VmHWM) of this process, so the peak covers only what follows."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_child(name: str, tokens: int, vocab: int, topk: int, dtype: str, out: mp.Queue) -> None:
    torch.set_num_threads(1)
    x = make_inputs(tokens, vocab, topk, dtype=DTYPES[dtype])
    fn = step_fn(name, x, vocab)
    fn()  # warm-up: the first call also loads code and sets up kernels, which is not the step's memory
    _reset_peak_rss()
    base = _status_kib("VmRSS")
    fn()
    out.put(max(0, _status_kib("VmHWM") - base) * 1024)


def peak_extra_bytes(name: str, x: dict[str, Tensor], vocab: int, topk: int) -> int:
    """Most bytes allocated above the inputs during one step of ``name``: CUDA's peak-allocation counter on a
    CUDA device; on CPU the peak RSS of a fresh subprocess that rebuilds the same inputs (seed 0), during its
    second step."""
    logits = x["logits"]
    if logits.device.type == "cuda":
        fn = step_fn(name, x, vocab)
        _sync(logits.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(logits.device)
        base = torch.cuda.memory_allocated(logits.device)
        fn()
        _sync(logits.device)
        return int(torch.cuda.max_memory_allocated(logits.device) - base)
    dtype = next(k for k, v in DTYPES.items() if v == logits.dtype)
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    p = ctx.Process(target=_peak_child, args=(name, logits.shape[0], vocab, topk, dtype, q))
    with mock.patch.dict(os.environ, MALLOC_MMAP_THRESHOLD_=_MMAP_THRESHOLD):  # read by glibc when the child starts
        p.start()
    value = q.get(timeout=600)
    p.join()
    return int(value)


def closed_form_errors(x: dict[str, Tensor], vocab: int, delta: float = DELTA) -> dict[str, dict[str, float]]:
    """D and Ddot (both tails) as the trainer computes them from these logits, against float64 from the same
    logits and rollout log-probs: per closed form the largest absolute error, the largest relative error (against
    max(|float64 value|, REL_FLOOR)) and ``decision_flips``, the tokens whose mask decision differs (D > delta
    for D, A * Ddot > 0 for Ddot)."""
    out = {name: {"max_abs": 0.0, "max_rel": 0.0, "decision_flips": 0.0} for name, _ in _CLOSED_FORMS}
    n = x["logits"].shape[0]
    for s in range(0, n, _CHUNK_ROWS):
        e = min(s + _CHUNK_ROWS, n)
        ids, valid, k = x["ids"][s:e], x["valid"][s:e], x["sampled_index"][s:e]
        adv = x["adv"][s:e].double()
        with torch.no_grad():
            pairs = []
            for logits, mu in ((x["logits"][s:e], x["mu"][s:e]), (x["logits"][s:e].double(), x["mu"][s:e].double())):
                pi = gather_support_logprobs(logits, ids, valid)
                values = []
                for _, tail in _CLOSED_FORMS:
                    values.append(topk_divergence(mu, pi, valid) if tail is None else
                                  predicted_divergence_change(mu, pi, valid, k, tail=tail, vocab_size=vocab))
                pairs.append(values)
                del pi
        for (name, tail), low, ref in zip(_CLOSED_FORMS, pairs[0], pairs[1], strict=True):
            low = low.double()
            err = (low - ref).abs()
            rel = err / ref.abs().clamp_min(REL_FLOOR)
            if tail is None:
                flips = (low > delta) != (ref > delta)
            else:
                flips = (adv * low > 0) != (adv * ref > 0)
            row = out[name]
            row["max_abs"] = max(row["max_abs"], float(err.max()))
            row["max_rel"] = max(row["max_rel"], float(rel.max()))
            row["decision_flips"] += float(flips.sum())
    return out


def targets(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The PASS/FAIL targets of one size's record: each predictive mask's time ratio against the baseline, and
    each method's peak extra memory (when measured)."""
    rows = [target(f"time {m} / {BASELINE}", record["time_ratio"][m], TIME_RATIO_MAX)
            for m in METHODS if m != BASELINE]
    return rows + [target(f"peak extra memory {m} (x logits)", record["peak_extra"][m], PEAK_EXTRA_MAX)
                   for m in METHODS if m in record["peak_extra"]]


def bench_size(tokens: int, *, vocab: int, topk: int, device: str, dtype: torch.dtype, repeats: int,
               memory: bool) -> dict[str, Any]:
    """Time, memory, closed-form errors and targets at one size (a JSON-ready record)."""
    x = make_inputs(tokens, vocab, topk, device=device, dtype=dtype)
    names = (REFERENCE, *METHODS)
    med = median_times({n: step_fn(n, x, vocab) for n in names}, repeats, x["logits"].device)
    unit = x["logits"].numel() * x["logits"].element_size()
    peak = {n: peak_extra_bytes(n, x, vocab, topk) / unit for n in names} if memory else {}
    record: dict[str, Any] = {
        "tokens": tokens, "vocab": vocab, "topk": topk, "logits_bytes": unit, "median_s": med,
        "time_ratio": {m: med[m] / med[BASELINE] for m in METHODS}, "peak_extra": peak,
        "closed_forms": closed_form_errors(x, vocab),
    }
    record["targets"] = targets(record)
    del x
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return record


def environment(device: str) -> dict[str, Any]:
    """What the numbers were measured on."""
    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__, "device": device,
                           "cpu_threads": torch.get_num_threads()}
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(device))
        env.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
    return env

