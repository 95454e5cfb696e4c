"""The variational family's stage graph: which upstream stages' outputs each stage reads, per final recipe.

One owner for the sweep's expansion (``sweeps.vr_chain``), the CPU stage runner (``predmask.rl.vr_runner``) and
the cluster commands (``predmask.verl.vr_cluster``); what a stage writes is each backend's own.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["FINAL_INPUTS", "STAGES", "STAGE_INPUTS", "stage_inputs", "with_upstream"]

#: the stages, in pipeline order (one run directory each; the ``stage`` key of a run's config)
STAGES: tuple[str, ...] = ("prior", "posterior", "traces", "weights", "final")
#: the stages before the finals, in pipeline order, and the upstream stages each reads
STAGE_INPUTS: dict[str, tuple[str, ...]] = {"prior": (), "posterior": (), "traces": ("posterior",),
                                            "weights": ("prior", "traces")}
#: what a vr_* final reads (its traces and their weights); sft trains on the original data and rft samples pi_theta0
#: inside its own run, so they read no stage run
FINAL_INPUTS: tuple[str, ...] = ("traces", "weights")


def stage_inputs(stage: str, recipe: str | None = None) -> tuple[str, ...]:
    """The upstream stages whose outputs ``stage`` reads (a final: by its ``recipe``, ``method.name``)."""
    if stage == "final":
        return FINAL_INPUTS if str(recipe).startswith("vr_") else ()
    if stage not in STAGE_INPUTS:
        raise ValueError(f"unknown stage {stage!r}; allowed: {', '.join(STAGES)}")
    return STAGE_INPUTS[stage]


def with_upstream(stages: Iterable[str]) -> set[str]:
    """``stages`` (not finals) and every stage they read, transitively."""
    out: set[str] = set()
    todo = list(stages)
    while todo:
        stage = todo.pop()
        if stage not in out:
            out.add(stage)
            todo.extend(stage_inputs(stage))
    return out
