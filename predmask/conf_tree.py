"""Where the installed config tree conf/ is and which options a config group has: below the schemas and the config
layer, so both can list conf/ (standard library only)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def conf_dir() -> Path:
    """The installed config tree (works from any working directory)."""
    return Path(str(resources.files("conf")))


def group_options(group: str) -> list[str]:
    """Names of the options of config group ``group`` (conf/<group>/*.yaml), sorted."""
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))
