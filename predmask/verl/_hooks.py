"""Post-import hooks: run a callback on a module right after it is first imported (or now, if it already is).

The VeRL plugin must patch/register into verl modules in every Ray worker without importing heavy verl (or vLLM)
modules a process never uses. ``when_imported(name, callback)`` defers the callback until ``name`` is imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

Callback = Callable[[ModuleType], None]

_LOCK = threading.RLock()


class _CallbackLoader(importlib.abc.Loader):
    """Delegates to the real loader, then runs the callbacks on the executed module."""

    def __init__(self, loader: importlib.abc.Loader, fullname: str, finder: _PostImportFinder) -> None:
        self._loader = loader
        self._fullname = fullname
        self._finder = finder

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._finder.fire(self._fullname, module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, is_package, get_resource_reader, ...
        return getattr(self._loader, name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Meta-path finder that wraps the loader of watched modules; finds nothing itself."""

    def __init__(self) -> None:
        self.callbacks: dict[str, list[Callback]] = {}
        self._busy: set[str] = set()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.callbacks or fullname in self._busy:
            return None
        self._busy.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy.discard(fullname)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _CallbackLoader(spec.loader, fullname, self)
        return spec

    def fire(self, fullname: str, module: ModuleType) -> None:
        with _LOCK:
            callbacks = self.callbacks.pop(fullname, [])
        for callback in callbacks:
            callback(module)


_FINDER = _PostImportFinder()


def when_imported(fullname: str, callback: Callback) -> None:
    """Call ``callback(module)`` once ``fullname`` is imported; immediately if it already is.

    A callback already waiting for ``fullname`` is not added twice.
    """
    with _LOCK:
        module = sys.modules.get(fullname)
        if module is None:
            pending = _FINDER.callbacks.setdefault(fullname, [])
            if callback not in pending:
                pending.append(callback)
            if _FINDER not in sys.meta_path:
                sys.meta_path.insert(0, _FINDER)
            return
    callback(module)
