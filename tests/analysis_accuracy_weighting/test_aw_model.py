"""Real-batch measurement on a tiny real model (autograd on its parameters): the per-batch identities of REINFORCE,
RFT and VR, and GRPO's measured weight against an independent computation from per-sample gradients.

The tiny random policy never earns the task reward, so the batches get fixed 0/1 rewards: the identities hold for
any rewards (they are algebra on the batch), and the reward function is not what is tested here."""

from __future__ import annotations

import math

import pytest
import torch

from analysis.accuracy_weighting.measure import model_rows, question_weights
from predmask.rl.model import build_policy
from predmask.rl.rollout import rollout_problems
from predmask.rl.task import make_split
from predmask.rl.tokenizer import ArithmeticTokenizer
from predmask.schemas.task_schema import TaskConfig

TINY_MODEL = {
    "name": "tiny", "backend": "cpu", "arch": "qwen3", "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
    "tie_word_embeddings": True, "max_position_embeddings": 64,
}
TASK = TaskConfig()


def _model(seed: int = 0) -> torch.nn.Module:
    model = build_policy(TINY_MODEL, ArithmeticTokenizer(TASK.max_number).vocab_size, seed)
    with torch.no_grad():  # peaked distributions: short, varied responses
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(4.0)
    return model.eval()


def _batch(model: torch.nn.Module, n: int, rewards: list[float], seed: int = 0):
    tok = ArithmeticTokenizer(TASK.max_number)
    problem = make_split(TASK, "train", 1)
    batch = rollout_problems(model, tok, problem, n=n, max_new_tokens=6, generator=torch.Generator().manual_seed(seed))
    batch.rewards = torch.tensor(rewards, dtype=torch.float32)
    return batch


def _sample_grads(model: torch.nn.Module, batch) -> torch.Tensor:
    """∇ Σ_t log π(y_i,t) of every sample separately [n, P] (its own forward, written here)."""
    params = [p for p in model.parameters() if p.requires_grad]
    ids = torch.cat([batch.prompt_ids, batch.response_ids], 1)
    attn = torch.cat([batch.prompt_mask, batch.response_mask], 1).long()
    pos = (attn.cumsum(-1) - 1).clamp_min(0)
    p_len = batch.prompt_ids.shape[1]
    rows = []
    for i in range(ids.shape[0]):
        logits = model(input_ids=ids[i:i + 1], attention_mask=attn[i:i + 1], position_ids=pos[i:i + 1]).logits[0]
        logp = torch.log_softmax(logits[p_len - 1:-1].float(), -1)
        tok = batch.response_ids[i]
        keep = batch.response_mask[i]
        s = logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)[keep].sum()
        g = torch.autograd.grad(s, params, allow_unused=True)
        rows.append(torch.cat([(x if x is not None else torch.zeros_like(p)).reshape(-1).double()
                               for x, p in zip(g, params)]))
    return torch.stack(rows)


REWARDS = [[1, 0, 0, 0, 1, 0, 0, 0], [1, 1, 1, 0, 1, 1, 0, 1], [0, 0, 0, 0, 0, 0, 0, 1], [1] * 8]


@pytest.mark.parametrize("rewards", REWARDS)
def test_per_batch_identities_and_grpo_against_per_sample_gradients(rewards: list[int]) -> None:
    model = _model()
    batch = _batch(model, 8, [float(r) for r in rewards])
    eps = 1e-6
    got = question_weights(model, batch, group_size=8, eps=eps)
    n, c = len(rewards), sum(rewards)
    p_hat = c / n
    assert got["reinforce"] == pytest.approx(p_hat, rel=1e-4)
    assert got["rft"] == pytest.approx(p_hat, rel=1e-4)
    assert got["vr"] == pytest.approx(1.0, rel=1e-4)
    # GRPO from per-sample gradients: −∇L = (1/n) Σ A_i s_i, A from the unbiased std (written here)
    s = _sample_grads(model, batch)
    r = torch.tensor(rewards, dtype=torch.float64)
    std = math.sqrt(((r - r.mean()) ** 2).sum().item() / (n - 1))
    adv = (r - r.mean()) / (std + eps)
    g_hat = s[r > 0].mean(0)
    direction = (adv[:, None] * s).sum(0) / n
    expected = float(direction @ g_hat / (g_hat @ g_hat))
    assert got["grpo"] == pytest.approx(expected, rel=1e-3, abs=1e-6)
    if c == n:
        assert got["grpo"] == pytest.approx(0.0, abs=1e-6)  # all rewards equal: no advantage, no gradient


def test_grpo_groups_inside_a_question() -> None:
    """Two GRPO groups of 4 in a question's 8 samples: each group has its own baseline."""
    model = _model(1)
    rewards = [1, 0, 0, 0, 1, 1, 1, 0]
    batch = _batch(model, 8, [float(x) for x in rewards], seed=3)
    got = question_weights(model, batch, group_size=4)
    s = _sample_grads(model, batch)
    r = torch.tensor(rewards, dtype=torch.float64).view(2, 4)
    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).reshape(-1)
    g_hat = s[torch.tensor(rewards) > 0].mean(0)
    expected = float(((adv[:, None] * s).sum(0) / 8) @ g_hat / (g_hat @ g_hat))
    assert got["grpo"] == pytest.approx(expected, rel=1e-3, abs=1e-6)


def test_no_correct_sample_gives_null_weights_and_a_count() -> None:
    model = _model()
    batch = _batch(model, 4, [0.0] * 4)
    assert question_weights(model, batch, group_size=4) == dict.fromkeys(("rft", "reinforce", "grpo", "vr"))
    # the random policy earns no task reward: every question counted, every weight None, none dropped
    out = model_rows(model, TASK, questions=3, samples=4, group_size=2, label="tiny random policy")
    assert out.no_correct == 3 and len(out.rows) == 3 * 4
    assert all(row["measured_weight"] is None and row["accuracy"] == 0.0 for row in out.rows)
    with pytest.raises(ValueError, match="samples = 5 is not a multiple of group_size = 2"):
        model_rows(model, TASK, questions=1, samples=5, group_size=2)
