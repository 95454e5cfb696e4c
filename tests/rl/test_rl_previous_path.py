"""The benchmark's switch back to the engine's previous path (predmask.rl.bench.use_previous_path) and its sweep
projection (project_sweep, validations_per_run)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from rl_helpers import peaked_policy

from predmask.methods import MethodParams, get_method
from predmask.precisions import get_precision
from predmask.rl.bench import project_sweep, use_previous_path, validations_per_run
from predmask.rl.emulated_precision import RoundedLinear, make_rollout_model
from predmask.rl.engine import Engine
from predmask.rl.task import make_split
from predmask.schemas.task_schema import TaskConfig
from predmask.schemas.train_schema import RolloutConfig, TrainerConfig


def test_the_previous_path_uses_torchs_products_per_row_prefill_and_the_tail_always(tokenizer, monkeypatch) -> None:
    """An engine assembled from its parts (a full Engine pretrains a base model): after the switch its rollout
    model has no RoundedLinear, every sample's prompt is prefilled apart and the update asks for the exact tail
    even for a method that does not read it."""
    from predmask.rl import algo, rollout

    engine = Engine.__new__(Engine)
    engine.model = peaked_policy(tokenizer, scale=6.0).train()
    engine.precision, engine.tokenizer, engine.top_k = get_precision("bf16"), tokenizer, 20
    engine.rollout_cfg, engine.trainer_cfg = RolloutConfig(n=4, response_length=8), TrainerConfig.from_mapping({})
    engine.method, engine.params = get_method("dppo_topk_kl"), MethodParams(vocab_size=tokenizer.vocab_size)
    engine.optimizer = torch.optim.SGD(engine.model.parameters(), lr=1e-3)
    engine.rollout_model = make_rollout_model(engine.model, engine.precision)
    engine.prefill_once, engine.tail_where_read = True, True
    prefill_rows: list[int] = []
    real_generate = rollout.generate

    def spy_generate(model, prompt_ids, *args, **kwargs):
        prefill_rows.append(int(prompt_ids.shape[0]))
        return real_generate(model, prompt_ids, *args, **kwargs)

    asked: list[bool] = []
    real_gather = algo.gather_support_logprobs

    def spy_gather(*args, **kwargs):
        asked.append(bool(kwargs.get("return_tail_sq", False)))
        return real_gather(*args, **kwargs)

    monkeypatch.setattr(rollout, "generate", spy_generate)
    monkeypatch.setattr(algo, "gather_support_logprobs", spy_gather)
    problems = make_split(TaskConfig(), "train", 6)
    batches = []
    for previous in (False, True):
        if previous:
            use_previous_path(engine)
        assert any(isinstance(m, RoundedLinear) for m in engine.rollout_model.modules()) is not previous
        b = engine.sample(problems, generator=torch.Generator().manual_seed(1))
        engine.update(b, b.support(), torch.linspace(-1, 1, b.batch_size))
        batches.append(b)
    assert prefill_rows == [6, 24]
    assert asked == [False, True]
    assert all(b.batch_size == 24 for b in batches)


def test_the_sweep_projection_counts_each_runs_parts_by_hand() -> None:
    """``project_sweep`` on one made-up setting (2 methods x 3 seeds, 10 steps, 3 validations per run, 2 slots),
    against the sums written out: each run pays its start-up, engine build, steps and validations; the shared step-0
    validation is paid once per seed; the worker imports once and each run pays only its child's start-up."""
    row = {"setting": "s", "model": "m", "steps": 2.0, "pretrain_s": 90.0}
    row.update({"old_build_cpu_s": 1.0, "old_steps_cpu_s": 4.0, "old_val_cpu_s": 3.0,
                "new_build_cpu_s": 1.0, "new_steps_cpu_s": 2.0, "new_val_cpu_s": 1.5})
    stages = project_sweep([row], start_up_s=6.0, worker_start_s=0.5, methods=2, seeds=3, steps=10, validations=3,
                           slots=2)
    old = 6 * (6.0 + 1.0 + 4.0 * 5 + 3 * 3.0)                   # 216 s
    new = 6 * (6.0 + 1.0 + 2.0 * 5 + 3 * 1.5)                   # 129 s
    shared = 6 * (6.0 + 1.0 + 2.0 * 5 + 2 * 1.5) + 3 * 1.5      # 124.5 s
    warm = 6.0 + 6 * (0.5 + 1.0 + 2.0 * 5 + 2 * 1.5) + 3 * 1.5  # 97.5 s
    assert [round(s["cpu_min"] * 60, 6) for s in stages] == [old, new, shared, warm]
    assert [round(s["wall_min"] * 60, 6) for s in stages] == [old / 2, new / 2, shared / 2, warm / 2]
    assert [round(s["ratio"], 6) for s in stages] == [1.0, round(old / new, 6), round(old / shared, 6),
                                                       round(old / warm, 6)]
    assert stages[0]["base_models_min"] == 1.5


@pytest.mark.parametrize(("steps", "every", "before", "expected"), [
    (60, 15, True, 5),   # step 0, 15, 30, 45, 60
    (10, 4, True, 4),    # step 0, 4, 8, and the last step, 10
    (10, 4, False, 3),
    (7, 0, True, 2),     # no periodic validation: step 0 and the last step
])
def test_validations_per_run_counts_the_trainers_schedule(steps: int, every: int, before: bool, expected: int) -> None:
    trainer = SimpleNamespace(steps=steps, val_every=every, val_before_train=before)
    assert validations_per_run(trainer) == expected
