"""Compose and expand a named sweep into fully resolved run configs with stable run ids (Hydra's own sweeper).

A sweep is a grid of cells (Hydra's BasicSweeper) times a list of seeds per cell, from the command line, else
the sweep's own seed axis, else the cluster config's ``seeds``; the count is part of no run, so a cell's
seed-0 run keeps its id whatever the count."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf

from predmask.config import (
    LAUNCHER_KEYS,
    ConfigError,
    compose,
    cpu_standin,
    group_entry,
    group_options,
    stable_id,
    sweep_params,
    to_container,
)
from predmask.methods import method_config
from predmask.rundir import first_line

#: config groups whose options are checked up front with a one-line error
GROUPS: tuple[str, ...] = ("method", "model", "precision", "cluster", "setting", "task", "base", "sweep")
PRIMARY = "train"
#: the precision a run whose config names none reports (a variational stage: the CPU engine in fp32)
NO_PRECISION = "fp32"
#: the two spellings of the seed axis: ``seed=`` (Hydra values) and ``seeds=`` (a count or a list)
SEED_KEYS: tuple[str, ...] = ("seed", "seeds")


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
        precision = self.config.get("precision")
        return str(precision["name"]) if isinstance(precision, dict) else NO_PRECISION

    @property
    def delta(self) -> float | None:
        delta = self.config.get("delta")
        return None if delta is None else float(delta)

    @property
    def stage(self) -> str | None:
        """The variational stage the run is; None for a train-primary run."""
        stage = self.config.get("stage")
        return None if stage is None else str(stage)

    @property
    def inputs(self) -> dict[str, str]:
        """Upstream stage -> the run id of the sibling run this run reads (empty when it reads none)."""
        return {str(k): str(v) for k, v in (self.config.get("inputs") or {}).items()}

    @property
    def seed(self) -> int:
        return int(self.config.get("seed", 0))

    @property
    def cell(self) -> str:
        return cell_text(self.config)

    @property
    def cell_id(self) -> str:
        """The id of the run's cell: the run id's hash without the seed (the same for every seed of a cell)."""
        return stable_id(self.config, exclude=(*LAUNCHER_KEYS, "seed"))


def sweep_names() -> list[str]:
    return group_options("sweep")


#: the family of a sweep file that declares none: a grid of ``python -m predmask.rl.train`` runs
TRAIN_FAMILY = "train"


def sweep_family(sweep: str) -> str:
    """The family a sweep file declares (``family: variational``: sweeps.vr_chain expands it), else ``train``."""
    return str(group_entry("sweep", sweep).get("family") or TRAIN_FAMILY)


def parse_overrides(overrides: list[str]) -> list[Any]:
    """Hydra's parse of command-line overrides; a bad one is a one-line SweepError."""
    try:
        return OverridesParser.create().parse_overrides(overrides)
    except HydraException as err:
        raise SweepError(f"bad override: {first_line(err)}") from None


def check_values(key: str, values: Sequence[str], allowed: Sequence[str]) -> None:
    """Every value of ``key`` is one of ``allowed`` (else one SweepError line naming the valid ones)."""
    for value in values:
        if value not in allowed:
            raise SweepError(f"unknown {key} {value!r}; valid: {', '.join(allowed)}")


def override_values(ov: Any) -> list[str]:
    """The values a parsed override names (a comma list sweeps them)."""
    return list(ov.sweep_string_iterator()) if ov.is_sweep_override() else [ov.get_value_element_as_str()]


def check_group_values(parsed: list[Any], groups: Sequence[str] = GROUPS) -> None:
    """Every value given to a config group of ``groups`` is one of its options."""
    for ov in parsed:
        if override_key(ov) in groups:
            check_values(override_key(ov), override_values(ov), group_options(override_key(ov)))


def override_key(ov: Any) -> str:
    """The key of a parsed override without Hydra's ``+`` / ``~`` prefix."""
    return str(ov.get_key_element()).lstrip("+~")


_SEEDS_ALLOWED = "a count >= 1 (seeds=5: seeds 0..4) or a list of distinct integers >= 0 (seeds=[0,3,7])"
_SEED_ALLOWED = "an integer >= 0 or a comma list of distinct ones (seed=0,3,7)"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def seed_list(value: object, key: str = "seeds", written: str | None = None) -> list[int]:
    """The seeds that ``key`` (``seeds``: a count or a list; ``seed``: a list of values) = ``value`` names, a
    count ``n`` being seeds 0..n-1; ``written``: the value as the user wrote it, for the error line."""
    shown = written if written is not None else str(value)
    if key == "seeds" and _is_int(value):
        if value < 1:  # type: ignore[operator]
            raise SweepError(f"seeds must be {_SEEDS_ALLOWED}; got {shown}")
        return list(range(value))  # type: ignore[call-overload]
    seeds = list(value) if isinstance(value, list | tuple) else None
    if not seeds or not all(_is_int(s) and s >= 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise SweepError(f"{key} must be {_SEEDS_ALLOWED if key == 'seeds' else _SEED_ALLOWED}; got {shown}")
    return seeds


def _override_seeds(ov: Any) -> list[int]:
    """The seeds a parsed ``seed=`` or ``seeds=`` override names."""
    key, written = override_key(ov), str(ov.input_line).partition("=")[2]
    if ov.is_sweep_override():
        if key == "seeds":
            raise SweepError(f"seeds must be {_SEEDS_ALLOWED}; got {written}")
        return seed_list(list(ov.sweep_iterator()), key, written)
    value = ov.value()
    return seed_list(value if key == "seeds" else [value], key, written)


def seed_axis(sweep_axes: Sequence[Any], user: Sequence[Any]) -> list[int] | None:
    """The seeds given by the command line, else by the sweep's own axes; None: each cell's cluster default."""
    for source, where in ((user, "on the command line"), (sweep_axes, "in the sweep")):
        given = [ov for ov in source if override_key(ov) in SEED_KEYS]
        if len({override_key(ov) for ov in given}) > 1:
            raise SweepError(f"give seeds=N (or seeds=[...]) or seed=..., not both {where}")
        if given:
            return _override_seeds(given[-1])
    return None


def cluster_seeds(cfg: DictConfig) -> list[int]:
    """The default seeds of a cell: its cluster config's ``seeds`` count (or list)."""
    cluster = cfg.get("cluster") or {}
    name = cluster.get("name", "?")
    value = cluster.get("seeds")
    if value is None:
        raise SweepError(f"cluster {name!r} sets no seeds: give seeds=N or add seeds: N to conf/cluster/{name}.yaml")
    value = OmegaConf.to_container(value) if not isinstance(value, int | str) else value
    try:
        return seed_list(value, "seeds")
    except SweepError as err:
        raise SweepError(f"cluster {name!r}: {err}") from None


def config_at_seed(cfg: DictConfig, seed: int) -> dict[str, Any]:
    """The resolved config of a cell at ``seed`` (interpolations such as ``run_dir`` resolve with it)."""
    out = cfg.copy()
    out.seed = seed
    return to_container(out)


def describe_grid(specs: Sequence[RunSpec]) -> str:
    """How many runs, cells and seeds per cell of a grid, e.g. ``48 runs (16 cells x 3 seeds)``."""
    per_cell = Counter(spec.cell_id for spec in specs)
    if not per_cell:
        return "0 runs"
    counts = sorted(set(per_cell.values()))
    seeds = plural(counts[0], "seed") if len(counts) == 1 else f"{counts[0]}-{counts[-1]} seeds"
    return f"{plural(len(specs), 'run')} ({plural(len(per_cell), 'cell')} x {seeds})"


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' if n != 1 else ''}"


#: the run config's top-level numbers (no schema types them): key -> (type, what is allowed); their ranges are the
#: trainers' own checks (predmask.methods.MethodParams for delta, the engine's and the VeRL translation's for top_k)
_NUMBERS: dict[str, tuple[type, str]] = {
    "delta": (float, "a finite number > 0 (the trust-region threshold, e.g. delta=0.15)"),
    "top_k": (int, "an integer >= 1 (K of the rollout's top-K, e.g. top_k=20)"),
}


def _check_values(cfg: dict[str, Any]) -> None:
    """The top-level numbers have their type: a bad one is one line naming the key, the value and what is allowed."""
    for key, (kind, allowed) in _NUMBERS.items():
        value = cfg.get(key)
        numeric = isinstance(value, int | float) if kind is float else isinstance(value, int)
        if value is not None and (isinstance(value, bool) or not numeric):
            raise SweepError(f"{key} must be {allowed}, got {value!r}")


def cell_text(cfg: dict[str, Any]) -> str:
    """A run's place in the grid, for messages: ``method=... model=... precision=... delta=... seed=...``
    (a variational stage: ``stage=... method=... [data=...] model=... seed=...``)."""
    method, model, precision = (cfg.get(k) for k in ("method", "model", "precision"))
    if cfg.get("stage") is not None:
        method = method if isinstance(method, dict) else {}
        data = [("data", method["data"])] if method.get("data") else []
        model_name = model.get("name") if isinstance(model, dict) else model
        return " ".join(f"{k}={v}" for k, v in (("stage", cfg["stage"]), ("method", method.get("name")), *data,
                                                ("model", model_name), ("seed", cfg.get("seed", 0))))
    names = [(k, v.get("name") if isinstance(v, dict) else v)
             for k, v in (("method", method), ("model", model), ("precision", precision))]
    return " ".join(f"{k}={v}" for k, v in (*names, ("delta", cfg.get("delta")), ("seed", cfg.get("seed", 0))))


def compose_run(primary: str, overrides: list[str]) -> tuple[DictConfig, list[str]]:
    """``primary`` composed with ``overrides``, and the overrides that compose it: on a CPU trainer a cluster model
    maps to its CPU stand-in; a config that does not compose is one line."""
    try:
        cfg = compose(primary, overrides)
        if cfg.cluster.get("trainer", "cpu") == "cpu" and cfg.model.get("backend") != "cpu":
            overrides = [*overrides, f"model={cpu_standin(to_container(cfg.model))['name']}"]
            cfg = compose(primary, overrides)
    except ConfigError as err:
        raise SweepError(str(err)) from None
    return cfg, overrides


def cell_runs(sweep: str, batch: Sequence[str], seeds: list[int] | None,
              *, sweep_file: bool = True) -> list[tuple[int, RunSpec]]:
    """The runs of one cell of the grid, one per seed (``seeds`` None: the cell's cluster default);
    ``sweep_file`` False leaves the sweep's own file out (the variational family's grpo final), the run still
    in ``sweep``."""
    ovs = [*([f"+sweep={sweep}"] if sweep_file else []), *batch]
    cfg, standin = compose_run(PRIMARY, ovs)
    runs = []
    for seed in seeds if seeds is not None else cluster_seeds(cfg):
        resolved = config_at_seed(cfg, seed)
        _check_values(resolved)
        try:  # the run records every parameter its loss reads
            resolved["method"] = method_config(resolved["method"])
        except ValueError as err:
            raise SweepError(f"cell {cell_text(resolved)}: {first_line(err)}") from None
        runs.append((seed, RunSpec(stable_id(resolved), sweep, (*standin, f"seed={seed}"), resolved)))
    return runs


def expand_grid(sweep: str, overrides: list[str] | None = None) -> list[RunSpec]:
    """Expand the train-family ``sweep`` with command-line ``overrides`` (which replace the sweep's own axes
    of the same key) into resolved runs, seed by seed: every cell at the first seed, then at the next."""
    if sweep not in sweep_names():
        raise SweepError(f"unknown sweep {sweep!r}; valid: {', '.join(sweep_names())}")
    if sweep_family(sweep) != TRAIN_FAMILY:
        raise SweepError(f"sweep {sweep!r} is of family {sweep_family(sweep)!r}: expand it with sweeps.families.expand")
    _, parsed, seeds = parse_axes(sweep, overrides, GROUPS)
    (batches,) = BasicSweeper.split_arguments(parsed, None)
    runs = [(seed, cell, spec) for cell, batch in enumerate(batches) for seed, spec in cell_runs(sweep, batch, seeds)]
    runs.sort(key=lambda run: run[:2])
    return unique_runs(spec for _, _, spec in runs)  # two cells may be one run (the same CPU run on two clusters)


def parse_axes(sweep: str, overrides: Sequence[str] | None,
               checked: Sequence[str] = ()) -> tuple[list[Any], list[Any], list[int] | None]:
    """The command line's ``overrides`` parsed; the sweep's own axes then theirs, without the seed axis (a key
    given twice: the later replaces the earlier); and the seeds either gives (None: each cell's cluster default).
    The values of the ``checked`` groups are checked: the command line's first, the sweep's after the seeds."""
    user = parse_overrides(list(overrides or []))
    check_group_values(user, checked)
    own = parse_overrides([f"{k}={v}" for k, v in sweep_params(sweep).items()])
    seeds = seed_axis(own, user)
    check_group_values(own, checked)
    return user, [ov for ov in own + user if override_key(ov) not in SEED_KEYS], seeds


def unique_runs(specs: Iterable[RunSpec]) -> list[RunSpec]:
    """Each run once, where it is first met."""
    unique: dict[str, RunSpec] = {}
    for spec in specs:
        unique.setdefault(spec.run_id, spec)
    return list(unique.values())
