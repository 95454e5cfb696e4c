"""``python -m predmask.verl.launch <verl hydra overrides>``: verl's PPO trainer with the plugin in every process.

Runs verl's own Hydra app (``verl.trainer.main_ppo``) in this process -- this module is not a Hydra app, so there is
no Hydra-inside-Hydra. Before that it makes every process import :mod:`predmask.verl`:

- this process (the Ray driver): ``VERL_USE_EXTERNAL_MODULES`` gets ``predmask.verl`` appended, so ``import verl``
  imports the plugin;
- every Ray worker (TaskRunner, actor/rollout workers, vLLM servers, agent-loop workers, on every node): the same
  variable goes into Ray's job ``runtime_env`` through the override
  ``+ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES=predmask.verl`` (added unless given).

It also adds ``trainer.use_v1=false`` unless given (the plugin rides verl's DataProto trainer) and refuses
``trainer.use_v1=true``. Any Hydra flag (``--cfg job``, ``--help``) passes through to verl.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping, Sequence

from predmask.verl.overrides import PLUGIN_ENV, PLUGIN_MODULE, RUNTIME_ENV

__all__ = ["plugin_modules_value", "launch_argv", "main"]

_KEY = re.compile(r"^(\+\+|\+|~)?([^=]+)=(.*)$", re.S)
TRAINER_MODULE = "verl.trainer.main_ppo"


def plugin_modules_value(current: str | None) -> str:
    """``VERL_USE_EXTERNAL_MODULES`` with ``predmask.verl`` included (existing entries kept, order kept)."""
    modules = [m.strip() for m in (current or "").split(",") if m.strip()]
    if PLUGIN_MODULE not in modules:
        modules.append(PLUGIN_MODULE)
    return ",".join(modules)


def _override_keys(overrides: Sequence[str]) -> dict[str, str]:
    keys: dict[str, str] = {}
    for item in overrides:
        match = _KEY.match(item)
        if match and not item.startswith("-"):
            keys[match.group(2).strip()] = match.group(3).strip()
    return keys


def launch_argv(overrides: Sequence[str], environ: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """The verl argv (overrides plus the plugin's defaults) and the environment updates for this process."""
    keys = _override_keys(overrides)
    use_v1 = keys.get("trainer.use_v1")
    if use_v1 is not None and use_v1.strip("'\"").lower() not in ("false", "0"):
        raise ValueError(
            f"trainer.use_v1={use_v1} is not supported: predmask's top-K plumbing runs on verl's DataProto "
            "trainer (trainer.use_v1=false)"
        )
    modules = plugin_modules_value(environ.get(PLUGIN_ENV))
    argv = list(overrides)
    env_key = f"{RUNTIME_ENV.lstrip('+')}.{PLUGIN_ENV}"
    if env_key not in keys:
        argv.append(f"{RUNTIME_ENV}.{PLUGIN_ENV}='{modules}'" if "," in modules else f"{RUNTIME_ENV}.{PLUGIN_ENV}={modules}")
    elif PLUGIN_MODULE not in keys[env_key]:
        raise ValueError(f"{env_key}={keys[env_key]} must include {PLUGIN_MODULE}")
    if use_v1 is None:
        argv.append("trainer.use_v1=false")
    return argv, {PLUGIN_ENV: modules}


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point: set up the plugin environment, then hand the command line to verl's Hydra app."""
    overrides = list(sys.argv[1:] if argv is None else argv)
    try:
        verl_argv, env = launch_argv(overrides, os.environ)
    except ValueError as exc:
        raise SystemExit(f"predmask.verl.launch: {exc}") from None
    os.environ.update(env)
    import predmask.verl  # noqa: F401  (the driver registers too, whatever imported verl first)

    from verl.trainer import main_ppo

    sys.argv = [main_ppo.__file__, *verl_argv]
    main_ppo.main()


if __name__ == "__main__":
    main()
