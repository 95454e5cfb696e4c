"""The variational-reasoning family on a cluster: one stage run -> its job's argv (pure; imports no verl).

:func:`stage_command` is what the sweep calls for ``trainer=verl``, for the stages of ``predmask.vr_stages``:
the SFT stages (``prior`` / ``posterior`` / ``final``) through ``python -m predmask.verl.vr_sft`` on the Ray
head of the job over all its GPUs, the vLLM stages (``traces`` / ``weights`` / ``rft_samples`` / ``eval``)
through ``python -m predmask.verl.vr_sample`` on the head node's GPUs (docs/cluster.md). ``config`` is the
composed stage config of conf/variational.yaml with a cluster model and a verl cluster
(``cluster.variational``: ``predmask.schemas.cluster_schema.VariationalClusterConfig``): ``stage``,
``method``, ``seed``, ``inputs`` (upstream stage -> run id, a sibling of ``run_dir``), ``model.path``,
``sweep``?, ``run_id``?. Bad input raises ValueError with one line naming the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from predmask.config import group_entry, typed_view
from predmask.rundir import METRICS_FILE
from predmask.schemas.cluster_schema import SFTStageConfig, VerlClusterConfig
from predmask.schemas.variational_schema import DATA_MODES, FINAL_RECIPES
from predmask.verl.overrides import (
    DATA_FILES,
    HYDRA_SUBDIR,
    attention_overrides,
    config_get,
    config_select,
    hydra_value,
    plain_value,
    require,
    tracker_names,
)
from predmask.vr_stages import CLUSTER_STAGES, SFT_STAGES, stage_inputs

SFT_MODULE = "predmask.verl.vr_sft"
SAMPLE_MODULE = "predmask.verl.vr_sample"
#: what a missing key is needed for, in the one-line errors
VR_RUN = "the variational family on a cluster"
#: files of ``python -m sweeps.datasets prepare --family variational`` under ``cluster.variational.data_dir``
VR_DATA_FILES: dict[str, str] = {
    "sft": "bespoke_sft.parquet",            # the original data: reasoning prompt -> original response
    "posterior": "bespoke_posterior.parquet",  # q_phi's data: hint prompt -> original response
    "questions": "bespoke_questions.parquet",  # one row per question: prompts, hint, reference answer
}
#: what each stage leaves in its run directory (the SFT stages: verl's checkpoints, HF export at the last step)
STAGE_OUTPUTS: dict[str, str] = {"prior": "checkpoints", "posterior": "checkpoints", "traces": "traces.parquet",
                                 "weights": "weights.parquet", "rft_samples": "rft_samples.parquet",
                                 "final": "checkpoints", "eval": METRICS_FILE}
#: the final recipes composed for the cluster
CLUSTER_RECIPES: tuple[str, ...] = FINAL_RECIPES
#: the evaluation splits of the cluster: the RL family's AIME files (``python -m sweeps.datasets prepare``) in
#: ``cluster.data_dir``; a split's name is its metric's source (``val-core/aime24/acc/mean@16``)
EVAL_SPLITS: tuple[str, ...] = ("aime24", "aime25")


#: the bound on a vLLM step's tokens is a multiple of this (vLLM's scheduler works in such blocks; ours)
TOKEN_MULTIPLE = 256
GIB = 2**30


def max_safe_utilization(tokens: int, *, vocab: int, bytes_per_logit: int, gpu_memory_gib: float,
                         reserve_gib: float) -> float:
    """The largest ``gpu_memory_utilization`` that leaves room for the prompt log-probs of ``tokens`` tokens
    (``tokens x vocab x bytes_per_logit`` bytes, which vLLM's memory profiling does not count) plus ``reserve_gib``:
    1 − (that + reserve) / gpu_memory."""
    return 1.0 - (tokens * vocab * bytes_per_logit / GIB + reserve_gib) / gpu_memory_gib


def prompt_logprob_tokens(*, vocab: int, bytes_per_logit: int, gpu_memory_gib: float, utilization: float,
                          reserve_gib: float, max_model_len: int) -> int:
    """vLLM's ``max_num_batched_tokens`` for scoring with ``prompt_logprobs``: the most tokens (a multiple of
    TOKEN_MULTIPLE, at most ``max_model_len``) whose [tokens, vocab] logits and log-probs, ``bytes_per_logit``
    bytes per entry, fit in the memory vLLM leaves outside its budget, (1 − utilization) x gpu_memory − reserve
    (docs/cluster.md, "Sampling"). ValueError (one line) when not even TOKEN_MULTIPLE tokens fit."""
    free = (1.0 - utilization) * gpu_memory_gib - reserve_gib
    per_token = vocab * bytes_per_logit
    tokens = int(max(free, 0.0) * GIB // per_token) // TOKEN_MULTIPLE * TOKEN_MULTIPLE
    if tokens < TOKEN_MULTIPLE:
        top = max_safe_utilization(TOKEN_MULTIPLE, vocab=vocab, bytes_per_logit=bytes_per_logit,
                                   gpu_memory_gib=gpu_memory_gib, reserve_gib=reserve_gib)
        raise ValueError(f"cluster.variational.vllm.gpu_memory_utilization={utilization!r} leaves {free:.2f} GiB "
                         f"outside vLLM's budget, less than the prompt log-probs of {TOKEN_MULTIPLE} tokens need "
                         f"({TOKEN_MULTIPLE * per_token / GIB:.2f} GiB); allowed: at most {top:.3f}")
    return min(tokens, max_model_len)


def cluster_settings(config: Any) -> VerlClusterConfig:
    """The stage config's ``cluster`` section, checked (``cluster.variational`` included), with a data directory."""
    cluster = typed_view(VerlClusterConfig, config_get(config, "cluster"), "cluster", VR_RUN)
    if not cluster.variational.data_dir:
        raise ValueError("the variational family on a cluster needs cluster.variational.data_dir or cluster.data_dir")
    cluster.variational.data_dir = cluster.variational.data_dir.rstrip("/")
    return cluster


def _eval_files(cluster: VerlClusterConfig) -> list[str]:
    base = cluster.data_dir.rstrip("/") if cluster.data_dir else cluster.variational.data_dir
    return [f"{base}/{DATA_FILES[s]}" for s in EVAL_SPLITS]


def eval_files(config: Any) -> list[str]:
    """The evaluation files an ``eval`` stage reads, one per EVAL_SPLITS: the RL family's AIME files in
    ``cluster.data_dir`` (else ``cluster.variational.data_dir``); what the eval command passes and the dry run checks."""
    return _eval_files(cluster_settings(config))


def merged_settings(config: Any) -> dict[str, Any]:
    """``cluster.variational`` of a stage config as a plain dict, checked (what ``sweeps.plan`` reads)."""
    return dataclasses.asdict(cluster_settings(config).variational)


def stage_output(stage: str, run_dir: Any) -> str:
    """The path a stage's dependents read from its run directory."""
    if stage not in STAGE_OUTPUTS:
        raise ValueError(f"unknown stage {stage!r}; allowed: {', '.join(CLUSTER_STAGES)}")
    return f"{str(run_dir).rstrip('/')}/{STAGE_OUTPUTS[stage]}"


#: CPU-engine settings of the variational family (key, the value the cluster path runs): the cluster's data files and
#: prompts (sweeps.datasets, conf/prompt/) fix q_phi's hint and data, so any other value would be silently ignored
CPU_ONLY_SETTINGS: tuple[tuple[str, Any], ...] = (("hint.use", True), ("posterior.source", "original"))


@dataclass(frozen=True)
class _Stage:
    """What a stage's command reads of its config (read once, by :func:`_read_stage`)."""

    stage: str
    run_dir: str
    python: str
    method: str
    estimator: str | None
    data: str | None
    inputs: Any  # upstream stage -> run id (checked where a stage needs one)
    model_path: Any  # checked by the SFT stages
    model_name: Any
    seed: int
    trackers: dict[str, str]
    cluster: VerlClusterConfig


def _read_stage(config: Any, run_dir: Any, python: str | None) -> _Stage:
    stage = config_get(config, "stage")
    if stage not in CLUSTER_STAGES:
        raise ValueError(f"unknown stage {stage!r}; allowed: {', '.join(CLUSTER_STAGES)}")
    for key, runs in CPU_ONLY_SETTINGS:
        value = config_select(config, key)
        if value is not None and value != runs:
            raise ValueError(f"{key}={value!r} runs on the CPU engine only; the cluster path runs {key}={runs!r} "
                             "(its hint prompts and q_phi's data come from sweeps.datasets and conf/prompt/)")
    run_dir = str(run_dir).rstrip("/")
    method = config_get(config, "method")
    name, estimator, data = ((method, None, None) if isinstance(method, str) else
                             (str(config_get(method, "name")), config_get(method, "estimator"), config_get(method, "data")))
    return _Stage(stage, run_dir, python or sys.executable, name, estimator, data,
                  inputs=plain_value(config_get(config, "inputs")) or {},
                  model_path=config_select(config, "model.path"), model_name=config_select(config, "model.name"),
                  seed=int(require(config, "seed", VR_RUN)),
                  trackers=tracker_names(config, f"{stage}-{PurePosixPath(run_dir).name}"),
                  cluster=cluster_settings(config))


def _upstream(r: _Stage) -> dict[str, str]:
    """Upstream stage -> the output its run left in the sibling run directory ``inputs`` names."""
    parent = PurePosixPath(r.run_dir).parent
    out = {}
    for need in stage_inputs(r.stage, r.method, cluster=True):
        run_id = r.inputs.get(need) if isinstance(r.inputs, Mapping) else None
        if not run_id:
            raise ValueError(f"stage {r.stage} needs inputs.{need} (the run id of its {need} run); "
                             f"got inputs={r.inputs!r}")
        out[need] = stage_output(need, parent / str(run_id))
    return out


def _sft_overrides(r: _Stage, train_file: str, s: SFTStageConfig) -> dict[str, Any]:
    v, nodes, gpus = r.cluster.variational, r.cluster.nodes, r.cluster.gpus_per_node
    if not r.model_path:
        raise ValueError("the variational family on a cluster needs a real base model with model.path: give "
                         "model=qwen3_4b_base (the paper's Qwen3-4B-Base; or qwen3_8b_base), not the CPU model "
                         f"{r.model_name!r}")
    sp = v.sequence_parallel
    if gpus % sp:
        raise ValueError(f"cluster.variational.sequence_parallel={sp} must divide cluster.gpus_per_node={gpus}")
    if s.batch % (nodes * gpus // sp):
        raise ValueError(f"the {r.stage} batch {s.batch} must be a multiple of the data-parallel size "
                         f"{nodes * gpus // sp} (nodes x gpus_per_node / sequence_parallel)")
    return {
        "data.train_files": [train_file], "data.val_files": None, "data.messages_key": "messages",
        "data.train_batch_size": s.batch, "data.micro_batch_size_per_gpu": 1, "data.use_dynamic_bsz": True,
        "data.max_token_len_per_gpu": v.max_token_len_per_gpu, "data.pad_mode": "no_padding",
        "data.max_length": v.max_length, "data.truncation": "right",
        "data.custom_cls.path": f"pkg://{SFT_MODULE}", "data.custom_cls.name": "WeightedSFTDataset",
        "model.path": str(r.model_path), "model.use_remove_padding": True, "model.enable_gradient_checkpointing": True,
        **attention_overrides("model", r.cluster, sp, "cluster.variational.sequence_parallel"),
        "engine.ulysses_sequence_parallel_size": sp, "engine.seed": r.seed,
        "optim.lr": s.lr, "optim.lr_warmup_steps_ratio": v.warmup_ratio, "optim.lr_scheduler_type": "cosine",
        "optim.clip_grad": 1.0, "checkpoint.save_contents": ["model", "optimizer", "extra", "hf_model"],
        "trainer.default_local_dir": stage_output(r.stage, r.run_dir), **r.trackers,
        "trainer.total_epochs": s.epochs, "trainer.logger": ["console", "file"], "trainer.seed": r.seed,
        "trainer.save_freq": v.save_every, "trainer.test_freq": -1, "trainer.resume_mode": "auto",
        "trainer.nnodes": nodes, "trainer.n_gpus_per_node": gpus, "hydra.run.dir": f"{r.run_dir}/{HYDRA_SUBDIR}",
    }


def _final_train(r: _Stage, predmask: dict[str, Any]) -> str:
    """The final stage's training file (the original data for sft; for rft pi_theta0's correct samples and for vr_*
    the weighted traces, which vr_sft builds from its upstream outputs, whose paths go into ``predmask``)."""
    name, data = r.method, r.cluster.variational.data_dir
    if name not in CLUSTER_RECIPES:
        raise ValueError(f"final recipe method.name={name!r} is not composed for the cluster; allowed: "
                         f"{', '.join(CLUSTER_RECIPES)}")
    if name == "sft":
        return f"{data}/{VR_DATA_FILES['sft']}"
    train = f"{r.run_dir}/final_sft.parquet"  # built by vr_sft before training (see predmask.verl.vr_sft)
    if name == "rft":
        predmask.update({"recipe": name, "samples_file": _upstream(r)["rft_samples"],
                         "questions_file": f"{data}/{VR_DATA_FILES['questions']}", "train_file": train})
        return train
    setting = r.data or "all_weighted"
    if setting not in DATA_MODES:
        raise ValueError(f"unknown method.data={setting!r}; allowed: {', '.join(DATA_MODES)}")
    expected = str(group_entry("vr_method", name)["estimator"])  # the recipe's own file owns it
    if r.estimator not in (None, expected):
        raise ValueError(f"method.estimator={r.estimator!r} does not match recipe {name} (expects {expected!r})")
    upstream = _upstream(r)
    predmask.update({"recipe": name, "estimator": expected, "data": setting, "weights_file": upstream["weights"],
                     "traces_file": upstream["traces"], "questions_file": f"{data}/{VR_DATA_FILES['questions']}",
                     "original_file": f"{data}/{VR_DATA_FILES['sft']}", "train_file": train})
    return train


def _sft_command(r: _Stage) -> list[str]:
    v = r.cluster.variational
    s: SFTStageConfig = getattr(v, r.stage)
    predmask: dict[str, Any] = {"stage": r.stage, "run_dir": r.run_dir,
                                "normaliser": float(v.normaliser_tokens) * s.batch}
    train = (f"{v.data_dir}/{VR_DATA_FILES['sft' if r.stage == 'prior' else 'posterior']}" if r.stage != "final"
             else _final_train(r, predmask))
    o = _sft_overrides(r, train, s)
    o.update({f"predmask.{k}": val for k, val in predmask.items()})
    return [r.python, "-m", SFT_MODULE, *(f"{k}={hydra_value(val)}" for k, val in o.items())]


def _sample_command(r: _Stage) -> list[str]:
    upstream = _upstream(r)
    v, gpus = r.cluster.variational, r.cluster.gpus_per_node
    tp = v.vllm.tensor_parallel
    if gpus % tp:
        raise ValueError(f"cluster.variational.vllm.tensor_parallel={tp} must divide cluster.gpus_per_node={gpus}")
    e = v.vllm
    bound = prompt_logprob_tokens(vocab=e.logits_vocab, bytes_per_logit=e.bytes_per_logit,
                                  gpu_memory_gib=e.gpu_memory_gib, utilization=e.gpu_memory_utilization,
                                  reserve_gib=e.reserve_gib, max_model_len=e.max_model_len)
    common = ["--run-dir", r.run_dir, "--seed", str(r.seed),
              "--tensor-parallel", str(tp), "--replicas", str(gpus // tp),
              "--gpu-memory-utilization", repr(e.gpu_memory_utilization), "--max-model-len", str(e.max_model_len),
              "--max-num-batched-tokens", str(bound), "--questions", f"{v.data_dir}/{VR_DATA_FILES['questions']}"]
    if r.stage == "traces":
        mode, sampling = "traces", v.traces
        extra = ["--posterior", upstream["posterior"], "--k", str(sampling.k)]
    elif r.stage == "rft_samples":
        mode, sampling = "rft", v.rft
        extra = ["--prior", upstream["prior"], "--samples", str(sampling.samples)]
    elif r.stage == "eval":
        mode, sampling, (source,) = "eval", v.eval, upstream.values()
        files = [a for f in _eval_files(r.cluster) for a in ("--eval-file", f)]
        extra = ["--model", source, *files, "--n", str(sampling.n)]
    else:
        mode, sampling = "weights", v.weights
        extra = ["--prior", upstream["prior"], "--traces", upstream["traces"], "--m", str(sampling.m)]
    return [r.python, "-m", SAMPLE_MODULE, mode, *common, *extra, "--temperature", repr(sampling.temperature),
            "--top-p", repr(sampling.top_p), "--max-tokens", str(sampling.max_tokens)]


def stage_attention(config: Any) -> str | None:
    """The attention a stage loads its transformers model with: ``cluster.attn_implementation`` for the SFT stages,
    None for the vLLM stages (vLLM's own)."""
    return cluster_settings(config).attn_implementation if config_get(config, "stage") in SFT_STAGES else None


def stage_command(config: Any, run_dir: Any, python: str | None = None) -> list[str]:
    """The argv of one variational stage run on the cluster (see the module docstring); raises ValueError."""
    r = _read_stage(config, run_dir, python)
    return _sft_command(r) if r.stage in SFT_STAGES else _sample_command(r)


# -- the files of the stage programs (vr_sft and vr_sample) --------------------------------------------------

class MissingInput(FileNotFoundError):
    """An upstream output is not there (exit 2, one line)."""


def read_parquet(path: str | Path, stage: str, how: str) -> list[dict[str, Any]]:
    """The rows of a stage's input file; :class:`MissingInput` naming the stage, the path and ``how``."""
    import pyarrow.parquet as pq

    if not Path(path).is_file():
        raise MissingInput(f"stage {stage}: missing {path}; {how}")
    return pq.read_table(path).to_pylist()


def write_parquet(rows: Sequence[Mapping[str, Any]], path: Path, columns: Sequence[str] | None = None,
                  schema: Any = None) -> None:
    """``rows`` (only ``columns``, in that order, when given) as a parquet file, written atomically, with
    ``schema`` or else the one pyarrow infers."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from predmask.io import atomic_write

    table = pa.Table.from_pylist([dict(r) if columns is None else {c: r[c] for c in columns} for r in rows],
                                 schema=schema)
    atomic_write(path, lambda tmp: pq.write_table(table, tmp))


def chat_messages(system: str, user: str, assistant: str | None = None) -> list[dict[str, str]]:
    """A chat: the system turn (if not empty), the user turn, the assistant's (if given)."""
    out = [{"role": "system", "content": system}] if system else []
    out.append({"role": "user", "content": user})
    return [*out, {"role": "assistant", "content": assistant}] if assistant is not None else out


# -- the response format of the cluster data (one owner: sweeps.datasets and vr_sample both use these) ---------------

#: Bespoke-Stratos-17k's section markers (also in conf/prompt/reasoning.yaml, which sweeps.datasets checks against these)
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
