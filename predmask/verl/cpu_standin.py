"""A verl run on the CPU trains the CPU engine's stand-in model on the engine's task: the verl model it is given.

On a cluster with ``device: cpu`` (``conf/cluster/verl_cpu.yaml``, ``slurm_emulated_verl.yaml``) a run's cluster
model (e.g. ``qwen3_4b_base``) is replaced by the cluster's ``standin`` (a ``conf/model`` CPU model that vLLM's
CPU attention can serve), exported as a Hugging Face directory (:mod:`predmask.rl.hf_export`), and its batch and
schedule are the CPU engine's (``trainer.*``, ``rollout.*`` of conf/train.yaml), so that a verl run and a CPU
engine run of one config train the same model on the same prompts with the same sizes. Pure: imports no verl and
no torch; the sweep makes the inputs (:mod:`sweeps.verl_inputs`) and hands their paths in the run config's
``verl_inputs`` (``model_path``, ``train_files``, ``val_files``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from predmask.precisions import Precision
from predmask.verl.arithmetic_task import REWARD_FUNCTION_NAME, REWARD_FUNCTION_PATH

#: the run config's key under which the sweep hands a CPU verl run its inputs' paths
INPUTS_KEY = "verl_inputs"
#: the module that makes verl and vLLM run on the CPU (predmask.verl.cpu), listed before the plugin in every process
CPU_MODULE = "predmask.verl.cpu"
#: the verl settings a CPU run needs beside the platform (verl's Hydra overrides)
VERL_CPU_OVERRIDES: dict[str, Any] = {
    "trainer.device": "cpu",
    "+actor_rollout_ref.rollout.enable_sleep_mode": False,  # "Sleep mode is not supported on current platform"
    "actor_rollout_ref.rollout.free_cache_engine": False,
    "actor_rollout_ref.rollout.enforce_eager": True,  # no CUDA graphs
}
#: vLLM's dtype per training precision of a CPU run (FP8 has no CPU kernels in vLLM 0.24: refused)
_ROLLOUT_DTYPE = {"bf16": "bfloat16"}


def _get(cfg: Any, dotted: str) -> Any:
    for key in dotted.split("."):
        if cfg is None:
            return None
        cfg = cfg.get(key) if isinstance(cfg, Mapping) or hasattr(cfg, "get") else getattr(cfg, key, None)
    return cfg


def _need(cfg: Any, dotted: str) -> Any:
    value = _get(cfg, dotted)
    if value is None or value == "":
        raise ValueError(f"run config is missing {dotted} (needed for a verl run on the CPU)")
    return value


def rollout_dtype(precision: Precision) -> str:
    """vLLM's dtype for a CPU run of ``precision``; ValueError (one line) for a precision the CPU cannot run."""
    if precision.rollout_fp8 or precision.train_fp8:
        raise ValueError(f"precision {precision.name!r} needs FP8 kernels, which vLLM's CPU build does not have; "
                         f"allowed on a CPU cluster: {', '.join(sorted(_ROLLOUT_DTYPE))} (a sweep: its bf16 settings, "
                         "e.g. +setting=qwen3_4b_bf16,qwen3_8b_bf16)")
    try:
        return _ROLLOUT_DTYPE[precision.name]
    except KeyError:
        raise ValueError(f"precision {precision.name!r} does not run on a CPU cluster; allowed: "
                         f"{', '.join(sorted(_ROLLOUT_DTYPE))}") from None


def standin_model(run_cfg: Any) -> dict[str, Any]:
    """The cluster model (``ClusterModelConfig`` fields) of a CPU verl run: the exported stand-in, the CPU
    engine's sizes and schedule, FSDP2 without fused kernels (the support comes from the logits), one GPU token
    per worker."""
    inputs = _need(run_cfg, INPUTS_KEY)
    standin = str(_need(run_cfg, "cluster.standin"))
    max_position = int(_need(inputs, "max_position_embeddings"))
    response = int(_need(run_cfg, "rollout.response_length"))
    if response >= max_position:
        raise ValueError(f"rollout.response_length={response} leaves no room for a prompt in the stand-in "
                         f"{standin}'s {max_position} positions")
    groups = int(_need(run_cfg, "trainer.train_batch_size")) * int(_need(run_cfg, "rollout.n"))
    model = _get(run_cfg, "model") or {}
    return {
        "name": standin, "backend": "hf", "label": str(inputs.get("label") or standin),
        "hf_id": f"predmask/{standin}", "path": str(_need(inputs, "model_path")), "cpu_standin": standin,
        "stands_in_for": str(_get(model, "stands_in_for") or _get(model, "name") or standin),
        "engine": "fsdp", "fused_kernels": False,
        "parallel": {"tensor": 1, "pipeline": 1, "expert": 1, "sequence": 1, "rollout_tensor": 1},
        "batch": {
            "train_prompts": int(_need(run_cfg, "trainer.train_batch_size")),
            "responses_per_prompt": int(_need(run_cfg, "rollout.n")),
            "ppo_mini_batch_prompts": int(_need(run_cfg, "trainer.ppo_mini_batch_size")),
            "max_prompt_length": max_position - response, "max_response_length": response,
            "max_token_len_per_gpu": None, "lr": float(_need(run_cfg, "trainer.lr")),
            "temperature": float(_need(run_cfg, "rollout.temperature")),
            "val_temperature": float(_need(run_cfg, "rollout.temperature")), "val_top_p": 1.0,
            "total_steps": int(_need(run_cfg, "trainer.steps")), "val_every": int(_need(run_cfg, "trainer.val_every")),
            "save_every": int(_need(run_cfg, "trainer.save_every")), "gpu_memory_utilization": 0.5,
        },
        "verl": {
            "actor_rollout_ref.actor.strategy": "fsdp2",  # the run config's verl={...} may say fsdp
            "actor_rollout_ref.rollout.max_model_len": max_position,
            "actor_rollout_ref.rollout.max_num_seqs": groups,
            "actor_rollout_ref.rollout.max_num_batched_tokens": max(groups * max_position, 256),
            "actor_rollout_ref.rollout.load_format": "safetensors",
            "actor_rollout_ref.rollout.agent.num_workers": 1,
            "actor_rollout_ref.actor.optim.betas": list(_need(run_cfg, "trainer.betas")),
            "actor_rollout_ref.actor.optim.weight_decay": float(_need(run_cfg, "trainer.weight_decay")),
            "actor_rollout_ref.actor.grad_clip": float(_need(run_cfg, "trainer.grad_clip")),
            "data.shuffle": False,  # the engine's prompt order (sweeps.datasets writes it)
            "data.dataloader_num_workers": 0,
            "reward.num_workers": 1,
            "reward.custom_reward_function.path": REWARD_FUNCTION_PATH,
            "reward.custom_reward_function.name": REWARD_FUNCTION_NAME,
        },
    }


def standin_data(run_cfg: Any) -> dict[str, Any]:
    """The ``data`` section (train and validation parquet files) of a CPU verl run."""
    inputs = _need(run_cfg, INPUTS_KEY)
    return {"train_files": list(_need(inputs, "train_files")), "val_files": list(_need(inputs, "val_files"))}
