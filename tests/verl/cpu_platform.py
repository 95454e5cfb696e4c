"""A CPU platform for verl 0.9.1, so that its real workers and FSDP engine run in the tests (no GPU here).

verl resolves its accelerator through ``verl.plugin.platform`` (device name, device id, collective backend,
the ``torch.<device>`` module): it knows CUDA, NPU and ROCm only and falls back to CUDA, and its FSDP engines are
registered for ``cuda``/``npu``. The CI machines have no GPU, so :func:`install` sets, through verl's own
extension points only:

- :class:`PlatformCPU` as verl's platform (``set_platform``): device ``cpu``, ``current_device() == "cpu"`` (verl
  moves micro-batches with ``.to(get_device_id())``), collective backend ``gloo`` instead of NCCL, and a
  ``device_module`` that answers the few ``torch.cuda`` calls verl makes (memory statistics read as 0, cache
  and synchronisation are no-ops, seeding seeds the CPU generator);
- ``VERL_ENGINE_DEVICE=cuda``, verl's documented override of the device it picks an engine for, so that
  ``EngineRegistry`` returns the FSDP engine (its code is device-agnostic once the platform says ``cpu``).

Nothing else of verl is changed. Must run before verl's worker and engine modules are imported (some read the
device name at import time); :func:`install` refuses to run after that.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from types import ModuleType, SimpleNamespace
from typing import Any

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry, set_platform

__all__ = ["PlatformCPU", "install"]

#: verl modules that read the device name when imported: the platform must be set before them
_READS_DEVICE_AT_IMPORT = ("verl.workers.engine.fsdp.transformer_impl", "verl.workers.engine_workers")
_INSTALLED: PlatformCPU | None = None


def _zero(*args: Any, **kwargs: Any) -> int:
    return 0


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


def _device_module() -> SimpleNamespace:
    """The ``torch.cuda`` calls verl makes, answered for the CPU (memory statistics 0, the rest no-ops)."""
    return SimpleNamespace(
        is_available=lambda: True, device_count=lambda: 1, current_device=lambda: "cpu", set_device=_nothing,
        synchronize=_nothing, empty_cache=_nothing, reset_peak_memory_stats=_nothing,
        manual_seed=torch.manual_seed, manual_seed_all=torch.manual_seed, get_rng_state=torch.get_rng_state,
        set_rng_state=torch.set_rng_state, max_memory_allocated=_zero, max_memory_reserved=_zero,
        memory_allocated=_zero, memory_reserved=_zero, mem_get_info=lambda *args: (0, 0),
        get_device_name=lambda *args: "CPU",
    )


class PlatformCPU(PlatformBase):
    """verl's platform interface on the CPU: device ``cpu``, collectives on gloo, no profiler, no IPC."""

    def __init__(self) -> None:
        self._module = _device_module()

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> ModuleType:
        return self._module  # type: ignore[return-value]

    def is_available(self) -> bool:
        return True

    def current_device(self) -> Any:
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str):  # type: ignore[override]
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


def install() -> PlatformCPU:
    """Make verl run on the CPU in this process (idempotent); see the module docstring for what is set."""
    global _INSTALLED
    if _INSTALLED is not None:
        return _INSTALLED
    early = [name for name in _READS_DEVICE_AT_IMPORT if name in sys.modules]
    if early:
        raise RuntimeError(f"install the CPU platform before importing {', '.join(early)}")
    PlatformRegistry.register(platform="cpu")(PlatformCPU)
    platform = PlatformCPU()
    set_platform(platform)
    os.environ["VERL_ENGINE_DEVICE"] = "cuda"
    _INSTALLED = platform
    return platform
