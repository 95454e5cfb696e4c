"""Compose and expand a named sweep into fully resolved run configs with stable run ids (Hydra's own sweeper)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_module
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import OmegaConf

#: config keys that say where/how a run is launched, not what it computes: excluded from the run id
LAUNCHER_KEYS: tuple[str, ...] = ("cluster", "run_dir", "cache_dir", "hydra")
#: config groups whose options are checked up front with a one-line error
GROUPS: tuple[str, ...] = ("method", "model", "precision", "cluster", "setting", "sweep")
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


def conf_dir() -> Path:
    """The installed config tree (works from any working directory)."""
    return Path(str(resources.files("conf")))


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))


def sweep_names() -> list[str]:
    return group_options("sweep")


def run_id_of(config: dict[str, Any]) -> str:
    """Stable hash of the resolved config without launcher keys: the same grid finds the same runs."""
    core = {k: v for k, v in config.items() if k not in LAUNCHER_KEYS}
    blob = json.dumps(core, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


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


class _Hydra:
    """A Hydra compose context over the installed ``conf`` package, re-entrant across calls."""

    def __enter__(self) -> _Hydra:
        GlobalHydra.instance().clear()
        self._ctx = initialize_config_module(config_module="conf", version_base=None)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._ctx.__exit__(*exc)
        GlobalHydra.instance().clear()

    def compose(self, overrides: list[str], hydra_cfg: bool = False) -> Any:
        try:
            return compose(PRIMARY, overrides=overrides, return_hydra_config=hydra_cfg)
        except HydraException as err:
            raise SweepError(f"cannot compose {' '.join(overrides)}: {str(err).splitlines()[0]}") from None


def sweep_axes(hy: _Hydra, sweep: str) -> list[str]:
    """The sweep's axes as Hydra override strings, from ``hydra.sweeper.params`` of conf/sweep/<sweep>.yaml."""
    cfg = hy.compose([f"+sweep={sweep}"], hydra_cfg=True)
    params = OmegaConf.to_container(cfg.hydra.sweeper.params or {}, resolve=False)
    return [f"{k}={v}" for k, v in params.items()]  # type: ignore[union-attr]


def _standin_override(hy: _Hydra, overrides: list[str], cfg: Any) -> list[str]:
    """On a CPU trainer, a cluster model maps to its CPU stand-in (labelled by ``model.stands_in_for``)."""
    if cfg.cluster.get("trainer", "cpu") == "cpu" and cfg.model.get("backend") != "cpu":
        standin = cfg.model.get("cpu_standin")
        if not standin:
            raise SweepError(f"model {cfg.model.name!r} has no cpu_standin for a CPU run")
        return [*overrides, f"model={standin}"]
    return overrides


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
    with _Hydra() as hy:
        axes = sweep_axes(hy, sweep)
        parsed = _parse(axes + overrides)
        _check_groups(parsed)
        (batches,) = BasicSweeper.split_arguments(parsed, None)
        for batch in batches:
            ovs = [f"+sweep={sweep}", *batch]
            cfg = hy.compose(ovs)
            ovs = _standin_override(hy, ovs, cfg)
            cfg = hy.compose(ovs) if ovs[-1].startswith("model=") else cfg
            resolved = OmegaConf.to_container(cfg, resolve=True)
            assert isinstance(resolved, dict)
            _check_values(resolved)
            runs.append(RunSpec(run_id_of(resolved), sweep, tuple(ovs), resolved))
    seen: set[str] = set()
    unique = [r for r in runs if not (r.run_id in seen or seen.add(r.run_id))]  # type: ignore[func-returns-value]
    return unique
