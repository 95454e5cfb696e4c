"""Layouts of the rollout support (pure; imports no verl): records -> response-aligned [B, L, K+1] -> packed rows.

verl packs each sample as prompt + response into one no-padding token stream, where the logits at row ``t``
predict token ``t + 1``: the response-aligned support is placed on the rows that predict each response token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields

import numpy as np
import torch
from torch import Tensor

from predmask.support import TopKSupport, build_support
from predmask.verl.records import TopKRecord


def records_to_padded(records: Sequence[TopKRecord | None], length: int) -> dict[str, Tensor]:
    """Stack per-sample records into response-aligned tensors of width ``length`` (longer records truncated).

    Returns ``topk_ids`` long / ``topk_logprobs`` float / ``topk_valid`` bool [B, L, K], ``sampled_ids`` long /
    ``sampled_logprobs`` float [B, L], and ``present`` bool [B, L] (False past a record's end or for None).
    """
    ks = {r.k for r in records if r is not None}
    if len(ks) > 1:
        raise ValueError(f"top-K records of one batch have different K: {sorted(ks)}")
    k = ks.pop() if ks else 1
    b = len(records)
    ids = np.zeros((b, length, k), dtype=np.int64)
    lps = np.full((b, length, k), -np.inf, dtype=np.float32)
    valid = np.zeros((b, length, k), dtype=bool)
    sampled = np.zeros((b, length), dtype=np.int64)
    sampled_lp = np.zeros((b, length), dtype=np.float32)
    present = np.zeros((b, length), dtype=bool)
    for i, rec in enumerate(records):
        if rec is None:
            continue
        n = min(rec.length, length)
        ids[i, :n] = rec.topk_ids[:n]
        lps[i, :n] = rec.topk_logprobs[:n]
        valid[i, :n] = rec.topk_valid[:n]
        sampled[i, :n] = rec.token_ids[:n]
        sampled_lp[i, :n] = rec.logprobs[:n]
        present[i, :n] = True
    return {
        "topk_ids": torch.from_numpy(ids),
        "topk_logprobs": torch.from_numpy(lps),
        "topk_valid": torch.from_numpy(valid),
        "sampled_ids": torch.from_numpy(sampled),
        "sampled_logprobs": torch.from_numpy(sampled_lp),
        "present": torch.from_numpy(present),
    }


def support_from_records(
    records: Sequence[TopKRecord | None], responses: Tensor, response_mask: Tensor
) -> tuple[TopKSupport, Tensor]:
    """The rollout support [B, L, K+1] and the anchor ``log mu_k`` [B, L] for padded ``responses`` [B, L].

    Checks that every response token in ``response_mask`` has a record entry and that the recorded sampled token
    is the response token (single-turn rollouts; agent loops that insert tokens are not supported).
    """
    if len(records) != responses.shape[0]:
        raise ValueError(f"{len(records)} top-K records for a batch of {responses.shape[0]} responses")
    padded = records_to_padded(records, int(responses.shape[1]))
    mask = response_mask.bool().cpu()
    missing = mask & ~padded["present"]
    if bool(missing.any()):
        raise ValueError(
            f"{int(missing.sum())} response tokens have no rollout top-K; was the rollout run with "
            "predmask.top_k=K through predmask.verl.launch?"
        )
    mismatch = mask & (padded["sampled_ids"] != responses.cpu().long())
    if bool(mismatch.any()):
        raise ValueError(
            f"rollout top-K records disagree with the response tokens on {int(mismatch.sum())} positions "
            "(multi-turn / tool agent loops are not supported by the top-K plumbing)"
        )
    present = padded["present"]
    support = build_support(
        padded["topk_ids"], padded["topk_logprobs"], padded["sampled_ids"], padded["sampled_logprobs"],
        topk_valid=padded["topk_valid"] & present.unsqueeze(-1),
    )
    device = responses.device
    support = TopKSupport(*(getattr(support, f.name).to(device) for f in fields(support)))
    return support, padded["sampled_logprobs"].to(device)


def sequence_lengths(prompts: Tensor, responses: Tensor, attention_mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """Per-sample (prompt, response) token counts, computed as verl's ``no_padding_2_padding`` does."""
    if prompts.is_nested:
        return prompts.offsets().diff(), responses.offsets().diff()
    if attention_mask is None or attention_mask.is_nested:
        raise ValueError("padded prompts need the padded attention_mask to count tokens")
    width = prompts.shape[1]
    return attention_mask[:, :width].sum(dim=1), attention_mask[:, width:].sum(dim=1)


def packed_response_index(prompt_lens: Tensor, response_lens: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Where each response token's distribution sits in verl's packed stream (prompt+response per sample).

    Returns ``(rows, batch_idx, pos_idx)``, one entry per response token in sample order: token ``pos_idx`` of
    sample ``batch_idx`` is predicted by the logits at packed row ``rows`` = start of the sample + prompt length
    + pos_idx - 1 (the shift by one: row t predicts token t+1). Requires every prompt to be non-empty.
    """
    prompt_lens = prompt_lens.long().cpu()
    response_lens = response_lens.long().cpu()
    if bool((prompt_lens <= 0).any()):
        raise ValueError("every sample needs a non-empty prompt (the first response token is predicted by it)")
    seq_ends = (prompt_lens + response_lens).cumsum(0)
    batch_idx = torch.repeat_interleave(torch.arange(len(response_lens)), response_lens)
    starts = response_lens.cumsum(0) - response_lens
    pos_idx = torch.arange(int(response_lens.sum())) - torch.repeat_interleave(starts, response_lens)
    rows = (seq_ends - response_lens - 1)[batch_idx] + pos_idx
    return rows, batch_idx, pos_idx


def pack_response_tensor(values: Tensor, prompt_lens: Tensor, response_lens: Tensor, fill: float | bool = 0) -> Tensor:
    """Scatter response-aligned ``values`` [B, L, ...] into a packed [total_tokens, ...] tensor (rest = ``fill``)."""
    rows, batch_idx, pos_idx = packed_response_index(prompt_lens, response_lens)
    total = int((prompt_lens.long() + response_lens.long()).sum())
    out = torch.full((total, *values.shape[2:]), fill, dtype=values.dtype, device=values.device)
    out[rows.to(values.device)] = values[batch_idx.to(values.device), pos_idx.to(values.device)]
    return out
