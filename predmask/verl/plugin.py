"""The plugin entry point of every verl process: importing this module installs predmask's hooks into verl.

verl imports the modules named in ``VERL_USE_EXTERNAL_MODULES`` at ``import verl``; the launcher puts this
module there for the driver and, through Ray's ``runtime_env``, for every Ray worker
(:mod:`predmask.verl.launch`). Each hook runs when its verl module is imported (or at once if it already is),
so a process imports only the verl modules it uses. No other module of ``predmask.verl`` installs anything on
import.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from predmask.verl._hooks import when_imported

#: verl module -> the plugin modules and their functions that install into it, in order
_HOOKS: dict[str, tuple[tuple[str, str], ...]] = {
    "verl.trainer.ppo.core_algos": (("predmask.verl.loss", "register_all"),),
    "verl.workers.engine_workers": (("predmask.verl.worker", "install_actor"),),
    "verl.workers.rollout.vllm_rollout.vllm_async_server": (("predmask.verl.rollout_hook", "install_rollout"),),
    "verl.experimental.agent_loop.agent_loop": (("predmask.verl.rollout_hook", "install_agent_loop"),
                                                ("predmask.verl.stages", "install_rollout_stage")),
    "verl.checkpoint_engine.base": (("predmask.verl.stages", "install_weight_sync_stage"),),
    "verl.trainer.ppo.ray_trainer": (("predmask.verl.trainer_hook", "install_trainer"),),
}


def _install_into(module: ModuleType) -> None:
    for plugin_module, function in _HOOKS[module.__name__]:
        getattr(importlib.import_module(plugin_module), function)(module)


def install() -> None:
    """Install the hooks (idempotent: every hook checks whether it already ran)."""
    for name in _HOOKS:
        when_imported(name, _install_into)


install()
