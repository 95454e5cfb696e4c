"""The actor worker hook: verl's ``ActorRolloutRefWorker`` builds its actor with a top-K-aware TrainingWorker.

``ActorRolloutRefWorker.actor_worker_cls`` is a class attribute verl 0.9.1 provides for swapping the actor's
TrainingWorker. The subclass wraps the loss in :class:`predmask.verl.topk_loss.TopKPolicyLoss` (``set_loss_fn``)
and, when the batch carries top-K records and the method needs the support, sets the micro-batch flag
``distillation_use_topk`` (``train_batch``) so that the engines call the loss as logits processor first.
Imports verl; installed by :mod:`predmask.verl.plugin` when ``verl.workers.engine_workers`` is imported.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from verl.utils import tensordict_utils as tu

from predmask.verl.records import TOPK_KEY
from predmask.verl.topk_loss import TopKPolicyLoss

__all__ = ["install_actor", "make_training_worker_cls"]


def make_training_worker_cls(base: type) -> type:
    """Subclass of verl's TrainingWorker that installs :class:`TopKPolicyLoss` and the logits-processor flag."""

    class PredmaskTrainingWorker(base):  # type: ignore[misc, valid-type]
        predmask_topk = True

        def set_loss_fn(self, loss_fn: Callable[..., Any]) -> None:
            if not isinstance(loss_fn, TopKPolicyLoss):
                loss_fn = TopKPolicyLoss(loss_fn)
            self.loss_fn = loss_fn

        def train_batch(self, data: Any) -> Any:
            loss_fn = self.loss_fn
            if isinstance(loss_fn, TopKPolicyLoss) and loss_fn.needs_logits and TOPK_KEY in data:
                tu.assign_non_tensor(data, distillation_use_topk=True)
            return super().train_batch(data)

    PredmaskTrainingWorker.__qualname__ = PredmaskTrainingWorker.__name__ = f"Predmask{base.__name__}"
    return PredmaskTrainingWorker


def install_actor(engine_workers: ModuleType) -> None:
    """Make verl's ActorRolloutRefWorker build its actor with the predmask TrainingWorker (idempotent)."""
    worker = engine_workers.ActorRolloutRefWorker
    if getattr(worker.actor_worker_cls, "predmask_topk", False):
        return
    worker.actor_worker_cls = make_training_worker_cls(worker.actor_worker_cls)
