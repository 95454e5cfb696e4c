"""The rollout hook through verl's own ``vLLMHttpServer.generate`` (verl 0.9.1's vllm_async_server source).

vLLM cannot be installed on the CPU machines, so the test imports verl's real module against a stand-in: a stub
``vllm`` package (``sys.modules`` entries with only the names verl's import chain reads; every placeholder
raises when used), a stub ``msgspec`` (a vLLM dependency verl imports, with ``field``), and a distribution record
``vllm 0.18.0`` on ``sys.path`` (verl checks the installed version). Only ``SamplingParams`` and ``TokensPrompt``
behave: they hold what verl passes. The engine is a fake ``AsyncLLM``: it streams RequestOutput-like objects whose
``logprobs`` follow vLLM's documented structure (the sampled token, then the ``SamplingParams.logprobs`` most
likely tokens) for a fixed table of distributions. The server is made with ``__new__`` and the attributes
``generate`` reads, because its ``__init__`` starts Ray and the vLLM engine.

Truth: the table itself (its top-K by ``torch.topk``) and verl's own ``TokenOutput`` (tokens, sampled log-probs).
Everything verl imported is removed from ``sys.modules`` afterwards, so no other test sees the stubs.
"""

from __future__ import annotations

import asyncio
import importlib
import sys
from collections.abc import Iterator
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from verl_helpers import require_verl, vllm_position

require_verl("verl.workers.rollout.replica")

import predmask.verl.plugin
from predmask.verl.records import TOPK_KEY
from predmask.verl.rollout_hook import VALIDATE_KEY
from predmask.verl.settings import SETTINGS_ENV, PluginSettings

pytestmark = pytest.mark.verl

SERVER_MODULE = "verl.workers.rollout.vllm_rollout.vllm_async_server"
VLLM_VERSION = "0.18.0"
#: the names verl 0.9.1 imports from vLLM (module -> names) when vllm_async_server is imported
VLLM_NAMES: dict[str, tuple[str, ...]] = {
    "vllm": ("LLM", "SamplingParams"),
    "vllm.distributed": ("parallel_state",),
    "vllm.engine.arg_utils": ("AsyncEngineArgs",),
    "vllm.entrypoints.cli.serve": ("run_headless",),
    "vllm.entrypoints.openai.api_server": ("build_app", "init_app_state"),
    "vllm.entrypoints.openai.parser.harmony_utils": ("get_encoding",),
    "vllm.inputs": ("TokensPrompt",),
    "vllm.lora.layers.base": ("BaseLayerWithLoRA",),
    "vllm.lora.lora_model": ("LoRAModel",),
    "vllm.lora.request": ("LoRARequest",),
    "vllm.lora.utils": ("get_adapter_absolute_path",),
    "vllm.lora.worker_manager": ("LRUCacheWorkerLoRAManager",),
    "vllm.model_executor.layers.fused_moe.layer": ("FusedMoE",),
    "vllm.model_executor.layers.linear": ("LinearBase",),
    "vllm.model_executor.models.deepseek_v2": ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"),
    "vllm.model_executor.models.kimi_vl": ("KimiVLForConditionalGeneration",),
    "vllm.model_executor.models.mixtral": ("MixtralForCausalLM",),
    "vllm.model_executor.models.qwen2_moe": ("Qwen2MoeForCausalLM",),
    "vllm.model_executor.models.qwen3_5": ("Qwen3_5MoeForCausalLM",),
    "vllm.model_executor.models.qwen3_moe": ("Qwen3MoeForCausalLM",),
    "vllm.model_executor.models.qwen3_next": ("Qwen3NextForCausalLM",),
    "vllm.model_executor.models.qwen3_vl_moe": ("Qwen3MoeLLMForCausalLM",),
    "vllm.outputs": ("RequestOutput",),
    "vllm.usage.usage_lib": ("UsageContext",),
    "vllm.utils.argparse_utils": ("FlexibleArgumentParser",),
    "vllm.v1.engine.async_llm": ("AsyncLLM",),
}
VOCAB, K, STEPS = 30, 5, 6


class SamplingParams:
    """Holds what verl passes (vLLM's SamplingParams is a msgspec struct with many more fields)."""

    def __init__(self, max_tokens: int, logprobs: int | None = None, prompt_logprobs: int | None = None,
                 **others: Any) -> None:
        self.max_tokens, self.logprobs, self.prompt_logprobs = max_tokens, logprobs, prompt_logprobs
        self.others = others


def _placeholder(module: str, name: str) -> type:
    def unavailable(self: Any, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"{module}.{name} is a test stand-in (vLLM is not installed)")

    return type(name, (), {"__init__": unavailable, "__module__": module})


def stub_modules() -> dict[str, ModuleType]:
    """The stub ``vllm`` package (and its parents) and ``msgspec``, as ``sys.modules`` entries."""
    modules: dict[str, ModuleType] = {}
    for dotted, names in VLLM_NAMES.items():
        parts = dotted.split(".")
        for i in range(1, len(parts) + 1):
            name = ".".join(parts[:i])
            if name not in modules:
                module = modules[name] = ModuleType(name)
                module.__path__ = []  # a package, so that submodules resolve
                if i > 1:
                    setattr(modules[".".join(parts[:i - 1])], parts[i - 1], module)
        for attr in names:
            setattr(modules[dotted], attr, _placeholder(dotted, attr))
    modules["vllm"].__version__ = VLLM_VERSION
    modules["vllm"].SamplingParams = SamplingParams
    modules["vllm.inputs"].TokensPrompt = dict  # a TypedDict in vLLM
    msgspec = modules["msgspec"] = ModuleType("msgspec")
    msgspec.field = lambda default=None, **kwargs: default
    return modules


@pytest.fixture(scope="module")
def server_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModuleType]:
    """verl's vllm_async_server imported against the stubs (the plugin's hook fires on import); removed after."""
    if SERVER_MODULE in sys.modules:
        pytest.fail(f"{SERVER_MODULE} is already imported: vLLM is installed here or a test leaked stubs")
    site = tmp_path_factory.mktemp("site")
    dist = site / f"vllm-{VLLM_VERSION}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}\n")
    before = set(sys.modules)
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(site))
        for name, module in stub_modules().items():
            mp.setitem(sys.modules, name, module)
        predmask.verl.plugin.install()  # the hooks wait for their module (again, if an earlier import used them)
        try:
            yield importlib.import_module(SERVER_MODULE)
        finally:
            for name in sorted(set(sys.modules) - before, reverse=True):
                if name.split(".")[0] == "verl":
                    parent, _, child = name.rpartition(".")
                    module = sys.modules.pop(name)
                    if getattr(sys.modules.get(parent), child, None) is module:
                        delattr(sys.modules[parent], child)


class FakeEngine:
    """A stand-in for vLLM's AsyncLLM: streams RequestOutput-like objects for a fixed table of distributions."""

    def __init__(self, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.table = torch.log_softmax(2 * torch.randn(STEPS, VOCAB, generator=g), -1)
        self.requested: list[int | None] = []

    def tokens(self, request_id: str) -> list[int]:
        """Deterministic 'samples' per request: not always the most likely token (some lie outside the top-K)."""
        shift = sum(map(ord, request_id))
        order = self.table.argsort(-1, descending=True)
        return [int(order[t, (t * 3 + shift) % (2 * K)]) for t in range(STEPS)]

    async def generate(self, prompt: Any, sampling_params: SamplingParams, request_id: str, **kwargs: Any):
        self.requested.append(sampling_params.logprobs)
        tokens = self.tokens(request_id)[: sampling_params.max_tokens]
        k = sampling_params.logprobs
        logprobs = None
        if k is not None:  # logprobs=0: the sampled token only; else it and the k most likely
            logprobs = [vllm_position(self.table[t], tok, k) if k else dict([next(iter(vllm_position(
                self.table[t], tok, 1).items()))]) for t, tok in enumerate(tokens)]
        for n in range(1, len(tokens) + 1):  # streaming: cumulative outputs, the last is final
            await asyncio.sleep(0)
            completion = SimpleNamespace(token_ids=tokens[:n], logprobs=logprobs and logprobs[:n],
                                         finish_reason="length" if n == len(tokens) else None)
            yield SimpleNamespace(outputs=[completion], num_cached_tokens=0, prompt_logprobs=None)


def make_server(module: ModuleType, calculate_log_probs: bool = True) -> Any:
    """verl's vLLMHttpServer with a real RolloutConfig and the fake engine (``__init__`` would start Ray)."""
    from verl.workers.config import RolloutConfig

    server = module.vLLMHttpServer.__new__(module.vLLMHttpServer)
    server.config = RolloutConfig(name="vllm", calculate_log_probs=calculate_log_probs, prompt_length=8,
                                  response_length=STEPS, max_model_len=32)
    server.model_config = SimpleNamespace(processor=None, lora_rank=0, lora={})  # no LoRA adapter
    server.engine = FakeEngine()
    server.replica_rank, server.global_steps = 0, 3
    server._disaggregation_role, server._pd_decode_peers = "null", []
    server._submission_paused, server._rejecting, server._admitting = False, False, 0
    server._warned_missing_spec_decode_stats = False
    return server


def generate(server: Any, request_id: str, sampling_params: dict[str, Any]) -> Any:
    return asyncio.run(server.generate([5, 6, 7], sampling_params, request_id))


def test_hook_is_installed_when_verl_imports_the_server(server_module) -> None:
    assert getattr(server_module.vLLMHttpServer.generate, "_predmask_topk", False)
    assert server_module.SamplingParams is SamplingParams  # verl's module really runs against the stubs


def test_records_come_through_verls_generate(server_module, monkeypatch) -> None:
    monkeypatch.setenv(SETTINGS_ENV, PluginSettings(top_k=K).to_json())
    server = make_server(server_module)
    out = generate(server, "req-a", {"logprobs": True, "temperature": 1.0})
    assert server.engine.requested == [K]  # verl asked for logprobs=0; the hook raised it to K
    assert out.stop_reason == "completed" and out.extra_fields["global_steps"] == 3
    assert out.extra_fields["num_cached_tokens"] == 0  # verl's own extra fields are kept
    rec = out.extra_fields[TOPK_KEY]
    tokens = server.engine.tokens("req-a")
    assert list(out.token_ids) == tokens and list(rec.token_ids) == tokens and rec.length == STEPS and rec.k == K
    # verl's own sampled log-probs, read by verl's code from the same output, equal the record's
    np.testing.assert_array_equal(rec.logprobs, np.asarray(out.log_probs, dtype=np.float32))
    top = server.engine.table.topk(K, -1)
    assert np.array_equal(rec.topk_ids, top.indices.numpy())
    np.testing.assert_array_equal(rec.topk_logprobs, top.values.numpy())
    assert any(t not in top.indices[i].tolist() for i, t in enumerate(tokens))  # some samples lie outside
    assert server._predmask_pending == {}


def test_concurrent_requests_get_their_own_records(server_module, monkeypatch) -> None:
    monkeypatch.setenv(SETTINGS_ENV, PluginSettings(top_k=K).to_json())
    server = make_server(server_module)

    async def both():
        return await asyncio.gather(*(server.generate([1, 2], {"logprobs": True}, rid) for rid in ("r1", "r2")))

    outs = asyncio.run(both())
    for rid, out in zip(("r1", "r2"), outs, strict=True):
        assert list(out.extra_fields[TOPK_KEY].token_ids) == server.engine.tokens(rid) == list(out.token_ids)
    assert server.engine.tokens("r1") != server.engine.tokens("r2")


@pytest.mark.parametrize(("top_k", "logprobs", "requested"), [(0, True, 0), (K, False, None), (0, False, None)])
def test_plain_verl_requests_are_left_alone(server_module, monkeypatch, top_k, logprobs, requested) -> None:
    monkeypatch.setenv(SETTINGS_ENV, PluginSettings(top_k=top_k).to_json())
    server = make_server(server_module)
    out = generate(server, "req-b", {"logprobs": logprobs})
    assert server.engine.requested == [requested] and TOPK_KEY not in out.extra_fields
    assert (out.log_probs is None) == (not logprobs)


def test_validation_requests_ask_for_no_top_k(server_module, monkeypatch) -> None:
    """The agent loop's validation marker: verl's own request (logprobs=0), no record, and vLLM never sees it."""
    monkeypatch.setenv(SETTINGS_ENV, PluginSettings(top_k=K).to_json())
    server = make_server(server_module)
    seen: list[SamplingParams] = []
    engine_generate = server.engine.generate

    def recording(prompt: Any, sampling_params: SamplingParams, request_id: str, **kwargs: Any):
        seen.append(sampling_params)
        return engine_generate(prompt, sampling_params, request_id, **kwargs)

    server.engine.generate = recording
    out = generate(server, "req-v", {"logprobs": True, VALIDATE_KEY: True})
    assert server.engine.requested == [0] and TOPK_KEY not in out.extra_fields
    assert out.log_probs is not None and len(out.log_probs) == STEPS  # verl's own sampled log-probs stay
    assert VALIDATE_KEY not in seen[0].others
