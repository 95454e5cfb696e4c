"""Top-K plumbing: vLLM output parsing, records -> support, packed alignment, the support gather, verl's engine path.

Truth is independent of the code under test: full distributions (parsing), verl's own ``no_padding_2_padding``
(alignment), a tiny transformers model's padded forward and ``log_softmax`` (gather), real ``torch.distributed``
all-reduces (vocab-parallel gather). Mocked only what cannot exist here: vLLM (its ``Logprob`` entries and
``AsyncLLM`` engine -- vLLM cannot be installed on the CPU machines; the real thing runs in scripts/gpu_check.py)
and the GPU (the FSDP engine's ``forward_step`` is replayed with its real ``prepare_model_inputs`` /
``prepare_model_outputs`` on CPU).
"""

from __future__ import annotations

import asyncio
import math
from functools import partial
from types import ModuleType, SimpleNamespace

import numpy as np
import pytest
import torch
from verl_helpers import MockLogprob, require_verl, tiny_causal_lm, vllm_position

require_verl()

import predmask
import predmask.verl
from predmask.verl import topk
from predmask.verl.topk import (
    TOPK_KEY,
    TopKPolicyLoss,
    TopKRecord,
    chunked_support_logprobs,
    pack_response_tensor,
    packed_response_index,
    parse_vllm_logprobs,
    records_to_padded,
    support_from_records,
    topk_setting,
    vocab_parallel_support_logprobs,
)

pytestmark = pytest.mark.verl


# --------------------------------------------------------------------------------------------------------------
# vLLM output parsing (mock Logprob objects: the documented CompletionOutput.logprobs structure)
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("seed", range(4))
def test_parse_recovers_topk_of_the_full_distribution(k: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    vocab, length = 30, 12
    mu = torch.log_softmax(torch.randn(length, vocab, generator=g) * 2.5, -1)
    sampled = torch.distributions.Categorical(logits=mu).sample().tolist()
    sampled[0] = int(mu[0].argmin())  # at least one token far outside the top-k
    positions = [vllm_position(mu[t], sampled[t], k) for t in range(length)]
    rec = parse_vllm_logprobs(positions, sampled, k)
    expect = mu.topk(k, -1)
    assert np.array_equal(rec.topk_ids, expect.indices.numpy())
    np.testing.assert_allclose(rec.topk_logprobs, expect.values.numpy(), rtol=0, atol=1e-6)
    assert rec.topk_valid.all()
    np.testing.assert_allclose(rec.logprobs, mu.gather(-1, torch.tensor(sampled)[:, None])[:, 0].numpy(), atol=1e-6)
    support, anchor = support_from_records([rec], torch.tensor([sampled]), torch.ones(1, length))
    # every valid slot carries mu at its id; the sampled token always has a valid slot
    assert torch.allclose(torch.where(support.valid[0], support.mu_logprobs[0], 0.0),
                          torch.where(support.valid[0], mu.gather(-1, support.ids[0]), 0.0), atol=1e-6)
    assert torch.equal(support.ids[0].gather(-1, support.sampled_index[0][:, None])[:, 0], torch.tensor(sampled))
    in_topk = torch.tensor([s in set(expect.indices[t].tolist()) for t, s in enumerate(sampled)])
    assert torch.equal(support.valid[0, :, k], ~in_topk)  # the extra slot is used exactly when needed
    assert torch.allclose(anchor[0], torch.from_numpy(rec.logprobs))


def test_parse_pads_positions_with_fewer_than_k_entries_and_keeps_minus_inf() -> None:
    positions = [
        {5: MockLogprob(-0.1, 1), 2: MockLogprob(-2.5, 2)},
        {7: MockLogprob(float("-inf"), 3), 1: MockLogprob(-0.2, 1), 3: MockLogprob(-1.9, 2)},
    ]
    rec = parse_vllm_logprobs(positions, [5, 7], 3)
    assert rec.topk_valid.tolist() == [[True, True, False], [True, True, True]]
    assert rec.topk_ids.tolist() == [[5, 2, 0], [1, 3, 7]]
    assert rec.logprobs[1] == -math.inf and rec.topk_logprobs[0, 2] == -math.inf


def test_parse_orders_by_logprob_when_ranks_are_missing() -> None:
    positions = [{4: MockLogprob(-3.0), 9: MockLogprob(-0.5), 1: MockLogprob(-1.0)}]
    rec = parse_vllm_logprobs(positions, [4], 2)
    assert rec.topk_ids.tolist() == [[9, 1]]


@pytest.mark.parametrize(
    ("positions", "tokens", "match"),
    [
        ([{1: MockLogprob(-0.1, 1)}], [2], "sampled token 2 is missing"),
        ([{1: MockLogprob(float("nan"), 1)}], [1], "NaN|nan"),
        ([{1: MockLogprob(-0.1, 1)}], [1, 1], "positions"),
        ([None], [1], "no log-probs"),
    ],
)
def test_parse_rejects_bad_vllm_output(positions, tokens, match) -> None:
    with pytest.raises(ValueError, match=match):
        parse_vllm_logprobs(positions, tokens, 2)


def test_topk_setting() -> None:
    assert topk_setting(True) == 0 and topk_setting(False) == 0 and topk_setting(None) == 0
    assert topk_setting(20) == 20 and topk_setting(np.int64(5)) == 5
    for bad in (-1, "20", 2.5):
        with pytest.raises(ValueError, match="calculate_log_probs"):
            topk_setting(bad)


# --------------------------------------------------------------------------------------------------------------
# Records -> response-aligned support
# --------------------------------------------------------------------------------------------------------------


def record(tokens: list[int], k: int = 2, seed: int = 0) -> TopKRecord:
    g = torch.Generator().manual_seed(seed)
    n = len(tokens)
    lp = torch.log_softmax(torch.randn(n, 16, generator=g), -1)
    top = lp.topk(k, -1)
    sampled_lp = lp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]
    return TopKRecord(np.array(tokens, np.int32), sampled_lp.numpy(), top.indices.numpy().astype(np.int32),
                      top.values.numpy(), np.ones((n, k), bool))


def test_records_to_padded_pads_truncates_and_marks_presence() -> None:
    padded = records_to_padded([record([3, 4, 5]), None, record([6, 7, 8, 9, 10])], 4)
    assert padded["present"].tolist() == [[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]]
    assert padded["sampled_ids"][2].tolist() == [6, 7, 8, 9]
    assert padded["topk_ids"].shape == (3, 4, 2) and not padded["topk_valid"][0, 3].any()
    with pytest.raises(ValueError, match="different K"):
        records_to_padded([record([1], k=2), record([1], k=3)], 2)


def test_support_from_records_checks_alignment_with_the_responses() -> None:
    responses = torch.tensor([[3, 4, 5, 0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    support, anchor = support_from_records([record([3, 4, 5])], responses, mask)
    assert support.ids.shape == (1, 4, 3) and anchor.shape == (1, 4)
    with pytest.raises(ValueError, match="disagree"):
        support_from_records([record([3, 9, 5])], responses, mask)
    with pytest.raises(ValueError, match="no rollout top-K"):
        support_from_records([record([3, 4])], responses, mask)
    with pytest.raises(ValueError, match="records for a batch"):
        support_from_records([record([3]), record([3])], responses, mask)


# --------------------------------------------------------------------------------------------------------------
# Packed alignment, against verl's own no_padding_2_padding
# --------------------------------------------------------------------------------------------------------------


def padded_batch(prompt_lens: list[int], response_lens: list[int], width_p: int, width_r: int, seed: int = 0):
    """verl's left/right padded layout: prompts left-padded to width_p, responses right-padded to width_r."""
    g = torch.Generator().manual_seed(seed)
    b = len(prompt_lens)
    prompts = torch.zeros(b, width_p, dtype=torch.long)
    responses = torch.zeros(b, width_r, dtype=torch.long)
    attention = torch.zeros(b, width_p + width_r, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens, strict=True)):
        prompts[i, width_p - p:] = torch.randint(1, 40, (p,), generator=g)
        responses[i, :r] = torch.randint(1, 40, (r,), generator=g)
        attention[i, width_p - p: width_p + r] = 1
    return prompts, responses, attention


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
    p_lens, r_lens = topk.sequence_lengths(prompts, responses, attention)
    assert p_lens.tolist() == plens and r_lens.tolist() == rlens


def test_packed_index_rejects_empty_prompts() -> None:
    with pytest.raises(ValueError, match="non-empty prompt"):
        packed_response_index(torch.tensor([0, 2]), torch.tensor([1, 1]))


# --------------------------------------------------------------------------------------------------------------
# The gather: chunked, vocab-parallel
# --------------------------------------------------------------------------------------------------------------


def gather_case(seed: int = 0, n: int = 23, vocab: int = 37, width: int = 5):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g) * 3
    ids = torch.stack([torch.randperm(vocab, generator=g)[:width] for _ in range(n)])
    valid = torch.rand(n, width, generator=g) > 0.2
    return logits, ids, valid


def test_chunked_gather_equals_predmask_gather() -> None:
    logits, ids, valid = gather_case()
    ref, ref_tail = predmask.gather_support_logprobs(logits, ids, valid, temperature=0.7, return_tail_sq=True)
    out, tail = chunked_support_logprobs(logits, ids, valid, temperature=0.7, return_tail_sq=True, chunk_rows=5)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(tail, ref_tail)


def test_vocab_parallel_gather_on_one_rank_equals_predmask_gather() -> None:
    logits, ids, valid = gather_case(seed=1)
    ref, ref_tail = predmask.gather_support_logprobs(logits, ids, valid, return_tail_sq=True)
    out, tail = vocab_parallel_support_logprobs(logits, ids, valid, vocab_start=0, return_tail_sq=True, chunk_rows=7)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(tail, ref_tail, rtol=1e-5, atol=1e-6)


def _tp_worker(rank: int, world: int, port: int, path: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    logits, ids, valid = gather_case(seed=2, vocab=36)
    shard = logits.shape[1] // world
    out, tail = vocab_parallel_support_logprobs(logits[:, rank * shard:(rank + 1) * shard], ids, valid,
                                                vocab_start=rank * shard, group=dist.group.WORLD, return_tail_sq=True)
    torch.save({"out": out, "tail": tail}, f"{path}.{rank}")
    dist.destroy_process_group()


@pytest.mark.slow
def test_vocab_parallel_gather_over_two_gloo_ranks(tmp_path) -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_tp_worker, args=(2, port, str(tmp_path / "tp")), nprocs=2, join=True)
    logits, ids, valid = gather_case(seed=2, vocab=36)
    ref, ref_tail = predmask.gather_support_logprobs(logits, ids, valid, return_tail_sq=True)
    for rank in range(2):
        res = torch.load(tmp_path / f"tp.{rank}")
        torch.testing.assert_close(res["out"], ref)
        torch.testing.assert_close(res["tail"], ref_tail, rtol=1e-5, atol=1e-6)


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


def run_fsdp_engine(model, td, loss_fn):
    """FSDPEngineWithLMHead.forward_step without the device move/autocast (no GPU here)."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    engine = FSDPEngineWithLMHead.__new__(FSDPEngineWithLMHead)
    engine.pad_to_length, engine.use_ulysses_sp, engine.ulysses_sequence_parallel_size = False, False, 1
    engine.module = model
    inputs, output_args = engine.prepare_model_inputs(td)
    raw = model(**inputs, use_cache=False)
    model_output = engine.prepare_model_outputs(raw, output_args, td, logits_processor_func=loss_fn)
    return model_output, loss_fn(model_output=model_output, data=td)


@pytest.mark.parametrize(("layers", "remove_padding"), [(1, False), (0, True)])
def test_fsdp_engine_gathers_the_support_at_the_predicting_positions(layers: int, remove_padding: bool) -> None:
    """With 0 layers logits depend on the token only, so verl's packed (remove-padding) forward is exact on CPU."""
    from verl.workers.config import FSDPActorConfig
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    temperature, k = 0.7, 4
    model = tiny_causal_lm(layers=layers)
    plens, rlens = [3, 5, 2], [6, 4, 1]
    td, logits, records, responses, mask, width_p = verl_micro_batch(
        model, plens, rlens, k=k, temperature=temperature, remove_padding=remove_padding)
    config = FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio=0.05,
                             clip_ratio_c=10.0, policy_loss={"loss_mode": "predmask_kl_exact"})
    loss_fn = TopKPolicyLoss(partial(ppo_loss, config=config))
    model_output, (loss, metrics) = run_fsdp_engine(model, td, loss_fn)

    # direct computation: log_softmax(logits / T) at the padded position predicting each response token
    support, anchor = support_from_records(records, responses, mask)
    direct = torch.log_softmax(logits / temperature, -1)
    pi = torch.stack([no_padding_2_padding(model_output[f"{topk.PI_KEY_PREFIX}{j}"], td) for j in range(k + 1)], -1)
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


def test_loss_wrapper_refuses_fused_kernels_and_distillation() -> None:
    from verl.workers.config import FSDPActorConfig

    config = FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, use_fused_kernels=True,
                             policy_loss={"loss_mode": "dppo_topk_kl"})
    with pytest.raises(ValueError, match="use_fused_kernels=false"):
        TopKPolicyLoss(lambda **kw: None, config=config)
    with pytest.raises(ValueError, match="distillation"):
        TopKPolicyLoss(partial(lambda **kw: None, config=config, distillation_config=object()))


# --------------------------------------------------------------------------------------------------------------
# The worker hook and the rollout hook
# --------------------------------------------------------------------------------------------------------------


def test_actor_worker_class_is_swapped_in_verl() -> None:
    engine_workers = require_verl("verl.workers.engine_workers")
    cls = engine_workers.ActorRolloutRefWorker.actor_worker_cls
    assert getattr(cls, "predmask_topk", False) and issubclass(cls, engine_workers.TrainingWorker)
    topk.install_actor(engine_workers)  # idempotent
    assert engine_workers.ActorRolloutRefWorker.actor_worker_cls is cls


def test_training_worker_subclass_wraps_the_loss_and_sets_the_flag() -> None:
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import FSDPActorConfig

    class Base:
        def __init__(self):
            self.loss_fn = None
            self.seen = None

        def train_batch(self, data):
            self.seen = tu.get_non_tensor_data(data, "distillation_use_topk", False)
            return "trained"

    worker = topk.make_training_worker_cls(Base)()
    config = FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                             policy_loss={"loss_mode": "predmask_kl_agg"})
    worker.set_loss_fn(partial(lambda **kw: None, config=config))
    assert isinstance(worker.loss_fn, TopKPolicyLoss) and worker.loss_fn.needs_logits
    with_records = TensorDict({}, batch_size=1)
    tu.assign_non_tensor_stack(with_records, TOPK_KEY, [None])
    assert worker.train_batch(with_records) == "trained" and worker.seen is True
    assert worker.train_batch(TensorDict({}, batch_size=1)) == "trained" and worker.seen is False


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
        def __init__(self, calculate_log_probs):
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


def test_rollout_hook_returns_the_topk_record_in_extra_fields() -> None:
    module = fake_vllm_server_module()
    topk.install_rollout(module)
    topk.install_rollout(module)  # idempotent
    server = module.vLLMHttpServer(calculate_log_probs=6)
    out = asyncio.run(server.generate([1, 2], {"logprobs": 6, "temperature": 1.0}, "req-1"))
    rec = out.extra_fields[TOPK_KEY]
    assert server.engine.requested == [6] and out.extra_fields["global_steps"] == 1
    assert rec.length == 5 and rec.k == 6 and list(rec.token_ids) == out.token_ids
    np.testing.assert_allclose(rec.logprobs, out.log_probs, rtol=0, atol=0)
    expect = module.dist[:5].topk(6, -1)
    assert np.array_equal(rec.topk_ids, expect.indices.numpy())
    assert server._predmask_pending == {}


@pytest.mark.parametrize(("setting", "requested"), [(True, 0), (False, None)])
def test_rollout_hook_leaves_plain_verl_requests_alone(setting, requested) -> None:
    module = fake_vllm_server_module()
    topk.install_rollout(module)
    server = module.vLLMHttpServer(calculate_log_probs=setting)
    out = asyncio.run(server.generate([1], {"logprobs": setting}, "req-2"))
    assert TOPK_KEY not in out.extra_fields and server.engine.requested == [requested]
