"""Translate a composed predmask run config into verl 0.9.1 Hydra overrides (pure; imports no verl).

``verl_overrides(run_cfg)`` returns the overrides for ``python -m predmask.verl.launch`` (verl's ``main_ppo``).
Keys read from ``run_cfg`` (a mapping or an OmegaConf DictConfig, shaped like the composed ``conf/`` tree;
``?`` = optional, default in brackets):

- ``method``: a method name, or a mapping with ``name`` and optionally ``delta``, ``eps_low``, ``eps_high``,
  ``ratio_cap``, ``loss_agg_mode`` (defaults: ``predmask.MethodParams``)
- ``delta``: the trust-region threshold when ``method.delta`` is absent; ``top_k``: K of the rollout support
- ``precision``: a precision of ``predmask.precisions`` that runs on the cluster (``bf16`` | ``fp8_rollout`` |
  ``fp8_e2e``; a name, or a mapping with ``name``): ``rollout_fp8`` -> vLLM FP8, ``train_fp8`` -> Megatron FP8
- ``model``: ``path`` (HF id or local directory, required), ``engine`` [megatron] | fsdp,
  ``parallel``: ``tensor`` [1], ``pipeline`` [1], ``expert`` [1] (Megatron only: verl's FSDP engine has no
  tensor/pipeline/expert parallelism), ``sequence`` [1] (FSDP's Ulysses sequence parallelism), ``rollout_tensor`` [1];
  ``batch``: ``train_prompts`` [256], ``responses_per_prompt`` [16], ``ppo_mini_batch_prompts`` [64],
  ``max_prompt_length`` [1024], ``max_response_length`` [8192], ``max_token_len_per_gpu`` [2 (prompt + response)],
  ``lr`` [1e-6], ``temperature`` [1.0], ``val_temperature`` [temperature], ``val_top_p`` [1.0],
  ``total_steps`` [500], ``val_every`` [10], ``save_every`` [20], ``gpu_memory_utilization`` [0.6];
  ``verl`` [{}]: extra raw verl overrides ``{dotted.key: value}`` (applied after ours)
- ``cluster``: ``nodes`` and ``gpus_per_node``; ``data_dir``?
- ``data``?: ``train_files`` and ``val_files`` (a path or a list), or ``dir``; else ``cluster.data_dir``. A
  directory means the files of ``python -m sweeps.data prepare`` (:data:`DATA_FILES`).
- ``trainer``?: ``logger`` [console, file]: verl's ``trainer.logger``, the same list as the CPU engine's
  (:mod:`predmask.rl.trackers`; the launcher points TensorBoard and W&B at the run directory)
- ``seed`` [0], ``val_n`` [16], ``run_id``?, ``sweep``? (verl's project name, [predmask]), ``run_dir``?
  (checkpoints under ``<run_dir>/checkpoints``, Hydra's output under ``<run_dir>/hydra``), ``verl`` [{}]

predmask's own parameters travel under predmask's own keys (``predmask.delta``, ``predmask.ratio_cap``,
``predmask.anchor``, ``predmask.top_k``, ``predmask.stats_dir``; :mod:`predmask.verl.settings`), so no verl key
changes meaning: verl's ``clip_ratio_low`` / ``clip_ratio_high`` are grpo_clip_higher's PPO eps, as in verl, and
``rollout.calculate_log_probs=true`` keeps verl's meaning (rollout log-probs). ``python -m predmask.verl.launch``
takes the ``predmask.*`` keys off verl's argv and hands them to every process.

``file_logger_path`` goes into every Ray worker's environment (verl's FileLogger reads ``VERL_FILE_LOGGER_PATH``
in the trainer process, a Ray actor). :func:`verl_command` is the full argv of one run.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from predmask.methods import METHODS, MethodParams, get_method
from predmask.metrics import LOSS_STATS_DIR
from predmask.precisions import CLUSTER_PRECISIONS, Precision, get_precision
from predmask.rl.trackers import DEFAULT_LOGGERS, check_loggers
from predmask.verl.settings import PREFIX

__all__ = [
    "DATA_FILES",
    "ENGINES",
    "HYDRA_SUBDIR",
    "PLUGIN_ENV",
    "PLUGIN_MODULE",
    "config_get",
    "data_files",
    "hydra_value",
    "plain_value",
    "verl_command",
    "verl_overrides",
]

ENGINES: tuple[str, ...] = ("megatron", "fsdp")
#: verl's Hydra output directory inside a run directory (how the launcher finds the run directory it writes)
HYDRA_SUBDIR = "hydra"
#: the module every verl process must import (it installs the hooks), and verl's env var that makes it do so
#: (verl/__init__.py imports the comma-separated modules it names)
PLUGIN_MODULE = "predmask.verl.plugin"
PLUGIN_ENV = "VERL_USE_EXTERNAL_MODULES"
#: file names written by ``python -m sweeps.data prepare``
DATA_FILES: dict[str, str] = {"train": "dapo_math_13k.parquet", "aime24": "aime24.parquet", "aime25": "aime25.parquet"}
RUNTIME_ENV = "+ray_kwargs.ray_init.runtime_env.env_vars"
#: vLLM's default cap on logprobs per token (engine arg max_logprobs); a larger K raises it
VLLM_DEFAULT_MAX_LOGPROBS = 20

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


def plain_value(value: Any) -> Any:
    """OmegaConf containers -> plain Python (lists/dicts), other values unchanged."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - omegaconf is a core dependency
        return value
    if isinstance(value, DictConfig | ListConfig):
        return OmegaConf.to_container(value, resolve=True)
    return value


def _require(cfg: Any, key: str, where: str) -> Any:
    value = config_get(cfg, key)
    if value is None or value == "":
        raise ValueError(f"run config is missing {where}.{key} (needed for a VeRL run)")
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
        return _files(_require(data, "train_files", "data")), _files(_require(data, "val_files", "data"))
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
    precision = get_precision(_name(config_get(run_cfg, "precision", "bf16"), "precision"))
    if not precision.cluster:
        allowed = ", ".join(CLUSTER_PRECISIONS)
        raise ValueError(f"precision {precision.name!r} does not run on the cluster; allowed: {allowed}")
    return precision


def verl_overrides(run_cfg: Any, *, file_logger_path: str | None = None) -> list[str]:
    """verl Hydra overrides for one run (see the module docstring for the keys read); raises on bad input."""
    name, params = _method_params(run_cfg)
    method = get_method(name)
    top_k = _positive_int(config_get(run_cfg, "top_k"), "top_k")
    precision = _precision(run_cfg)
    model = config_get(run_cfg, "model")
    if model is None:
        raise ValueError("run config is missing model (needed for a VeRL run)")
    path = str(_require(model, "path", "model"))
    engine = str(config_get(model, "engine", "megatron"))
    if engine not in ENGINES:
        raise ValueError(f"unknown model.engine {engine!r}; allowed: {', '.join(ENGINES)}")
    if precision.train_fp8 and engine != "megatron":
        raise ValueError(f"precision {precision.name} (FP8 training) needs model.engine=megatron")
    cluster = config_get(run_cfg, "cluster")
    nnodes = _positive_int(config_get(cluster, "nodes"), "cluster.nodes")
    gpus = _positive_int(config_get(cluster, "gpus_per_node"), "cluster.gpus_per_node")
    train_files, val_files = data_files(run_cfg)
    seed = int(config_get(run_cfg, "seed", 0))
    val_n = _positive_int(config_get(run_cfg, "val_n", 16), "val_n")
    parallel, batch_cfg = config_get(model, "parallel"), config_get(model, "batch")

    def b(key: str, default: Any) -> Any:
        value = config_get(batch_cfg, key)
        return default if value is None else value

    def par(key: str) -> int:
        value = config_get(parallel, key)
        return _positive_int(1 if value is None else value, f"model.parallel.{key}")

    prompt_len = _positive_int(b("max_prompt_length", 1024), "model.batch.max_prompt_length")
    response_len = _positive_int(b("max_response_length", 8192), "model.batch.max_response_length")
    token_len = _positive_int(b("max_token_len_per_gpu", 2 * (prompt_len + response_len)),
                              "model.batch.max_token_len_per_gpu")
    tp, pp, ep, rollout_tp = par("tensor"), par("pipeline"), par("expert"), par("rollout_tensor")
    sp = par("sequence")
    temperature = float(b("temperature", 1.0))

    actor = "actor_rollout_ref.actor"
    rollout = "actor_rollout_ref.rollout"
    o: dict[str, Any] = {}
    o["model_engine"] = "megatron" if engine == "megatron" else "dp"
    # -- data and reward (reward: verl's default dispatch on data_source -> DAPO math scoring)
    o["data.train_files"] = train_files
    o["data.val_files"] = val_files
    o["data.prompt_key"] = "prompt"
    o["data.max_prompt_length"] = prompt_len
    o["data.max_response_length"] = response_len
    o["data.train_batch_size"] = _positive_int(b("train_prompts", 256), "model.batch.train_prompts")
    o["data.filter_overlong_prompts"] = True
    o["data.truncation"] = "error"
    o["data.seed"] = seed
    # -- algorithm: GRPO advantages, no KL, one PPO epoch per batch (paper)
    o["algorithm.adv_estimator"] = "grpo"
    o["algorithm.use_kl_in_reward"] = False
    # -- model
    o["actor_rollout_ref.model.path"] = path
    o["actor_rollout_ref.model.use_remove_padding"] = True
    o["actor_rollout_ref.model.use_fused_kernels"] = False  # the support gather needs the logits
    # -- actor: the loss and its parameters (see predmask.verl.loss for the key mapping)
    o[f"{actor}.policy_loss.loss_mode"] = name
    o[f"{actor}.loss_agg_mode"] = params.loss_agg_mode
    if method.kind == "clip":  # verl's PPO clip range, in verl's meaning
        o[f"{actor}.clip_ratio_low"] = params.eps_low
        o[f"{actor}.clip_ratio_high"] = params.eps_high
    o[f"{actor}.ppo_epochs"] = 1
    o[f"{actor}.ppo_mini_batch_size"] = _positive_int(b("ppo_mini_batch_prompts", 64), "model.batch.ppo_mini_batch_prompts")
    o[f"{actor}.use_dynamic_bsz"] = True
    o[f"{actor}.ppo_max_token_len_per_gpu"] = token_len
    o[f"{actor}.use_kl_loss"] = False
    o[f"{actor}.entropy_coeff"] = 0
    o[f"{actor}.optim.lr"] = float(b("lr", 1e-6))
    o[f"{actor}.data_loader_seed"] = seed
    if engine == "megatron":
        o[f"{actor}.megatron.tensor_model_parallel_size"] = tp
        o[f"{actor}.megatron.pipeline_model_parallel_size"] = pp
        o[f"{actor}.megatron.expert_model_parallel_size"] = ep
        o[f"{actor}.megatron.context_parallel_size"] = 1
        o[f"{actor}.megatron.seed"] = seed
        if sp != 1:
            raise ValueError("model.parallel.sequence (Ulysses) applies to engine=fsdp; Megatron runs with CP=1 here")
    else:
        if tp != 1 or pp != 1 or ep != 1:
            raise ValueError(
                f"model.engine=fsdp has no tensor/pipeline/expert parallelism in verl 0.9.1 (got tensor={tp}, "
                f"pipeline={pp}, expert={ep}): set them to 1 or use model.engine=megatron"
            )
        o[f"{actor}.fsdp_config.seed"] = seed
        o[f"{actor}.fsdp_config.ulysses_sequence_parallel_size"] = sp
    if precision.train_fp8:
        o[f"+{actor}.megatron.override_transformer_config.fp8"] = "hybrid"
        o[f"+{actor}.megatron.override_transformer_config.fp8_recipe"] = "blockwise"
        o[f"+{actor}.optim.override_optimizer_config.fp8_recipe"] = "blockwise"
    # -- rollout: vLLM; with predmask.top_k the plugin's hook also returns the top-K (see predmask.verl.rollout)
    anchor = method.anchor(params)
    wants_topk = method.needs_support or anchor == "rollout"
    o[f"{rollout}.name"] = "vllm"
    o[f"{rollout}.mode"] = "async"
    o[f"{rollout}.calculate_log_probs"] = True
    o[f"{rollout}.logprobs_mode"] = "processed_logprobs"
    if wants_topk and top_k > VLLM_DEFAULT_MAX_LOGPROBS:
        o[f"+{rollout}.engine_kwargs.vllm.max_logprobs"] = top_k
    o[f"{rollout}.n"] = _positive_int(b("responses_per_prompt", 16), "model.batch.responses_per_prompt")
    o[f"{rollout}.temperature"] = temperature
    o[f"{rollout}.top_p"] = 1.0
    o[f"{rollout}.top_k"] = -1
    o[f"{rollout}.tensor_model_parallel_size"] = rollout_tp
    o[f"{rollout}.gpu_memory_utilization"] = float(b("gpu_memory_utilization", 0.6))
    o[f"{rollout}.log_prob_max_token_len_per_gpu"] = token_len
    o[f"{rollout}.seed"] = seed
    o[f"{rollout}.val_kwargs.n"] = val_n
    o[f"{rollout}.val_kwargs.do_sample"] = True
    o[f"{rollout}.val_kwargs.temperature"] = float(b("val_temperature", temperature))
    o[f"{rollout}.val_kwargs.top_p"] = float(b("val_top_p", 1.0))
    if precision.rollout_fp8:
        o[f"{rollout}.quantization"] = "fp8"
    # -- trainer
    run_id = config_get(run_cfg, "run_id")
    run_dir = config_get(run_cfg, "run_dir")
    o["trainer.use_v1"] = False  # the top-K plumbing rides verl's DataProto path (the v1 trainer needs TransferQueue)
    o["trainer.nnodes"] = nnodes
    o["trainer.n_gpus_per_node"] = gpus
    o["trainer.logger"] = list(check_loggers(plain_value(config_get(config_get(run_cfg, "trainer"), "logger")) or DEFAULT_LOGGERS))
    o["trainer.project_name"] = str(config_get(run_cfg, "sweep", "predmask") or "predmask")
    o["trainer.experiment_name"] = str(run_id or name)
    o["trainer.val_before_train"] = True
    o["trainer.test_freq"] = _positive_int(b("val_every", 10), "model.batch.val_every")
    o["trainer.save_freq"] = _positive_int(b("save_every", 20), "model.batch.save_every")
    o["trainer.resume_mode"] = "auto"
    o["trainer.total_training_steps"] = _positive_int(b("total_steps", 500), "model.batch.total_steps")
    o["trainer.total_epochs"] = 1000  # an upper bound: total_training_steps ends the run
    if run_dir:
        o["trainer.default_local_dir"] = f"{str(run_dir).rstrip('/')}/checkpoints"
        o["hydra.run.dir"] = f"{str(run_dir).rstrip('/')}/{HYDRA_SUBDIR}"
    # -- every Ray worker imports the plugin (verl/__init__.py honours VERL_USE_EXTERNAL_MODULES)
    o[f"{RUNTIME_ENV}.{PLUGIN_ENV}"] = PLUGIN_MODULE
    if file_logger_path:
        o[f"{RUNTIME_ENV}.VERL_FILE_LOGGER_PATH"] = str(file_logger_path)
    # -- predmask's own keys (predmask.verl.settings; the launcher hands them to every process)
    if method.kind != "clip":
        o[f"{PREFIX}delta"] = params.delta
        o[f"{PREFIX}ratio_cap"] = params.ratio_cap
    o[f"{PREFIX}anchor"] = anchor
    if wants_topk:
        o[f"{PREFIX}top_k"] = top_k
    if run_dir:
        o[f"{PREFIX}stats_dir"] = f"{str(run_dir).rstrip('/')}/{LOSS_STATS_DIR}"
    # -- raw extras: model.verl, then run_cfg.verl
    for extra in (config_get(model, "verl"), config_get(run_cfg, "verl")):
        for key, value in (plain_value(extra) or {}).items():
            o[str(key)] = plain_value(value)
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
    logger_path = file_logger_path or f"{str(run_dir).rstrip('/')}/metrics.jsonl"
    return [python or sys.executable, "-m", "predmask.verl.launch", *verl_overrides(cfg, file_logger_path=logger_path)]
