"""The variational sampler's memory bound: ``prompt_logprob_tokens`` against numbers worked out by hand, and the
bound carried from the config through the stage command into vLLM's engine arguments.

vLLM cannot be installed here (no GPU): the engine-argument test puts a fake ``vllm`` module in ``sys.modules``
whose ``LLM`` only records its keyword arguments; everything else (the config, the command, the parser, the
engine wrapper) is the real code.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from predmask.config import compose, to_container
from predmask.verl.vr_cluster import max_safe_utilization, prompt_logprob_tokens, stage_command

QWEN3 = {"vocab": 151_936, "bytes_per_logit": 6}


def test_the_h20_default_by_hand() -> None:
    # (1 - 0.85) x 95 GiB - 2 GiB = 12.25 GiB = 13,153,337,344 B; one token's logits: 151,936 x 6 = 911,616 B;
    # 13,153,337,344 / 911,616 = 14,428.6 tokens -> 56 x 256 = 14,336 (14,592 would need 13,302,300,672 B)
    got = prompt_logprob_tokens(**QWEN3, gpu_memory_gib=95, utilization=0.85, reserve_gib=2, max_model_len=40_960)
    assert got == 14_336


def test_a_small_case_by_hand_and_the_cap() -> None:
    # 0.5 x 1 GiB = 536,870,912 B / (1,000 x 4 B) = 134,217.7 tokens -> 524 x 256 = 134,144
    small = {"vocab": 1_000, "bytes_per_logit": 4, "gpu_memory_gib": 1, "utilization": 0.5, "reserve_gib": 0}
    assert prompt_logprob_tokens(**small, max_model_len=200_000) == 134_144
    assert prompt_logprob_tokens(**small, max_model_len=100_000) == 100_000


def test_max_safe_utilization_by_hand() -> None:
    # 8,192 tokens x 911,616 B = 7,467,958,272 B = 6.955 GiB; (6.955 + 2) / 95 = 0.09427 -> 0.90573
    got = max_safe_utilization(8_192, **QWEN3, gpu_memory_gib=95, reserve_gib=2)
    assert got == pytest.approx(1 - (7_467_958_272 / 2**30 + 2) / 95, rel=1e-12)
    assert got == pytest.approx(0.90573, abs=1e-5)


def test_too_high_a_utilization_is_one_line() -> None:
    # 256 tokens need 233,373,696 B = 0.2173 GiB: at most 1 - (0.2173 + 2) / 95 = 0.977
    with pytest.raises(ValueError, match=None) as info:
        prompt_logprob_tokens(**QWEN3, gpu_memory_gib=95, utilization=0.98, reserve_gib=2, max_model_len=40_960)
    message = str(info.value)
    assert "gpu_memory_utilization=0.98" in message and "allowed: at most 0.977" in message and "\n" not in message


def _config(stage: str, **vllm: object) -> dict:
    c = to_container(compose("variational", [
        "cluster=h20_4x8", "model=qwen3_4b_base", "model.path=/m", "cluster.data_dir=/d", f"stage={stage}",
        *(f"cluster.variational.vllm.{k}={v}" for k, v in vllm.items())]))
    c["inputs"] = {"posterior": "p", "prior": "q", "traces": "t"}
    c["method"] = {"name": stage}
    return c


# 0.7: 0.3 x 95 - 2 = 26.5 GiB = 28,454,158,336 B / 911,616 = 31,212.6 tokens -> 121 x 256 = 30,976
@pytest.mark.parametrize(("vllm", "bound"), [({}, 14_336), ({"gpu_memory_utilization": 0.7}, 30_976)])
def test_the_engine_arguments_carry_the_bound(vllm: dict, bound: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from predmask.verl import vr_sample

    argv = stage_command(_config("weights", **vllm), "/runs/s/w", "python3")
    args = vr_sample._parser().parse_args(argv[3:])
    assert args.max_num_batched_tokens == bound
    seen: dict = {}

    class LLM:  # the fake vLLM engine: records its arguments
        def __init__(self, **kw: object) -> None:
            seen.update(kw)

        def get_tokenizer(self) -> SimpleNamespace:
            return SimpleNamespace()

    fake = ModuleType("vllm")
    fake.LLM = LLM  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", fake)
    vr_sample._Engine(Path("/models/prior"), args)
    assert seen["max_num_batched_tokens"] == args.max_num_batched_tokens
    assert seen["enable_chunked_prefill"] is True and seen["gpu_memory_utilization"] == args.gpu_memory_utilization
    assert seen["max_model_len"] == 40_960 and seen["model"] == "/models/prior"
