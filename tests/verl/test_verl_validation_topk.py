"""Validation asks vLLM for no top-K: verl's real ``AgentLoopWorker._run_agent_loop`` with the plugin on hands a
validation sample's agent loop sampling parameters carrying the plugin's marker, and a training sample's without.

The worker is verl's own class, made with ``__new__`` and the attributes ``_run_agent_loop`` reads (its
``__init__`` starts vLLM server clients); the agent loop is a recording one registered in verl's agent-loop
registry, instantiated by verl's own code. It stops the loop once it has the parameters (what follows needs a
vLLM server). Truth: the parameters verl passed to the agent loop's ``run``.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from verl_helpers import require_verl

require_verl("verl.experimental.agent_loop.agent_loop")

import predmask.verl.plugin
from predmask.verl.rollout_hook import VALIDATE_KEY
from predmask.verl.settings import SETTINGS_ENV, PluginSettings

pytestmark = pytest.mark.verl

SEEN: list[dict[str, Any]] = []


class Stop(Exception):
    """Raised by the recording loop once it has its parameters."""


class RecordingLoop:
    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
        SEEN.append(dict(sampling_params))
        raise Stop


def run_sample(validate: bool, rollout: str = "vllm") -> dict[str, Any]:
    predmask.verl.plugin.install()
    from omegaconf import OmegaConf
    from verl.experimental.agent_loop import agent_loop

    agent_loop._agent_loop_registry["predmask_recording"] = {"_target_": f"{__name__}.RecordingLoop"}
    worker = agent_loop.AgentLoopWorker.__new__(agent_loop.AgentLoopWorker)
    worker.config = OmegaConf.create({"data": {}})
    worker.rollout_config = SimpleNamespace(name=rollout)
    worker.llm_client = worker.tokenizer = worker.processor = worker.hf_model_type = None
    worker.dataset_cls, worker.tools = None, []
    trajectory = {"step": 1, "sample_index": 0, "rollout_n": 0, "validate": validate}
    SEEN.clear()
    with pytest.raises(Stop):
        asyncio.run(worker._run_agent_loop({"logprobs": True, "temperature": 1.0}, trajectory,
                                           agent_name="predmask_recording"))
    return SEEN[0]


def test_the_hook_is_installed_when_verl_imports_the_agent_loop() -> None:
    predmask.verl.plugin.install()
    from verl.experimental.agent_loop import agent_loop

    assert getattr(agent_loop.AgentLoopWorker._run_agent_loop, "_predmask_topk", False)


@pytest.mark.parametrize(("top_k", "validate", "rollout", "marked"), [
    (4, True, "vllm", True), (4, False, "vllm", False), (0, True, "vllm", False), (4, True, "sglang", False)])
def test_only_validation_samples_of_a_top_k_run_on_vllm_are_marked(monkeypatch, top_k, validate, rollout,
                                                                    marked) -> None:
    monkeypatch.setenv(SETTINGS_ENV, PluginSettings(top_k=top_k).to_json())
    params = run_sample(validate, rollout)
    assert (VALIDATE_KEY in params) == marked
    assert params["logprobs"] is True and params["temperature"] == 1.0
