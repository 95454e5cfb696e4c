"""Benchmark: loss forward+backward time and peak memory of the predictive mask against DPPO-TopK-KL.

    python -m predmask.bench [--tokens 4096] [--vocab 32000] [--topk 20] [--repeats 7]

Every method runs the whole path a trainer runs: gather the training log-probs on the support from the
logits (log-sum-exp), the masked loss, and the backward pass to the logits. Timings interleave the methods in
one process (median of the repeats); peak memory is measured per method in a fresh subprocess (peak RSS above
the inputs), in units of one [tokens, vocab] float32 tensor. The last line is the ratio the project tracks.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable

import torch

from predmask.methods import MethodParams, policy_loss
from predmask.support import build_support, gather_support_logprobs

METHODS = ("dppo_topk_kl", "predmask_kl_agg", "predmask_kl_uniform")
REFERENCE = "log_softmax_gather"  # the plain sampled-token loss: log_softmax over the vocabulary, gathered


def make_inputs(tokens: int, vocab: int, topk: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, vocab, generator=g) * 2.0
    # the rollout distribution: the same logits, perturbed (a stand-in for precision mismatch)
    mu_lp = torch.log_softmax(logits + 0.3 * torch.randn(tokens, vocab, generator=g), -1)
    sampled = torch.multinomial(mu_lp.exp(), 1, generator=g).squeeze(-1)
    top = mu_lp.topk(topk, -1)
    sup = build_support(top.indices, top.values, sampled, mu_lp.gather(-1, sampled[:, None]).squeeze(-1))
    adv = torch.randn(tokens, generator=g)
    return {"logits": logits, "ids": sup.ids, "mu": sup.mu_logprobs, "valid": sup.valid,
            "sampled_index": sup.sampled_index, "sampled": sampled, "adv": adv}


def step_fn(name: str, x: dict[str, torch.Tensor], vocab: int) -> Callable[[], None]:
    """One forward+backward of ``name`` on the inputs (batch of 1 sequence x tokens)."""
    params = MethodParams(delta=0.05, vocab_size=vocab)
    mask = torch.ones(1, x["adv"].shape[0], dtype=torch.bool)
    old = x["mu"].gather(-1, x["sampled_index"][:, None]).squeeze(-1)[None]

    def reference() -> None:
        z = x["logits"].detach().requires_grad_()
        lp = torch.log_softmax(z, -1).gather(-1, x["sampled"][:, None]).squeeze(-1)
        loss = -(x["adv"] * (lp - old[0]).exp().detach() * lp).mean()
        loss.backward()

    def method() -> None:
        z = x["logits"].detach().requires_grad_()
        pi = gather_support_logprobs(z, x["ids"], x["valid"])
        log_prob = pi.gather(-1, x["sampled_index"][:, None]).squeeze(-1)
        loss, _ = policy_loss(name, log_prob=log_prob[None], old_log_prob=old, advantages=x["adv"][None],
                              response_mask=mask, mu_logprobs=x["mu"][None], pi_logprobs=pi[None],
                              valid=x["valid"][None], sampled_index=x["sampled_index"][None], params=params)
        loss.backward()

    return reference if name == REFERENCE else method


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


def _peak_child(name: str, tokens: int, vocab: int, topk: int, out: mp.Queue) -> None:
    torch.set_num_threads(1)
    x = make_inputs(tokens, vocab, topk)
    fn = step_fn(name, x, vocab)
    _reset_peak_rss()
    base = _status_kib("VmRSS")
    fn()
    out.put(max(0, _status_kib("VmHWM") - base) * 1024)


def peak_extra_memory(name: str, tokens: int, vocab: int, topk: int) -> int:
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    p = ctx.Process(target=_peak_child, args=(name, tokens, vocab, topk, q))
    p.start()
    value = q.get(timeout=600)
    p.join()
    return int(value)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m predmask.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--topk", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--no-memory", action="store_true", help="skip the per-method peak-memory subprocesses")
    ap.add_argument("--json", action="store_true", help="also print the results as one JSON line")
    args = ap.parse_args(argv)

    x = make_inputs(args.tokens, args.vocab, args.topk)
    names = (REFERENCE, *METHODS)
    fns = {n: step_fn(n, x, args.vocab) for n in names}
    for fn in fns.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(args.repeats):
        for n in names:  # interleaved, so machine noise hits every method alike
            t0 = time.perf_counter()
            fns[n]()
            times[n].append(time.perf_counter() - t0)
    med = {n: statistics.median(v) for n, v in times.items()}
    unit = args.tokens * args.vocab * 4
    print(f"predmask.bench: {args.tokens} tokens, vocab {args.vocab}, K={args.topk}, CPU threads "
          f"{torch.get_num_threads()}, median of {args.repeats}")
    mem: dict[str, float] = {}
    for n in names:
        line = f"  {n:22s} fwd+bwd {med[n] * 1e3:8.1f} ms"
        if not args.no_memory:
            mem[n] = peak_extra_memory(n, args.tokens, args.vocab, args.topk) / unit
            line += f"   peak extra memory {mem[n]:5.2f} x [tokens, vocab] fp32"
        print(line)
    if args.json:
        print(json.dumps({"median_s": med, "peak_extra_tv_units": mem}))
    print(f"predmask_kl_agg / dppo_topk_kl loss time ratio: {med['predmask_kl_agg'] / med['dppo_topk_kl']:.2f}")


if __name__ == "__main__":
    main()
