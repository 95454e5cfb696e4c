"""The benchmark's switch back to the engine's previous path (predmask.rl.bench.use_previous_path)."""

from __future__ import annotations

import torch
from rl_helpers import peaked_policy

from predmask.methods import MethodParams, get_method
from predmask.precisions import get_precision
from predmask.rl.bench import use_previous_path
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
