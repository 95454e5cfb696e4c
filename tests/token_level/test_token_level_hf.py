"""The GPU path on CPU: a tiny randomly initialised transformers checkpoint (saved here, nothing downloaded) through
HFBackend's transformers rollout and the study; vLLM's output format through stand-in objects (vLLM cannot be
installed on this machine, so its RequestOutput/CompletionOutput/Logprob are mocked with the same attributes)."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from token_level_helpers import TINY_TASK, settings, synthetic_rewards

from analysis.token_level.compute.backend import problems_for_seed
from analysis.token_level.compute.hf import HFBackend, batch_from_vllm
from analysis.token_level.compute.study import study_batch
from analysis.token_level.compute.study_config import compose_study
from predmask.precisions import get_precision
from predmask.rl.tokenizer import ArithmeticTokenizer


def save_tiny_checkpoint(path: Path) -> Path:
    """A 1-layer Qwen3 with a word-level tokenizer over the arithmetic task's vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    words = ArithmeticTokenizer(TINY_TASK.max_number).tokens
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<pad>"
    )
    cfg = Qwen3Config(
        vocab_size=len(words),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # a peaked random policy (a fresh init is almost uniform)
        model.model.embed_tokens.weight.mul_(4.0)
    model.save_pretrained(str(path))
    fast.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("hf") / "tiny-qwen3")


def _backend(path: Path, precision: str = "bf16") -> HFBackend:
    cfg = compose_study(["device=cpu", "hf.rollout_engine=transformers", "hf.rollout_chunk=6"])
    return HFBackend(
        path,
        precision=get_precision(precision),
        top_k=5,
        max_new_tokens=5,
        temperature=cfg["temperature"],
        device=cfg["device"],
        **cfg["hf"],
    )


def test_transformers_rollout_reports_mu_of_the_rollout_model(checkpoint: Path) -> None:
    backend = _backend(checkpoint)
    problems = problems_for_seed(TINY_TASK, 0, 3)
    batch = backend.rollout(problems, 4, seed=0)
    assert batch.batch_size == 12 and batch.topk_ids.shape[-1] == 5
    assert set(batch.rewards.tolist()) <= {0.0, 1.0}
    # independent truth: a teacher-forced forward of the rollout copy on prompt + response
    roll = backend._rollout_copy()
    ids = torch.cat([batch.prompt_ids, batch.response_ids], 1)
    att = torch.cat([batch.prompt_mask, batch.response_mask], 1).long()
    pos = (att.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        logits = roll(input_ids=ids, attention_mask=att, position_ids=pos).logits.float()
    p = batch.prompt_ids.shape[1]
    logp = torch.log_softmax(logits[:, p - 1 : -1], -1)
    m = batch.response_mask
    sampled = logp.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(sampled[m], batch.sampled_logprobs[m], atol=0.05)  # bf16 cache vs one bf16 forward
    top = logp.topk(5, -1)
    assert (top.indices[m] == batch.topk_ids[m]).float().mean() > 0.9
    # rows stop at eos: nothing after the first eos is in the mask
    for row, mask in zip(batch.response_ids, m):
        eos = (row == backend.eos_id).nonzero()
        if eos.numel():
            assert not mask[int(eos[0]) + 1 :].any()
    again = backend.rollout(problems, 4, seed=0)
    assert torch.equal(again.response_ids, batch.response_ids)


def test_study_runs_on_the_transformers_path(checkpoint: Path) -> None:
    backend = _backend(checkpoint, precision="fp8_rollout")
    batch = synthetic_rewards(backend.rollout(problems_for_seed(TINY_TASK, 1, 4), 4, seed=1), seed=1)
    s = settings(delta=1e-3, group_size=4, vocab_size=backend.vocab_size, staleness=2, minibatches=2, lr=0.05)
    out = study_batch(backend.policy(), batch, s)
    assert out.tokens.height > 0
    assert {"dd_ratio", "dd_pred_agg", "dd_pred_uniform", "dd_pred_exact", "dd_all"} <= set(
        out.tokens.columns
    )
    # policy() resets the weights: a second study from the same state gives the same rows
    assert study_batch(backend.policy(), batch, s).tokens.equals(out.tokens)


def _lp(logprob: float, rank: int) -> SimpleNamespace:
    return SimpleNamespace(logprob=logprob, rank=rank)


def test_batch_from_vllm_output_format() -> None:
    k = 2
    # completion 1: sampled 7 (rank 3, outside the top-2), then eos 2 (rank 1); completion 2: sampled 5 (rank 1)
    c1 = SimpleNamespace(
        token_ids=[7, 2],
        logprobs=[
            {4: _lp(-0.5, 1), 5: _lp(-1.5, 2), 7: _lp(-2.0, 3)},
            {2: _lp(-0.1, 1), 3: _lp(-3.0, 2)},
        ],
    )
    c2 = SimpleNamespace(token_ids=[5], logprobs=[{5: _lp(-0.2, 1), 6: _lp(-2.2, 2)}])
    req = SimpleNamespace(prompt_token_ids=[1, 9, 10], outputs=[c1, c2])
    batch = batch_from_vllm([req], top_k=k, eos_id=2, pad_id=0)
    assert batch.prompt_ids.tolist() == [[1, 9, 10], [1, 9, 10]]
    assert batch.response_ids.tolist() == [[7, 2], [5, 0]]
    assert batch.response_mask.tolist() == [[True, True], [True, False]]
    assert batch.topk_ids[0, 0].tolist() == [4, 5] and batch.topk_ids[1, 0].tolist() == [5, 6]
    assert batch.sampled_logprobs[0, 0].item() == pytest.approx(-2.0)
    support = batch.support()
    # the sampled token outside the top-K takes the extra slot; inside it, the extra slot is invalid
    assert support.sampled_index[0, 0].item() == k and support.valid[0, 0].tolist() == [True, True, True]
    assert support.sampled_index[1, 0].item() == 0 and support.valid[1, 0].tolist() == [True, True, False]
    assert math.isclose(support.mu_logprobs[0, 0, k].item(), -2.0)
