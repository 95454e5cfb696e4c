"""The token-level study's config: compose, the study id, validation, and the typed pieces read from it.

The study id leaves out the launcher keys, so a rerun with the same settings finds the seeds already stored,
whatever the seed count and launcher.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from analysis.token_level.compute.step_settings import StepSettings, require
from predmask.config import ConfigError, compose, group_options, stable_id, to_container
from predmask.rundir import first_line

if TYPE_CHECKING:  # the engine's modules import torch: loaded only when a config is turned into them
    from analysis.token_level.compute.study import StudySettings
    from predmask.precisions import Precision
    from predmask.schemas.task_schema import TaskConfig


#: bump when a code change alters what a study computes (it is part of the study id)
STUDY_VERSION = 1
#: keys that say where/how the study runs, not what it computes: excluded from the study id
LAUNCHER_KEYS: tuple[str, ...] = ("cluster", "launcher", "paths", "hydra")
#: config groups whose values are checked against conf/<group>/*.yaml with a one-line error
GROUPS: tuple[str, ...] = ("model", "precision", "cluster")
#: short override names accepted on the command line
ALIASES: dict[str, str] = {"K": "top_k"}
PRIMARY = "token_level"
SCHEMA = "token_level_schema"


class StudyInputError(ValueError):
    """Bad input; the message is one line naming the bad value and what is allowed."""


def _normalise_overrides(overrides: Sequence[str], cluster: str | None) -> list[str]:
    out = []
    for ov in overrides:
        if ov.startswith("~"):  # Hydra's delete syntax
            out.append(ov)
            continue
        if "=" not in ov:
            raise StudyInputError(f"bad override {ov!r}: expected key=value (e.g. delta=0.1)")
        key, value = ov.split("=", 1)
        prefix = "+" if key.startswith("+") else ""
        key = prefix + ALIASES.get(key.lstrip("+"), key.lstrip("+"))
        if key in GROUPS:
            _check_option(key, value)
        out.append(f"{key}={value}")
    if cluster is not None:
        _check_option("cluster", cluster)
        out.append(f"cluster={cluster}")
    return out


def _check_option(group: str, name: str) -> None:
    if name not in group_options(group):
        raise StudyInputError(f"unknown {group} {name!r}; valid: {', '.join(group_options(group))}")


@dataclass(frozen=True, kw_only=True)
class HFSettings:
    """The ``hf:`` block: the GPU path's backend options (model backend: hf)."""

    rollout_engine: str
    prompt_template: str
    train_dtype: str
    rollout_chunk: int
    vllm_kwargs: dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class LauncherSettings:
    """The ``launcher:`` block: how the seed workers run (not part of the study id)."""

    threads: int
    array_tasks: int | None
    array_parallelism: int | None
    gpus_per_node: int | None
    cpus_per_task: int
    mem_gb: int | None
    timeout_min: int
    slurm_additional_parameters: dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class PathSettings:
    """The ``paths:`` block: where things live (not part of the study id)."""

    cache_dir: str


@dataclass(frozen=True, kw_only=True)
class StudyConfig(StepSettings):
    """The structured-config schema of the composed study (Hydra's ConfigStore: token_level_schema): every
    top-level key and its type, once. Values come from conf/token_level.yaml and the command line only (no field
    has a default); OmegaConf refuses a value of the wrong type at compose. The groups (model, precision,
    cluster, task, base) are typed by their own entries and schemas.
    """

    model: Any
    precision: Any
    cluster: Any
    task: Any
    base: Any

    checkpoint: str | None
    top_k: int
    sequences: int
    max_new_tokens: int
    device: str
    hf: HFSettings
    launcher: LauncherSettings
    paths: PathSettings


def compose_study(overrides: Sequence[str] = (), cluster: str | None = None) -> dict[str, Any]:
    """The resolved study config: conf/token_level.yaml with ``overrides`` (``predmask.config.compose``)."""
    ovs = _normalise_overrides(overrides, cluster)
    try:
        resolved = to_container(compose(PRIMARY, ovs, schemas={SCHEMA: StudyConfig}))
    except (ConfigError, ValueError) as err:
        raise StudyInputError(first_line(err)) from None
    if resolved.get("checkpoint"):  # one study whatever the spelling of the path
        resolved["checkpoint"] = str(Path(str(resolved["checkpoint"])).resolve())
    resolved["label"] = _label(resolved)
    return resolved


def _label(cfg: Mapping[str, Any]) -> str:
    """How outputs name this run (a CPU stand-in and emulated precision are said to be so)."""
    m = cfg["model"]
    if m.get("backend") == "cpu":
        p = precision_of(cfg)
        return f"{model_label(cfg)}; {p.name} (CPU emulation: {p.emulates})"
    return f"{m.get('name')} ({cfg.get('checkpoint') or m.get('path')}); precision {cfg['precision'].get('name')}"


def study_id_of(cfg: Mapping[str, Any]) -> str:
    """Stable id of the study config without launcher keys (the seed count is not in the config)."""
    return stable_id(study_config(cfg), exclude=())


def study_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """What token_level_studies stores: the config without launcher keys, plus the study version."""
    return {"study_version": STUDY_VERSION, **{k: v for k, v in cfg.items() if k not in LAUNCHER_KEYS}}


def validate(cfg: Mapping[str, Any]) -> None:
    """One-line errors for a config the study cannot run (checked before anything is written): the ranges of
    the step settings are ``StudySettings``' own (built on a stand-in vocabulary), the rest checked here."""
    try:
        settings_of(cfg, vocab_size=1 << 20)
        _check_batch(cfg)
        _check_model(cfg)
    except ValueError as err:
        raise StudyInputError(first_line(err)) from None


def _check_batch(cfg: Mapping[str, Any]) -> None:
    group, seqs, mbs = cfg["group_size"], cfg["sequences"], cfg["minibatches"]
    require(cfg["top_k"] >= 1, "top_k", cfg["top_k"], "an integer >= 1")
    require(seqs >= group and seqs % group == 0, "sequences", seqs, f"a positive multiple of group_size={group}")
    if mbs > seqs // group:
        raise ValueError(f"minibatches={mbs} exceeds the {seqs // group} prompt groups of a seed")
    require(cfg["max_new_tokens"] >= 1, "max_new_tokens", cfg["max_new_tokens"], "an integer >= 1")


def _check_model(cfg: Mapping[str, Any]) -> None:
    m = cfg["model"]
    if m.get("backend") not in ("cpu", "hf"):
        raise ValueError(f"model {m.get('name')!r} has backend {m.get('backend')!r}; allowed: cpu, hf")
    ckpt = cfg["checkpoint"]
    if ckpt is not None and not Path(ckpt).exists():
        raise ValueError(f"checkpoint {ckpt} does not exist")
    if m.get("backend") == "hf":
        path = ckpt or m.get("path")
        if not path or not Path(str(path)).exists():
            raise ValueError(
                f"model {m.get('name')!r}: checkpoint path {path} does not exist (set "
                "PREDMASK_MODEL_ROOT or checkpoint=...)"
            )
        return
    from predmask.rl.tokenizer import ArithmeticTokenizer

    vocab = ArithmeticTokenizer(task_of(cfg).max_number).vocab_size
    require(cfg["top_k"] < vocab - 1, "top_k", cfg["top_k"], f"< {vocab - 1} (vocabulary {vocab})")


def task_of(cfg: Mapping[str, Any]) -> TaskConfig:
    """The task of a composed study config."""
    from predmask.schemas.task_schema import TaskConfig

    return TaskConfig.from_mapping(dict(cfg.get("task") or {}))


def precision_of(cfg: Mapping[str, Any]) -> Precision:
    """The precision (``predmask.precisions`` entry) of a composed study config."""
    from predmask.rl import emulated_precision

    return emulated_precision.precision_of(dict(cfg["precision"]))


def model_label(cfg: Mapping[str, Any]) -> str:
    """How outputs name the model: a CPU model says which cluster model it stands in for."""
    m = cfg["model"]
    if m.get("backend") == "cpu":
        return f"{m.get('name')} (CPU stand-in for {m.get('stands_in_for', '?')}, not the real model)"
    return str(m.get("name"))


def settings_of(cfg: Mapping[str, Any], vocab_size: int) -> StudySettings:
    """The StudySettings of a composed study config: its step settings, the precision and ``vocab_size``."""
    from analysis.token_level.compute.study import StudySettings

    steps = {f.name: cfg[f.name] for f in fields(StepSettings)}
    return StudySettings(**steps, vocab_size=vocab_size, precision=precision_of(cfg))
