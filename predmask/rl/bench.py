"""Steps/s and generated tokens/s of the CPU engine per model size, and the rollout-vs-training mismatch of each
precision on a model's base policy (measurements, not tests; run by ``python scripts/benchmark.py engine``).

``bench_model`` builds the engine from ``conf/train.yaml`` (the cached base model; built on first use), times GRPO
steps (rollout + mini-batch updates + weight sync) and one validation, and projects the wall time of a
``trainer.steps`` run. ``measure_mismatch`` measures on the base policy, per precision, the mean / max top-K KL,
verl's sampled KL, the fraction of tokens with D > delta, and the rollout's probability mass outside the top-K (the
tail the estimators model).
"""

from __future__ import annotations

import torch

from predmask import metrics as M
from predmask.bench import stopwatch
from predmask.config import compose
from predmask.precisions import CLUSTER_PRECISIONS
from predmask.rl.engine import Engine
from predmask.rl.task import iter_train_prompts

__all__ = ["bench_model", "measure_mismatch"]


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
        with stopwatch() as step:
            m = engine.train_step(problems, torch.Generator().manual_seed(i))
        if i >= warmup:
            total += step["wall"]
            gen_s += m[M.TIMING_GEN]
            upd_s += m[M.TIMING_UPDATE_ACTOR]
            tokens += m[M.PERF_TOTAL_NUM_TOKENS]
    with stopwatch() as val:
        engine.validate(0)
    val_s = val["wall"]
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

