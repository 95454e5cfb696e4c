"""The one config layer: the installed conf/ tree, Hydra compose with structured schemas, stable ids, option entries.

``compose`` stores the schemas of ``predmask.schemas`` (and a caller's own) in Hydra's ConfigStore first, so
unknown keys and wrong types fail at compose time with one line (``ConfigError``); the YAML files name their
schema in their defaults list and only select values."""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf

from predmask.conf_tree import conf_dir, group_options
from predmask.schemas.unknown_keys import check_known_keys

#: config keys that say where/how a run is launched or watched, not what it computes: excluded from the run id
#: (a dotted key names a nested one: the trackers a run logs to are not part of it)
LAUNCHER_KEYS: tuple[str, ...] = ("cluster", "run_dir", "cache_dir", "hydra", "trainer.logger")
T = TypeVar("T")


class ConfigError(ValueError):
    """A config that does not compose or an unknown option; the message is one line."""


def _engine_schemas() -> dict[tuple[str | None, str], Any]:
    """(group, name) -> node of the engine's schemas, as named in the defaults lists of conf/."""
    from predmask.schemas import cluster_schema as cs
    from predmask.schemas.task_schema import TaskConfig
    from predmask.schemas.train_schema import BaseConfig, RolloutConfig, TrainerConfig
    from predmask.schemas.variational_schema import SECTIONS

    return {
        ("task", "schema"): TaskConfig,
        ("base", "schema"): BaseConfig,
        ("model", "cluster_schema"): cs.ClusterModelConfig,
        ("cluster", "schema"): cs.ClusterConfig,
        ("cluster", "slurm_schema"): cs.SlurmClusterConfig,
        ("cluster", "verl_schema"): cs.VerlClusterConfig,
        (None, "train_schema"): {"rollout": RolloutConfig, "trainer": TrainerConfig},
        (None, "variational_schema"): SECTIONS,
    }


def _schema_node(node: Any) -> DictConfig:
    """A dataclass (or a mapping of them) as a writable typed node: YAML values merge into it, a frozen
    dataclass's read-only flag would refuse them (the dataclass itself is built from the resolved config)."""
    cfg = OmegaConf.structured(node) if not isinstance(node, Mapping) else OmegaConf.create(
        {k: OmegaConf.structured(v) for k, v in node.items()}
    )
    assert isinstance(cfg, DictConfig)
    for child in [cfg, *(cfg._get_node(k) for k in cfg)]:  # nodes, not values: a schema field may be MISSING
        if isinstance(child, DictConfig):
            OmegaConf.set_readonly(child, False)
    return cfg


def store_schemas(schemas: Mapping[str, Any] | None = None) -> None:
    """Store the engine's schemas and ``schemas`` (primary-level name -> dataclass) in Hydra's ConfigStore:
    before ``@hydra.main`` of an app that composes conf/ itself (``compose`` calls it)."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for (group, name), node in _engine_schemas().items():
        store.store(name=name, group=group, node=_schema_node(node))
    for name, node in (schemas or {}).items():
        store.store(name=name, node=_schema_node(node))


def compose(
    config_name: str,
    overrides: Sequence[str] = (),
    *,
    schemas: Mapping[str, Any] | None = None,
    return_hydra_config: bool = False,
) -> DictConfig:
    """Hydra compose of the primary config ``conf/<config_name>.yaml`` with ``overrides``, schemas stored first."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    store_schemas(schemas)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module="conf", version_base=None):
            cfg = hydra_compose(config_name, overrides=list(overrides), return_hydra_config=return_hydra_config)
    except (HydraException, OmegaConfBaseException) as err:
        hint = _override_hint(config_name, overrides, _one_line(err), schemas)
        raise ConfigError(
            hint or f"cannot compose {config_name} with {' '.join(overrides) or 'no overrides'}: {_one_line(err)}"
        ) from None
    finally:
        GlobalHydra.instance().clear()
    _check_schema_keys(cfg)
    return cfg


_UNKNOWN_KEY = re.compile(r"Could not override '([^']+)'")
_BAD_VALUE = re.compile(r"Error merging override ([^=\s]+)=.*?Value '(.*)' of type '\w+' could not be converted to (\w+)")


def bare_key(override: str) -> str:
    """The dotted key of a Hydra override (``+a.b=1``, ``~a.b``, ``a.b=1,2`` -> ``a.b``)."""
    return override.lstrip("+~").split("=", 1)[0]


def config_keys(cfg: DictConfig, prefix: str = "") -> list[str]:
    """Every dotted key of ``cfg`` (sections and leaves), without Hydra's own node."""
    keys: list[str] = []
    for key in cfg:
        if str(key) == "hydra":
            continue
        path = f"{prefix}.{key}" if prefix else str(key)
        keys.append(path)
        node = cfg._get_node(key)  # type: ignore[union-attr]
        if isinstance(node, DictConfig):
            keys.extend(config_keys(node, path))
    return keys


def closest_keys(key: str, known: Sequence[str], n: int = 3) -> list[str]:
    """The known dotted keys nearest to ``key``: by the whole path, then by its last part (``lr`` -> ``trainer.lr``)."""
    whole = difflib.get_close_matches(key, known, n=n, cutoff=0.6)
    last = key.rsplit(".", 1)[-1]
    names = sorted({k.rsplit(".", 1)[-1] for k in known})
    near = difflib.get_close_matches(last, names, n=n, cutoff=0.75)
    tails = [k for name in near for k in known if k.rsplit(".", 1)[-1] == name]
    return list(dict.fromkeys(whole + tails))[:n]


def _override_hint(
    config_name: str, overrides: Sequence[str], message: str, schemas: Mapping[str, Any] | None
) -> str | None:
    """One line for an unknown key (its nearest known keys) or a bad value (key, value, the type it takes)."""
    bad = _BAD_VALUE.search(message)
    if bad:
        key, value, kind = bad.groups()
        article = "an" if kind[0] in "AEIOU" else "a"
        return f"bad value for {key}: {value!r} is not {article} {kind.lower()} ({key} takes {article} {kind.lower()})"
    unknown = _UNKNOWN_KEY.search(message)
    if not unknown:
        return None
    key = unknown.group(1)
    rest = [o for o in overrides if bare_key(o) != key]
    try:
        known = config_keys(compose(config_name, rest, schemas=schemas))
    except ConfigError:
        known = []
    near = closest_keys(key, known)
    allowed = f"did you mean {' or '.join(near)}?" if near else "no known key is close"
    return f"unknown config key {key!r} (conf/{config_name}.yaml and its groups); {allowed}"


def _check_schema_keys(cfg: DictConfig, path: str = "") -> None:
    """Keys appended with ``+key=value`` into a schema node must still be fields of its dataclass."""
    kind = OmegaConf.get_type(cfg)
    if dataclasses.is_dataclass(kind):
        try:
            check_known_keys(kind, {str(k): None for k in cfg}, path or "config")  # type: ignore[union-attr]
        except ValueError as err:
            raise ConfigError(str(err)) from None
    for key in cfg:
        node = cfg._get_node(key)  # type: ignore[union-attr]
        if isinstance(node, DictConfig) and str(key) != "hydra":
            _check_schema_keys(node, f"{path}.{key}" if path else str(key))


def typed_view(schema: type[T], values: Any, key: str, needed_for: str) -> T:
    """``values`` (a run config's section ``key``: a mapping or a DictConfig) as the dataclass ``schema``, its checks
    run; a missing, unknown or mistyped field raises one ConfigError line naming it (``key.<field>``)."""
    from omegaconf.errors import ConfigKeyError, MissingMandatoryValue, ValidationError

    if not isinstance(values, Mapping | DictConfig):
        raise ConfigError(f"run config is missing {key} (needed for {needed_for})")
    plain = OmegaConf.to_container(values, resolve=True) if isinstance(values, DictConfig) else values
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), plain))  # type: ignore[return-value]
    except MissingMandatoryValue as err:
        raise ConfigError(f"run config is missing {key}.{err.full_key} (needed for {needed_for})") from None
    except ConfigKeyError as err:
        section = f"{key}.{err.full_key}".rsplit(".", 1)[0]
        allowed = ", ".join(f.name for f in dataclasses.fields(err.object_type))  # type: ignore[arg-type]
        raise ConfigError(f"unknown {section} key {err.key!r}; allowed: {allowed}") from None
    except ValidationError as err:
        raise ConfigError(f"bad value for {key}.{err.full_key}: {_one_line(err)}") from None


def _one_line(err: BaseException) -> str:
    """Hydra's message (and its cause's) up to the first blank line, without OmegaConf's full_key/object_type lines."""
    parts = [err, *([err.__cause__] if err.__cause__ else [])]
    lines = [ln.strip() for e in parts for ln in str(e).strip().split("\n\n")[0].splitlines()]
    keep = [ln.rstrip(":") for ln in lines if ln and not ln.startswith(("full_key:", "object_type=", "reference_type="))]
    return ": ".join(keep) or type(err).__name__


def to_container(cfg: DictConfig | Mapping[str, Any]) -> dict[str, Any]:
    """A resolved plain-dict copy of a config (without the ``hydra`` node)."""
    node = cfg if isinstance(cfg, DictConfig) else OmegaConf.create(dict(cfg))
    out = OmegaConf.to_container(node, resolve=True)
    assert isinstance(out, dict)
    out.pop("hydra", None)
    return out  # type: ignore[return-value]


#: keys that only say how an option is displayed: never part of an id, so editing a label orphans no run
DISPLAY_KEYS: frozenset[str] = frozenset({"label"})


def _without_display_keys(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _without_display_keys(v) for k, v in value.items() if k not in DISPLAY_KEYS}
    if isinstance(value, list | tuple):
        return [_without_display_keys(v) for v in value]
    return value


def _without_keys(config: Mapping[str, Any], exclude: Collection[str]) -> dict[str, Any]:
    """``config`` without the ``exclude`` keys; a dotted key (``trainer.logger``) names a nested one."""
    out = {k: v for k, v in config.items() if k not in exclude}
    for key in (k for k in exclude if "." in k):
        head, rest = key.split(".", 1)
        if isinstance(out.get(head), Mapping):
            out[head] = _without_keys(out[head], [rest])
    return out


def stable_id(config: Mapping[str, Any], exclude: Collection[str] = LAUNCHER_KEYS) -> str:
    """12-hex sha256 of the resolved ``config`` without the ``exclude`` keys and without ``label`` keys at any
    depth (display text): the same computation, the same id."""
    core = _without_display_keys(_without_keys(config, exclude))
    blob = json.dumps(core, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def group_entry(group: str, name: str) -> dict[str, Any]:
    """The YAML of option ``name`` of ``group`` as a plain dict (interpolations left as written)."""
    path = conf_dir() / group / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"unknown {group} {name!r}; valid: {', '.join(group_options(group)) or 'none'}")
    out = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    assert isinstance(out, dict)
    return out  # type: ignore[return-value]


def sweep_params(sweep: str) -> dict[str, str]:
    """The grid of conf/sweep/<sweep>.yaml: Hydra sweeper params, axis -> comma-separated values as written."""
    params = group_entry("sweep", sweep).get("hydra", {}).get("sweeper", {}).get("params") or {}
    return {str(k): str(v) for k, v in params.items()}


def option_choices(group: str, name: str) -> dict[str, str]:
    """The group choices an option's defaults list makes, e.g. a setting's ``{"model": ..., "precision": ...}``."""
    out: dict[str, str] = {}
    for item in group_entry(group, name).get("defaults", []):
        if isinstance(item, dict):
            for key, value in item.items():
                out[str(key).removeprefix("override ").lstrip("/")] = str(value)
    return out


def label(group: str, name: str) -> str:
    """Display label of option ``name`` of ``group``: its ``label:`` key in conf/ (an option packaged
    ``_global_``, such as a setting, keeps its own keys under its group name: ``setting.label``)."""
    entry = group_entry(group, name)
    own = entry.get(group) if isinstance(entry.get(group), dict) else entry
    if not isinstance(own.get("label"), str):
        raise ConfigError(f"{group} {name!r} has no label: key in conf/{group}/{name}.yaml")
    return own["label"]


def known_label(group: str, name: str) -> str:
    """:func:`label` of an option conf/ has; else ``name`` itself, so the runs of an option conf/ no longer has still
    list and draw."""
    return label(group, name) if name in group_options(group) else name


def cpu_models() -> list[str]:
    """The options of conf/model that the CPU engine trains (``backend: cpu``), sorted."""
    return [m for m in group_options("model") if group_entry("model", m).get("backend") == "cpu"]


def cpu_standin(model_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The CPU model to train for a model entry: itself when ``backend: cpu``, else its ``cpu_standin`` entry,
    which carries ``resolved_from`` = the name of the model it replaces."""
    if model_cfg.get("backend") == "cpu":
        return dict(model_cfg)
    name = model_cfg.get("name")
    standin = model_cfg.get("cpu_standin")
    if not standin:
        cpu = cpu_models()
        choices = f"{', '.join(cpu[:-1])} or {cpu[-1]}" if len(cpu) > 1 else "".join(cpu)
        raise ConfigError(f"model {name!r} is not a CPU model and names no cpu_standin; use model={choices}")
    if standin not in group_options("model"):
        raise ConfigError(f"cpu_standin {standin!r} of model {name!r} has no conf/model/{standin}.yaml")
    resolved = OmegaConf.to_container(OmegaConf.load(conf_dir() / "model" / f"{standin}.yaml"), resolve=True)
    assert isinstance(resolved, dict)
    return {**resolved, "resolved_from": name}  # type: ignore[dict-item]
