"""The one shape of predmask's registries of behaviour: a name -> entry dict with a decorator and a checked lookup."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(dict[str, T], Generic[T]):
    """Entries by name (unique), in registration order; ``what`` names the kind of entry in error messages,
    and ``lookup(name)`` raises one ValueError line listing the allowed names."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what

    def add(self, name: str, entry: T) -> T:
        if name in self:
            raise ValueError(f"{self.what} {name!r} is already registered")
        self[name] = entry
        return entry

    def register(self, name: str) -> Callable[[T], T]:
        def decorator(entry: T) -> T:
            return self.add(name, entry)

        return decorator

    def lookup(self, name: str) -> T:
        try:
            return self[name]
        except KeyError:
            raise ValueError(f"unknown {self.what} {name!r}; allowed: {', '.join(self)}") from None
