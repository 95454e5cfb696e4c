"""predmask's own parameters of a verl run: the ``predmask.*`` keys of the command line and how they reach every process.

verl's keys keep verl's meaning; what only predmask reads travels under its own keys (:data:`SETTINGS_KEYS`;
their meanings and defaults: docs/verl-plugin.md, "The losses"; a key not given is None, ``top_k`` 0: no top-K
records; ``predmask.support`` is the top-K methods' support, one of ``predmask.methods.TOPK_SUPPORTS``, the
first by default). ``python -m predmask.verl.launch`` takes them off verl's argv (:func:`split_argv`) and puts
them, as JSON, into :data:`SETTINGS_ENV` of its own process and of every Ray worker (the job's
``runtime_env``); every plugin piece reads them with :func:`current_settings`. Imports no verl.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from predmask.methods import ANCHORS, TOPK_SUPPORTS, MethodParams

PREFIX = "predmask."
#: the environment variable holding the settings (JSON) in every process of the run
SETTINGS_ENV = "PREDMASK_VERL_SETTINGS"
_OVERRIDE = re.compile(r"^(\+\+|\+)?predmask\.([^=]+)=(.*)$", re.DOTALL)


@dataclass(frozen=True)
class PluginSettings:
    """The values of the ``predmask.*`` keys (None: the key was not given; see the module docstring)."""

    delta: float | None = None
    ratio_cap: float | None = None
    anchor: str | None = None
    support: str | None = None
    top_k: int = 0
    stats_dir: str | None = None
    #: seconds a rollout or weight sync may last before the launcher ends the run (predmask.verl.stages); None: no bound
    stage_timeout_s: float | None = None
    #: the launch that wrote these settings (one per attempt of a run; names its statistics files)
    session: str | None = None

    def __post_init__(self) -> None:
        for key in ("delta", "ratio_cap"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
                raise ValueError(f"predmask.{key} must be a number, got {value!r}")
        given = {k: getattr(self, k) for k in ("delta", "ratio_cap") if getattr(self, k) is not None}
        try:
            MethodParams.from_mapping(given)  # the one owner of their ranges; its messages start with the key
        except ValueError as err:
            raise ValueError(f"predmask.{err}") from None
        if self.anchor is not None and self.anchor not in ANCHORS:
            raise ValueError(f"predmask.anchor must be one of {', '.join(ANCHORS)}, got {self.anchor!r}")
        if self.support is not None and self.support not in TOPK_SUPPORTS:
            raise ValueError(f"predmask.support must be one of {', '.join(TOPK_SUPPORTS)}, got {self.support!r}")
        value = self.stage_timeout_s
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or value <= 0):
            raise ValueError(f"predmask.stage_timeout_s must be a number of seconds > 0 or null, got {value!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"predmask.top_k must be an integer >= 0 (0: no top-K records), got {self.top_k!r}")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> PluginSettings:
        """From ``{key: value}``; an unknown key raises one line naming it and the allowed keys."""
        unknown = sorted(set(values) - set(SETTINGS_KEYS) - {"session"})
        if unknown:
            allowed = ", ".join(f"{PREFIX}{k}" for k in SETTINGS_KEYS)
            raise ValueError(f"unknown key {PREFIX}{unknown[0]}; allowed: {allowed}")
        return cls(**dict(values))

    def to_json(self) -> str:
        """The compact JSON of the values that differ from the defaults (what :data:`SETTINGS_ENV` holds)."""
        default = asdict(PluginSettings())
        return json.dumps({k: v for k, v in asdict(self).items() if v != default[k]}, sort_keys=True,
                          separators=(",", ":"))


#: the keys a command line may give (``predmask.<key>=<value>``)
SETTINGS_KEYS: tuple[str, ...] = ("delta", "ratio_cap", "anchor", "support", "top_k", "stats_dir", "stage_timeout_s")


def parse_value(text: str) -> Any:
    """A Hydra override value as the Python value Hydra's grammar gives (quoted strings unquoted)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    (override,) = OverridesParser.create().parse_overrides([f"key={text}"])
    return override.value()


def split_argv(argv: Sequence[str]) -> tuple[list[str], dict[str, Any]]:
    """``(verl's argv without the predmask.* overrides, {key: value} of those overrides)``; a repeated key: last wins."""
    rest: list[str] = []
    values: dict[str, Any] = {}
    for item in argv:
        match = _OVERRIDE.match(item)
        if match is None:
            rest.append(item)
            continue
        values[match.group(2).strip()] = parse_value(match.group(3).strip())
    PluginSettings.from_mapping(values)  # one line on a bad key or value, before anything starts
    return rest, values


def current_settings(environ: Mapping[str, str] | None = None) -> PluginSettings:
    """The settings of this process (:data:`SETTINGS_ENV`); the defaults when it is unset."""
    text = (os.environ if environ is None else environ).get(SETTINGS_ENV)
    if not text:
        return PluginSettings()
    try:
        values = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{SETTINGS_ENV} is not JSON ({err.msg}): {text[:80]!r}") from None
    if not isinstance(values, dict):
        raise TypeError(f"{SETTINGS_ENV} must be a JSON object, got {text[:80]!r}")
    return PluginSettings.from_mapping(values)
