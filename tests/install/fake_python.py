"""A stand-in Python interpreter for scripts/install.sh's tests: it answers the few calls install.sh makes.

A real virtual environment would mean a real pip install of torch and the project (minutes, a network), so the
interpreter install.sh is given (``PYTHON``) and the one in the ``.venv`` it makes are copies of this script.
Each runs the ``-c`` code install.sh passes with the real interpreter (started with ``-I -S``, so the real
site-packages and its torch are out of sight), after setting what the fake claims about itself from
``fake.json`` next to it: ``sys.prefix``/``sys.base_prefix``, ``sys.version``, whether ``ensurepip`` exists.
``-m venv DIR`` makes DIR/bin/python (a copy of this script, its ``fake.json`` saying it is a venv of this base);
``-m pip install`` records its arguments and "installs" by writing a module (``torch.py`` or ``predmask.py``)
and its dist-info into DIR/site, the fake venv's site-packages; ``-m pytest`` is only recorded. Every call is appended to the
JSON-lines file ``$FAKE_PYTHON_LOG`` as ``{"exe": ..., "argv": [...]}``.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CONFIG = HERE / "fake.json"


def load() -> dict[str, Any]:
    return json.loads(CONFIG.read_text())


def record(argv: list[str]) -> None:
    with open(os.environ["FAKE_PYTHON_LOG"], "a") as log:
        log.write(json.dumps({"exe": str(Path(__file__).resolve()), "argv": argv}) + "\n")


def install(cfg: dict[str, Any], spec: str, args: list[str]) -> int:
    """One `pip install` of the fake venv: fails where fake.json's pip_fails says so, else writes the module."""
    for needle, unless in cfg.get("pip_fails", []):
        if needle in spec and (not unless or unless not in args):
            print(f"fake pip: cannot install {spec}", file=sys.stderr)
            return 1
    name, version = spec.split("==", 1) if spec.startswith("torch==") else ("predmask", "0.1.0")
    site = HERE.parent / "site"
    (site / f"{name}-{version}.dist-info").mkdir(parents=True, exist_ok=True)
    (site / f"{name}-{version}.dist-info" / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (site / f"{name}.py").write_text(f"__version__ = {version!r}\n")
    return 0


def make_venv(cfg: dict[str, Any], target: Path) -> int:
    if cfg.get("venv_fails"):
        (target / "bin").mkdir(parents=True)  # a half-made venv, as a failed ensurepip leaves one
        print("fake venv: ensurepip failed", file=sys.stderr)
        return 1
    (target / "bin").mkdir(parents=True)
    exe = target / "bin" / "python"
    shutil.copyfile(__file__, exe)
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    venv_cfg = {**cfg, "venv": str(target.resolve())}
    (target / "bin" / "fake.json").write_text(json.dumps(venv_cfg))
    (target / "pyvenv.cfg").write_text(f"home = {cfg['base_prefix']}/bin\n")
    return 0


def run_code(cfg: dict[str, Any], code: str) -> None:
    sys.base_prefix = cfg["base_prefix"]
    sys.prefix = cfg.get("venv") or cfg["base_prefix"]
    sys.version = f"{cfg['version']} (fake)"
    sys.version_info = tuple(int(p) for p in cfg["version"].split("."))  # type: ignore[assignment]
    if not cfg.get("ensurepip", True):
        sys.modules["ensurepip"] = None  # type: ignore[assignment]
    if cfg.get("venv"):
        sys.path.insert(0, str(HERE.parent / "site"))
    exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102 (install.sh's own check)


def main(argv: list[str]) -> int:
    record(argv)
    cfg = load()
    if argv[:1] == ["-c"]:
        run_code(cfg, argv[1])
        return 0
    if argv[:2] == ["-m", "venv"]:
        return make_venv(cfg, Path(argv[2]))
    if argv[:3] == ["-m", "pip", "install"] and cfg.get("venv"):
        takes_value = {"--progress-bar", "--extra-index-url", "--index-url"}  # pip options followed by a value
        args = argv[3:]
        specs = [a for i, a in enumerate(args) if not a.startswith("-") and not a.startswith("http")
                 and not (i and args[i - 1] in takes_value)]
        return install(cfg, specs[0], argv[3:])
    if argv[:2] == ["-m", "pytest"]:
        return int(os.environ.get("FAKE_PYTEST_RC", "0"))
    print(f"fake python: unexpected call {argv}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
