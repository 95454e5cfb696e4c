"""The post-import hooks (predmask/verl/_hooks.py) on real modules written to a temporary directory: a callback runs
once, after the module has executed, and at once for a module already imported. Imports no verl."""

from __future__ import annotations

import importlib
import sys

import pytest

from predmask.verl._hooks import when_imported

pytestmark = pytest.mark.verl


@pytest.fixture
def module_dir(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("predmask_hook_probe")]:
        del sys.modules[name]


def test_callback_runs_once_after_the_module_executed(module_dir) -> None:
    (module_dir / "predmask_hook_probe_a.py").write_text("VALUE = 41\n")
    seen: list[int] = []

    def callback(module) -> None:
        seen.append(module.VALUE)
        module.VALUE += 1

    when_imported("predmask_hook_probe_a", callback)
    when_imported("predmask_hook_probe_a", callback)  # the same callback is not queued twice
    assert seen == [] and "predmask_hook_probe_a" not in sys.modules
    module = importlib.import_module("predmask_hook_probe_a")
    assert seen == [41] and module.VALUE == 42
    importlib.reload(module)  # fired hooks are gone: a reload runs nothing
    assert seen == [41] and module.VALUE == 41


def test_callback_runs_at_once_for_an_imported_module_and_packages_work(module_dir) -> None:
    pkg = module_dir / "predmask_hook_probe_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "sub.py").write_text("NAME = 'sub'\n")
    seen: list[str] = []
    when_imported("predmask_hook_probe_pkg.sub", lambda m: seen.append(m.NAME))
    from predmask_hook_probe_pkg import sub  # noqa: F401

    assert seen == ["sub"]
    when_imported("predmask_hook_probe_pkg.sub", lambda m: seen.append(m.__name__))
    assert seen == ["sub", "predmask_hook_probe_pkg.sub"]
