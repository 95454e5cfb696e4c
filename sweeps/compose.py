"""Compose and expand a named sweep into fully resolved run configs with stable run ids (Hydra's own sweeper)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig

from predmask.config import (
    ConfigError,
    compose,
    cpu_standin,
    group_options,
    stable_id,
    sweep_params,
    to_container,
)
from predmask.methods import method_config

#: config groups whose options are checked up front with a one-line error
GROUPS: tuple[str, ...] = ("method", "model", "precision", "cluster", "setting", "task", "base", "sweep")
PRIMARY = "train"


class SweepError(ValueError):
    """Bad sweep input; the message is one line naming the bad value and what is allowed."""


@dataclass(frozen=True)
class RunSpec:
    """One run of a sweep: its id, its resolved config, and the overrides that compose it."""

    run_id: str
    sweep: str
    overrides: tuple[str, ...]
    config: dict[str, Any]

    @property
    def method(self) -> str:
        return str(self.config["method"]["name"])

    @property
    def model(self) -> str:
        return str(self.config["model"]["name"])

    @property
    def precision(self) -> str:
        return str(self.config["precision"]["name"])

    @property
    def delta(self) -> float:
        return float(self.config["delta"])

    @property
    def seed(self) -> int:
        return int(self.config.get("seed", 0))


def sweep_names() -> list[str]:
    return group_options("sweep")


def _parse(overrides: list[str]) -> list[Any]:
    try:
        return OverridesParser.create().parse_overrides(overrides)
    except HydraException as err:
        raise SweepError(f"bad override: {str(err).splitlines()[0]}") from None


def _check_groups(parsed: list[Any]) -> None:
    for ov in parsed:
        key = ov.get_key_element().lstrip("+~")
        if key not in GROUPS:
            continue
        values = list(ov.sweep_string_iterator()) if ov.is_sweep_override() else [ov.get_value_element_as_str()]
        allowed = group_options(key)
        for value in values:
            if value not in allowed:
                raise SweepError(f"unknown {key} {value!r}; valid: {', '.join(allowed)}")


def _check_values(cfg: dict[str, Any]) -> None:
    delta = cfg.get("delta")
    if delta is not None and not float(delta) > 0:
        raise SweepError(f"delta must be > 0, got {delta}")
    top_k = cfg.get("top_k")
    if top_k is not None and int(top_k) < 1:
        raise SweepError(f"top_k (K) must be >= 1, got {top_k}")


def _compose(overrides: list[str]) -> DictConfig:
    try:
        return compose(PRIMARY, overrides)
    except ConfigError as err:
        raise SweepError(str(err)) from None


def sweep_axes(sweep: str) -> list[str]:
    """The sweep's axes as Hydra override strings (``predmask.config.sweep_params``)."""
    return [f"{k}={v}" for k, v in sweep_params(sweep).items()]


def _standin_override(overrides: list[str], cfg: DictConfig) -> list[str]:
    """On a CPU trainer, a cluster model maps to its CPU stand-in (labelled by ``model.stands_in_for``)."""
    if cfg.cluster.get("trainer", "cpu") != "cpu" or cfg.model.get("backend") == "cpu":
        return overrides
    try:
        standin = cpu_standin(to_container(cfg.model))
    except ConfigError as err:
        raise SweepError(str(err)) from None
    return [*overrides, f"model={standin['name']}"]


def expand(sweep: str, overrides: list[str] | None = None) -> list[RunSpec]:
    """Expand ``sweep`` with command-line ``overrides`` (Hydra multirun syntax) into resolved runs.

    The sweep's axes come first and command-line overrides of the same key replace them; everything else is
    Hydra's BasicSweeper expansion (cartesian product of the sweep overrides).
    """
    if sweep not in sweep_names():
        raise SweepError(f"unknown sweep {sweep!r}; valid: {', '.join(sweep_names())}")
    overrides = list(overrides or [])
    parsed_user = _parse(overrides)
    _check_groups(parsed_user)
    runs: list[RunSpec] = []
    parsed = _parse(sweep_axes(sweep) + overrides)
    _check_groups(parsed)
    (batches,) = BasicSweeper.split_arguments(parsed, None)
    for batch in batches:
        ovs = [f"+sweep={sweep}", *batch]
        cfg = _compose(ovs)
        standin = _standin_override(ovs, cfg)
        resolved = to_container(_compose(standin) if standin != ovs else cfg)
        _check_values(resolved)
        try:  # the run records every parameter its loss reads
            resolved["method"] = method_config(resolved["method"])
        except ValueError as err:
            raise SweepError(str(err).splitlines()[0]) from None
        runs.append(RunSpec(stable_id(resolved), sweep, tuple(standin), resolved))
    seen: set[str] = set()
    unique = [r for r in runs if not (r.run_id in seen or seen.add(r.run_id))]  # type: ignore[func-returns-value]
    return unique
