"""The rollout engine's output layout and its agreement with a plain full forward (predmask.rl.rollout)."""

from __future__ import annotations

import pytest
import torch

from predmask.precisions import get_precision
from predmask.rl.algo import response_logits
from predmask.rl.emulated_precision import make_rollout_model
from predmask.rl.rollout import concat_batches, encode_prompts, generate, rollout_problems
from predmask.rl.task import make_split
from predmask.rl.tokenizer import ArithmeticTokenizer
from predmask.schemas.task_schema import TaskConfig

TASK = TaskConfig()


def _batch(model: torch.nn.Module, tokenizer: ArithmeticTokenizer, top_k: int = 20, seed: int = 0, n: int = 4):
    problems = make_split(TASK, "train", 12)  # 1..4 operations: prompts of different lengths (left padding)
    return rollout_problems(model, tokenizer, problems, n=n, max_new_tokens=10, top_k=top_k,
                            generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8_rollout"])
def test_layout_sampled_token_in_support_topk_sorted_normalised(policy, tokenizer, precision: str) -> None:
    roll = make_rollout_model(policy, get_precision(precision))
    b = _batch(roll, tokenizer)
    k = 20
    bsz, r = b.response_ids.shape
    assert b.topk_ids.shape == (bsz, r, k) and b.topk_logprobs.shape == (bsz, r, k)
    assert b.sampled_logprobs.shape == (bsz, r) and b.response_mask.dtype == torch.bool
    m = b.response_mask
    assert torch.isfinite(b.topk_logprobs[m]).all() and torch.isfinite(b.sampled_logprobs[m]).all()
    # sorted, highest first
    assert (b.topk_logprobs[m][:, :-1] >= b.topk_logprobs[m][:, 1:]).all()
    # top-K mass at most 1 (float32 log_softmax: tolerance 1e-5)
    assert (b.topk_logprobs[m].exp().sum(-1) <= 1 + 1e-5).all()
    # the sampled token always has a valid slot of the support, with its own log-prob
    s = b.support()
    assert s.ids.shape[-1] == k + 1
    slot_ids = s.ids.gather(-1, s.sampled_index.unsqueeze(-1)).squeeze(-1)
    assert (slot_ids[m] == b.response_ids[m]).all()
    assert s.valid.gather(-1, s.sampled_index.unsqueeze(-1)).squeeze(-1)[m].all()
    assert torch.equal(s.sampled_logprob(s.mu_logprobs)[m], b.sampled_logprobs[m])
    # a sampled token that is in the top-K has the top-K's log-prob
    in_topk = (b.topk_ids == b.response_ids.unsqueeze(-1)).any(-1) & m
    topk_lp = torch.where(b.topk_ids == b.response_ids.unsqueeze(-1), b.topk_logprobs, torch.zeros(())).sum(-1)
    assert torch.allclose(topk_lp[in_topk], b.sampled_logprobs[in_topk])
    # after <eos> the row is padding
    eos = (b.response_ids == tokenizer.eos_id) & m
    for i, j in eos.nonzero().tolist():
        assert not m[i, j + 1:].any()
    assert (b.response_mask.sum(-1) >= 1).all()


def test_full_vocabulary_topk_sums_to_one(policy, tokenizer) -> None:
    b = _batch(policy, tokenizer, top_k=tokenizer.vocab_size)
    total = b.topk_logprobs[b.response_mask].exp().sum(-1)
    assert torch.allclose(total, torch.ones_like(total), atol=1e-5)


def test_kv_cache_rollout_matches_a_full_forward(policy, tokenizer) -> None:
    """Independent truth: one teacher-forced forward (no cache) of prompt + generated response."""
    b = _batch(policy, tokenizer)
    with torch.no_grad():
        logp = torch.log_softmax(response_logits(policy, b), -1)
    lp_sampled = logp.gather(-1, b.response_ids.unsqueeze(-1)).squeeze(-1)
    m = b.response_mask
    assert torch.allclose(lp_sampled[m], b.sampled_logprobs[m], atol=1e-4)
    top = torch.topk(logp, 20, -1)
    assert torch.allclose(top.values[m], b.topk_logprobs[m], atol=1e-4)


def test_temperature_scales_the_rollout_distribution(policy, tokenizer) -> None:
    ids, mask = encode_prompts(tokenizer, ["3 + 4 =", "1 + 2 - 3 + 4 ="])
    gen = torch.Generator().manual_seed(0)
    b1 = generate(policy, ids, mask, max_new_tokens=1, eos_id=2, top_k=tokenizer.vocab_size, generator=gen)
    gen = torch.Generator().manual_seed(0)
    b2 = generate(policy, ids, mask, max_new_tokens=1, eos_id=2, top_k=tokenizer.vocab_size, temperature=2.0,
                  generator=gen)
    # log softmax(z / 2) from log softmax(z): z = lp + c
    lp1 = torch.zeros(2, tokenizer.vocab_size).scatter(-1, b1.topk_ids[:, 0], b1.topk_logprobs[:, 0])
    expected = torch.log_softmax(lp1 / 2.0, -1)
    got = torch.zeros(2, tokenizer.vocab_size).scatter(-1, b2.topk_ids[:, 0], b2.topk_logprobs[:, 0])
    assert torch.allclose(got, expected, atol=1e-5)
    with pytest.raises(ValueError, match="temperature"):
        generate(policy, ids, mask, max_new_tokens=1, eos_id=2, temperature=0.0)


def test_same_generator_seed_same_rollout_and_groups(policy, tokenizer) -> None:
    a = _batch(policy, tokenizer, seed=3)
    b = _batch(policy, tokenizer, seed=3)
    c = _batch(policy, tokenizer, seed=4)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.topk_logprobs, b.topk_logprobs)
    assert not torch.equal(a.response_ids, c.response_ids)
    # rows i*n .. i*n+n-1 share problem i's prompt
    n = 4
    for i in range(a.batch_size // n):
        rows = a.prompt_ids[i * n:(i + 1) * n]
        assert (rows == rows[0]).all()


def test_rewards_match_the_decoded_text(policy, tokenizer) -> None:
    from predmask.rl.task import reward

    problems = make_split(TASK, "train", 12)
    b = _batch(policy, tokenizer)
    for i, row in enumerate(b.response_ids.tolist()):
        assert b.rewards[i] == reward(tokenizer.decode(row), problems[i // 4].answer)


def test_chunked_rollout_size_and_concat_roundtrip(policy, tokenizer) -> None:
    problems = make_split(TASK, "train", 6)
    whole = rollout_problems(policy, tokenizer, problems, n=2, max_new_tokens=8,
                             generator=torch.Generator().manual_seed(0), chunk_size=4)
    assert whole.batch_size == 12
    parts = concat_batches([whole.select(slice(0, 5)), whole.select(slice(5, 12))])
    assert torch.equal(parts.response_ids, whole.response_ids)
    assert torch.equal(parts.rewards, whole.rewards)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8_rollout"])
def test_prefill_once_samples_equal_the_per_row_prefill(policy, tokenizer, precision: str) -> None:
    """The independent truth is the per-row path: every sample's own copy of its prompt prefilled. On a fixed seed
    the prefill-once path samples the same tokens with the same top-K and log-probs (to float summation order)."""
    roll = make_rollout_model(policy, get_precision(precision))
    problems = make_split(TASK, "train", 12)
    once, rows = (rollout_problems(roll, tokenizer, problems, n=4, max_new_tokens=10, prefill_once=flag,
                                   generator=torch.Generator().manual_seed(5)) for flag in (True, False))
    assert torch.equal(once.prompt_ids, rows.prompt_ids) and torch.equal(once.prompt_mask, rows.prompt_mask)
    assert torch.equal(once.response_ids, rows.response_ids) and torch.equal(once.response_mask, rows.response_mask)
    assert torch.equal(once.topk_ids[once.response_mask], rows.topk_ids[rows.response_mask])
    m = once.response_mask
    # equal on this machine; where a CPU's kernels sum the prefill in another order, a bf16 logit may move by one
    # rounding step (2^-7 relative; the policy's logits stay below 8)
    tol = 1e-5 if precision == "fp32" else 8 * 2.0 ** -7
    assert torch.allclose(once.topk_logprobs[m], rows.topk_logprobs[m], atol=tol, rtol=0)
    assert torch.allclose(once.sampled_logprobs[m], rows.sampled_logprobs[m], atol=tol, rtol=0)
    assert torch.equal(once.rewards, rows.rewards)


def test_prefill_once_chunks_whole_problems(policy, tokenizer) -> None:
    """A chunk holds whole problems (at least one), so a problem's samples share one prefill."""
    problems = make_split(TASK, "train", 5)
    b = rollout_problems(policy, tokenizer, problems, n=3, max_new_tokens=4, chunk_size=4,
                         generator=torch.Generator().manual_seed(0))
    assert b.batch_size == 15
    for i in range(5):
        assert (b.prompt_ids[3 * i:3 * i + 3] == b.prompt_ids[3 * i]).all()
