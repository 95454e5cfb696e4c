"""Top-K plumbing inside verl: the packed layout against verl's own padding code, records through verl's batch
path, verl's FSDP engine calling the loss wrapper, the worker hook and the rollout hook.

Truth is independent of the code under test: verl's own ``no_padding_2_padding`` (alignment), a tiny transformers
model's padded forward and ``log_softmax`` (gather), ``predmask.policy_loss`` on directly computed inputs (loss).
Mocked only what cannot exist here: vLLM (its ``Logprob`` entries and ``AsyncLLM`` engine -- vLLM cannot be
installed on the CPU machines; the real thing runs in scripts/gpu_check.py) and the GPU (the FSDP engine's
``forward_step`` is replayed with its real ``prepare_model_inputs`` / ``prepare_model_outputs`` on CPU). The
verl-free functions have their own tests (test_verl_topk_pure.py, also run without verl: test_verl_free.py).
"""

from __future__ import annotations

import asyncio
import json
import math
from functools import partial
from types import MethodType, ModuleType, SimpleNamespace

import numpy as np
import pytest
import torch
from verl_helpers import padded_batch, require_verl, tiny_causal_lm, vllm_position

require_verl("verl.workers.engine_workers")

import predmask
import predmask.verl.plugin  # installs the hooks, as in every verl process of a run
from predmask.verl import rollout_hook, worker
from predmask.verl.loss_stats import LossStatsWriter
from predmask.verl.packing import (
    pack_response_tensor,
    packed_response_index,
    sequence_lengths,
    support_from_records,
)
from predmask.verl.records import TOPK_KEY, parse_vllm_logprobs
from predmask.verl.settings import SETTINGS_ENV
from predmask.verl.topk_loss import PI_KEY_PREFIX, PI_TAIL_KEY, TopKPolicyLoss

pytestmark = pytest.mark.verl


@pytest.fixture
def settings(monkeypatch):
    """predmask's settings of this process, as the launcher sets them (``settings(delta=0.05, top_k=6)``)."""
    def set_(**values):
        monkeypatch.setenv(SETTINGS_ENV, json.dumps(values))
    return set_


# --------------------------------------------------------------------------------------------------------------
# Packed alignment, against verl's own no_padding_2_padding
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("plens", "rlens"), [([3, 1, 5], [4, 6, 1]), ([2], [2]), ([1, 1], [0, 3])])
def test_packed_index_agrees_with_verl_no_padding_2_padding(plens, rlens) -> None:
    from tensordict import TensorDict
    from verl.workers.utils.padding import no_padding_2_padding

    prompts, responses, attention = padded_batch(plens, rlens, 5, 6)
    data = TensorDict({"prompts": prompts, "responses": responses, "attention_mask": attention}, batch_size=len(plens))
    total = sum(plens) + sum(rlens)
    values = torch.randn(total, 3)
    theirs = no_padding_2_padding(values, data)  # [B, 6, 3]: verl's "left-shift by one" response slice
    rows, bidx, pidx = packed_response_index(torch.tensor(plens), torch.tensor(rlens))
    assert torch.equal(theirs[bidx, pidx], values[rows])
    # pack then unpack is the identity on response tokens
    x = torch.randn(len(plens), 6, 3)
    back = no_padding_2_padding(pack_response_tensor(x, torch.tensor(plens), torch.tensor(rlens)), data)
    assert torch.equal(back[bidx, pidx], x[bidx, pidx])
    p_lens, r_lens = sequence_lengths(prompts, responses, attention)
    assert p_lens.tolist() == plens and r_lens.tolist() == rlens


# --------------------------------------------------------------------------------------------------------------
# The records travel in verl's DataProto -> TensorDict -> micro-batch path
# --------------------------------------------------------------------------------------------------------------


def verl_micro_batch(model: torch.nn.Module, plens, rlens, *, k: int, temperature: float, seed: int = 0,
                     remove_padding: bool = False, loss_mode: str = "predmask_kl_exact"):
    """A micro-batch built exactly as verl's trainer/worker do (DataProto.to_tensordict, left_right_2_no_padding,
    the flags of RayPPOTrainer._update_actor), with records sampled from perturbed model distributions."""
    from tensordict import TensorDict
    from verl import DataProto
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    g = torch.Generator().manual_seed(seed)
    width_p, width_r = max(plens), max(rlens)
    prompts, responses, attention = padded_batch(plens, rlens, width_p, width_r, seed=seed)
    input_ids = torch.cat([prompts, responses], 1)
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention, position_ids=position_ids).logits
    records = []
    for b, r in enumerate(rlens):
        rows = logits[b, width_p - 1: width_p - 1 + r] / temperature
        mu = torch.log_softmax(rows + 0.5 * torch.randn(rows.shape, generator=g), -1)  # a "rollout engine" mu
        tokens = responses[b, :r].tolist()
        records.append(parse_vllm_logprobs([vllm_position(mu[t], tokens[t], k) for t in range(r)], tokens, k))
    objs = np.empty(len(records), dtype=object)
    objs[:] = records
    batch = TensorDict({
        "prompts": prompts, "responses": responses, "input_ids": input_ids, "attention_mask": attention,
        "position_ids": position_ids, "response_mask": attention[:, width_p:].clone(),
        "old_log_probs": torch.randn(len(plens), width_r, generator=g),
        "advantages": torch.randn(len(plens), 1, generator=g).expand(-1, width_r).contiguous(),
    }, batch_size=len(plens))
    td = DataProto(batch=batch, non_tensor_batch={TOPK_KEY: objs}, meta_info={"temperature": temperature}).to_tensordict()
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(td, calculate_entropy=False, distillation_use_topk=True, distillation_only=False,
                         use_remove_padding=remove_padding, use_fused_kernels=False, dp_size=1,
                         batch_num_tokens=int(attention[:, width_p:].sum()), global_batch_size=len(plens))
    return td, logits, records, responses, attention[:, width_p:].clone(), width_p


def test_records_survive_verl_tensordict_splitting() -> None:
    from verl.utils import tensordict_utils as tu

    model = tiny_causal_lm()
    td, _, records, _, _, _ = verl_micro_batch(model, [2, 3, 4, 2], [3, 1, 2, 4], k=3, temperature=1.0)
    chunks = tu.chunk_tensordict(td, 2)
    got = [rec for chunk in chunks for rec in tu.get(chunk, TOPK_KEY)]
    assert all(a is not None and np.array_equal(a.topk_ids, b.topk_ids) for a, b in zip(got, records, strict=True))
    picked = tu.index_select_tensor_dict(td, torch.tensor([3, 1]))
    assert [r.length for r in tu.get(picked, TOPK_KEY)] == [4, 1]


# --------------------------------------------------------------------------------------------------------------
# verl's FSDP engine path on CPU: real prepare_model_inputs / prepare_model_outputs / ppo_loss
# --------------------------------------------------------------------------------------------------------------


def run_fsdp_engine(model, td, loss_fn, fused: bool = False):
    """FSDPEngineWithLMHead.forward_step without the device move/autocast (no GPU here). ``fused``: verl's fused
    path -- its torch-backend fused forward bound to this model only (verl's own patch would change the class of
    every test's model) and the plugin's hidden-states hooks (worker.install_hidden_gather) on the engine."""
    from verl.models.transformers.dense_common import forward_with_torch_backend
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    engine = FSDPEngineWithLMHead.__new__(FSDPEngineWithLMHead)
    engine.pad_to_length, engine.use_ulysses_sp, engine.ulysses_sequence_parallel_size = False, False, 1
    engine.module = model

    def forward_step(micro_batch, loss_function, forward_only):
        inputs, output_args = engine.prepare_model_inputs(micro_batch)
        raw = engine.module(**inputs, use_cache=False)
        model_output = engine.prepare_model_outputs(output=raw, output_args=output_args, micro_batch=micro_batch,
                                                    logits_processor_func=loss_function)
        return model_output, loss_function(model_output=model_output, data=micro_batch)

    engine.forward_step = forward_step
    if fused:
        model.forward = MethodType(forward_with_torch_backend, model)
        worker.install_hidden_gather(engine)
    tu.assign_non_tensor(td, use_fused_kernels=fused)
    return engine.forward_step(td, loss_fn, forward_only=False)


@pytest.mark.parametrize(("layers", "remove_padding"), [(1, False), (0, True)])
def test_fsdp_engine_gathers_the_support_at_the_predicting_positions(settings, layers: int,
                                                                      remove_padding: bool) -> None:
    """With 0 layers logits depend on the token only, so verl's packed (remove-padding) forward is exact on CPU."""
    from verl.workers.config import FSDPActorConfig
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    temperature, k = 0.7, 4
    model = tiny_causal_lm(layers=layers)
    plens, rlens = [3, 5, 2], [6, 4, 1]
    td, logits, records, responses, mask, width_p = verl_micro_batch(
        model, plens, rlens, k=k, temperature=temperature, remove_padding=remove_padding)
    settings(delta=0.05, ratio_cap=10.0)
    config = FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                             policy_loss={"loss_mode": "predmask_kl_exact"})
    loss_fn = TopKPolicyLoss(partial(ppo_loss, config=config))
    model_output, (loss, metrics) = run_fsdp_engine(model, td, loss_fn)

    # direct computation: log_softmax(logits / T) at the padded position predicting each response token
    support, anchor = support_from_records(records, responses, mask)
    direct = torch.log_softmax(logits / temperature, -1)
    pi = torch.stack([no_padding_2_padding(model_output[f"{PI_KEY_PREFIX}{j}"], td) for j in range(k + 1)], -1)
    log_prob = no_padding_2_padding(model_output["log_probs"], td)
    pi_direct = torch.full_like(pi, float("-inf"))
    lp_direct = torch.zeros_like(log_prob)
    for b, r in enumerate(rlens):
        for i in range(r):
            row = direct[b, width_p + i - 1]
            pi_direct[b, i] = torch.where(support.valid[b, i], row[support.ids[b, i]], float("-inf"))
            lp_direct[b, i] = row[responses[b, i]]
    ok = support.valid & mask.bool().unsqueeze(-1)
    torch.testing.assert_close(pi[ok], pi_direct[ok], rtol=0, atol=1e-5)
    torch.testing.assert_close(log_prob[mask.bool()], lp_direct[mask.bool()], rtol=0, atol=1e-5)

    # the loss verl computes equals predmask.policy_loss on the direct quantities
    tail = torch.stack([(direct[b, width_p - 1: width_p - 1 + responses.shape[1]].exp() ** 2).sum(-1)
                        for b in range(len(rlens))])
    tail = (tail - torch.where(support.valid, pi_direct.exp() ** 2, 0.0).sum(-1)).clamp_min(0)
    ref, ref_metrics = predmask.policy_loss(
        "predmask_kl_exact", log_prob=log_prob, old_log_prob=anchor, advantages=td["advantages"],
        response_mask=mask, mu_logprobs=support.mu_logprobs, pi_logprobs=pi_direct, valid=support.valid,
        sampled_index=support.sampled_index, pi_tail_sq=tail,
        params=predmask.MethodParams(delta=0.05, ratio_cap=10.0, vocab_size=48),
        global_batch_info={"dp_size": 1, "batch_num_tokens": int(mask.sum()), "global_batch_size": 3})
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    values = {k: v.aggregate() if hasattr(v, "aggregate") else v for k, v in metrics.items()}
    for key in ("actor/pg_clipfrac", "actor/mask/outside_frac", "actor/mask/divergence_max"):
        assert math.isclose(float(values[key]), ref_metrics[key], rel_tol=1e-4, abs_tol=1e-6), key
    assert float(values["actor/mask/pi_sampled_gap"]) < 1e-4
    assert 0 < ref_metrics["actor/mask/outside_frac"] < 1  # the check is not vacuous


@pytest.mark.parametrize(("loss_mode", "remove_padding"), [("predmask_kl_exact", True),
                                                         ("predmask_kl_exact", False), ("dppo_topk_kl", True)])
def test_fused_path_gathers_the_support_from_hidden_states_as_the_logits_path(settings, loss_mode: str,
                                                                              remove_padding: bool) -> None:
    """The same micro-batch through verl's fused path (no logits; the support from the decoder's hidden states)
    and its logits path: the same support log-probs, exact tail, loss and gradient on every parameter."""
    from verl.workers.config import FSDPActorConfig
    from verl.workers.utils.losses import ppo_loss

    settings(delta=0.05, ratio_cap=10.0)
    model = tiny_causal_lm(layers=1)  # float32, as verl's fused kernel computes (whatever the model's dtype)
    td, *_ = verl_micro_batch(model, [3, 5, 2], [6, 4, 1], k=4, temperature=0.7, remove_padding=remove_padding,
                              loss_mode=loss_mode)
    config = FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, use_fused_kernels=True,
                             policy_loss={"loss_mode": loss_mode})
    runs = []
    for fused in (False, True):
        model.zero_grad()
        model_output, (loss, _) = run_fsdp_engine(model, td.clone(), TopKPolicyLoss(partial(ppo_loss, config=config)),
                                                  fused=fused)
        loss.backward()
        runs.append((model_output, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (ref, ref_loss, ref_grads), (out, loss, grads) = runs
    assert "logits" not in out and set(ref) == set(out)
    assert (PI_TAIL_KEY in out) == (loss_mode == "predmask_kl_exact")
    for key in (k for k in ref if k.startswith("predmask_")):
        torch.testing.assert_close(out[key].values(), ref[key].values(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-7)
    assert ref_grads.keys() == grads.keys() and any(g.abs().sum() > 0 for g in grads.values())
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_fused_path_without_support_is_verls_own(settings) -> None:
    """A method that reads no support (grpo_clip_higher): the hooked fused engine gathers nothing and computes
    verl's fused log-probs and loss."""
    from verl.workers.config import FSDPActorConfig
    from verl.workers.utils.losses import ppo_loss

    settings()
    model = tiny_causal_lm(layers=1)
    td, *_ = verl_micro_batch(model, [3, 2], [2, 4], k=3, temperature=0.9, remove_padding=True)
    config = FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, use_fused_kernels=True,
                             policy_loss={"loss_mode": "grpo_clip_higher"})
    out, (loss, _) = run_fsdp_engine(model, td, TopKPolicyLoss(partial(ppo_loss, config=config)), fused=True)
    assert set(out) == {"log_probs"}
    ref, (ref_loss, _) = run_fsdp_engine(tiny_causal_lm(layers=1), td, partial(ppo_loss, config=config), fused=True)
    torch.testing.assert_close(out["log_probs"].values(), ref["log_probs"].values(), rtol=0, atol=0)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)


def _run_layout(model, pieces, loss_fn, directory, session: str = "1") -> tuple[dict[str, float], list]:
    """One mini-batch split into ``pieces`` (micro-batches on ranks: piece i on rank i % 2), through verl's FSDP
    engine path and loss; returns (merged statistics of step 1, verl's per-piece metrics)."""
    from analysis.store.exact_metrics import exact_step_metrics

    writers = [LossStatsWriter(directory / "loss_stats", session, rank) for rank in (0, 1)]
    for w in writers:
        w.begin_step(1)
        w.begin_mini_batch()
    verl_metrics = []
    for i, piece in enumerate(pieces):
        loss_fn.stats_writer = writers[i % 2]
        _, (_, metrics) = run_fsdp_engine(model, piece, loss_fn)
        verl_metrics.append(metrics)
    return exact_step_metrics(directory)[1], verl_metrics


def test_exact_metrics_do_not_depend_on_how_the_batch_is_split(settings, tmp_path) -> None:
    """The same mini-batch as one micro-batch, as 2 + 4 sequences on one rank, and as 1 + 2 + 3 sequences over two
    ranks: the merged loss statistics agree (counts and maxima exactly, means to float rounding) and equal
    predmask.policy_loss on the whole batch, while verl's mean-reduced numbers differ with the split."""
    from verl.utils import tensordict_utils as tu
    from verl.utils.metric.utils import Metric
    from verl.workers.config import FSDPActorConfig
    from verl.workers.utils.losses import ppo_loss

    settings(delta=0.05)
    model = tiny_causal_lm(layers=0)  # logits depend on the token only: packing cannot change them
    plens, rlens = [3, 5, 2, 4, 2, 3], [6, 4, 1, 5, 3, 2]
    td, *_ = verl_micro_batch(model, plens, rlens, k=4, temperature=0.9, remove_padding=True, seed=3)
    config = FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                             policy_loss={"loss_mode": "predmask_kl_agg"})
    loss_fn = TopKPolicyLoss(partial(ppo_loss, config=config))
    pick = [tu.index_select_tensor_dict(td, torch.tensor(ix)) for ix in ([0, 1], [2, 3, 4, 5], [5], [0, 3], [1, 2, 4])]
    whole, verl_whole = _run_layout(model, [td], loss_fn, tmp_path / "one")
    two, verl_two = _run_layout(model, pick[:2], loss_fn, tmp_path / "two")
    three, _ = _run_layout(model, pick[2:], loss_fn, tmp_path / "three")

    assert set(whole) == set(two) == set(three) and "actor/mask/direction_disagree" in whole
    for name, value in whole.items():
        if predmask.metrics.metric(name).reduce == "mean":
            for other in (two, three):
                assert math.isclose(other[name], value, rel_tol=1e-6, abs_tol=1e-9), name
        else:
            assert two[name] == value == three[name], name
    assert whole["actor/mask/tokens"] == sum(rlens) and whole["actor/mask/outside_frac"] > 0
    # the merged values are those of the whole batch (its own micro-batch, the CPU engine's reduction)
    (verl_one,) = verl_whole
    for name in ("actor/mask/tokens", "actor/mask/divergence_max", "actor/pg_clipfrac", "actor/ppo_kl"):
        assert math.isclose(whole[name], float(verl_one[name].aggregate()), rel_tol=1e-6), name

    def verl_reduced(per_piece, name):  # verl's reduction of a policy-loss metric: a mean over micro-batches
        gathered = Metric(per_piece[0][name].aggregation)
        for m in per_piece:
            gathered.extend(m[name])
        return float(Metric.aggregate_dp([gathered]))

    assert verl_reduced(verl_two, "actor/mask/tokens") != verl_reduced(verl_whole, "actor/mask/tokens")
    assert verl_reduced(verl_two, "actor/mask/divergence_max") != whole["actor/mask/divergence_max"]


def test_training_worker_counts_steps_from_the_checkpoint_and_writes_one_line_per_loss_call(settings,
                                                                                           tmp_path) -> None:
    """The stand-in base replaces verl's TrainingWorker and its engine (no GPU here): its train_mini_batch runs two
    mini-batches (train_batch), each calling the loss once; verl's real worker is run in test_verl_worker_cpu.py."""
    from verl.workers.config import FSDPActorConfig

    from analysis.store.exact_metrics import read_records

    class Engine:
        def __init__(self, src: bool):
            self.src = src

        def is_mp_src_rank_with_outputs(self):
            return self.src

        def get_data_parallel_rank(self):
            return 3

    class Base:
        def __init__(self, src: bool):
            self.loss_fn, self.engine = None, Engine(src)

        def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=False):
            return None

        def train_mini_batch(self, data):
            return [self.train_batch(data) for _ in range(2)]

        def train_batch(self, data):
            if self.loss_fn.stats_writer is not None:
                self.loss_fn.stats_writer.write({"actor/mask/tokens": 4.0})
            return "trained"

    settings(stats_dir=str(tmp_path / "stats"), session="00007")
    config = FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                             policy_loss={"loss_mode": "grpo_clip_higher"})
    cls = worker.make_training_worker_cls(Base)
    trainer = cls(True)
    trainer.set_loss_fn(partial(lambda **kw: None, config=config))
    trainer.load_checkpoint("/ckpt/global_step_40/actor")
    from tensordict import TensorDict

    trainer.train_mini_batch(TensorDict({}, batch_size=1))
    trainer.train_mini_batch(TensorDict({}, batch_size=1))
    records = read_records(tmp_path / "stats" / "00007.rank3.jsonl")
    assert [(r["step"], r["mini_batch"], r["micro_batch"], r["rank"]) for r in records] == [
        (41, 0, 0, 3), (41, 1, 0, 3), (42, 0, 0, 3), (42, 1, 0, 3)]
    other = cls(False)  # not the first rank of its model-parallel group: writes nothing
    other.set_loss_fn(partial(lambda **kw: None, config=config))
    other.train_mini_batch(TensorDict({}, batch_size=1))
    assert sorted(p.name for p in (tmp_path / "stats").iterdir()) == ["00007.rank3.jsonl"]
    with pytest.raises(ValueError, match="global_step"):
        trainer.load_checkpoint("/ckpt/latest/actor")


def test_loss_wrapper_passes_verl_losses_through() -> None:
    from verl.workers.config import FSDPActorConfig

    calls = []

    def inner(model_output=None, data=None, dp_group=None):
        calls.append((model_output, data, dp_group))
        return "verl"

    config = FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1)
    wrapped = TopKPolicyLoss(inner, config=config)
    assert wrapped.method is None and not wrapped.needs_logits
    from tensordict import TensorDict

    assert wrapped(model_output={}, data=TensorDict({}, batch_size=0), dp_group=None) == "verl"
    assert wrapped(student_logits=torch.zeros(1, 2, 3), data=None) == {}


def test_loss_wrapper_refuses_fused_kernels_where_unwired_and_distillation() -> None:
    from verl.workers.config import FSDPActorConfig

    config = FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, use_fused_kernels=True,
                             policy_loss={"loss_mode": "dppo_topk_kl"})
    assert TopKPolicyLoss(lambda **kw: None, config=config).needs_logits  # FSDP's fused path is wired
    unwired = SimpleNamespace(strategy="veomni", use_fused_kernels=True, policy_loss={"loss_mode": "dppo_topk_kl"})
    with pytest.raises(ValueError, match="strategy 'veomni'.*use_fused_kernels=false"):
        TopKPolicyLoss(lambda **kw: None, config=unwired)
    with pytest.raises(ValueError, match="distillation"):
        TopKPolicyLoss(partial(lambda **kw: None, config=config, distillation_config=object()))


# --------------------------------------------------------------------------------------------------------------
# The worker hook and the rollout hook
# --------------------------------------------------------------------------------------------------------------


def test_actor_worker_class_is_swapped_in_verl() -> None:
    engine_workers = require_verl("verl.workers.engine_workers")
    cls = engine_workers.ActorRolloutRefWorker.actor_worker_cls
    assert getattr(cls, "predmask_topk", False) and issubclass(cls, engine_workers.TrainingWorker)
    worker.install_actor(engine_workers)  # idempotent
    assert engine_workers.ActorRolloutRefWorker.actor_worker_cls is cls


def test_training_worker_subclass_wraps_the_loss_and_sets_the_flag() -> None:
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import FSDPActorConfig

    class Base:  # verl's TrainingWorker as far as the subclass reads it (fused kernels off)
        def __init__(self):
            self.loss_fn = None
            self.seen = None
            self.engine_config = SimpleNamespace(use_fused_kernels=False)

        def train_batch(self, data):
            self.seen = tu.get_non_tensor_data(data, "distillation_use_topk", False)
            return "trained"

    trainer = worker.make_training_worker_cls(Base)()
    config = FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                             policy_loss={"loss_mode": "predmask_kl_agg"})
    trainer.set_loss_fn(partial(lambda **kw: None, config=config))
    assert isinstance(trainer.loss_fn, TopKPolicyLoss) and trainer.loss_fn.needs_logits
    with_records = TensorDict({}, batch_size=1)
    tu.assign_non_tensor_stack(with_records, TOPK_KEY, [None])
    assert trainer.train_batch(with_records) == "trained" and trainer.seen is True
    assert trainer.train_batch(TensorDict({}, batch_size=1)) == "trained" and trainer.seen is False


def fake_vllm_server_module(vocab: int = 20, k_dist_seed: int = 0) -> ModuleType:
    """A stand-in for verl's vllm_async_server with the same generate() contract (verl 0.9.1): the agent loop's
    ``logprobs`` is turned into ``SamplingParams.logprobs = 0``; the engine yields RequestOutputs whose
    ``outputs[0].logprobs`` hold ``SamplingParams.logprobs`` top entries plus the sampled token."""
    from verl.workers.rollout.replica import TokenOutput

    g = torch.Generator().manual_seed(k_dist_seed)
    dist = torch.log_softmax(torch.randn(8, vocab, generator=g) * 2, -1)

    class SamplingParams:
        def __init__(self, max_tokens, logprobs=None, **kw):
            self.max_tokens, self.logprobs = max_tokens, logprobs

    class Engine:
        def __init__(self):
            self.requested = []

        async def generate(self, prompt, sampling_params, request_id, **kw):
            self.requested.append(sampling_params.logprobs)
            tokens = [int(dist[t].argsort()[-1 - (t % 3)]) for t in range(sampling_params.max_tokens)]
            k = sampling_params.logprobs
            lps = None if k is None else [vllm_position(dist[t], tokens[t], max(k, 1)) for t in range(len(tokens))]
            for n in (1, len(tokens)):  # streaming: a partial, then the final output
                yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=tokens[:n], logprobs=lps and lps[:n])])

    class vLLMHttpServer:
        def __init__(self, calculate_log_probs=True):
            self.config = SimpleNamespace(calculate_log_probs=calculate_log_probs)
            self.engine = Engine()

        async def generate(self, prompt_ids, sampling_params, request_id, image_data=None, **kw):
            sampling_params["logprobs"] = 0 if sampling_params.pop("logprobs", False) else None
            params = SamplingParams(max_tokens=5, **sampling_params)
            final = None
            async for out in self.engine.generate(prompt=prompt_ids, sampling_params=params, request_id=request_id):
                final = out
            ids = final.outputs[0].token_ids
            log_probs = None
            if params.logprobs is not None:
                log_probs = [lp[ids[i]].logprob for i, lp in enumerate(final.outputs[0].logprobs)]
            return TokenOutput(token_ids=ids, log_probs=log_probs, extra_fields={"global_steps": 1})

    module = ModuleType("fake_vllm_async_server")
    module.vLLMHttpServer = vLLMHttpServer
    module.dist = dist
    return module


def test_rollout_hook_returns_the_topk_record_in_extra_fields(settings) -> None:
    """K comes from predmask.top_k; verl's calculate_log_probs keeps its bool meaning (the request asks for log-probs)."""
    settings(top_k=6)
    module = fake_vllm_server_module()
    rollout_hook.install_rollout(module)
    rollout_hook.install_rollout(module)  # idempotent
    server = module.vLLMHttpServer(calculate_log_probs=True)
    out = asyncio.run(server.generate([1, 2], {"logprobs": True, "temperature": 1.0}, "req-1"))
    rec = out.extra_fields[TOPK_KEY]
    assert server.engine.requested == [6] and out.extra_fields["global_steps"] == 1
    assert rec.length == 5 and rec.k == 6 and list(rec.token_ids) == out.token_ids
    np.testing.assert_allclose(rec.logprobs, out.log_probs, rtol=0, atol=0)
    expect = module.dist[:5].topk(6, -1)
    assert np.array_equal(rec.topk_ids, expect.indices.numpy())
    assert server._predmask_pending == {}


@pytest.mark.parametrize(("top_k", "logprobs", "requested"), [(0, True, 0), (6, False, None), (0, False, None)])
def test_rollout_hook_leaves_plain_verl_requests_alone(settings, top_k, logprobs, requested) -> None:
    settings(top_k=top_k)
    module = fake_vllm_server_module()
    rollout_hook.install_rollout(module)
    server = module.vLLMHttpServer(calculate_log_probs=logprobs)
    out = asyncio.run(server.generate([1], {"logprobs": logprobs}, "req-2"))
    assert TOPK_KEY not in out.extra_fields and server.engine.requested == [requested]
