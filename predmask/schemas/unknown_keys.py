"""The one unknown-key check of every config section: a mapping's keys against the fields of its dataclass."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def check_known_keys(cls: type, values: Mapping[str, Any], section: str) -> None:
    """Raise one ValueError line naming the keys of ``values`` that are not fields of the dataclass ``cls``."""
    known = set(cls.__dataclass_fields__)  # type: ignore[attr-defined]
    bad = sorted(set(values) - known)
    if bad:
        raise ValueError(f"unknown {section} keys {bad}; allowed: {sorted(known)}")
