"""The rollout hook: verl's ``vLLMHttpServer.generate`` also returns vLLM's top-K log-probs (one record per sample).

verl 0.9.1 asks vLLM for ``logprobs=0`` and exposes no ``RequestOutput``. When ``predmask.top_k`` is K >= 1
and the request asks for log-probs, the wrapper wraps the server's engine client ``generate`` (an instance
attribute) to raise ``logprobs`` to K for that request (with vLLM's cheaper flat log-prob lists) and keep the
final output, parses it off the server's event loop (``asyncio.to_thread``) and puts the record into
``TokenOutput.extra_fields`` (key :data:`~predmask.verl.records.TOPK_KEY`); verl carries it to the actor
unchanged.

Validation asks for no top-K: :func:`install_agent_loop` marks a validation sample's sampling parameters with
:data:`VALIDATE_KEY`, which the server's wrapper removes before verl builds vLLM's ``SamplingParams``. Imports
no verl: the modules are passed in by :mod:`predmask.verl.plugin`.
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from predmask.verl.records import TOPK_KEY, parse_vllm_logprobs
from predmask.verl.settings import current_settings

#: the sampling-parameter marker of a validation request (added by the agent loop's wrapper, removed by the server's)
VALIDATE_KEY = "predmask_validate"


@dataclass
class _Pending:
    k: int
    final: Any = None


def _wrap_engine(server: Any) -> None:
    """Instance-level wrapper on the server's vLLM engine client: raise ``logprobs`` to K for our requests and keep
    the final RequestOutput."""
    engine = server.engine
    if getattr(engine, "_predmask_topk", False):
        return
    original = engine.generate

    def generate(*args: Any, **kwargs: Any) -> Any:
        pending = server._predmask_pending.get(kwargs.get("request_id"))
        params = kwargs.get("sampling_params")
        if pending is not None and params is not None and getattr(params, "logprobs", None) is not None:
            params.logprobs = max(int(params.logprobs), pending.k)
            if hasattr(params, "flat_logprobs"):  # vLLM's flat lists: cheaper for vLLM to build and for us to parse
                params.flat_logprobs = True
        stream = original(*args, **kwargs)
        if pending is None:
            return stream

        async def capture() -> Any:
            async for output in stream:
                pending.final = output
                yield output

        return capture()

    engine.generate = generate
    engine._predmask_topk = True


def install_rollout(vllm_async_server: ModuleType) -> None:
    """Wrap ``vLLMHttpServer.generate`` so that it returns the top-K record in ``extra_fields`` (idempotent)."""
    server_cls = vllm_async_server.vLLMHttpServer
    original = server_cls.generate
    if getattr(original, "_predmask_topk", False):
        return

    @functools.wraps(original)
    async def generate(self: Any, prompt_ids: Any, sampling_params: dict[str, Any], request_id: str, *args: Any,
                       **kwargs: Any) -> Any:
        validate = bool(sampling_params.get(VALIDATE_KEY, False))
        sampling_params = {key: v for key, v in sampling_params.items() if key != VALIDATE_KEY}
        k = current_settings().top_k
        if k < 1 or validate or not sampling_params.get("logprobs"):
            return await original(self, prompt_ids, sampling_params, request_id, *args, **kwargs)
        if not hasattr(self, "_predmask_pending"):
            self._predmask_pending = {}
        _wrap_engine(self)
        pending = self._predmask_pending[request_id] = _Pending(k)
        try:
            output = await original(self, prompt_ids, sampling_params, request_id, *args, **kwargs)
        finally:
            self._predmask_pending.pop(request_id, None)
        final = pending.final
        if final is None or not getattr(final, "outputs", None) or not output.token_ids:
            return output
        completion = final.outputs[0]
        record = await asyncio.to_thread(parse_vllm_logprobs, completion.logprobs, list(completion.token_ids), k)
        if list(record.token_ids) != list(output.token_ids):
            raise ValueError("vLLM's final output and verl's TokenOutput disagree on the generated tokens")
        output.extra_fields = {**output.extra_fields, TOPK_KEY: record}
        return output

    generate._predmask_topk = True  # type: ignore[attr-defined]
    server_cls.generate = generate


def install_agent_loop(agent_loop: ModuleType) -> None:
    """Wrap ``AgentLoopWorker._run_agent_loop`` so that a validation sample's sampling parameters carry
    :data:`VALIDATE_KEY` when the run asks vLLM for top-K records (idempotent)."""
    worker_cls = agent_loop.AgentLoopWorker
    original = worker_cls._run_agent_loop
    if getattr(original, "_predmask_topk", False):
        return

    @functools.wraps(original)
    async def _run_agent_loop(self: Any, sampling_params: dict[str, Any], trajectory: dict[str, Any], *args: Any,
                              **kwargs: Any) -> Any:
        rollout = getattr(getattr(self, "rollout_config", None), "name", "vllm")
        if (trajectory.get("validate") and rollout == "vllm" and current_settings().top_k >= 1
                and sampling_params.get("logprobs")):
            sampling_params = {**sampling_params, VALIDATE_KEY: True}
        return await original(self, sampling_params, trajectory, *args, **kwargs)

    _run_agent_loop._predmask_topk = True  # type: ignore[attr-defined]
    worker_cls._run_agent_loop = _run_agent_loop
