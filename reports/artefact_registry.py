"""The registry of report artefacts: every figure and table the artefact modules declare, in the paper's order."""

from __future__ import annotations

import re
from collections.abc import Iterable
from types import ModuleType

from reports.artefact import Artefact, Kind
from reports.figures import token_level as token_level_figures
from reports.figures import training as training_figures
from reports.figures import variational as variational_figures
from reports.tables import hyperparameters as hyperparameters_table
from reports.tables import main_results as main_results_table
from reports.tables import token_level as token_level_table
from reports.tables import variational as variational_table

#: every module that declares artefacts: the figure families, then the table families
MODULES: tuple[ModuleType, ...] = (
    training_figures,
    token_level_figures,
    variational_figures,
    hyperparameters_table,
    token_level_table,
    main_results_table,
    variational_table,
)


def collect(modules: Iterable[ModuleType]) -> dict[str, Artefact]:
    """name -> artefact for every Artefact a module defines at its top level (ValueError on a repeated name)."""
    found: dict[str, Artefact] = {}
    for module in modules:
        for value in vars(module).values():
            if isinstance(value, Artefact):
                if value.name in found and found[value.name] is not value:
                    raise ValueError(f"artefact {value.name!r} declared twice")
                found[value.name] = value
    return found


ARTEFACTS: dict[str, Artefact] = collect(MODULES)

#: the variational-reasoning family's artefacts share this name prefix; they follow the paper's
VR_PREFIX = "vr_"


def is_variational(name: str) -> bool:
    """Whether an artefact belongs to the variational-reasoning family."""
    return name.startswith(VR_PREFIX)


def _name_order(name: str) -> tuple[str | int, ...]:
    """A name as a sort key with its numbers as numbers: fig2 before fig10."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def artefacts(kind: Kind | None = None) -> list[Artefact]:
    """Declared artefacts in the paper's order (by name, numbers as numbers: fig1..fig10, table1, ...), then the
    variational family's (figures, then its table), optionally of one kind."""
    return sorted(
        (a for a in ARTEFACTS.values() if kind is None or a.kind == kind),
        key=lambda a: (is_variational(a.name), a.kind, _name_order(a.name)),
    )


def get(name: str) -> Artefact:
    """The artefact declared under name (KeyError naming the valid names)."""
    if name not in ARTEFACTS:
        raise KeyError(f"unknown artefact {name!r}; valid: {', '.join(a.name for a in artefacts())}")
    return ARTEFACTS[name]
