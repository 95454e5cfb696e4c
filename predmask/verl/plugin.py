"""The plugin entry point of every verl process: importing this module installs predmask's hooks into verl.

verl imports the modules named in ``VERL_USE_EXTERNAL_MODULES`` at ``import verl``; the launcher puts this module
there for the driver and, through Ray's ``runtime_env``, for every Ray worker (:mod:`predmask.verl.launch`).
Each hook runs when its verl module is imported (or at once if it already is), so a process imports only the
verl modules it uses:

- ``verl.trainer.ppo.core_algos``: every method of ``predmask.METHODS`` is registered under its name
  (:func:`predmask.verl.loss.register_all`);
- ``verl.workers.engine_workers``: the actor's TrainingWorker becomes the top-K-aware subclass
  (:func:`predmask.verl.worker.install_actor`);
- ``verl.workers.rollout.vllm_rollout.vllm_async_server``: vLLM returns the top-K log-probs
  (:func:`predmask.verl.rollout_hook.install_rollout`);
- ``verl.experimental.agent_loop.agent_loop``: validation requests are marked so that they ask for no top-K
  (:func:`predmask.verl.rollout_hook.install_agent_loop`);
- ``verl.trainer.ppo.ray_trainer``: the old-log-prob actor forward is skipped for rollout-anchored methods
  (:func:`predmask.verl.trainer_hook.install_trainer`).

No other module of ``predmask.verl`` installs anything on import.
"""

from __future__ import annotations

from types import ModuleType

from predmask.verl._hooks import when_imported


def _register_losses(core_algos: ModuleType) -> None:
    from predmask.verl.loss import register_all

    register_all(core_algos)


def _install_actor(engine_workers: ModuleType) -> None:
    from predmask.verl.worker import install_actor

    install_actor(engine_workers)


def _install_rollout(vllm_async_server: ModuleType) -> None:
    from predmask.verl.rollout_hook import install_rollout

    install_rollout(vllm_async_server)


def _install_agent_loop(agent_loop: ModuleType) -> None:
    from predmask.verl.rollout_hook import install_agent_loop

    install_agent_loop(agent_loop)


def _install_trainer(ray_trainer: ModuleType) -> None:
    from predmask.verl.trainer_hook import install_trainer

    install_trainer(ray_trainer)


def install() -> None:
    """Install the hooks (idempotent: every hook checks whether it already ran)."""
    when_imported("verl.trainer.ppo.core_algos", _register_losses)
    when_imported("verl.workers.engine_workers", _install_actor)
    when_imported("verl.workers.rollout.vllm_rollout.vllm_async_server", _install_rollout)
    when_imported("verl.experimental.agent_loop.agent_loop", _install_agent_loop)
    when_imported("verl.trainer.ppo.ray_trainer", _install_trainer)


install()
