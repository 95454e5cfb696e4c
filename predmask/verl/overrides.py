"""Translate a composed predmask run config into verl 0.9.1 Hydra overrides (pure; imports no verl).

``verl_overrides(run_cfg)`` returns the overrides for ``python -m predmask.verl.launch``, built per verl
section by one small function each; :func:`verl_command` is the full argv of one run. ``run_cfg`` is the
composed conf/train.yaml with a cluster model and a verl cluster (:mod:`predmask.schemas.cluster_schema`);
optionally ``data`` (``train_files`` and ``val_files``, or ``dir``; else ``cluster.data_dir``: the files of
``python -m sweeps.datasets prepare``), ``run_dir``, ``run_id``, ``sweep`` (verl's project name) and ``verl``
(raw verl overrides, applied after ``model.verl``). No verl key changes meaning: predmask's own parameters
travel under predmask's own keys (:mod:`predmask.verl.settings`).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from predmask.config import typed_view
from predmask.methods import METHODS, TOPK_SUPPORTS, Method, MethodParams, get_method
from predmask.metrics import LOSS_STATS_DIR
from predmask.precisions import CLUSTER_PRECISIONS, Precision, get_precision
from predmask.rundir import METRICS_FILE
from predmask.schemas.cluster_schema import ClusterModelConfig, VerlClusterConfig
from predmask.schemas.train_schema import check_loggers
from predmask.verl.cpu_standin import (
    CPU_MODULE,
    VERL_CPU_OVERRIDES,
    rollout_dtype,
    standin_data,
    standin_model,
)
from predmask.verl.settings import PREFIX

#: verl's Hydra output directory inside a run directory (how the launcher finds the run directory it writes)
HYDRA_SUBDIR = "hydra"
#: the module every verl process must import (it installs the hooks), and verl's env var that makes it do so
#: (verl/__init__.py imports the comma-separated modules it names)
PLUGIN_MODULE = "predmask.verl.plugin"
PLUGIN_ENV = "VERL_USE_EXTERNAL_MODULES"
#: file names written by ``python -m sweeps.datasets prepare``
DATA_FILES: dict[str, str] = {"train": "dapo_math_13k.parquet", "aime24": "aime24.parquet", "aime25": "aime25.parquet"}
RUNTIME_ENV = "+ray_kwargs.ray_init.runtime_env.env_vars"
#: vLLM's default cap on logprobs per token (engine arg max_logprobs); a larger K raises it
VLLM_DEFAULT_MAX_LOGPROBS = 20
#: the key under a verl model section that sets the attention its transformers model is loaded with (verl reads
#: ``override_config.get("attn_implementation", "flash_attention_2")``, verl/workers/config/model.py)
ATTN_KEY = "override_config.attn_implementation"
#: the only attention verl 0.9.1's Ulysses sequence parallelism works with: its all-to-all is patched into
#: transformers' flash-attention forward (verl/models/transformers/monkey_patch.py), so any other would attend within
#: each rank's slice of the sequence
ULYSSES_ATTENTION = "flash_attention_2"
#: what :func:`run_attention` says of a Megatron run: Megatron's own attention (verl's
#: ``actor.megatron.override_transformer_config.attention_backend``, default flash), not ``cluster.attn_implementation``
MEGATRON_ATTENTION = "megatron"

_SAFE = re.compile(r"^[A-Za-z0-9_./@:+-]+$")
_LOOKS_TYPED = re.compile(r"^(true|false|null|nan|inf|-inf|[+-]?[0-9][0-9_]*(\.[0-9]*)?([eE][+-]?[0-9]+)?)$", re.IGNORECASE)


def _quoted(text: str) -> str:
    """A single-quoted Hydra string that parses (and resolves) back to ``text`` literally.

    Hydra keeps backslashes in quoted strings except runs right before a quote (doubled here, including before
    the closing quote), ``\\'`` is a quote, and ``\\${`` keeps an interpolation literal.
    """
    text = text.replace("${", "\\${")
    text = re.sub(r"(\\+)(?='|$)", lambda m: m.group(1) * 2, text)
    return "'" + text.replace("'", "\\'") + "'"


def hydra_value(value: Any) -> str:
    """Format a Python value as a Hydra override value (strings quoted unless plainly safe)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        if _SAFE.match(value) and not _LOOKS_TYPED.match(value) and not value.startswith(("-", "+")):
            return value
        return _quoted(value)
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{hydra_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, Sequence):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    raise ValueError(f"cannot express {type(value).__name__} value {value!r} as a Hydra override")


def config_get(cfg: Any, key: str, default: Any = None) -> Any:
    """``key`` of a mapping, an OmegaConf config or any object with a ``get`` (else its attribute); ``default`` when
    it has none or ``cfg`` is None."""
    if cfg is None:
        return default
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    getter = getattr(cfg, "get", None)
    return getter(key, default) if callable(getter) else getattr(cfg, key, default)


def config_select(cfg: Any, dotted: str, default: Any = None) -> Any:
    """The value at ``dotted`` of ``cfg`` (:func:`config_get` per key); else ``default``."""
    for key in dotted.split("."):
        cfg = config_get(cfg, key)
        if cfg is None:
            return default
    return cfg


def plain_value(value: Any) -> Any:
    """OmegaConf containers -> plain Python (lists/dicts), other values unchanged."""
    if isinstance(value, DictConfig | ListConfig):
        return OmegaConf.to_container(value, resolve=True)
    return value


#: what a missing key is needed for, in the one-line errors
VERL_RUN = "a VeRL run"


def require(cfg: Any, dotted: str, needed_for: str = VERL_RUN) -> Any:
    """The value at ``dotted`` of a run config; one line when it is missing or empty."""
    value = config_select(cfg, dotted)
    if value is None or value == "":
        raise ValueError(f"run config is missing {dotted} (needed for {needed_for})")
    return value


def _name(value: Any, what: str) -> str:
    name = value if isinstance(value, str) else config_get(value, "name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"run config {what} must be a name or a mapping with 'name', got {value!r}")
    return name


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be an integer >= 1, got {value!r}")
    return value


def _files(value: Any) -> list[str]:
    value = plain_value(value)
    files = [value] if isinstance(value, str) else list(value or [])
    if not files or not all(isinstance(f, str) and f for f in files):
        raise ValueError(f"data files must be a path or a list of paths, got {value!r}")
    return files


def data_files(run_cfg: Any) -> tuple[list[str], list[str]]:
    """(train files, validation files) a VeRL run of ``run_cfg`` reads (see the module docstring's ``data``)."""
    data = config_get(run_cfg, "data")
    if config_get(data, "train_files") is not None:
        return _files(require(run_cfg, "data.train_files")), _files(require(run_cfg, "data.val_files"))
    data_dir = config_get(data, "dir") or config_get(config_get(run_cfg, "cluster"), "data_dir")
    if not data_dir:
        raise ValueError(
            "run config needs data.train_files/data.val_files, data.dir or cluster.data_dir for a VeRL run"
        )
    base = str(data_dir).rstrip("/")
    return [f"{base}/{DATA_FILES['train']}"], [f"{base}/{DATA_FILES['aime24']}", f"{base}/{DATA_FILES['aime25']}"]


def _method_params(run_cfg: Any) -> tuple[str, MethodParams]:
    method_cfg = config_get(run_cfg, "method")
    name = _name(method_cfg, "method")
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; known methods: {', '.join(sorted(METHODS))}")
    values: dict[str, Any] = {}
    if not isinstance(method_cfg, str):
        values.update({k: v for k, v in (plain_value(method_cfg) or {}).items() if k != "name"})
    if values.get("delta") is None and config_get(run_cfg, "delta") is not None:
        values["delta"] = config_get(run_cfg, "delta")
    given = {k: v for k, v in values.items() if v is not None}
    return name, MethodParams.from_mapping({**dict(METHODS[name].defaults), **given})  # the method's own defaults


def _precision(run_cfg: Any) -> Precision:
    precision = get_precision(_name(require(run_cfg, "precision"), "precision"))
    if not precision.cluster:
        allowed = ", ".join(CLUSTER_PRECISIONS)
        raise ValueError(f"precision {precision.name!r} does not run on the cluster; allowed: {allowed}")
    return precision


@dataclass(frozen=True)
class _Run:
    """What the section builders read, checked."""

    name: str
    method: Method
    params: MethodParams
    precision: Precision
    model: ClusterModelConfig
    cluster: VerlClusterConfig
    top_k: int
    seed: int
    val_n: int
    run_dir: str | None
    cfg: Any  # the run config itself: data files, trainer.logger, sweep, run_id, verl

    @property
    def anchor(self) -> str:
        return self.method.anchor(self.params)

    @property
    def wants_topk(self) -> bool:
        return self.method.needs_support or self.anchor == "rollout"

    @property
    def token_len(self) -> int:
        b = self.model.batch
        return b.max_token_len_per_gpu or 2 * (b.max_prompt_length + b.max_response_length)


def _run(run_cfg: Any) -> _Run:
    name, params = _method_params(run_cfg)
    top_k = _positive_int(config_get(run_cfg, "top_k"), "top_k")
    precision = _precision(run_cfg)
    cluster = typed_view(VerlClusterConfig, config_get(run_cfg, "cluster"), "cluster", VERL_RUN)
    if cluster.device == "cpu":  # the CPU stand-in in place of the cluster model (predmask.verl.cpu_standin)
        rollout_dtype(precision)
        model = typed_view(ClusterModelConfig, standin_model(run_cfg), "model", VERL_RUN)
    else:
        model = typed_view(ClusterModelConfig, config_get(run_cfg, "model"), "model", VERL_RUN)
    if precision.train_fp8 and model.engine != "megatron":
        raise ValueError(f"precision {precision.name} (FP8 training) needs model.engine=megatron")
    run_dir = config_get(run_cfg, "run_dir")
    return _Run(name, get_method(name), params, precision, model, cluster, top_k, int(require(run_cfg, "seed")),
                _positive_int(require(run_cfg, "trainer.val_n"), "trainer.val_n"),
                str(run_dir).rstrip("/") if run_dir else None, run_cfg)


def attention_overrides(section: str, cluster: VerlClusterConfig, sequence_parallel: int,
                        sequence_key: str) -> dict[str, str]:
    """The override that loads the transformers model of verl's model ``section`` with ``cluster.attn_implementation``
    (always spelled out, verl's default included, so that the command says it); one line when it cannot run with
    ``sequence_parallel`` Ulysses ranks (set by the run config's ``sequence_key``)."""
    attn = cluster.attn_implementation
    if sequence_parallel > 1 and attn != ULYSSES_ATTENTION:
        raise ValueError(f"cluster.attn_implementation={attn} with {sequence_key}={sequence_parallel}: verl 0.9.1 runs "
                         f"Ulysses sequence parallelism inside {ULYSSES_ATTENTION} only; set "
                         f"cluster.attn_implementation={ULYSSES_ATTENTION} or {sequence_key}=1")
    return {f"+{section}.{ATTN_KEY}": attn}


def run_attention(run_cfg: Any) -> str:
    """The attention a VeRL training run's actor uses: ``cluster.attn_implementation`` on engine=fsdp,
    :data:`MEGATRON_ATTENTION` on Megatron (what the dry-run says)."""
    cluster = config_get(run_cfg, "cluster")
    if config_get(cluster, "device") == "cpu":  # the stand-in on FSDP (predmask.verl.cpu_standin)
        return str(config_get(cluster, "attn_implementation"))
    r = _run(run_cfg)
    return r.cluster.attn_implementation if r.model.engine == "fsdp" else MEGATRON_ATTENTION


def _data(r: _Run) -> dict[str, Any]:
    """Data, reward (verl's default dispatch on data_source: DAPO math scoring) and GRPO advantages without KL, divided
    by the group's std or not as the cluster config says."""
    if r.cluster.device == "cpu":
        data = standin_data(r.cfg)
        train_files, val_files = data["train_files"], data["val_files"]
    else:
        train_files, val_files = data_files(r.cfg)
    b = r.model.batch
    return {"data.train_files": train_files, "data.val_files": val_files, "data.prompt_key": "prompt",
            "data.max_prompt_length": b.max_prompt_length, "data.max_response_length": b.max_response_length,
            "data.train_batch_size": b.train_prompts, "data.filter_overlong_prompts": True,
            "data.truncation": "error", "data.seed": r.seed,
            "algorithm.adv_estimator": "grpo", "algorithm.use_kl_in_reward": False,
            "algorithm.norm_adv_by_std_in_grpo": r.cluster.norm_adv_by_std}


def _actor(r: _Run) -> dict[str, Any]:
    """The model (on FSDP with the cluster's attention) and the actor: the loss and its parameters
    (predmask.verl.loss maps them), the PPO epochs per batch (``trainer.ppo_epochs``, the CPU engine's: the paper's
    one), no KL, the engine's parallelism, FP8 training."""
    actor, b, p = "actor_rollout_ref.actor", r.model.batch, r.model.parallel
    o: dict[str, Any] = {"actor_rollout_ref.model.path": r.model.path,
                         "actor_rollout_ref.model.use_remove_padding": True,
                         "actor_rollout_ref.model.use_fused_kernels": r.model.fused_kernels and r.model.engine == "fsdp"}
    if r.model.engine == "fsdp":
        o |= attention_overrides("actor_rollout_ref.model", r.cluster, p.sequence, "model.parallel.sequence")
    o |= {f"{actor}.policy_loss.loss_mode": r.name, f"{actor}.loss_agg_mode": r.params.loss_agg_mode}
    if r.method.kind == "clip":  # verl's PPO clip range, in verl's meaning
        o |= {f"{actor}.clip_ratio_low": r.params.eps_low, f"{actor}.clip_ratio_high": r.params.eps_high}
    o |= {f"{actor}.ppo_epochs": _positive_int(require(r.cfg, "trainer.ppo_epochs"), "trainer.ppo_epochs"),
          f"{actor}.ppo_mini_batch_size": b.ppo_mini_batch_prompts,
          f"{actor}.use_dynamic_bsz": True, f"{actor}.ppo_max_token_len_per_gpu": r.token_len,
          f"{actor}.use_kl_loss": False, f"{actor}.entropy_coeff": 0, f"{actor}.optim.lr": b.lr,
          f"{actor}.data_loader_seed": r.seed}
    if r.model.engine == "megatron":
        mg = f"{actor}.megatron"
        o |= {f"{mg}.tensor_model_parallel_size": p.tensor, f"{mg}.pipeline_model_parallel_size": p.pipeline,
              f"{mg}.expert_model_parallel_size": p.expert, f"{mg}.context_parallel_size": 1, f"{mg}.seed": r.seed}
    else:
        o |= {f"{actor}.fsdp_config.seed": r.seed, f"{actor}.fsdp_config.ulysses_sequence_parallel_size": p.sequence}
    if r.precision.train_fp8:
        o |= {f"+{actor}.megatron.override_transformer_config.fp8": "hybrid",
              f"+{actor}.megatron.override_transformer_config.fp8_recipe": "blockwise",
              f"+{actor}.optim.override_optimizer_config.fp8_recipe": "blockwise"}
    return o


def _rollout(r: _Run) -> dict[str, Any]:
    """vLLM with verl's rollout log-probs; with predmask.top_k the plugin's hook also returns the top-K
    (predmask.verl.rollout_hook); validation avg@``trainer.val_n``."""
    ro, b = "actor_rollout_ref.rollout", r.model.batch
    o: dict[str, Any] = {f"{ro}.name": "vllm", f"{ro}.mode": "async", f"{ro}.calculate_log_probs": True,
                         f"{ro}.logprobs_mode": "processed_logprobs"}
    if r.wants_topk and r.top_k > VLLM_DEFAULT_MAX_LOGPROBS:
        o[f"+{ro}.engine_kwargs.vllm.max_logprobs"] = r.top_k
    o |= {f"{ro}.n": b.responses_per_prompt, f"{ro}.temperature": b.temperature,
          f"{ro}.top_p": require(r.cfg, "rollout.top_p"), f"{ro}.top_k": -1,
          f"{ro}.tensor_model_parallel_size": r.model.parallel.rollout_tensor,
          f"{ro}.gpu_memory_utilization": b.gpu_memory_utilization,
          f"{ro}.log_prob_max_token_len_per_gpu": r.token_len, f"{ro}.seed": r.seed,
          f"{ro}.val_kwargs.n": r.val_n, f"{ro}.val_kwargs.do_sample": True,
          f"{ro}.val_kwargs.temperature": b.val_temperature, f"{ro}.val_kwargs.top_p": b.val_top_p}
    if r.precision.rollout_fp8:
        o[f"{ro}.quantization"] = "fp8"
    if r.cluster.device == "cpu":
        o[f"{ro}.dtype"] = rollout_dtype(r.precision)
    return o


def tracker_names(run_cfg: Any, name: str) -> dict[str, str]:
    """The run's names in the trackers: the project is its sweep, the experiment its run id (``predmask`` and
    ``name`` for a config outside a sweep)."""
    return {"trainer.project_name": str(config_get(run_cfg, "sweep") or "predmask"),
            "trainer.experiment_name": str(config_get(run_cfg, "run_id") or name)}


def _trainer(r: _Run, file_logger_path: str | None) -> dict[str, Any]:
    """The trainer: the cluster's shape, trackers, names, schedule, the run directory's places, and what every Ray
    worker's environment holds (the plugin, verl's file logger path)."""
    b = r.model.batch
    o: dict[str, Any] = {
        "trainer.use_v1": False,  # the top-K plumbing rides verl's DataProto path (the v1 trainer needs TransferQueue)
        "trainer.nnodes": r.cluster.nodes, "trainer.n_gpus_per_node": r.cluster.gpus_per_node,
        "trainer.logger": list(check_loggers(plain_value(require(r.cfg, "trainer.logger")))),
        **tracker_names(r.cfg, r.name),
        "trainer.val_before_train": bool(require(r.cfg, "trainer.val_before_train")),
        "trainer.test_freq": b.val_every, "trainer.save_freq": b.save_every,
        "trainer.resume_mode": "auto", "trainer.total_training_steps": b.total_steps,
        "trainer.total_epochs": 1000,  # an upper bound: total_training_steps ends the run
    }
    if r.run_dir:
        o |= {"trainer.default_local_dir": f"{r.run_dir}/checkpoints", "hydra.run.dir": f"{r.run_dir}/{HYDRA_SUBDIR}"}
    # verl/__init__.py imports them in every Ray worker; on the CPU, the platform first (predmask.verl.cpu)
    o[f"{RUNTIME_ENV}.{PLUGIN_ENV}"] = f"{CPU_MODULE},{PLUGIN_MODULE}" if r.cluster.device == "cpu" else PLUGIN_MODULE
    if r.cluster.device == "cpu":
        o |= VERL_CPU_OVERRIDES
    if file_logger_path:
        o[f"{RUNTIME_ENV}.VERL_FILE_LOGGER_PATH"] = str(file_logger_path)
    return o


def _predmask(r: _Run) -> dict[str, Any]:
    """predmask's own keys (predmask.verl.settings; the launcher hands them to every process)."""
    o: dict[str, Any] = {}
    if r.method.kind != "clip":
        o |= {f"{PREFIX}delta": r.params.delta, f"{PREFIX}ratio_cap": r.params.ratio_cap}
    o[f"{PREFIX}anchor"] = r.anchor
    support = r.method.topk_support(r.params)
    if support is not None and support != TOPK_SUPPORTS[0]:  # the default travels as no key (as in the run id)
        o[f"{PREFIX}support"] = support
    if r.wants_topk:
        o[f"{PREFIX}top_k"] = r.top_k
    if r.run_dir:
        o[f"{PREFIX}stats_dir"] = f"{r.run_dir}/{LOSS_STATS_DIR}"
    if r.cluster.stage_timeout_s is not None:  # the launcher's bound on a hung rollout or weight sync
        o[f"{PREFIX}stage_timeout_s"] = r.cluster.stage_timeout_s
    return o


def verl_overrides(run_cfg: Any, *, file_logger_path: str | None = None) -> list[str]:
    """verl Hydra overrides for one run (module docstring), then the raw extras ``model.verl`` and the run config's
    ``verl``; raises ValueError (one line) on bad input."""
    r = _run(run_cfg)
    o = {"model_engine": "megatron" if r.model.engine == "megatron" else "dp", **_data(r), **_actor(r),
         **_rollout(r), **_trainer(r, file_logger_path), **_predmask(r)}
    for extra in (r.model.verl, plain_value(config_get(run_cfg, "verl")) or {}):
        o.update({str(key): plain_value(value) for key, value in extra.items()})
    return [f"{key}={hydra_value(value)}" for key, value in o.items()]


def verl_command(run_cfg: Any, run_dir: Any, *, python: str | None = None,
                 file_logger_path: str | None = None) -> list[str]:
    """The argv of one VeRL run: ``python -m predmask.verl.launch`` with every override spelled out.

    ``run_dir`` overrides ``run_cfg.run_dir``; the file logger writes ``<run_dir>/metrics.jsonl`` unless
    ``file_logger_path`` is given (at run time the job may set ``VERL_FILE_LOGGER_PATH``, e.g. one file per
    attempt: the launcher forwards it to the workers in place of this default).
    """
    cfg = dict(plain_value(run_cfg) if not isinstance(run_cfg, Mapping) else run_cfg)
    cfg["run_dir"] = str(run_dir)
    logger_path = file_logger_path or f"{str(run_dir).rstrip('/')}/{METRICS_FILE}"
    return [python or sys.executable, "-m", "predmask.verl.launch", *verl_overrides(cfg, file_logger_path=logger_path)]
