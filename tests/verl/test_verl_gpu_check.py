"""scripts/gpu_check.py without a GPU: everything but the vLLM rollout and the CUDA forward.

vLLM's outputs are mocked (``RequestOutput``/``CompletionOutput`` with the documented ``logprobs`` structure) --
vLLM needs a GPU and cannot be installed here; the script itself runs it on a GPU machine. The "rollout" samples
from a tiny transformers model, so when it reports that model's own distribution the check must see D = 0.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from verl_helpers import tiny_causal_lm, vllm_position

import predmask
from predmask.metrics import (
    CLIPFRAC,
    MASK_DIVERGENCE_MAX,
    MASK_DIVERGENCE_MEAN,
    MASK_OUTSIDE_FRAC,
    MASK_PI_SAMPLED_GAP,
    PPO_KL,
)

pytestmark = pytest.mark.verl

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("predmask_gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def mock_rollout(model, prompts: list[list[int]], samples: int, length: int, k: int, noise: float, seed: int = 0):
    """vLLM-shaped outputs: each completion sampled token by token from the model (plus ``noise`` on the logits
    the "rollout engine" reports and samples from)."""
    g = torch.Generator().manual_seed(seed)
    outputs = []
    for prompt in prompts:
        completions = []
        for _ in range(samples):
            ids, positions = list(prompt), []
            for _ in range(length):
                with torch.no_grad():
                    logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
                mu = torch.log_softmax(logits + noise * torch.randn(logits.shape, generator=g), -1)
                token = int(torch.multinomial(mu.exp(), 1, generator=g))
                positions.append(vllm_position(mu, token, k))
                ids.append(token)
            completions.append(SimpleNamespace(token_ids=ids[len(prompt):], logprobs=positions, text=" 12\nmore"))
        outputs.append(SimpleNamespace(prompt_token_ids=prompt, outputs=completions))
    return outputs


def logits_fn(model, shift: int = 0):
    """The training forward; ``shift`` rolls its rows (a support aligned to the wrong logits row when nonzero)."""
    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=torch.tensor([ids])).logits[0].float().roll(shift, 0)

    return run


def batch_rows(gpu_check, noise: float, shift: int = 0, sharpness: float = 1.0):
    """method_rows of a mock rollout; ``sharpness`` scales the output layer (peaked distributions, as a trained
    model has, where the tiny random model's are nearly uniform)."""
    model = tiny_causal_lm(vocab=40)
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpness)
    outputs = mock_rollout(model, [[3, 4, 5], [7, 8]], samples=3, length=5, k=6, noise=noise)
    prompt_ids, records, _ = gpu_check.records_from_outputs(outputs, 6)
    rewards = torch.tensor([1.0, -1.0, 1.0, -1.0, -1.0, 1.0])
    batch = gpu_check.build_batch(prompt_ids, records, logits_fn(model, shift), rewards, group=3)
    return gpu_check.method_rows(batch, delta=0.15)


@pytest.mark.parametrize("noise", [0.0, 1.5])
def test_check_batch_and_method_rows(gpu_check, noise: float) -> None:
    model = tiny_causal_lm(vocab=40)
    prompts = [[3, 4, 5], [7, 8]]
    outputs = mock_rollout(model, prompts, samples=3, length=5, k=6, noise=noise)
    prompt_ids, records, texts = gpu_check.records_from_outputs(outputs, 6)
    assert len(records) == 6 and prompt_ids[3] == [7, 8] and texts[0] == " 12\nmore"
    rewards = torch.tensor([1.0, -1.0, 1.0, -1.0, -1.0, 1.0])
    batch = gpu_check.build_batch(prompt_ids, records, logits_fn(model), rewards, group=3)
    rows = {row["method"]: row for row in gpu_check.method_rows(batch, delta=0.01)}
    assert set(rows) == set(predmask.METHODS)
    assert all(row["grad_finite"] == 1.0 and torch.isfinite(torch.tensor(row["loss"])) for row in rows.values())
    gap = rows["predmask_kl_agg"][MASK_PI_SAMPLED_GAP]
    assert gap < 1e-5  # the packed gather and the direct log-softmax agree on the sampled token
    if noise == 0.0:  # the rollout reports the model's own distribution: no divergence, nothing masked
        assert rows["dppo_topk_kl"][MASK_DIVERGENCE_MAX] < 1e-5 and rows["predmask_kl_agg"][MASK_OUTSIDE_FRAC] == 0.0
        assert abs(rows["grpo_clip_higher"][PPO_KL]) < 1e-5 and rows["grpo_clip_higher"][CLIPFRAC] == 0.0
    else:
        assert rows["predmask_kl_agg"][MASK_OUTSIDE_FRAC] > 0.0 and rows["dppo_topk_kl"][MASK_DIVERGENCE_MEAN] > 0.01


def test_rewards(gpu_check) -> None:
    assert gpu_check.rewards_for([" 5050 is it", "no", ""], ["5050", "10", "1"]).tolist() == [1.0, -1.0, -1.0]


@pytest.mark.parametrize("samples", [1, 3])
def test_group_advantages_are_grpo_and_finite_for_a_group_of_one(gpu_check, samples: int) -> None:
    """The batch's advantages: (r - group mean) / (unbiased group std + 1e-6), computed here by hand; a group of
    one sample has advantage 0 (a bare mean/std would give NaN)."""
    model = tiny_causal_lm(vocab=40)
    outputs = mock_rollout(model, [[3, 4, 5], [7, 8]], samples=samples, length=3, k=4, noise=0.5)
    prompt_ids, records, _ = gpu_check.records_from_outputs(outputs, 4)
    rewards = torch.tensor([1.0, -1.0, 1.0, 1.0, -1.0, -1.0])[: 2 * samples]
    batch = gpu_check.build_batch(prompt_ids, records, logits_fn(model), rewards, group=samples)
    expect = torch.zeros(2 * samples)
    if samples > 1:
        for g in range(2):
            r = rewards[g * samples:(g + 1) * samples].tolist()
            mean = sum(r) / samples
            std = (sum((x - mean) ** 2 for x in r) / (samples - 1)) ** 0.5
            expect[g * samples:(g + 1) * samples] = torch.tensor([(x - mean) / (std + 1e-6) for x in r])
    assert torch.isfinite(batch.advantages).all()
    torch.testing.assert_close(batch.advantages, expect.unsqueeze(-1) * batch.response_mask)
    assert samples == 1 or bool((batch.advantages != 0).any())


def test_checks_pass_on_a_matching_rollout(gpu_check) -> None:
    """The rollout reports the training model's own distribution: no gap, no divergence, nothing fails."""
    assert gpu_check.check_failures(batch_rows(gpu_check, noise=0.0)) == []


def test_training_logits_one_row_off_fail_the_divergence_check(gpu_check) -> None:
    """Training logits one row off (each support meets the logits of a neighbouring position): the support and
    the direct log-softmax read the same wrong row, so the gap stays small, and the step-0 divergence check fails
    (mean D about 0.5 here, against 0 when aligned)."""
    rows = batch_rows(gpu_check, noise=0.0, shift=1, sharpness=10.0)
    assert max(row[MASK_PI_SAMPLED_GAP] for row in rows) <= gpu_check.PI_SAMPLED_GAP_MAX
    (failure,) = gpu_check.check_failures(rows)
    assert "STEP0_DIVERGENCE_MEAN_MAX" in failure


def test_a_gap_beyond_the_threshold_fails(gpu_check) -> None:
    """The gap check on rows as method_rows returns them, one with the sampled token read from another row."""
    rows = batch_rows(gpu_check, noise=0.0)
    rows[2] = {**rows[2], MASK_PI_SAMPLED_GAP: 0.7}
    (failure,) = gpu_check.check_failures(rows)
    assert f"{MASK_PI_SAMPLED_GAP} 0.7 > PI_SAMPLED_GAP_MAX" in failure
    rows[2] = {**rows[2], MASK_PI_SAMPLED_GAP: gpu_check.PI_SAMPLED_GAP_MAX, "grad_finite": 0.0}
    (failure,) = gpu_check.check_failures(rows)
    assert "non-finite gradient" in failure


def test_a_rollout_far_from_training_fails_the_divergence_check(gpu_check) -> None:
    """A rollout engine whose distribution is far from the training forward's: the step-0 divergence check
    fails (and only it: the support is aligned)."""
    rows = batch_rows(gpu_check, noise=3.0)
    d = next(r for r in rows if r["method"] == gpu_check.DIVERGENCE_ROW)[MASK_DIVERGENCE_MEAN]
    assert d > gpu_check.STEP0_DIVERGENCE_MEAN_MAX
    (failure,) = gpu_check.check_failures(rows)
    assert "STEP0_DIVERGENCE_MEAN_MAX" in failure and f"{d:.3g}" in failure


def test_print_rows(gpu_check, capsys) -> None:
    gpu_check.print_rows([{"method": "dppo_topk_kl", "loss": 0.5, CLIPFRAC: 0.125}], width=250)
    out = capsys.readouterr().out
    assert "dppo_topk_kl" in out and "pg_clipfrac" in out and "0.125" in out


def test_model_is_a_required_local_path(gpu_check, tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        gpu_check.main([])
    assert exc.value.code == 2 and "--model" in capsys.readouterr().err
    missing = tmp_path / "Qwen3-0.6B-Base"
    assert gpu_check.main(["--model", str(missing)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(missing) in err and "nothing is downloaded" in err
    missing.mkdir()
    assert gpu_check.main(["--model", str(missing)]) == 2
    assert "no config.json" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the exit without a GPU")
def test_no_gpu_exit(gpu_check, tmp_path, capsys) -> None:
    tiny_causal_lm(vocab=40).save_pretrained(tmp_path / "tiny")
    assert gpu_check.main(["--model", str(tmp_path / "tiny"), "--prompts", "1"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err
