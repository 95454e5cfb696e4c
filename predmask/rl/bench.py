"""Steps/s and generated tokens/s of the CPU engine per model size, the rollout-vs-training mismatch of each
precision on a model's base policy, and the engine's speed against its previous path (measurements, not tests; run
by ``python scripts/benchmark.py engine``).

``bench_model`` builds the engine from ``conf/train.yaml`` (the cached base model; built on first use), times GRPO
steps (rollout + mini-batch updates + weight sync) and one validation, and projects the wall time of a
``trainer.steps`` run. ``measure_mismatch`` measures on the base policy, per precision, the mean / max top-K KL,
verl's sampled KL, the fraction of tokens with D > delta, and the rollout's probability mass outside the top-K (the
tail the estimators model). ``compare_rollouts`` and ``compare_runs`` time, in one process, the engine's path
against the previous one (``use_previous_path``: torch's own bf16 products instead of the matrix-product rule of
``predmask.precisions``, every sample's prompt prefilled apart, the exact tail computed for every method): rollouts
of a training batch and of a validation split per precision (median CPU seconds, old and new interleaved), and a
short run (GRPO steps and one validation) per setting; ``project_sweep`` projects a whole sweep (the main comparison)
from those runs, with and without the shared step-0 validation and the warm worker of local runs.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import torch
from omegaconf import DictConfig

from predmask import metrics as M
from predmask.bench import stopwatch
from predmask.config import compose, group_options
from predmask.precisions import CLUSTER_PRECISIONS
from predmask.rl.emulated_precision import make_rollout_model
from predmask.rl.engine import Engine
from predmask.rl.rollout import RolloutBatch
from predmask.rl.task import Problem, iter_train_prompts
from predmask.rl.train import due


def validations_per_run(trainer: Any) -> int:
    """The validations of a run of ``trainer`` (its config section), as ``predmask.rl.train`` schedules them: step
    0's (``val_before_train``), every ``val_every`` steps, and the last step's."""
    steps = int(trainer.steps)
    return int(trainer.val_before_train) + sum(due(s, int(trainer.val_every), steps) for s in range(1, steps + 1))


def bench_model(model: str, overrides: list[str], steps: int, warmup: int = 2) -> dict[str, float]:
    """Time ``steps`` GRPO steps (rollout + mini-batch updates + weight sync) and one validation of ``model``
    (the engine from ``conf/train.yaml``), and project the wall time of a ``trainer.steps`` run."""
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
    n_val = validations_per_run(t)
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
    """Per precision (default: the paper's, ``Precision.cluster``), on ``model``'s base policy (one rollout
    batch each): the mean / max top-K KL, verl's sampled KL, the fraction of tokens with D > delta, and the
    rollout's probability mass outside the top-K (the tail the estimators model)."""
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



def use_previous_path(engine: Engine) -> None:
    """Switch ``engine`` to the previous path (the module docstring)."""
    engine.rollout_model = make_rollout_model(engine.model, engine.precision, native_products=True)
    engine.prefill_once = False
    engine.tail_where_read = False


def _agreement(old: RolloutBatch, new: RolloutBatch) -> tuple[bool, float]:
    """Whether both paths sampled the same tokens, and the largest |Δ log mu| of the sampled tokens if so."""
    same = old.response_ids.shape == new.response_ids.shape and torch.equal(old.response_ids, new.response_ids)
    if not same:
        return False, float("nan")
    m = new.response_mask
    return True, float((old.sampled_logprobs - new.sampled_logprobs)[m].abs().max())


def _train_config(model: str, precision: str, overrides: list[str]) -> DictConfig:
    """The composed train config of ``model`` at ``precision``; a catalogue entry without a conf/precision option
    (fp32, the CPU reference) is selected by name."""
    if precision in group_options("precision"):
        chosen = [f"precision={precision}"]
    else:
        chosen = [f"precision.name={precision}", f"precision.label={precision.upper()}"]
    return compose("train", [f"model={model}", *chosen, *overrides])


def compare_rollouts(model: str, precisions: list[str], overrides: list[str],
                     repeats: int = 3) -> list[dict[str, float | str | bool]]:
    """Per precision: the rollout of one training batch and of one validation split (avg@val_n), previous path
    against this one, same seed; median CPU seconds over ``repeats`` interleaved repetitions."""
    rows: list[dict[str, float | str | bool]] = []
    for name in precisions:
        engine = Engine(_train_config(model, name, overrides), progress=True)
        roll = {"new": engine.rollout_model,
                "old": make_rollout_model(engine.model, engine.precision, native_products=True)}
        stream = iter_train_prompts(engine.task)
        train = [next(stream) for _ in range(engine.trainer_cfg.train_batch_size)]
        split, val = next(iter(engine.eval_problems.items()))
        cases: dict[str, tuple[list[Problem], int]] = {
            f"train batch ({len(train)} x {engine.rollout_cfg.n})": (train, engine.rollout_cfg.n),
            f"{split} ({len(val)} x {engine.trainer_cfg.val_n})": (val, engine.trainer_cfg.val_n),
        }
        for what, (problems, n) in cases.items():
            seconds: dict[str, list[float]] = {"old": [], "new": []}
            out: dict[str, RolloutBatch] = {}
            for _ in range(repeats):
                for path in ("old", "new"):
                    engine.rollout_model, engine.prefill_once = roll[path], path == "new"
                    with stopwatch() as t:  # n samples per problem from the current path, seed 0
                        out[path] = engine.sample(problems, n=n, generator=torch.Generator().manual_seed(0))
                    seconds[path].append(t["cpu"])
            old_s, new_s = statistics.median(seconds["old"]), statistics.median(seconds["new"])
            same, dlog = _agreement(out["old"], out["new"])
            rows.append({"model": model, "precision": name, "rollout": what, "old_s": old_s, "new_s": new_s,
                         "ratio": old_s / new_s, "same_tokens": same, "max_dlogmu": dlog})
    return rows


def _short_run(engine: Engine, steps: int) -> dict[str, float]:
    stream = iter_train_prompts(engine.task)
    with stopwatch() as t:
        for i in range(steps):
            problems = [next(stream) for _ in range(engine.trainer_cfg.train_batch_size)]
            m = engine.train_step(problems, torch.Generator().manual_seed(i))
    with stopwatch() as tv:
        val = engine.validate(0)
    return {"steps_cpu_s": t["cpu"], "val_cpu_s": tv["cpu"], "cpu_s": t["cpu"] + tv["cpu"],
            "wall_s": t["wall"] + tv["wall"], "score": m[M.SCORE_MEAN],
            "val": statistics.mean(v for k, v in val.items() if "/acc/mean@" in k)}


def compare_runs(settings: Sequence[str], overrides: list[str], steps: int = 4,
                 repeats: int = 3) -> list[dict[str, float | str]]:
    """Per setting (``conf/setting``, e.g. the main comparison's four): ``steps`` GRPO steps and one validation from
    the base model, previous path and this one (each from a fresh engine, whose build is timed too; same seeds;
    ``repeats`` interleaved repetitions); median CPU and wall seconds."""
    rows: list[dict[str, float | str]] = []
    for setting in settings:
        cfg = compose("train", [f"+setting={setting}", *overrides])
        base = Engine(cfg, progress=False).base_info  # untimed: pretrains the base model if the cache lacks it
        runs: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
        for _ in range(repeats):
            for path in ("old", "new"):
                with stopwatch() as build:
                    engine = Engine(cfg, progress=False)
                    if path == "old":
                        use_previous_path(engine)
                runs[path].append({**_short_run(engine, steps), "build_cpu_s": build["cpu"]})
        old, new = ({k: statistics.median(r[k] for r in runs[path]) for k in runs[path][0]} for path in ("old", "new"))
        rows.append({"setting": setting, "model": str(engine.model_cfg["name"]), "precision": engine.precision.name,
                     "method": str(cfg.method.name), "steps": float(steps), "ratio": old["cpu_s"] / new["cpu_s"],
                     "pretrain_s": float(base.get("pretrain_seconds", 0.0)),
                     **{f"old_{k}": v for k, v in old.items()}, **{f"new_{k}": v for k, v in new.items()}})
    return rows


def project_sweep(rows: Sequence[dict[str, float | str]], *, start_up_s: float, worker_start_s: float,
                  methods: int = 4, seeds: int = 3, steps: int = 60, validations: int = 5,
                  slots: int = 2) -> list[dict[str, float | str]]:
    """A sweep's projected time from :func:`compare_runs`'s rows (one per setting; each setting run by ``methods`` x
    ``seeds`` runs of ``steps`` steps and ``validations`` validations, step 0's included), step by step from the
    previous path to this engine with the shared step-0 validation and the warm worker: per-run CPU seconds summed
    (process start-up ``start_up_s``, engine build, steps, validations), then divided over ``slots``
    single-thread slots. The base models' pretraining (once per model) is beside it."""
    def total(path: str, shared_val: bool, worker: bool) -> float:
        out = start_up_s if worker else 0.0  # the worker imports once
        for r in rows:
            run_s = (float(r[f"{path}_build_cpu_s"]) + float(r[f"{path}_steps_cpu_s"]) * steps / float(r["steps"])
                     + (validations - 1) * float(r[f"{path}_val_cpu_s"]))
            step0 = float(r[f"{path}_val_cpu_s"]) * (seeds if shared_val else methods * seeds)
            out += methods * seeds * (run_s + (worker_start_s if worker else start_up_s)) + step0
        return out

    stages = [("previous path, a process per run", "old", False, False),
              ("this engine, a process per run", "new", False, False),
              ("+ step-0 validation shared across methods", "new", True, False),
              ("+ warm worker (imports once)", "new", True, True)]
    first = total("old", False, False)
    pretrain = sum({str(r["model"]): float(r["pretrain_s"]) for r in rows}.values())
    return [{"stage": name, "cpu_min": total(path, shared, worker) / 60,
             "wall_min": total(path, shared, worker) / 60 / slots, "ratio": first / total(path, shared, worker),
             "base_models_min": pretrain / 60} for name, path, shared, worker in stages]
