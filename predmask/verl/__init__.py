"""The VeRL plugin: importing it registers predmask's methods as verl policy losses and installs the top-K plumbing.

``import predmask.verl`` is cheap and imports no verl module itself: each hook runs when its verl module is
imported (or at once if it already is):

- ``verl.trainer.ppo.core_algos``: every method of ``predmask.METHODS`` is registered under its name
  (:mod:`predmask.verl.loss`);
- ``verl.workers.engine_workers``: the actor's TrainingWorker becomes the top-K-aware subclass
  (:mod:`predmask.verl.topk`);
- ``verl.workers.rollout.vllm_rollout.vllm_async_server``: vLLM returns the top-K log-probs (:mod:`predmask.verl.topk`).

Every Ray worker imports it through verl's own ``VERL_USE_EXTERNAL_MODULES=predmask.verl`` (set by
``python -m predmask.verl.launch`` / :func:`verl_overrides`). See docs/verl-plugin.md.
"""

from __future__ import annotations

from types import ModuleType

from predmask.verl._hooks import when_imported
from predmask.verl.overrides import PLUGIN_ENV, PLUGIN_MODULE, verl_overrides

__all__ = ["PLUGIN_ENV", "PLUGIN_MODULE", "install", "verl_overrides"]


def _register_losses(core_algos: ModuleType) -> None:
    from predmask.verl.loss import register_all

    register_all(core_algos)


def _install_actor(engine_workers: ModuleType) -> None:
    from predmask.verl.topk import install_actor

    install_actor(engine_workers)


def _install_rollout(vllm_async_server: ModuleType) -> None:
    from predmask.verl.topk import install_rollout

    install_rollout(vllm_async_server)


def install() -> None:
    """Install the hooks (idempotent; done on import)."""
    when_imported("verl.trainer.ppo.core_algos", _register_losses)
    when_imported("verl.workers.engine_workers", _install_actor)
    when_imported("verl.workers.rollout.vllm_rollout.vllm_async_server", _install_rollout)


install()
