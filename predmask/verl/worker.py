"""The actor worker hook: verl's ``ActorRolloutRefWorker`` builds its actor with a top-K-aware TrainingWorker.

``ActorRolloutRefWorker.actor_worker_cls`` is a class attribute verl 0.9.1 provides for swapping the actor's
TrainingWorker. The subclass wraps the loss in :class:`predmask.verl.topk_loss.TopKPolicyLoss` (``set_loss_fn``)
and, when the batch carries top-K records and the method needs the support, sets the micro-batch flag
``distillation_use_topk`` (``train_batch``) so that the engines call the loss as logits processor first.

With ``predmask.stats_dir`` set (:mod:`predmask.verl.settings`) it also gives the loss a
:class:`~predmask.verl.loss_stats.LossStatsWriter` on the first rank of each model-parallel group and tells it the step
and the mini-batch: ``train_mini_batch`` is one training step (verl's ``update_actor``), counted from the step of
the checkpoint it resumed from (``load_checkpoint``'s ``global_step_<N>`` path; 0 for a fresh run), and
``train_batch`` one mini-batch. Imports verl; installed by :mod:`predmask.verl.plugin` when
``verl.workers.engine_workers`` is imported.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from verl.utils import tensordict_utils as tu

from predmask.verl.loss_stats import LossStatsWriter, checkpoint_step
from predmask.verl.records import TOPK_KEY
from predmask.verl.settings import current_settings
from predmask.verl.topk_loss import TopKPolicyLoss

__all__ = ["install_actor", "make_training_worker_cls"]


def make_training_worker_cls(base: type) -> type:
    """Subclass of verl's TrainingWorker that installs :class:`TopKPolicyLoss` and the logits-processor flag."""

    class PredmaskTrainingWorker(base):  # type: ignore[misc, valid-type]
        predmask_topk = True
        predmask_step = 0

        def set_loss_fn(self, loss_fn: Callable[..., Any]) -> None:
            if not isinstance(loss_fn, TopKPolicyLoss):
                loss_fn = TopKPolicyLoss(loss_fn)
            self.loss_fn = loss_fn

        def load_checkpoint(self, local_path: Any, *args: Any, **kwargs: Any) -> Any:
            out = super().load_checkpoint(local_path, *args, **kwargs)
            self.predmask_step = checkpoint_step(local_path)
            return out

        def _stats_writer(self) -> LossStatsWriter | None:
            loss_fn = self.loss_fn
            if not isinstance(loss_fn, TopKPolicyLoss) or loss_fn.method is None:
                return None
            if loss_fn.stats_writer is None:
                settings = current_settings()
                if not settings.stats_dir or not self.engine.is_mp_src_rank_with_outputs():
                    return None
                loss_fn.stats_writer = LossStatsWriter(settings.stats_dir, settings.session or "0",
                                                       self.engine.get_data_parallel_rank())
            return loss_fn.stats_writer

        def train_mini_batch(self, data: Any) -> Any:
            self.predmask_step += 1
            writer = self._stats_writer()
            if writer is not None:
                writer.begin_step(self.predmask_step)
            return super().train_mini_batch(data)

        def train_batch(self, data: Any) -> Any:
            loss_fn = self.loss_fn
            if isinstance(loss_fn, TopKPolicyLoss) and loss_fn.needs_logits and TOPK_KEY in data:
                tu.assign_non_tensor(data, distillation_use_topk=True)
            writer = self._stats_writer()
            if writer is not None:
                writer.begin_mini_batch()
            return super().train_batch(data)

    PredmaskTrainingWorker.__qualname__ = PredmaskTrainingWorker.__name__ = f"Predmask{base.__name__}"
    return PredmaskTrainingWorker


def install_actor(engine_workers: ModuleType) -> None:
    """Make verl's ActorRolloutRefWorker build its actor with the predmask TrainingWorker (idempotent)."""
    worker = engine_workers.ActorRolloutRefWorker
    if getattr(worker.actor_worker_cls, "predmask_topk", False):
        return
    worker.actor_worker_cls = make_training_worker_cls(worker.actor_worker_cls)
