"""One rank of verl's real actor worker on the CPU, for test_verl_worker_cpu.py, test_verl_hidden_gather.py and
test_verl_engine_parity.py: build it, run update_actor, save.

:func:`run_rank` is the body of each spawned process: it installs the CPU platform (predmask.verl.cpu),
joins a gloo process group, builds ``ActorRolloutRefWorker(role="actor")`` from verl's own Hydra config with the
FSDP2 engine (or FSDP1: ``strategy="fsdp"``, :func:`allow_fsdp1_on_cpu`) and the plugin on, computes the old
log-probs and updates the actor with a batch prepared the way
``RayPPOTrainer._compute_old_log_prob`` and ``_update_actor`` prepare it, and writes to ``out/rank<r>-rmpad<0|1>.pt``
what the test checks: the parameters before and after, and per micro-batch the responses it saw, verl's log-prob of
each response token and the plugin's support gather at the sampled token. With ``fused=(False, True)`` it runs the same
update with verl's fused kernels off, then on, and saves both, with the gradients and each micro-batch's loss.
:func:`run_cases` updates a fresh worker per case (method, predmask settings, verl overrides) with a batch a test
saved (:func:`load_batch`).

Test instrumentation (not part of the plugin): the loss set on the worker is a subclass of the plugin's
:class:`~predmask.verl.topk_loss.TopKPolicyLoss` that records each micro-batch's ``rollout_batch`` inputs and
outputs and its loss; it computes nothing else.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

#: the tiny policy: a 2-layer Qwen3, vocabulary 200 (no download)
VOCAB, LAYERS = 200, 2
K, TEMPERATURE, LOSS_MODE = 4, 0.7, "predmask_kl_exact"
#: 8 samples, 2 mini-batches of 4; dynamic batch size with 16 tokens per micro-batch splits each mini-batch
PROMPT_LENS = (3, 5, 2, 4, 6, 1, 3, 2)
RESPONSE_LENS = (6, 4, 1, 5, 3, 7, 2, 4)
MINI_BATCH, MAX_TOKENS, SEED = 4, 16, 7


def save_tiny_qwen3(path: Path, tied: bool = False) -> Path:
    """A randomly initialised tiny Qwen3 saved as a Hugging Face model directory (what verl loads by path);
    ``tied``: the lm_head shares the input embedding (as Qwen3-4B's does)."""
    from verl_helpers import tiny_causal_lm

    model = tiny_causal_lm(vocab=VOCAB, layers=LAYERS, seed=SEED)
    model.config.update({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": tied})
    if tied:
        model.tie_weights()
    model.save_pretrained(path)
    return path


def worker_config(model_dir: Path, sp: int, remove_padding: bool, fused: bool = False,
                  mini_batch: int = MINI_BATCH, strategy: str = "fsdp2", loss_mode: str = LOSS_MODE,
                  extra: tuple[str, ...] = ()) -> Any:
    """``actor_rollout_ref`` of verl's own ``ppo_trainer`` config, composed with the overrides of a CPU run
    (``strategy``: verl's FSDP engine, ``fsdp2`` or ``fsdp`` = FSDP1; ``extra``: more overrides, last)."""
    import verl
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    a = "actor_rollout_ref"
    overrides = [
        f"{a}.model.path={model_dir}", f"+{a}.model.load_tokenizer=false",
        f"+{a}.model.override_config.attn_implementation=sdpa",  # flash-attention needs a GPU
        f"{a}.model.use_remove_padding={str(remove_padding).lower()}",
        f"{a}.model.use_fused_kernels={str(fused).lower()}",
        f"{a}.model.enable_gradient_checkpointing=false",
        f"{a}.actor.strategy={strategy}", f"{a}.actor.fsdp_config.strategy={strategy}",
        f"+{a}.actor.fsdp_config.mixed_precision={{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}}",
        f"{a}.actor.use_torch_compile=false", f"{a}.actor.fsdp_config.use_torch_compile=false",
        f"{a}.actor.ulysses_sequence_parallel_size={sp}",
        f"{a}.actor.fsdp_config.ulysses_sequence_parallel_size={sp}",
        f"{a}.actor.ppo_mini_batch_size={mini_batch}", f"{a}.actor.shuffle=true",
        f"{a}.actor.use_dynamic_bsz=true", f"{a}.rollout.log_prob_use_dynamic_bsz=true",
        f"{a}.actor.ppo_max_token_len_per_gpu={MAX_TOKENS // sp}",  # verl multiplies it by sp
        f"{a}.rollout.log_prob_max_token_len_per_gpu={MAX_TOKENS // sp}",
        f"{a}.actor.policy_loss.loss_mode={loss_mode}", f"{a}.actor.optim.lr=1e-2",
        f"{a}.rollout.n=1", f"{a}.rollout.calculate_log_probs=true", f"{a}.rollout.temperature={TEMPERATURE}",
        *extra,
    ]
    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=overrides)
    OmegaConf.resolve(cfg)
    return cfg.actor_rollout_ref


def rollout_batch() -> Any:
    """The batch as the trainer holds it after generation: padded prompts/responses, advantages, and one vLLM
    top-K record per sample (parsed from vLLM-shaped log-prob entries of a random rollout distribution mu)."""
    from verl import DataProto
    from verl_helpers import padded_batch, vllm_position

    from predmask.verl.records import TOPK_KEY, parse_vllm_logprobs

    g = torch.Generator().manual_seed(SEED)
    width_p, width_r = max(PROMPT_LENS), max(RESPONSE_LENS)
    prompts, responses, attention = padded_batch(list(PROMPT_LENS), list(RESPONSE_LENS), width_p, width_r,
                                                 seed=SEED)
    records = np.empty(len(PROMPT_LENS), dtype=object)
    for b, r in enumerate(RESPONSE_LENS):
        mu = torch.log_softmax(2 * torch.randn(r, VOCAB, generator=g), -1)
        tokens = responses[b, :r].tolist()
        records[b] = parse_vllm_logprobs([vllm_position(mu[t], tokens[t], K) for t in range(r)], tokens, K)
    tensors = {
        "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attention, "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
        "response_mask": attention[:, width_p:].clone(),
        "advantages": torch.randn(len(PROMPT_LENS), 1, generator=g).expand(-1, width_r).contiguous(),
    }
    return DataProto.from_dict(tensors=tensors, non_tensors={TOPK_KEY: records},
                               meta_info={"temperature": TEMPERATURE})


def _dense(t: torch.Tensor) -> torch.Tensor:
    return t.to_padded_tensor(0) if t.is_nested else t


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _update(worker: Any, batch: Any, mini_batch: int = MINI_BATCH) -> None:
    """RayPPOTrainer._compute_old_log_prob then _update_actor (verl 0.9.1), on every rank, without Ray."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    td = left_right_2_no_padding(batch.to_tensordict())
    tu.assign_non_tensor(td, calculate_entropy=True, calculate_sum_pi_squared=False, compute_loss=False)
    # the single controller collects from the ranks that hold outputs (rank 0 here: data parallel size 1) and
    # dispatches the same batch to every rank
    collected = [worker.compute_log_prob(td)]
    torch.distributed.broadcast_object_list(collected, src=0)
    old = no_padding_2_padding(tu.get(collected[0], "log_probs"), td)
    batch.batch["old_log_probs"] = old.float()

    td = left_right_2_no_padding(batch.to_tensordict())
    tu.assign_non_tensor(td, calculate_entropy=False, distillation_use_topk=False, distillation_only=False,
                         global_batch_size=mini_batch, mini_batch_size=mini_batch, epochs=1, seed=42,
                         dataloader_kwargs={"shuffle": True}, compute_loss=True)
    worker.update_actor(td)


def _run_layout(sp: int, remove_padding: bool, model_dir: Path, run_dir: Path, fused: bool = False,
                mini_batch: int = MINI_BATCH, strategy: str = "fsdp2", loss_mode: str = LOSS_MODE,
                settings: dict[str, Any] | None = None, extra: tuple[str, ...] = (),
                batch: Any = None) -> dict[str, Any]:
    """Build the actor worker for one layout, update it once, return what the test checks. The plugin's loss
    statistics go to ``run_dir/loss_stats`` (predmask's settings, as the launcher gives them to Ray workers; more
    of them in ``settings``); ``batch``: the rollout batch (default :func:`rollout_batch`)."""
    from verl.workers.engine_workers import ActorRolloutRefWorker
    from verl.workers.utils.padding import no_padding_2_padding

    from predmask.metrics import LOSS_STATS_DIR
    from predmask.verl.settings import SETTINGS_ENV, PluginSettings
    from predmask.verl.topk_loss import TopKPolicyLoss

    os.environ[SETTINGS_ENV] = PluginSettings(top_k=K, stats_dir=str(run_dir / LOSS_STATS_DIR),
                                              **(settings or {})).to_json()

    seen: list[dict[str, torch.Tensor]] = []

    class RecordingLoss(TopKPolicyLoss):
        def __call__(self, model_output=None, data=None, dp_group=None, **kwargs):
            out = super().__call__(model_output=model_output, data=data, dp_group=dp_group, **kwargs)
            if model_output is not None:
                seen[-1]["loss"] = out[0].detach().clone()
            return out

        def rollout_batch(self, model_output, data):
            result = super().rollout_batch(model_output, data)
            support = result.support
            micro = {
                "responses": _dense(data["responses"]).clone(),
                "mask": _dense(data["response_mask"]).bool(),
                "log_prob": no_padding_2_padding(model_output["log_probs"], data).detach().clone(),
                "anchor": result.anchor_logprobs.detach().clone(),
            }
            if support is not None:  # a method that reads the support (not grpo_clip_higher)
                micro.update({
                    "pi_sampled": result.pi_logprobs.gather(-1, support.sampled_index.unsqueeze(-1))
                    .squeeze(-1).detach().clone(),
                    "pi": result.pi_logprobs.detach().clone(),
                    "ids": support.ids.clone(), "valid": support.valid.clone(),
                    "tail": None if result.pi_tail_sq is None else result.pi_tail_sq.detach().clone(),
                })
            seen.append(micro)
            return result

    worker = ActorRolloutRefWorker(config=worker_config(model_dir, sp, remove_padding, fused, mini_batch, strategy,
                                                        loss_mode, extra), role="actor")
    worker.init_model()
    worker.set_loss_fn(RecordingLoss(worker.loss_fn))
    module = worker.actor.engine.module
    before = {n: _full(p) for n, p in module.named_parameters()}
    grads: dict[str, torch.Tensor] = {}  # the accumulated gradient before the (last) optimizer step
    engine, optimizer_step = worker.actor.engine, worker.actor.engine.optimizer_step

    def recording_step() -> Any:
        grads.update({n: _full(p.grad) for n, p in module.named_parameters() if p.grad is not None})
        return optimizer_step()

    engine.optimizer_step = recording_step
    batch = rollout_batch() if batch is None else batch
    _update(worker, batch, mini_batch)
    after = {n: _full(p) for n, p in module.named_parameters()}
    return {"actor_cls": type(worker.actor).__name__, "engine_cls": type(worker.actor.engine).__name__,
            "module_cls": type(module).__name__, "run_dir": str(run_dir), "before": before, "after": after,
            "grads": grads, "micro_batches": seen, "old_log_probs": batch.batch["old_log_probs"].clone()}


def _join(rank: int, world_size: int, port: int) -> None:
    """This spawned process as rank ``rank`` of a gloo group on the CPU platform, with the plugin installed."""
    from predmask.verl import cpu

    cpu.install()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)  # verl's own would add NCCL
    import predmask.verl.plugin  # noqa: F401  (as VERL_USE_EXTERNAL_MODULES does in every verl process)


def allow_fsdp1_on_cpu() -> None:
    """Stand-in for a GPU under FSDP1 (``strategy=fsdp``): verl builds it with ``sync_module_states=True``, and
    torch's FSDP1 then refuses a module whose parameters are on the CPU (a check before its broadcast from rank 0,
    which itself runs on gloo with CPU tensors). This process drops that check; nothing else of FSDP1 changes."""
    from torch.distributed.fsdp import _init_utils

    _init_utils._check_module_states_for_sync_module_states = lambda module_states: None


def run_rank(rank: int, world_size: int, port: int, sp: int, layouts: tuple[bool, ...], model_dir: str,
             out: str, fused: tuple[bool, ...] = (False,), mini_batch: int = MINI_BATCH,
             strategy: str = "fsdp2") -> None:
    """Spawned process ``rank``: for each fused-kernel setting in ``fused`` and each remove-padding setting in
    ``layouts``, build verl's actor worker (FSDP engine ``strategy``) on the CPU, update it once and save what was
    seen to ``out/rank<rank>-rmpad<0|1>[-fused].pt`` (the plugin's loss statistics to
    ``out/run-rmpad<0|1>[-fused]/loss_stats``). Fused kernels off must come first: verl's fused patch replaces the
    model class's forward for the rest of the process."""
    _join(rank, world_size, port)
    if strategy == "fsdp":
        allow_fsdp1_on_cpu()
    try:
        for on in fused:
            for remove_padding in layouts:
                tag = f"rmpad{int(remove_padding)}" + ("-fused" if on else "")
                result = _run_layout(sp, remove_padding, Path(model_dir), Path(out) / f"run-{tag}", fused=on,
                                     mini_batch=mini_batch, strategy=strategy)
                torch.save(result, Path(out) / f"rank{rank}-{tag}.pt")
    finally:
        torch.distributed.destroy_process_group()


def run_cases(rank: int, world_size: int, port: int, model_dir: str, out: str, batch_file: str,
              cases: list[dict[str, Any]]) -> None:
    """Spawned process ``rank``: for each case (``tag``, ``loss_mode``, ``settings``: predmask's settings,
    ``remove_padding``, ``mini_batch``, ``extra``: more verl overrides), a fresh actor worker (FSDP2, fused kernels
    off) updated once with the batch :func:`load_batch` reads from ``batch_file``; what was seen saved to
    ``out/rank<rank>-<tag>.pt``, the loss statistics under ``out/run-<tag>``."""
    _join(rank, world_size, port)
    try:
        for case in cases:
            tag = case["tag"]
            result = _run_layout(1, case["remove_padding"], Path(model_dir), Path(out) / f"run-{tag}",
                                 mini_batch=case["mini_batch"], loss_mode=case["loss_mode"],
                                 settings=case.get("settings"), extra=tuple(case.get("extra", ())),
                                 batch=load_batch(batch_file))
            torch.save(result, Path(out) / f"rank{rank}-{tag}.pt")
    finally:
        torch.distributed.destroy_process_group()


def load_batch(path: str) -> Any:
    """The DataProto of a batch saved by a test as ``{"tensors": {...}, "records": [TopKRecord, ...],
    "temperature": T}`` (``torch.save``): the trainer's batch after generation and advantages."""
    from verl import DataProto

    from predmask.verl.records import TOPK_KEY

    saved = torch.load(path, weights_only=False)
    records = np.empty(len(saved["records"]), dtype=object)
    for i, record in enumerate(saved["records"]):
        records[i] = record
    return DataProto.from_dict(tensors=dict(saved["tensors"]), non_tensors={TOPK_KEY: records},
                               meta_info={"temperature": saved["temperature"]})
