"""The actor worker hook: verl's ``ActorRolloutRefWorker`` builds its actor with a top-K-aware TrainingWorker.

The subclass wraps the loss in :class:`predmask.verl.topk_loss.TopKPolicyLoss` and sets the micro-batch flag
``distillation_use_topk`` when the batch carries top-K records and the method needs the support, so that the
engines call the loss as logits processor first (with fused kernels on FSDP: :func:`install_hidden_gather`).
With ``predmask.stats_dir`` set it gives the loss a :class:`~predmask.verl.loss_stats.LossStatsWriter`
(docs/verl-plugin.md, "Metrics") and tells it the step (``train_mini_batch``) and the mini-batch
(``train_batch``). Imports verl.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import Tensor
from verl.utils import tensordict_utils as tu

from predmask.verl.loss_stats import LossStatsWriter, checkpoint_step
from predmask.verl.records import TOPK_KEY
from predmask.verl.settings import current_settings
from predmask.verl.topk_loss import TopKPolicyLoss


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
                if self.engine_config.use_fused_kernels:
                    install_hidden_gather(self.engine)
            writer = self._stats_writer()
            if writer is not None:
                writer.begin_mini_batch()
            return super().train_batch(data)

    PredmaskTrainingWorker.__qualname__ = PredmaskTrainingWorker.__name__ = f"Predmask{base.__name__}"
    return PredmaskTrainingWorker


@dataclass
class _FusedStep:
    """One fused forward step's logits processor: its loss, its micro-batch and, once the decoder ran, the outputs."""

    loss_fn: TopKPolicyLoss
    data: Any
    outputs: dict[str, Tensor] | None = None


_FUSED_STEP: ContextVar[_FusedStep | None] = ContextVar("predmask_fused_step", default=None)


def _decoder_hook(lm: Any) -> Callable[..., None]:
    """Forward hook of the decoder: inside the model's forward (where FSDP holds the lm_head weight unsharded), the
    logits processor of the current fused step reads the final hidden states and ``lm.lm_head.weight``."""

    def hook(_module: Any, _args: Any, output: Any) -> None:
        step = _FUSED_STEP.get()
        if step is None:
            return
        weight = lm.get_output_embeddings().weight
        weight = weight.full_tensor() if hasattr(weight, "full_tensor") else weight  # a TP DTensor: its rows
        step.outputs = step.loss_fn.hidden_support(output[0].detach(), weight.detach(), step.data)

    return hook


def install_hidden_gather(engine: Any) -> None:
    """verl's fused FSDP forward builds no logits: hook the engine so that a top-K micro-batch's support comes
    from the decoder's hidden states, put in ``model_output`` where the logits path puts it (idempotent)."""
    if getattr(engine, "predmask_hidden_gather", False):
        return
    lm = next((m for m in engine.module.modules() if hasattr(m, "get_output_embeddings") and hasattr(m, "get_decoder")),
              None)
    if lm is None:
        raise ValueError(f"use_fused_kernels with a top-K method needs a causal LM with an lm_head and a decoder; "
                         f"{type(engine.module).__name__} has neither")
    lm.get_decoder().register_forward_hook(_decoder_hook(lm))
    forward_step, prepare_model_outputs = engine.forward_step, engine.prepare_model_outputs

    def fused_forward_step(micro_batch: Any, loss_function: Any, forward_only: bool) -> Any:
        gathers = (isinstance(loss_function, TopKPolicyLoss) and loss_function.needs_logits
                   and tu.get_non_tensor_data(micro_batch, "distillation_use_topk", False)
                   and tu.get_non_tensor_data(micro_batch, "use_fused_kernels", False))
        token = _FUSED_STEP.set(_FusedStep(loss_function, micro_batch) if gathers else None)
        try:
            return forward_step(micro_batch, loss_function=loss_function, forward_only=forward_only)
        finally:
            _FUSED_STEP.reset(token)

    def fused_model_outputs(output: Any, output_args: dict[str, Any], micro_batch: Any, **kwargs: Any) -> Any:
        model_output = prepare_model_outputs(output, output_args, micro_batch, **kwargs)
        step = _FUSED_STEP.get()
        if step is not None:
            if step.outputs is None:
                raise RuntimeError("verl's fused forward did not run the decoder hook: no support log-probs")
            cu_seqlens = micro_batch["input_ids"].offsets()
            for key, value in step.outputs.items():
                value = value.squeeze(0)
                if "pad_size" in output_args:  # remove-padding: all-gather the Ulysses ranks, drop the pad
                    value = engine._gather_and_unpad_packed(value, output_args["pad_size"])
                model_output[key] = torch.nested.nested_tensor_from_jagged(value, cu_seqlens)
        return model_output

    engine.forward_step, engine.prepare_model_outputs = fused_forward_step, fused_model_outputs
    engine.predmask_hidden_gather = True


def install_actor(engine_workers: ModuleType) -> None:
    """Make verl's ActorRolloutRefWorker build its actor with the predmask TrainingWorker (idempotent)."""
    worker = engine_workers.ActorRolloutRefWorker
    if getattr(worker.actor_worker_cls, "predmask_topk", False):
        return
    worker.actor_worker_cls = make_training_worker_cls(worker.actor_worker_cls)
