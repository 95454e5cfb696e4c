"""The variational family's stage graph: which upstream stages' outputs each stage reads, per final recipe and backend.

One owner for the sweep's expansion, the CPU stage runner and the cluster commands. On a cluster the SFT jobs
cannot sample, so two more stages run there: ``rft_samples`` (pi_theta0's responses, the correct ones the rft
final trains on) and ``eval`` (one per evaluated model; its ``method`` is the evaluated run's, so its recipe
says which it reads).
"""

from __future__ import annotations

from collections.abc import Iterable

#: the stages of the CPU engine, in pipeline order (one run directory each; the ``stage`` key of a run's config)
STAGES: tuple[str, ...] = ("prior", "posterior", "traces", "weights", "final")
#: the stages of a cluster, in pipeline order
CLUSTER_STAGES: tuple[str, ...] = ("prior", "posterior", "traces", "weights", "rft_samples", "final", "eval")
#: the stages that train with SFT (on a cluster each has an SFT config, ``cluster.variational.<stage>``)
SFT_STAGES: tuple[str, ...] = ("prior", "posterior", "final")
#: the stages before the finals, in pipeline order, and the upstream stages each reads
STAGE_INPUTS: dict[str, tuple[str, ...]] = {"prior": (), "posterior": (), "traces": ("posterior",),
                                            "weights": ("prior", "traces"), "rft_samples": ("prior",)}
#: what a vr_* final reads (its traces and their weights); sft trains on the original data and, on the CPU engine,
#: rft samples pi_theta0 inside its own run, so they read no stage run
FINAL_INPUTS: tuple[str, ...] = ("traces", "weights")
#: what the rft final reads on a cluster: pi_theta0's samples
CLUSTER_RFT_INPUTS: tuple[str, ...] = ("rft_samples",)


def stage_inputs(stage: str, recipe: str | None = None, cluster: bool = False) -> tuple[str, ...]:
    """The upstream stages whose outputs ``stage`` reads (a final or an eval: by its ``recipe``, ``method.name``;
    an eval of ``recipe`` prior reads the prior, of a final recipe that final). ``cluster``: the cluster's graph
    (CLUSTER_STAGES), else the CPU engine's (STAGES)."""
    allowed = CLUSTER_STAGES if cluster else STAGES
    if stage not in allowed:
        raise ValueError(f"unknown stage {stage!r}; allowed: {', '.join(allowed)}")
    if stage == "final":
        if str(recipe).startswith("vr_"):
            return FINAL_INPUTS
        return CLUSTER_RFT_INPUTS if cluster and recipe == "rft" else ()
    if stage == "eval":
        return ("prior",) if recipe == "prior" else ("final",)
    return STAGE_INPUTS[stage]


def with_upstream(stages: Iterable[str], cluster: bool = False) -> set[str]:
    """``stages`` (not finals or evals) and every stage they read, transitively."""
    out: set[str] = set()
    todo = list(stages)
    while todo:
        stage = todo.pop()
        if stage not in out:
            out.add(stage)
            todo.extend(stage_inputs(stage, cluster=cluster))
    return out
