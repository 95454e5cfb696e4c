"""scripts/gpu_check.py without a GPU: everything but the vLLM rollout and the CUDA forward.

vLLM's outputs are mocked (``RequestOutput``/``CompletionOutput`` with the documented ``logprobs`` structure) --
vLLM needs a GPU and cannot be installed here; the script itself runs it on a GPU machine. The "rollout" samples
from a tiny transformers model, so when it reports that model's own distribution the check must see D = 0.

The node checks are mocked too, since this machine has no GPU, no NVIDIA driver and no flash-attn: ``nvidia-smi`` is
a stand-in script put first on PATH (it records its arguments and prints a driver version), torch's CUDA build
(``torch.version.cuda``) is set by the test, and flash_attn is made absent (``sys.modules[name] = None``),
importable (a stand-in package) or broken (a package whose import raises as a build for another torch does).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
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
    assert gpu_check.main(["--model", str(tmp_path / "tiny"), "--prompts", "1", "--attn-implementation", "sdpa"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


def fake_nvidia_smi(bin_dir: Path, *, prints: str, status: int = 0) -> Path:
    """An ``nvidia-smi`` stand-in in ``bin_dir``: records its arguments (one a line) in ``bin_dir/args``, prints
    ``prints`` and exits with ``status``."""
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "nvidia-smi"
    script.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > "{bin_dir}/args"\nprintf "{prints}"\nexit {status}\n')
    script.chmod(0o755)
    return script


@pytest.mark.parametrize(("cuda", "driver", "problem"), [
    ("13.0", "580.65.06", None), ("13.2", "590.48.01", None), ("12.8", "525.60.13", None), ("12.4", "570.1", None),
    ("11.8", "450.80.02", None),
    ("13.0", "575.57.08", "NVIDIA driver 575.57.08 is older than CUDA 13.x needs (>= 580)"),
    ("12.4", "525.60.12", "NVIDIA driver 525.60.12 is older than CUDA 12.x needs (>= 525.60.13)"),
    ("12.4", None, None),  # no driver read (no nvidia-smi): the GPU check speaks
    (None, "580.65.06", "is a CPU build (torch.version.cuda is None)"),
    ("14.0", "600.1", "CUDA 14.0, for which gpu_check knows no minimum driver"),
    ("13.0", "N/A", "cannot compare NVIDIA driver 'N/A' with torch's CUDA '13.0'"),
])
def test_the_driver_must_fit_torchs_cuda_build(gpu_check, cuda, driver, problem) -> None:
    """NVIDIA's minimum drivers of CUDA minor version compatibility: 13.x >= 580, 12.x >= 525.60.13 (Linux)."""
    found = gpu_check.driver_problem(cuda, driver)
    assert found is None if problem is None else problem in found


def test_the_driver_version_is_nvidia_smis(gpu_check, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    fake_nvidia_smi(tmp_path / "bin", prints="580.82.07\\n580.82.07\\n")
    assert gpu_check.driver_version() == "580.82.07"
    assert (tmp_path / "bin" / "args").read_text().split() == ["--query-gpu=driver_version", "--format=csv,noheader"]
    fake_nvidia_smi(tmp_path / "bin", prints="NVIDIA-SMI has failed\\n", status=9)
    assert gpu_check.driver_version() is None
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert gpu_check.driver_version() is None


def test_flash_attention_must_import_when_the_cluster_asks_for_it(gpu_check, tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # absent
    problem = gpu_check.attention_problem("flash_attention_2")
    assert problem.startswith("attn_implementation flash_attention_2 needs flash_attn, which does not import (")
    assert problem.endswith("install flash-attn (verl[fsdp] pins 2.8.3) or set cluster.attn_implementation=sdpa")
    assert gpu_check.attention_problem("sdpa") is None  # torch's own
    package = tmp_path / "flash_attn"  # a build for another torch fails at import, not as a missing module
    package.mkdir()
    (package / "__init__.py").write_text("raise OSError('flash_attn_2_cuda.so: undefined symbol: _ZN3c10')\n")
    monkeypatch.delitem(sys.modules, "flash_attn")
    monkeypatch.syspath_prepend(str(tmp_path))
    broken = gpu_check.attention_problem("flash_attention_2")
    assert "(OSError: flash_attn_2_cuda.so: undefined symbol: _ZN3c10)" in broken
    (package / "__init__.py").write_text("__version__ = '2.8.3'\n")
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    importlib.invalidate_caches()
    assert gpu_check.attention_problem("flash_attention_2") is None


def test_the_default_attention_is_the_cluster_configs(gpu_check, capsys) -> None:
    from omegaconf import OmegaConf

    shipped = OmegaConf.load(SCRIPT.parents[1] / "conf" / "cluster" / "h20_4x8.yaml")["attn_implementation"]
    assert gpu_check.cluster_attention() == shipped == "flash_attention_2"
    with pytest.raises(SystemExit):
        gpu_check.main(["--help"])
    assert "h20_4x8.yaml's attn_implementation, flash_attention_2)" in " ".join(capsys.readouterr().out.split())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the exit without a GPU")
def test_every_node_problem_is_named_in_one_line(gpu_check, tmp_path, capsys, monkeypatch) -> None:
    """A CUDA 13 torch on a 550 driver, no GPU, no flash_attn: exit 2 before any model is loaded, one line naming
    all three; with sdpa and a fitting driver only the missing GPU remains."""
    tiny_causal_lm(vocab=40).save_pretrained(tmp_path / "tiny")
    capsys.readouterr()  # transformers' progress bar
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    fake_nvidia_smi(tmp_path / "bin", prints="550.54.15\\n")
    monkeypatch.setattr(gpu_check.torch.version, "cuda", "13.0")
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    assert gpu_check.main(["--model", str(tmp_path / "tiny"), "--prompts", "1"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("gpu_check: NVIDIA driver 550.54.15 is older than CUDA 13.x needs (>= 580)")
    assert "; no CUDA GPU visible; attn_implementation flash_attention_2 needs flash_attn" in line
    fake_nvidia_smi(tmp_path / "bin", prints="580.82.07\\n")
    assert gpu_check.main(["--model", str(tmp_path / "tiny"), "--attn-implementation", "sdpa"]) == 2
    assert capsys.readouterr().err.splitlines() == ["gpu_check: no CUDA GPU visible"]
