"""The actor's policy loss as verl's engines call it: top-K logits processor first, then verl's loss in the support.

With the micro-batch flag ``distillation_use_topk`` (set by :mod:`predmask.verl.worker`) verl's engines first
call the loss with the temperature-scaled logits, and it gathers the training log-probs on the rollout support
into ``model_output`` (on the fused FSDP path, from the hidden states: :meth:`TopKPolicyLoss.hidden_support`);
then, as the loss, it calls verl's ``ppo_loss`` inside :func:`predmask.verl.loss.rollout_support`, so verl's
entropy, KL, aggregation and metrics stay verl's. Imports verl; loaded by the worker hook.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor
from verl.utils import tensordict_utils as tu
from verl.utils.ulysses import get_ulysses_sequence_parallel_rank, get_ulysses_sequence_parallel_world_size
from verl.workers.utils.padding import no_padding_2_padding

from predmask.methods import METHODS, Method
from predmask.support import TopKSupport
from predmask.verl.gather import (
    chunked_support_logprobs,
    hidden_support_logprobs,
    vocab_parallel_support_logprobs,
)
from predmask.verl.loss import RolloutSupport, loss_statistics, rollout_support
from predmask.verl.loss_stats import LossStatsWriter
from predmask.verl.overrides import config_select
from predmask.verl.packing import pack_response_tensor, sequence_lengths, support_from_records
from predmask.verl.records import TOPK_KEY

#: model_output keys written by the logits processor: one per support slot, plus the exact tail
PI_KEY_PREFIX = "predmask_pi_lp_"
PI_TAIL_KEY = "predmask_pi_tail_sq"
#: the actor strategies whose fused-kernel path gathers the support from the hidden states (predmask.verl.worker)
FUSED_STRATEGIES = ("fsdp", "fsdp2")


def _rollout_support(data: Any) -> tuple[TopKSupport, Tensor]:
    """The micro-batch's response-aligned rollout support and anchor, from its top-K records."""
    records = tu.get(data, TOPK_KEY, None)
    if records is None:
        raise ValueError(f"the micro-batch carries no {TOPK_KEY!r}")
    return support_from_records(list(records), _padded(data["responses"]), _padded(data["response_mask"]))


def _padded(t: Tensor, fill: float | bool = 0) -> Tensor:
    return t.to_padded_tensor(fill) if t.is_nested else t


def _fp8_padding(config: Any) -> bool:
    engine = getattr(config, "megatron", None) or getattr(config, "engine", None)
    override = getattr(engine, "override_transformer_config", None) or {}
    return override.get("fp8", None) in ("e4m3", "hybrid")


class TopKPolicyLoss:
    """Wraps verl's ``ppo_loss`` partial: logits processor (support gather) and loss (support context).

    Called by verl's engines as ``loss(model_output=..., data=..., dp_group=...)`` and, when the micro-batch flag
    ``distillation_use_topk`` is set, first as ``loss(student_logits=..., data=..., [data_format=...])``.
    For losses that are not predmask methods it passes everything straight through.
    """

    def __init__(self, inner: Callable[..., Any], config: Any | None = None) -> None:
        self.inner = inner
        keywords = getattr(inner, "keywords", {}) or {}
        self.config = config if config is not None else keywords.get("config")
        if keywords.get("distillation_config") is not None:
            raise ValueError("predmask's top-K plumbing does not combine with verl's distillation loss")
        name = str(config_select(self.config, "policy_loss.loss_mode", "vanilla"))
        self.method: Method | None = METHODS.get(name)
        self.vocab_size: int | None = None
        self.stats_writer: LossStatsWriter | None = None
        fused = bool(getattr(self.config, "use_fused_kernels", False))
        if self.needs_logits and fused and self.strategy not in FUSED_STRATEGIES:
            raise ValueError(
                f"policy loss {name!r} gathers its support from the logits or, with fused kernels, the hidden "
                f"states on {' or '.join(FUSED_STRATEGIES)} only (strategy {self.strategy!r}): set "
                "actor_rollout_ref.model.use_fused_kernels=false"
            )

    @property
    def needs_logits(self) -> bool:
        return self.method is not None and self.method.needs_support

    @property
    def needs_tail(self) -> bool:
        return self.method is not None and self.method.reads_tail_sq

    @property
    def strategy(self) -> str:
        return str(getattr(self.config, "strategy", "fsdp"))

    # -- logits processor -----------------------------------------------------------------------------------
    def _packed_support(self, data: Any) -> tuple[Tensor, Tensor]:
        """Support ids and validity [total_tokens, K+1] in verl's packed order (rows predicting each response token)."""
        support, _ = _rollout_support(data)
        attention_mask = data.get("attention_mask", None)
        prompt_lens, response_lens = sequence_lengths(data["prompts"], data["responses"], attention_mask)
        ids = pack_response_tensor(support.ids, prompt_lens, response_lens, fill=0)
        valid = pack_response_tensor(support.valid, prompt_lens, response_lens, fill=False)
        return ids, valid

    def _outputs(self, pi: Tensor, tail: Tensor | None, lead: torch.Size) -> dict[str, Tensor]:
        pi = torch.where(torch.isfinite(pi), pi, torch.zeros_like(pi))
        out = {f"{PI_KEY_PREFIX}{j}": pi[..., j].reshape(lead) for j in range(pi.shape[-1])}
        if tail is not None:
            out[PI_TAIL_KEY] = tail.reshape(lead)
        return out

    def support_logprobs(self, student_logits: Tensor, data: Any, data_format: str = "thd") -> dict[str, Tensor]:
        """Logits-processor call: per-slot training log-probs, shaped like ``student_logits.shape[:2]``."""
        if not self.needs_logits:
            return {}
        ids, valid = self._packed_support(data)
        ids, valid = ids.to(student_logits.device), valid.to(student_logits.device)
        if self.strategy == "megatron":
            return self._megatron_support(student_logits, data, ids, valid, data_format)
        return self._fsdp_support(student_logits, ids, valid)

    def _fsdp_support(self, logits: Tensor, ids: Tensor, valid: Tensor) -> dict[str, Tensor]:
        rows = logits.reshape(-1, logits.shape[-1])
        ids, valid = self._sp_local(ids, valid, rows.shape[0], "logits")
        self.vocab_size = int(logits.shape[-1])
        pi, tail = chunked_support_logprobs(rows, ids, valid, return_tail_sq=self.needs_tail)
        return self._outputs(pi, tail, logits.shape[:2])

    def hidden_support(self, hidden: Tensor, lm_head_weight: Tensor, data: Any) -> dict[str, Tensor]:
        """The logits processor on verl's fused FSDP path, from the final hidden states and the lm_head weight:
        the same outputs, shaped [1, packed rows]. ``hidden`` is verl's packed [1, rows, D] (this Ulysses rank's
        slice) or, without remove-padding, the padded [B, L, D] (its rows packed here as verl packs the logits);
        the temperature is the micro-batch's, as verl's fused forward applies it."""
        if not self.needs_logits:
            return {}
        if not tu.get_non_tensor_data(data, "use_remove_padding", True):
            lengths = data["input_ids"].offsets().diff().to(hidden.device)
            hidden = hidden[torch.arange(hidden.shape[1], device=hidden.device) < lengths[:, None]]
        rows = hidden.reshape(-1, hidden.shape[-1]).to(lm_head_weight.dtype)
        ids, valid = self._packed_support(data)
        ids, valid = self._sp_local(ids.to(rows.device), valid.to(rows.device), rows.shape[0], "hidden states")
        self.vocab_size = int(lm_head_weight.shape[0])
        pi, tail = hidden_support_logprobs(rows, lm_head_weight, ids, valid, temperature=float(data["temperature"]),
                                           return_tail_sq=self.needs_tail)
        return self._outputs(pi, tail, torch.Size((1, rows.shape[0])))

    @staticmethod
    def _sp_local(ids: Tensor, valid: Tensor, rows: int, source: str) -> tuple[Tensor, Tensor]:
        """This Ulysses rank's rows of the packed support (verl's pad-then-slice), checked against ``rows``."""
        sp = get_ulysses_sequence_parallel_world_size()
        if sp > 1:  # same pad-then-slice as verl's Ulysses inputs
            pad = (-ids.shape[0]) % sp
            if pad:
                ids = torch.cat([ids, ids.new_zeros((pad, ids.shape[1]))])
                valid = torch.cat([valid, valid.new_zeros((pad, valid.shape[1]))])
            part = ids.shape[0] // sp
            rank = get_ulysses_sequence_parallel_rank()
            ids, valid = ids[rank * part:(rank + 1) * part], valid[rank * part:(rank + 1) * part]
        if rows != ids.shape[0]:
            raise ValueError(
                f"top-K support has {ids.shape[0]} packed rows but the {source} have {rows} "
                "(static padding such as engine pad_to_length is not supported)"
            )
        return ids, valid

    def _megatron_support(self, logits: Tensor, data: Any, ids: Tensor, valid: Tensor, data_format: str) -> dict[str, Tensor]:
        from megatron.core import parallel_state as mpu
        from verl.models.mcore.util import preprocess_bshd_engine, preprocess_thd_engine

        offsets = data["input_ids"].offsets().to(ids.device)
        nested = [
            torch.nested.nested_tensor_from_jagged(t, offsets=offsets) for t in (ids, valid.to(torch.int8))
        ]
        if data_format == "thd":
            kwargs = {"use_fp8_padding": _fp8_padding(self.config),
                      "local_cp_size": tu.get_non_tensor_data(data, "local_cp_size", None)}
            packed = [preprocess_thd_engine(t, pre_process=True, **kwargs)[0] for t in nested]
        else:
            kwargs = {"forced_max_seqlen": tu.get_non_tensor_data(data, "forced_max_seqlen", None)}
            packed = [preprocess_bshd_engine(t, pre_process=True, **kwargs)[0] for t in nested]
        ids_l, valid_l = (p if p.dim() == 3 else p.unsqueeze(0) for p in packed)
        if tuple(ids_l.shape[:2]) != tuple(logits.shape[:2]):
            raise ValueError(
                f"top-K support packs to {tuple(ids_l.shape[:2])} but the Megatron logits are "
                f"{tuple(logits.shape[:2])}"
            )
        v_local = int(logits.shape[-1])
        tp_rank = mpu.get_tensor_model_parallel_rank()
        self.vocab_size = v_local * mpu.get_tensor_model_parallel_world_size()
        pi, tail = vocab_parallel_support_logprobs(
            logits.reshape(-1, v_local), ids_l.reshape(-1, ids_l.shape[-1]),
            valid_l.reshape(-1, valid_l.shape[-1]).bool(), vocab_start=tp_rank * v_local,
            group=mpu.get_tensor_model_parallel_group(), return_tail_sq=self.needs_tail,
        )
        return self._outputs(pi, tail, logits.shape[:2])

    # -- loss -----------------------------------------------------------------------------------------------
    def rollout_batch(self, model_output: Mapping[str, Any], data: Any) -> RolloutSupport:
        """Response-aligned rollout support, anchor and training support log-probs for this micro-batch."""
        support, anchor = _rollout_support(data)
        if not self.needs_logits:
            return RolloutSupport(anchor_logprobs=anchor, vocab_size=self.vocab_size)
        width = support.ids.shape[-1]
        keys = [f"{PI_KEY_PREFIX}{j}" for j in range(width)]
        missing = [k for k in keys if k not in model_output]
        if missing:
            raise ValueError(
                f"model output lacks the support log-probs {missing[:2]}...: the engine did not call the "
                "top-K logits processor (is the predmask actor worker installed?)"
            )
        pi = torch.stack([no_padding_2_padding(model_output[k], data) for k in keys], dim=-1).float()
        pi = pi[:, : support.ids.shape[1]]
        pi = torch.where(support.valid, pi, torch.full_like(pi, float("-inf")))
        tail = None
        if PI_TAIL_KEY in model_output:
            tail = no_padding_2_padding(model_output[PI_TAIL_KEY], data).float()[:, : support.ids.shape[1]]
        return RolloutSupport(anchor_logprobs=anchor, support=support, pi_logprobs=pi, pi_tail_sq=tail,
                              vocab_size=self.vocab_size)

    def __call__(
        self, model_output: Mapping[str, Any] | None = None, data: Any = None, dp_group: Any = None,
        student_logits: Tensor | None = None, data_format: str = "thd",
    ) -> Any:
        if student_logits is not None:
            return self.support_logprobs(student_logits, data, data_format)
        if self.method is None:
            return self.inner(model_output=model_output, data=data, dp_group=dp_group)
        has_records = data is not None and TOPK_KEY in data
        if not has_records and self.needs_logits:
            raise ValueError(
                f"policy loss {self.method.name!r} needs the rollout top-K (batch key {TOPK_KEY!r}): "
                "set predmask.top_k=K"
            )
        support = self.rollout_batch(model_output or {}, data) if has_records else None
        sink = self.stats_writer.write if self.stats_writer is not None else None
        with rollout_support(support), loss_statistics(sink):
            return self.inner(model_output=model_output, data=data, dp_group=dp_group)
