"""The variational-reasoning family on a cluster: one stage run -> its job's argv (pure; imports no verl).

:func:`stage_command` is what the sweep calls for ``trainer=verl`` (``python -m sweeps variational_reasoning
cluster=h20_4x8 --dry-run`` prints it). The stages are those of the CPU family (``predmask.rl.variational``):

- ``prior`` / ``posterior`` / ``final``: verl 0.9.1's Ray SFT trainer (``verl.trainer.sft_trainer_ray``,
  config ``sft_trainer_engine``) through ``python -m predmask.verl.vr_sft`` (which adds per-sample weights and
  the constant normaliser, and builds the final stage's weighted data), run on the Ray head of the job over all
  ``cluster.nodes x cluster.gpus_per_node`` GPUs;
- ``traces`` / ``weights``: ``python -m predmask.verl.vr_sample`` with vLLM on the head node's GPUs.

Keys read from ``config`` (the composed stage config of conf/variational.yaml with a cluster model and
``cluster=h20_4x8``; a mapping or a DictConfig): ``stage``, ``method`` (``name``; ``estimator`` and ``data`` for
``vr_*``), ``seed``, ``inputs`` (upstream stage -> run id, a sibling of ``run_dir``), ``model.path`` (the base
model, e.g. Qwen3-4B-Base), ``cluster.nodes``, ``cluster.gpus_per_node``, ``cluster.data_dir`` and
``cluster.variational`` (:data:`DEFAULTS` fills what it lacks: the paper's SFT settings, K, M, sampling),
``sweep``?, ``run_id``?. Bad input raises ValueError with one line naming the value and what is allowed.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import PurePosixPath
from typing import Any

from predmask.config import group_entry
from predmask.rl.vr_schema import DATA_MODES, FINAL_RECIPES, STAGES
from predmask.verl.overrides import config_get, hydra_value, plain_value

__all__ = [
    "CLUSTER_RECIPES",
    "DEFAULTS",
    "SAMPLE_MODULE",
    "SFT_MODULE",
    "SFT_STAGES",
    "SOLUTION_MARKERS",
    "STAGES",
    "STAGE_INPUTS",
    "THOUGHT_MARKERS",
    "VR_DATA_FILES",
    "answer_text",
    "answers_match",
    "boxed_answer",
    "checkpoint_dir",
    "cut_trace",
    "merged_settings",
    "split_response",
    "stage_command",
    "stage_output",
    "trace_text",
]

SFT_STAGES: tuple[str, ...] = ("prior", "posterior", "final")
#: the upstream stages each stage reads (``config.inputs`` must name a run id for each)
STAGE_INPUTS: dict[str, tuple[str, ...]] = {
    "prior": (), "posterior": (), "traces": ("posterior",), "weights": ("prior", "traces"),
    "final": ("traces", "weights"),  # a vr_* final; sft reads only the prepared data
}
SFT_MODULE = "predmask.verl.vr_sft"
SAMPLE_MODULE = "predmask.verl.vr_sample"
#: files of ``python -m sweeps.data prepare --family variational`` under ``cluster.variational.data_dir``
VR_DATA_FILES: dict[str, str] = {
    "sft": "bespoke_sft.parquet",            # the original data: reasoning prompt -> original response
    "posterior": "bespoke_posterior.parquet",  # q_phi's data: hint prompt -> original response
    "questions": "bespoke_questions.parquet",  # one row per question: prompts, hint, reference answer
}
#: what each stage leaves in its run directory (the SFT stages: verl's checkpoints, HF export at the last step)
STAGE_OUTPUTS: dict[str, str] = {"prior": "checkpoints", "posterior": "checkpoints", "traces": "traces.parquet",
                                 "weights": "weights.parquet", "final": "checkpoints"}
#: the final recipes composed for the cluster (rft needs a sampling stage of pi_theta0 that is not written yet)
CLUSTER_RECIPES: tuple[str, ...] = tuple(r for r in FINAL_RECIPES if r != "rft")

#: cluster.variational defaults. The SFT settings of pi_theta0 and q_phi are the paper's (§C.1/§C.3: pi_theta0 3
#: epochs, batch 96, lr 1e-5; q_phi 10 epochs, batch 16); the final model's are taken equal to pi_theta0's; K=8,
#: M=8, evaluation temperature 0.7 / top_p 1.0 are the paper's. Marked "ours": lengths, normaliser, vLLM sizes.
DEFAULTS: dict[str, Any] = {
    "data_dir": None,                       # null -> cluster.data_dir
    "max_length": 32768,                    # ours: prompt + response tokens of one SFT sample (longer: truncated)
    "max_token_len_per_gpu": 65536,         # ours: dynamic batch size budget per GPU
    "normaliser_tokens": 32768,             # ours: constant per-sample normaliser (x batch = the loss divisor)
    "sequence_parallel": 2,                 # ours: verl's Ulysses SP of the FSDP engine
    "save_every": 200,                      # ours: verl checkpoint every N steps (the last step always)
    "prior": {"epochs": 3, "batch": 96, "lr": 1.0e-5},
    "posterior": {"epochs": 10, "batch": 16, "lr": 1.0e-5},
    "final": {"epochs": 3, "batch": 96, "lr": 1.0e-5},
    "warmup_ratio": 0.1,                    # ours
    "traces": {"k": 8, "temperature": 1.0, "top_p": 1.0, "max_tokens": 32768},
    "weights": {"m": 8, "temperature": 1.0, "top_p": 1.0, "max_tokens": 8192},
    "eval": {"n": 16, "temperature": 0.7, "top_p": 1.0},
    "vllm": {"tensor_parallel": 1, "gpu_memory_utilization": 0.85, "max_model_len": 40960},
}


def _merge(base: Mapping[str, Any], extra: Mapping[str, Any] | None) -> dict[str, Any]:
    out = dict(base)
    for key, value in (extra or {}).items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def merged_settings(config: Any) -> dict[str, Any]:
    """``cluster.variational`` over :data:`DEFAULTS` (unknown keys refused), ``data_dir`` resolved."""
    cluster = config_get(config, "cluster")
    given = plain_value(config_get(cluster, "variational")) or {}
    if not isinstance(given, Mapping):  # a config value: ValueError, as every bad input here
        raise ValueError(f"cluster.variational must be a mapping, got {given!r}")  # noqa: TRY004
    unknown = sorted(set(given) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"unknown cluster.variational key {unknown[0]!r}; allowed: {', '.join(DEFAULTS)}")
    settings = _merge(DEFAULTS, given)
    data_dir = settings["data_dir"] or config_get(cluster, "data_dir")
    if not data_dir:
        raise ValueError("the variational family on a cluster needs cluster.variational.data_dir or cluster.data_dir")
    settings["data_dir"] = str(data_dir).rstrip("/")
    return settings


def _positive(value: Any, what: str, kind: type = int) -> Any:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and value > 0
    if kind is int:
        ok = ok and float(value).is_integer()
    if not ok:
        raise ValueError(f"{what} must be a positive {kind.__name__}, got {value!r}")
    return kind(value)


def checkpoint_dir(run_dir: Any) -> str:
    """Where verl's SFT trainer writes a stage's checkpoints (HF export: ``global_step_<n>/huggingface``)."""
    return f"{str(run_dir).rstrip('/')}/checkpoints"


def stage_output(stage: str, run_dir: Any) -> str:
    """The path a stage's dependents read from its run directory."""
    if stage not in STAGE_OUTPUTS:
        raise ValueError(f"unknown stage {stage!r}; allowed: {', '.join(STAGES)}")
    return f"{str(run_dir).rstrip('/')}/{STAGE_OUTPUTS[stage]}"


def _upstream(config: Any, run_dir: Any, stage: str) -> dict[str, str]:
    inputs = plain_value(config_get(config, "inputs")) or {}
    parent = PurePosixPath(str(run_dir).rstrip("/")).parent
    out = {}
    for need in STAGE_INPUTS[stage]:
        run_id = inputs.get(need) if isinstance(inputs, Mapping) else None
        if not run_id:
            raise ValueError(f"stage {stage} needs inputs.{need} (the run id of its {need} run); got inputs={inputs!r}")
        out[need] = str(parent / str(run_id))
    return out


def _method(config: Any) -> tuple[str, str | None, str | None]:
    method = config_get(config, "method")
    name = method if isinstance(method, str) else config_get(method, "name")
    estimator = None if isinstance(method, str) else config_get(method, "estimator")
    data = None if isinstance(method, str) else config_get(method, "data")
    return str(name), estimator, data


def _sft_overrides(config: Any, run_dir: str, settings: Mapping[str, Any], stage: str,
                   train_file: str, epochs: int, batch: int, lr: float) -> dict[str, Any]:
    cluster = config_get(config, "cluster")
    nodes = _positive(config_get(cluster, "nodes"), "cluster.nodes")
    gpus = _positive(config_get(cluster, "gpus_per_node"), "cluster.gpus_per_node")
    model = config_get(config, "model")
    path = config_get(model, "path")
    if not path:
        raise ValueError("the variational family on a cluster needs a real base model with model.path: give "
                         "model=qwen3_4b_base (the paper's Qwen3-4B-Base; or qwen3_8b_base), not the CPU model "
                         f"{config_get(model, 'name')!r}")
    sp = _positive(settings["sequence_parallel"], "cluster.variational.sequence_parallel")
    if gpus % sp:
        raise ValueError(f"cluster.variational.sequence_parallel={sp} must divide cluster.gpus_per_node={gpus}")
    if batch % (nodes * gpus // sp):
        raise ValueError(f"the {stage} batch {batch} must be a multiple of the data-parallel size {nodes * gpus // sp} "
                         f"(nodes x gpus_per_node / sequence_parallel)")
    seed = int(config_get(config, "seed", 0) or 0)
    o: dict[str, Any] = {
        "data.train_files": [train_file],
        "data.val_files": None,
        "data.messages_key": "messages",
        "data.train_batch_size": batch,
        "data.micro_batch_size_per_gpu": 1,
        "data.use_dynamic_bsz": True,
        "data.max_token_len_per_gpu": _positive(settings["max_token_len_per_gpu"],
                                                "cluster.variational.max_token_len_per_gpu"),
        "data.pad_mode": "no_padding",
        "data.max_length": _positive(settings["max_length"], "cluster.variational.max_length"),
        "data.truncation": "right",
        "data.custom_cls.path": f"pkg://{SFT_MODULE}",
        "data.custom_cls.name": "WeightedSFTDataset",
        "model.path": str(path),
        "model.use_remove_padding": True,
        "model.enable_gradient_checkpointing": True,
        "engine.ulysses_sequence_parallel_size": sp,
        "engine.seed": seed,
        "optim.lr": float(lr),
        "optim.lr_warmup_steps_ratio": float(settings["warmup_ratio"]),
        "optim.lr_scheduler_type": "cosine",
        "optim.clip_grad": 1.0,
        "checkpoint.save_contents": ["model", "optimizer", "extra", "hf_model"],
        "trainer.default_local_dir": checkpoint_dir(run_dir),
        "trainer.project_name": str(config_get(config, "sweep", "predmask") or "predmask"),
        "trainer.experiment_name": str(config_get(config, "run_id") or f"{stage}-{PurePosixPath(run_dir).name}"),
        "trainer.total_epochs": epochs,
        "trainer.logger": ["console", "file"],
        "trainer.seed": seed,
        "trainer.save_freq": _positive(settings["save_every"], "cluster.variational.save_every"),
        "trainer.test_freq": -1,
        "trainer.resume_mode": "auto",
        "trainer.nnodes": nodes,
        "trainer.n_gpus_per_node": gpus,
        "hydra.run.dir": f"{run_dir}/hydra",
    }
    return o


def _sft_command(config: Any, run_dir: str, python: str, settings: Mapping[str, Any], stage: str) -> list[str]:
    data = settings["data_dir"]
    stage_settings = settings[stage]
    epochs = _positive(stage_settings["epochs"], f"cluster.variational.{stage}.epochs")
    batch = _positive(stage_settings["batch"], f"cluster.variational.{stage}.batch")
    lr = _positive(stage_settings["lr"], f"cluster.variational.{stage}.lr", float)
    predmask: dict[str, Any] = {"stage": stage, "run_dir": run_dir,
                                "normaliser": float(_positive(settings["normaliser_tokens"],
                                                              "cluster.variational.normaliser_tokens")) * batch}
    if stage == "prior":
        train = f"{data}/{VR_DATA_FILES['sft']}"
    elif stage == "posterior":
        train = f"{data}/{VR_DATA_FILES['posterior']}"
    else:
        name, estimator, setting = _method(config)
        if name not in CLUSTER_RECIPES:
            why = " (rft needs a sampling stage of pi_theta0 on the cluster, not written yet)" if name == "rft" else ""
            raise ValueError(f"final recipe method.name={name!r} is not composed for the cluster{why}; allowed: "
                             f"{', '.join(CLUSTER_RECIPES)}")
        if name == "sft":
            train = f"{data}/{VR_DATA_FILES['sft']}"
        else:
            setting = setting or "all_weighted"
            if setting not in DATA_MODES:
                raise ValueError(f"unknown method.data={setting!r}; allowed: {', '.join(DATA_MODES)}")
            expected = str(group_entry("vr_method", name)["estimator"])  # the recipe's own file owns it
            if estimator not in (None, expected):
                raise ValueError(f"method.estimator={estimator!r} does not match recipe {name} "
                                 f"(expects {expected!r})")
            train = f"{run_dir}/final_sft.parquet"  # built by vr_sft before training (see predmask.verl.vr_sft)
            upstream = _upstream(config, run_dir, stage)
            predmask.update({"recipe": name, "estimator": expected, "data": setting,
                             "weights_file": stage_output("weights", upstream["weights"]),
                             "traces_file": stage_output("traces", upstream["traces"]),
                             "questions_file": f"{data}/{VR_DATA_FILES['questions']}",
                             "original_file": f"{data}/{VR_DATA_FILES['sft']}", "train_file": train})
    o = _sft_overrides(config, run_dir, settings, stage, train, epochs, batch, lr)
    o.update({f"predmask.{k}": v for k, v in predmask.items()})
    return [python, "-m", SFT_MODULE, *(f"{k}={hydra_value(v)}" for k, v in o.items())]


def _sample_command(config: Any, run_dir: str, python: str, settings: Mapping[str, Any], stage: str) -> list[str]:
    upstream = _upstream(config, run_dir, stage)
    vllm = settings["vllm"]
    gpus = _positive(config_get(config_get(config, "cluster"), "gpus_per_node"), "cluster.gpus_per_node")
    tp = _positive(vllm["tensor_parallel"], "cluster.variational.vllm.tensor_parallel")
    if gpus % tp:
        raise ValueError(f"cluster.variational.vllm.tensor_parallel={tp} must divide cluster.gpus_per_node={gpus}")
    common = [
        "--run-dir", run_dir, "--seed", str(int(config_get(config, "seed", 0) or 0)),
        "--tensor-parallel", str(tp), "--replicas", str(gpus // tp),
        "--gpu-memory-utilization", repr(float(vllm["gpu_memory_utilization"])),
        "--max-model-len", str(_positive(vllm["max_model_len"], "cluster.variational.vllm.max_model_len")),
        "--questions", f"{settings['data_dir']}/{VR_DATA_FILES['questions']}",
    ]
    if stage == "traces":
        s = settings["traces"]
        return [python, "-m", SAMPLE_MODULE, "traces", *common,
                "--posterior", stage_output("posterior", upstream["posterior"]),
                "--k", str(_positive(s["k"], "cluster.variational.traces.k")),
                "--temperature", repr(float(s["temperature"])), "--top-p", repr(float(s["top_p"])),
                "--max-tokens", str(_positive(s["max_tokens"], "cluster.variational.traces.max_tokens"))]
    s = settings["weights"]
    return [python, "-m", SAMPLE_MODULE, "weights", *common,
            "--prior", stage_output("prior", upstream["prior"]),
            "--traces", stage_output("traces", upstream["traces"]),
            "--m", str(_positive(s["m"], "cluster.variational.weights.m")),
            "--temperature", repr(float(s["temperature"])), "--top-p", repr(float(s["top_p"])),
            "--max-tokens", str(_positive(s["max_tokens"], "cluster.variational.weights.max_tokens"))]


def stage_command(config: Any, run_dir: Any, python: str | None = None) -> list[str]:
    """The argv of one variational stage run on the cluster (see the module docstring); raises ValueError."""
    stage = config_get(config, "stage")
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; allowed: {', '.join(STAGES)}")
    settings = merged_settings(config)
    run_dir = str(run_dir).rstrip("/")
    python = python or sys.executable
    if stage in SFT_STAGES:
        return _sft_command(config, run_dir, python, settings, stage)
    return _sample_command(config, run_dir, python, settings, stage)


# -- the response format of the cluster data (one owner: sweeps.data and vr_sample both use these) ---------------

#: Bespoke-Stratos-17k's section markers (also in conf/prompt/reasoning.yaml, which sweeps.data checks against these)
THOUGHT_MARKERS: tuple[str, str] = ("<|begin_of_thought|>", "<|end_of_thought|>")
SOLUTION_MARKERS: tuple[str, str] = ("<|begin_of_solution|>", "<|end_of_solution|>")


def split_response(text: str) -> tuple[str, str]:
    """(thought, solution) of a response in the dataset's format; ValueError naming what is wrong with it."""
    positions = {}
    for marker in (*THOUGHT_MARKERS, *SOLUTION_MARKERS):
        count = text.count(marker)
        if count != 1:
            raise ValueError(f"{'no' if count == 0 else count} {marker} marker{'s' if count > 1 else ''}"
                             f"{'' if count == 0 else ' (expected one)'}")
        positions[marker] = text.index(marker)
    order = [positions[m] for m in (*THOUGHT_MARKERS, *SOLUTION_MARKERS)]
    if order != sorted(order):
        raise ValueError("markers out of order (expected thought begin/end, then solution begin/end)")
    thought = text[positions[THOUGHT_MARKERS[0]] + len(THOUGHT_MARKERS[0]):positions[THOUGHT_MARKERS[1]]].strip()
    solution = text[positions[SOLUTION_MARKERS[0]] + len(SOLUTION_MARKERS[0]):positions[SOLUTION_MARKERS[1]]].strip()
    if not thought:
        raise ValueError("empty thought section")
    if not solution:
        raise ValueError("empty solution section")
    return thought, solution


def trace_text(thought: str) -> str:
    """The trace z as the model writes it: the thought section with its markers (the response's prefix)."""
    return f"{THOUGHT_MARKERS[0]}\n\n{thought}\n\n{THOUGHT_MARKERS[1]}"


def answer_text(solution: str) -> str:
    """The answer y′ that follows a trace: the solution section with its markers."""
    return f"\n\n{SOLUTION_MARKERS[0]}\n\n{solution}\n\n{SOLUTION_MARKERS[1]}"


def cut_trace(response: str) -> tuple[str, str] | None:
    """(z, the rest) of a generated response: z up to and including the end-of-thought marker; None without it."""
    end = response.find(THOUGHT_MARKERS[1])
    if end < 0:
        return None
    end += len(THOUGHT_MARKERS[1])
    return response[:end], response[end:]


def boxed_answer(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces matched), whitespace-collapsed; None when there is none."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return " ".join(text[i + 1:j].split())
    return None


def answers_match(response: str, reference: str) -> bool:
    """Whether a response's last boxed answer equals the reference's, as strings after collapsing whitespace
    (a plain comparison, not a math-equivalence check: ``1/2`` and ``0.5`` differ)."""
    got = boxed_answer(response)
    return bool(reference) and got is not None and got.replace(" ", "") == reference.replace(" ", "")
