"""A hung rollout or weight sync of a verl run ends the run with one line, within ``predmask.stage_timeout_s``.

verl 0.9.1 waits on its rollout (``AgentLoopManager.generate_sequences``: the training batch and validation) and on
its weight sync (``CheckpointEngineManager.update_weights``) with ``ray.get`` / ``await`` and no timeout, so a vLLM
server that never answers, or a sync that never completes, holds the job until Slurm's time limit
(``cluster.timeout_min``), and each requeue after it (``cluster.max_num_timeout``) hangs again. With
``predmask.stage_timeout_s`` set (``cluster.stage_timeout_s``), the launcher names a stage file
(:data:`STAGE_ENV`, ``<run_dir>/stage.json``) in every Ray worker; the plugin's hooks (:func:`install_rollout_stage`,
:func:`install_weight_sync_stage`) write there which of these two stages the trainer is in and since when, and the
launcher's status thread (:func:`hung_stage`) ends verl when one has lasted longer than the timeout, with
:func:`hang_line`. Imports no verl: the verl modules are passed in by the plugin.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

from predmask.io import atomic_write_text

#: the environment variable naming the stage file in every process of the run (unset: no marks)
STAGE_ENV = "PREDMASK_STAGE_FILE"
ROLLOUT, WEIGHT_SYNC = "rollout", "weight sync"
#: what to look at and do when a stage hangs, per stage
_ADVICE = {
    ROLLOUT: "a vLLM server stopped answering (its Ray logs: vLLMHttpServer); a longer rollout needs a larger "
             "cluster.stage_timeout_s",
    WEIGHT_SYNC: "the actor-to-vLLM weight transfer stalled (a dead worker or a blocked collective; Ray logs of "
                 "WorkerDict and vLLMHttpServer); a larger model may need a larger cluster.stage_timeout_s",
}


def _write(path: Path, stage: str | None) -> None:
    atomic_write_text(path, json.dumps({"stage": stage, "since": time.time(), "pid": os.getpid()}) + "\n")


@contextmanager
def stage_mark(stage: str, environ: Any = None) -> Iterator[None]:
    """Mark ``stage`` in the run's stage file for the block (nothing when :data:`STAGE_ENV` is unset)."""
    target = (os.environ if environ is None else environ).get(STAGE_ENV)
    if not target:
        yield
        return
    _write(Path(target), stage)
    try:
        yield
    finally:
        _write(Path(target), None)


def _marked(stage: str, auto_await: Callable[..., Any], method: Any) -> Any:
    """``method`` (verl's ``@auto_await`` coroutine method) with ``stage`` marked while its coroutine runs; verl's
    own ``auto_await`` is applied again around the marked coroutine, so every caller gets what it got before."""
    inner = getattr(method, "__wrapped__", method)

    async def marked(*args: Any, **kwargs: Any) -> Any:
        with stage_mark(stage):
            return await inner(*args, **kwargs)

    marked.__name__, marked.__qualname__, marked.__doc__ = inner.__name__, inner.__qualname__, inner.__doc__
    wrapped = auto_await(marked)
    wrapped._predmask_stage = stage  # type: ignore[attr-defined]
    return wrapped


def _install(cls: Any, name: str, stage: str, auto_await: Callable[..., Any]) -> None:
    method = getattr(cls, name)
    if getattr(method, "_predmask_stage", None) is None:
        setattr(cls, name, _marked(stage, auto_await, method))


def install_rollout_stage(agent_loop: ModuleType) -> None:
    """Mark verl's rollout (``AgentLoopManager.generate_sequences``) as :data:`ROLLOUT` (idempotent)."""
    _install(agent_loop.AgentLoopManager, "generate_sequences", ROLLOUT, agent_loop.auto_await)


def install_weight_sync_stage(checkpoint_engine: ModuleType) -> None:
    """Mark verl's weight sync (``CheckpointEngineManager.update_weights``) as :data:`WEIGHT_SYNC` (idempotent)."""
    _install(checkpoint_engine.CheckpointEngineManager, "update_weights", WEIGHT_SYNC, checkpoint_engine.auto_await)


def hung_stage(stage_file: Path, timeout_s: float, now: float | None = None) -> tuple[str, float] | None:
    """``(stage, seconds)`` when the stage file says a stage has run longer than ``timeout_s``; else None (no file,
    no stage, or a file being replaced)."""
    try:
        mark = json.loads(stage_file.read_text())
    except (OSError, ValueError):
        return None
    stage, since = mark.get("stage"), mark.get("since")
    if not stage or not isinstance(since, int | float):
        return None
    elapsed = (time.time() if now is None else now) - since
    return (str(stage), elapsed) if elapsed > timeout_s else None


def hang_line(stage: str, elapsed_s: float, timeout_s: float, last_step: int) -> str:
    """The one line of a run ended because ``stage`` hung."""
    return (f"verl's {stage} hung: running for {elapsed_s:.0f} s after step {last_step}, longer than "
            f"predmask.stage_timeout_s={timeout_s:g} (cluster.stage_timeout_s); "
            f"{_ADVICE.get(stage, 'see the Ray logs')}; rerun the sweep to resume from the last checkpoint")
