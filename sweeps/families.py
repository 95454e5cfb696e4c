"""Which family a sweep belongs to and how it expands: a grid of train runs (``sweeps.compose``) or the variational
family's chain of stage runs (``sweeps.vr_chain``); the one entry callers use."""

from __future__ import annotations

from collections.abc import Sequence

from sweeps.compose import (
    TRAIN_FAMILY,
    RunSpec,
    describe_grid,
    expand_grid,
    sweep_family,
    sweep_names,
)
from sweeps.vr_chain import describe_chain, expand_variational


def expand(sweep: str, overrides: list[str] | None = None) -> list[RunSpec]:
    """The runs of ``sweep`` with command-line ``overrides``, whatever its family (an unknown sweep: one line)."""
    if sweep not in sweep_names() or sweep_family(sweep) == TRAIN_FAMILY:
        return expand_grid(sweep, overrides)  # an unknown sweep: its one line
    return expand_variational(sweep, overrides)


def describe(specs: Sequence[RunSpec]) -> str:
    """How many runs a sweep has, in its family's terms."""
    if any(spec.stage is not None for spec in specs):
        return describe_chain(specs)
    return describe_grid(specs)
