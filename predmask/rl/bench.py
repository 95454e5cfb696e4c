"""`python -m predmask.rl.bench`: steps/s and generated tokens/s of the CPU engine per model size (not a test).

For each model (default: cpu_s, cpu_m, cpu_moe) it builds the engine from ``conf/train.yaml`` (the cached base
model; built on first use), times ``--steps`` GRPO steps (rollout + mini-batch updates + weight sync) and one
validation, and prints a rich table: parameters, s/step, steps/s, generated tokens/s of the rollout, training
tokens/s, validation seconds, and the projected wall time of a ``trainer.steps`` run. One torch thread unless
``--threads``. Extra arguments are Hydra overrides for every model (e.g. ``precision=fp8_e2e``).

``--mismatch`` instead measures, on each model's base policy, the rollout-vs-training mismatch of every precision
(mean / max top-K KL, verl's sampled KL, fraction of tokens with D > delta) and the rollout's probability mass
outside the top-K (the tail the estimators model), over ``--sequences`` sampled training responses.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from rich.console import Console
from rich.table import Table

from predmask import metrics as M
from predmask.config import compose
from predmask.precisions import CLUSTER_PRECISIONS
from predmask.rl.engine import Engine
from predmask.rl.task import iter_train_prompts

__all__ = ["bench_model", "main"]


def bench_model(model: str, overrides: list[str], steps: int, warmup: int = 2) -> dict[str, float]:
    """Time ``steps`` GRPO steps and one validation of ``model``; returns the measurements."""
    cfg = compose("train", [f"model={model}", *overrides])
    engine = Engine(cfg, progress=True)
    stream = iter_train_prompts(engine.task)
    t = engine.trainer_cfg
    gen_s = upd_s = total = 0.0
    tokens = 0.0
    for i in range(warmup + steps):
        problems = [next(stream) for _ in range(t.train_batch_size)]
        t0 = time.perf_counter()
        m = engine.train_step(problems, torch.Generator().manual_seed(i))
        dt = time.perf_counter() - t0
        if i >= warmup:
            total += dt
            gen_s += m[M.TIMING_GEN]
            upd_s += m[M.TIMING_UPDATE_ACTOR]
            tokens += m[M.PERF_TOTAL_NUM_TOKENS]
    t0 = time.perf_counter()
    engine.validate(0)
    val_s = time.perf_counter() - t0
    n_val = (t.steps // t.val_every if t.val_every else 0) + 1 + int(t.val_before_train)
    return {
        "params": float(engine.n_parameters),
        "s_per_step": total / steps,
        "steps_per_s": steps / total,
        "gen_tokens_per_s": tokens / gen_s,
        "train_tokens_per_s": tokens / upd_s,
        "val_s": val_s,
        "run_s": t.steps * total / steps + n_val * val_s,
        "run_steps": float(t.steps),
    }


@torch.no_grad()
def measure_mismatch(model: str, overrides: list[str], sequences: int,
                     precisions: tuple[str, ...] | None = None) -> list[dict[str, float | str]]:
    """Mismatch and top-K tail mass of each precision (default: the paper's, ``Precision.cluster``) on ``model``'s
    base policy (one rollout batch each)."""
    from predmask.divergence import topk_divergence
    from predmask.rl.algo import mismatch_metrics

    rows: list[dict[str, float | str]] = []
    for name in precisions or CLUSTER_PRECISIONS:
        engine = Engine(compose("train", [f"model={model}", f"precision={name}", *overrides]), progress=True)
        n = engine.rollout_cfg.n
        stream = iter_train_prompts(engine.task)
        problems = [next(stream) for _ in range(max(1, sequences // n))]
        batch = engine.sample(problems, generator=torch.Generator().manual_seed(0))
        support = batch.support()
        lp = engine.train_logprobs(batch, support)
        mm = mismatch_metrics(batch, support, lp.pi)
        d = topk_divergence(support.mu_logprobs, lp.pi, support.valid)[batch.response_mask]
        tail = (1.0 - batch.topk_logprobs.exp().sum(-1)).clamp_min(0.0)[batch.response_mask]
        rows.append({
            "model": model, "precision": name, "tokens": float(d.numel()),
            "topk_kl_mean": mm[M.MISMATCH_TOPK_KL], "topk_kl_max": mm[M.MISMATCH_TOPK_KL_MAX],
            "sampled_kl": mm[M.MISMATCH_KL], "frac_outside": float((d > engine.params.delta).float().mean()),
            "tail_mean": float(tail.mean()), "tail_median": float(tail.median()),
            "tail_p90": float(tail.quantile(0.9)), "tail_frac_gt_1e-3": float((tail > 1e-3).float().mean()),
        })
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="cpu_s,cpu_m,cpu_moe", help="comma-separated conf/model names")
    parser.add_argument("--steps", type=int, default=10, help="timed GRPO steps per model (after 2 warm-up steps)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--mismatch", action="store_true",
                        help="measure the rollout-vs-training mismatch of each precision and the top-K tail mass")
    parser.add_argument("--sequences", type=int, default=512, help="sampled sequences per precision (--mismatch)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides applied to every model")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    torch.set_num_threads(args.threads)
    if args.mismatch:
        _print_mismatch(args)
        return
    table = Table(title=f"predmask.rl CPU engine benchmark ({args.threads} thread(s); {' '.join(args.overrides)})")
    for col in ("model", "params", "s/step", "steps/s", "gen tok/s", "train tok/s", "val s", "run s (projected)"):
        table.add_column(col, justify="right")
    for model in [m for m in args.models.split(",") if m]:
        r = bench_model(model, list(args.overrides), args.steps)
        table.add_row(model, f"{int(r['params']):,}", f"{r['s_per_step']:.3f}", f"{r['steps_per_s']:.2f}",
                      f"{r['gen_tokens_per_s']:,.0f}", f"{r['train_tokens_per_s']:,.0f}", f"{r['val_s']:.2f}",
                      f"{r['run_s']:.0f} ({int(r['run_steps'])} steps)")
    Console(width=None if sys.stdout.isatty() else 200).print(table)


def _print_mismatch(args: argparse.Namespace) -> None:
    table = Table(title="rollout vs training mismatch on the base policy (CPU emulation of the precisions)")
    cols = ("model", "precision", "tokens", "topk_kl_mean", "topk_kl_max", "sampled_kl", "frac_outside",
            "tail_mean", "tail_median", "tail_p90", "tail_frac_gt_1e-3")
    for col in cols:
        table.add_column(col, justify="right")
    for model in [m for m in args.models.split(",") if m]:
        for row in measure_mismatch(model, list(args.overrides), args.sequences):
            table.add_row(*[v if isinstance(v, str) else (f"{int(v)}" if c == "tokens" else f"{v:.3g}")
                            for c, v in ((c, row[c]) for c in cols)])
    Console(width=None if sys.stdout.isatty() else 200).print(table)


if __name__ == "__main__":
    main()
