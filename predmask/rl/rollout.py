"""The rollout engine: batched KV-cache sampling that reports, per token, the sampled id, its log-prob and the top-K.

Log-probs are float32 ``log_softmax`` of the rollout logits
(``predmask.rl.emulated_precision.make_rollout_model`` gives the rollout model its precision), as vLLM's
sampler computes them; the top-K and sampled fields of a ``RolloutBatch`` are exactly what
``predmask.build_support`` takes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from predmask.rl.task import Problem, reward
from predmask.rl.tokenizer import ArithmeticTokenizer
from predmask.support import TopKSupport, build_support


@dataclass
class RolloutBatch:
    """B sampled sequences. Prompts left-padded to P tokens, responses right-padded to R tokens.

    prompt_ids, prompt_mask:     long [B, P], bool [B, P]
    response_ids, response_mask: long [B, R], bool [B, R] (True on generated tokens, including <eos>)
    sampled_logprobs:            float32 [B, R]  log mu of the sampled token
    topk_ids, topk_logprobs:     long [B, R, K], float32 [B, R, K]  top-K of mu, sorted descending
    rewards:                     float32 [B] (filled by ``rollout_problems``; zeros from ``generate``)
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    response_ids: Tensor
    response_mask: Tensor
    sampled_logprobs: Tensor
    topk_ids: Tensor
    topk_logprobs: Tensor
    rewards: Tensor

    @property
    def batch_size(self) -> int:
        return int(self.response_ids.shape[0])

    @property
    def response_lengths(self) -> Tensor:
        return self.response_mask.sum(-1)

    def support(self) -> TopKSupport:
        """The K+1 support of every response token (``predmask.build_support``)."""
        return build_support(self.topk_ids, self.topk_logprobs, self.response_ids, self.sampled_logprobs)

    def select(self, index: Tensor | slice) -> RolloutBatch:
        """Rows ``index`` of every field."""
        return RolloutBatch(**{f.name: getattr(self, f.name)[index] for f in fields(self)})


def pad_rows(rows: Sequence[Sequence[int]], pad_id: int, *, left: bool) -> tuple[Tensor, Tensor]:
    """Token id rows padded to one width, on the left or the right: ``(ids [B, W], mask [B, W])``."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, r in enumerate(rows):
        cols = slice(width - len(r), width) if left else slice(0, len(r))
        ids[i, cols] = torch.tensor(r, dtype=torch.long)
        mask[i, cols] = True
    return ids, mask


def encode_prompts(tokenizer: ArithmeticTokenizer, prompts: Sequence[str]) -> tuple[Tensor, Tensor]:
    """Tokenise (with <bos>) and left-pad: returns ``(prompt_ids [B, P], prompt_mask [B, P])``."""
    return pad_rows([tokenizer.encode(p, bos=True) for p in prompts], tokenizer.pad_id, left=True)


def _pad(x: Tensor, width: int, value: float, *, left: bool = False) -> Tensor:
    if x.shape[1] >= width:
        return x
    pad = torch.full((x.shape[0], width - x.shape[1], *x.shape[2:]), value, dtype=x.dtype)
    return torch.cat([pad, x] if left else [x, pad], 1)


def concat_batches(batches: Sequence[RolloutBatch], pad_id: int = 0) -> RolloutBatch:
    """Concatenate rollout batches along B, re-padding prompts (left) and responses (right)."""
    p = max(b.prompt_ids.shape[1] for b in batches)
    r = max(b.response_ids.shape[1] for b in batches)
    return RolloutBatch(
        prompt_ids=torch.cat([_pad(b.prompt_ids, p, pad_id, left=True) for b in batches]),
        prompt_mask=torch.cat([_pad(b.prompt_mask, p, False, left=True) for b in batches]),
        response_ids=torch.cat([_pad(b.response_ids, r, pad_id) for b in batches]),
        response_mask=torch.cat([_pad(b.response_mask, r, False) for b in batches]),
        sampled_logprobs=torch.cat([_pad(b.sampled_logprobs, r, 0.0) for b in batches]),
        topk_ids=torch.cat([_pad(b.topk_ids, r, pad_id) for b in batches]),
        topk_logprobs=torch.cat([_pad(b.topk_logprobs, r, float("-inf")) for b in batches]),
        rewards=torch.cat([b.rewards for b in batches]),
    )


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    *,
    max_new_tokens: int,
    eos_id: int,
    pad_id: int = 0,
    temperature: float = 1.0,
    top_k: int = 20,
    generator: torch.Generator | None = None,
    n: int = 1,
) -> RolloutBatch:
    """Sample ``n`` responses per prompt row from ``mu = softmax(logits / temperature)`` (top-p 1) with a KV
    cache; stop a row at ``eos_id`` or after ``max_new_tokens``.

    Each prompt is prefilled once; its KV cache and last logits are then repeated ``n`` times, so the batch's rows
    ``i*n .. i*n+n-1`` are prompt ``i``'s samples (the same samples, up to float summation order, as ``n`` copies of
    the prompt prefilled apart). The response width R is the number of decoding steps actually run. Positions
    after a row's <eos> hold ``pad_id`` and are False in ``response_mask`` (their top-K entries must be
    ignored).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature} (greedy decoding is not a sampling rollout)")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    vocab = int(model.config.vocab_size)
    if not 1 <= top_k <= vocab:
        raise ValueError(f"top_k must lie in [1, vocab_size={vocab}], got {top_k}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    attn = prompt_mask.long()
    pos = (attn.cumsum(-1) - 1).clamp_min(0)
    cache = DynamicCache(config=model.config)
    out = model(input_ids=prompt_ids, attention_mask=attn, position_ids=pos, past_key_values=cache,
                use_cache=True, logits_to_keep=1)
    logits = out.logits[:, -1]
    if n > 1:
        cache.batch_repeat_interleave(n)
        prompt_ids, prompt_mask, attn, pos, logits = (
            t.repeat_interleave(n, 0) for t in (prompt_ids, prompt_mask, attn, pos, logits))
    b = prompt_ids.shape[0]
    next_pos = pos[:, -1:] + 1
    finished = torch.zeros(b, dtype=torch.bool)
    ids, masks, lps, tk_ids, tk_lps = [], [], [], [], []
    for step in range(max_new_tokens):
        logp = torch.log_softmax(logits.float() / temperature, dim=-1)
        tok = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
        tok = torch.where(finished, torch.full_like(tok, pad_id), tok)
        top = torch.topk(logp, top_k, dim=-1, sorted=True)
        ids.append(tok)
        masks.append(~finished)
        lps.append(logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1))
        tk_ids.append(top.indices)
        tk_lps.append(top.values)
        finished = finished | (tok == eos_id)
        if bool(finished.all()) or step == max_new_tokens - 1:
            break
        attn = torch.cat([attn, torch.ones((b, 1), dtype=attn.dtype)], 1)
        logits = model(input_ids=tok.unsqueeze(-1), attention_mask=attn, position_ids=next_pos,
                       past_key_values=cache, use_cache=True).logits[:, -1]
        next_pos = next_pos + 1
    return RolloutBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask.bool(),
        response_ids=torch.stack(ids, 1),
        response_mask=torch.stack(masks, 1),
        sampled_logprobs=torch.stack(lps, 1),
        topk_ids=torch.stack(tk_ids, 1),
        topk_logprobs=torch.stack(tk_lps, 1),
        rewards=torch.zeros(b, dtype=torch.float32),
    )


def rollout_problems(
    model: nn.Module,
    tokenizer: ArithmeticTokenizer,
    problems: Sequence[Problem],
    *,
    n: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 20,
    generator: torch.Generator | None = None,
    chunk_size: int = 1024,
    prefill_once: bool = True,
) -> RolloutBatch:
    """``n`` sampled responses per problem (rows ``i*n .. i*n+n-1`` belong to problem ``i``) with their 1/0
    task reward, in chunks of at most ``chunk_size`` sequences (whole problems, at least one).
    ``prefill_once=False`` (benchmark only: the previous path) prefills every row instead of every problem."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    answers = [p.answer for p in problems for _ in range(n)]
    per_row = 1 if prefill_once else n
    prompts = [p.prompt for p in problems for _ in range(per_row)]
    step = max(1, chunk_size // n) * per_row
    parts = []
    for s in range(0, len(prompts), step):
        ids, mask = encode_prompts(tokenizer, prompts[s:s + step])
        parts.append(generate(model, ids, mask, max_new_tokens=max_new_tokens, eos_id=tokenizer.eos_id,
                              pad_id=tokenizer.pad_id, temperature=temperature, top_k=top_k, generator=generator,
                              n=n // per_row))
    batch = parts[0] if len(parts) == 1 else concat_batches(parts, tokenizer.pad_id)
    texts = [tokenizer.decode(r) for r in batch.response_ids.tolist()]
    batch.rewards = torch.tensor([reward(t, a) for t, a in zip(texts, answers)], dtype=torch.float32)
    return batch
