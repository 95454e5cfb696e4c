"""verl 0.9.1's real ``RayPPOTrainer.fit`` step with the plugin on: a rollout-anchored method skips the old-log-prob
actor forward, GRPO clip-higher (anchored on pi_old) keeps it.

The trainer is verl's own class and its training step runs as verl wrote it (one step of ``fit``: generation,
reward, old log-probs, advantages, actor update, metrics), on verl's own ``ppo_trainer`` config composed with Hydra.
Built with ``__new__`` and the attributes ``fit`` reads, because ``__init__`` builds Ray worker groups. Stand-ins,
for what needs a GPU, vLLM or Ray: the rollout manager (returns a generated batch with vLLM's rollout log-probs
mu), the checkpoint manager (weight sync to vLLM) and the actor worker group, which records every call: its
``compute_log_prob`` answers a fixed log-prob pi_old = -0.5 per token (the real worker's forward is checked in
tests/verl/test_verl_worker_cpu.py), its ``update_actor`` keeps the batch it is given.

Truth: the calls the trainer made, the ``old_log_probs`` the actor update received (the rollout's mu when the
forward is skipped, the forward's -0.5 when it runs), and the metrics verl's ``fit`` hands its trackers (verl's
``Tracking``, replaced by a recorder): those comparing pi_old with mu are absent when the forward is skipped and
computed from -0.5 and mu when it runs.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar
from unittest import mock

import numpy as np
import pytest
import torch
from verl_helpers import padded_batch, require_verl

require_verl("verl.trainer.ppo.ray_trainer")

import predmask.verl.plugin
from predmask.verl.settings import SETTINGS_ENV, PluginSettings
from predmask.verl.trainer_hook import old_log_prob_readers

pytestmark = pytest.mark.verl

PROMPTS, N, WIDTH_P, WIDTH_R = 2, 2, 5, 6
PI_OLD = -0.5


@pytest.fixture(scope="module")
def compose():
    """verl's ppo_trainer config composed with Hydra (as main_ppo does), resolved."""
    import verl
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")

    def run(overrides: list[str]) -> Any:
        GlobalHydra.instance().clear()
        initialize_config_dir(config_dir=config_dir, version_base=None)
        cfg = hydra_compose(config_name="ppo_trainer", overrides=overrides)
        OmegaConf.resolve(cfg)
        return cfg

    yield run
    GlobalHydra.instance().clear()


def trainer_config(compose: Any, method: str, *extra: str) -> Any:
    return compose([
        f"actor_rollout_ref.actor.policy_loss.loss_mode={method}", "algorithm.adv_estimator=grpo",
        f"actor_rollout_ref.rollout.n={N}", "actor_rollout_ref.rollout.calculate_log_probs=true",
        "trainer.logger=[console]", "trainer.val_before_train=false", "trainer.test_freq=-1",
        "trainer.save_freq=-1", "trainer.balance_batch=false", "trainer.resume_mode=disable",
        "trainer.total_epochs=1", *extra])


class RecordingActor:
    """The actor worker group: records the trainer's calls (a GPU and Ray are what the real one needs)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.old_log_probs: torch.Tensor | None = None

    def compute_log_prob(self, td: Any) -> Any:
        from verl.utils import tensordict_utils as tu

        self.calls.append("compute_log_prob")
        values = td["input_ids"].values()
        return tu.get_tensordict({"log_probs": torch.full(values.shape, PI_OLD),
                                  "entropy": torch.full(values.shape, 1.25)}, {"metrics": {"mfu": 0.5}})

    def update_actor(self, td: Any) -> Any:
        from verl.utils import tensordict_utils as tu

        self.calls.append("update_actor")
        old = td["old_log_probs"]
        self.old_log_probs = (old.to_padded_tensor(0.0) if old.is_nested else old).clone()
        return tu.get_tensordict({"dummy": torch.zeros(1)}, {"metrics": {"mfu": 0.1, "pg_loss": 0.0}})


class FakeRollout:
    """The rollout manager: answers every prompt N times with fixed responses, vLLM's mu and a reward (vLLM is not
    installed here)."""

    def __init__(self) -> None:
        prompts, responses, attention = padded_batch([3, 5, 4, 2], [6, 2, 4, 5], WIDTH_P, WIDTH_R, seed=3)
        g = torch.Generator().manual_seed(4)
        response_mask = attention[:, WIDTH_P:].clone()
        self.mu = (-torch.rand(PROMPTS * N, WIDTH_R, generator=g) * 3) * response_mask
        self.tensors = {
            "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": attention, "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
            "response_mask": response_mask, "rollout_log_probs": self.mu,
            "rm_scores": torch.zeros(PROMPTS * N, WIDTH_R).index_fill_(1, torch.tensor([0]), 1.0)
            * torch.tensor([1.0, 0.0, 0.0, 1.0])[:, None],
        }

    def generate_sequences(self, gen_batch: Any) -> Any:
        from verl import DataProto

        non_tensors = {**gen_batch.non_tensor_batch,
                       "multi_modal_inputs": np.array([{} for _ in range(len(gen_batch))], dtype=object)}
        return DataProto.from_dict(tensors=dict(self.tensors), non_tensors=non_tensors, meta_info={"timing": {}})


#: the prefixes of verl's metrics that compare pi_old with mu (its rollout correction's, its debug metrics')
PI_OLD_VS_MU = ("rollout_corr/", "training/rollout_probs_diff_", "training/rollout_actor_probs_pearson_corr")


class RecordingTracking:
    """verl's ``Tracking`` (the trackers): keeps what ``fit`` logs (W&B, files and consoles are not the point)."""

    logged: ClassVar[list[dict[str, Any]]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        RecordingTracking.logged = []

    def log(self, data: dict[str, Any], step: int, backend: Any = None) -> None:
        RecordingTracking.logged.append(dict(data))


def one_step(config: Any) -> tuple[RecordingActor, FakeRollout, dict[str, Any]]:
    """One step of verl's ``RayPPOTrainer.fit``; the actor's record, the rollout and the step's logged metrics."""
    predmask.verl.plugin.install()
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    trainer = RayPPOTrainer.__new__(RayPPOTrainer)
    actor, rollout = RecordingActor(), FakeRollout()
    trainer.config, trainer.tokenizer, trainer.processor = config, None, None
    trainer.use_rm = trainer.use_reference_policy = trainer.use_critic = False
    trainer.actor_rollout_wg, trainer.async_rollout_manager = actor, rollout
    trainer.checkpoint_manager = SimpleNamespace(update_weights=lambda step: None, sleep_replicas=lambda: None)
    trainer.resource_pool_manager = SimpleNamespace(get_n_gpus=lambda: 1)
    trainer.train_dataloader = [{"dummy": torch.zeros(PROMPTS, 1),
                                 "data_source": np.array(["math"] * PROMPTS, dtype=object)}]
    trainer.total_training_steps, trainer.train_dataset = 1, None
    trainer._init_dump_executor()
    with mock.patch("verl.utils.tracking.Tracking", RecordingTracking):
        trainer.fit()
    (metrics,) = RecordingTracking.logged
    return actor, rollout, metrics


def pi_old_vs_mu(metrics: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in metrics.items() if name.startswith(PI_OLD_VS_MU)}


def test_the_hook_is_installed_when_verl_imports_the_trainer() -> None:
    predmask.verl.plugin.install()
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    assert getattr(RayPPOTrainer._compute_old_log_prob, "_predmask_skip", False)


def test_a_divergence_method_skips_the_forward_and_anchors_on_mu(compose, monkeypatch) -> None:
    monkeypatch.setenv(SETTINGS_ENV, PluginSettings(top_k=4).to_json())
    actor, rollout, metrics = one_step(trainer_config(compose, "dppo_topk_kl"))
    assert actor.calls == ["update_actor"]
    assert torch.equal(actor.old_log_probs, rollout.mu)
    assert pi_old_vs_mu(metrics) == {}  # mu against itself (kl 0, ppl_ratio 1) is not logged
    assert "critic/score/mean" in metrics and "actor/pg_loss" in metrics  # the step's other metrics are


def test_grpo_clip_higher_keeps_the_forward(compose, monkeypatch) -> None:
    monkeypatch.setenv(SETTINGS_ENV, PluginSettings(top_k=4).to_json())
    actor, rollout, metrics = one_step(trainer_config(compose, "grpo_clip_higher"))
    assert actor.calls == ["compute_log_prob", "update_actor"]
    mask = rollout.tensors["response_mask"].bool()
    assert torch.equal(actor.old_log_probs[mask], torch.full((int(mask.sum()),), PI_OLD))
    measured = pi_old_vs_mu(metrics)  # verl's own comparison of the forward's pi_old with mu
    kl = float((rollout.mu[mask] - PI_OLD).mean())
    assert measured["rollout_corr/kl"] == pytest.approx(kl, rel=1e-5) and abs(kl) > 0.1
    assert measured["rollout_corr/ppl_ratio"] != pytest.approx(1.0) and measured["rollout_corr/chi2_token"] > 0
    assert {"rollout_corr/k3_kl", "training/rollout_probs_diff_mean"} <= set(measured)


def test_anchor_old_keeps_the_forward_for_a_divergence_method(compose, monkeypatch) -> None:
    monkeypatch.setenv(SETTINGS_ENV, PluginSettings(top_k=4, anchor="old").to_json())
    actor, _, metrics = one_step(trainer_config(compose, "predmask_kl_agg"))
    assert actor.calls == ["compute_log_prob", "update_actor"]
    assert "rollout_corr/kl" in metrics


def test_the_readers_of_the_forward_are_named(compose) -> None:
    """Every other reader of old_log_probs keeps the forward, with the reason."""
    rollout = PluginSettings(top_k=4)
    assert old_log_prob_readers(trainer_config(compose, "dppo_topk_kl"), rollout) == []
    assert old_log_prob_readers(trainer_config(compose, "vanilla"), rollout) == [
        "the policy loss 'vanilla' is verl's own (it reads old_log_probs)"]
    kl = old_log_prob_readers(trainer_config(compose, "dppo_topk_kl", "algorithm.use_kl_in_reward=true"), rollout)
    assert kl == ["algorithm.use_kl_in_reward=true (the KL penalty reads old_log_probs)"]
    sq = old_log_prob_readers(trainer_config(
        compose, "dppo_topk_kl", "actor_rollout_ref.actor.calculate_sum_pi_squared=true"), rollout)
    assert len(sq) == 1 and "calculate_sum_pi_squared" in sq[0]
    for key, value in (("rollout_is", "token"), ("rollout_rs", "token_k1")):
        corrected = old_log_prob_readers(trainer_config(
            compose, "dppo_topk_kl", f"algorithm.rollout_correction.{key}={value}"), rollout)
        assert corrected == [f"algorithm.rollout_correction.{key}={value} (it weighs or rejects by pi_old / mu)"]


def test_a_skipped_forward_without_rollout_log_probs_says_what_to_set(compose, monkeypatch) -> None:
    monkeypatch.setenv(SETTINGS_ENV, PluginSettings(top_k=4).to_json())
    config = trainer_config(compose, "dppo_topk_kl")
    original = FakeRollout.generate_sequences

    def without_mu(self: FakeRollout, gen_batch: Any) -> Any:
        out = original(self, gen_batch)
        out.batch.pop("rollout_log_probs")
        return out

    monkeypatch.setattr(FakeRollout, "generate_sequences", without_mu)
    with pytest.raises(ValueError, match="rollout.calculate_log_probs=true"):
        one_step(config)
