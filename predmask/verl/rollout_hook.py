"""The rollout hook: verl's ``vLLMHttpServer.generate`` also returns vLLM's top-K log-probs (one record per sample).

verl 0.9.1 turns the agent loop's ``logprobs`` into ``SamplingParams(logprobs=0)`` and returns only the sampled
token's log-prob; no hook exposes vLLM's ``RequestOutput``. When predmask's ``top_k`` setting is K >= 1
(``predmask.top_k``, :mod:`predmask.verl.settings`) and the request asks for log-probs (verl's
``rollout.calculate_log_probs=true``), the wrapper registers the request, wraps the server's engine client ``generate`` (an instance attribute)
to raise ``logprobs`` to K for that request and keep the final output, parses it
(:func:`predmask.verl.records.parse_vllm_logprobs`) and puts the record into ``TokenOutput.extra_fields``
(key :data:`~predmask.verl.records.TOPK_KEY`); verl's agent loop and ``DataProto.to_tensordict`` carry it to the
actor unchanged. This is the plugin's one monkeypatch. Installed by :mod:`predmask.verl.plugin` when
``verl.workers.rollout.vllm_rollout.vllm_async_server`` is imported (the module is passed in; nothing of verl is
imported here).
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from predmask.verl.records import TOPK_KEY, parse_vllm_logprobs
from predmask.verl.settings import current_settings

__all__ = ["install_rollout"]


class _Pending:
    __slots__ = ("final", "k")

    def __init__(self, k: int) -> None:
        self.k = k
        self.final: Any = None


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
        k = current_settings().top_k
        if k < 1 or not sampling_params.get("logprobs"):
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
        record = parse_vllm_logprobs(completion.logprobs, list(completion.token_ids), k)
        if list(record.token_ids) != list(output.token_ids):
            raise ValueError("vLLM's final output and verl's TokenOutput disagree on the generated tokens")
        output.extra_fields = {**output.extra_fields, TOPK_KEY: record}
        return output

    generate._predmask_topk = True  # type: ignore[attr-defined]
    server_cls.generate = generate
