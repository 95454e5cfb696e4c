"""The variational family's final scores: per comparison key (method, data setting, estimator) and seed, the last
value of every val-core metric, with the metric names and the scale note its figures and its table share."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from analysis.training import stats as training_stats
from predmask import metrics
from predmask.command_text import sweep_command
from predmask.rl.task import EVAL_SPLITS
from reports import queries
from reports.artefact import ReportContext
from reports.style import method_rank

AT_N = 16  # avg@16, pass@1..16
SWEEP_COMMAND = sweep_command(queries.VR_SWEEP)


def acc_name(split: str) -> str:
    return metrics.val_acc(split, AT_N)


def pass_name(split: str, k: int) -> str:
    return metrics.val_pass(split, k)


@dataclass
class VrScores:
    """The family's evaluated runs: per comparison key (method, data setting, estimator), per seed, the final
    value of every val-core metric; the selection rule; the runs used."""

    rule: str
    runs: list[queries.RunInfo] = field(default_factory=list)
    by_key: dict[queries.VrKey, dict[Hashable, dict[str, float]]] = field(default_factory=dict)

    def values(self, key: queries.VrKey, name: str) -> dict[Hashable, float]:
        """seed -> final value of one metric (the seeds that logged it)."""
        return {s: m[name] for s, m in self.by_key.get(key, {}).items() if name in m}

    def interval(self, key: queries.VrKey, name: str) -> training_stats.Interval:
        return training_stats.t_interval(self.values(key, name).values())


def _key_rank(key: queries.VrKey) -> tuple:
    return (method_rank(key.method), key.method or "", key.data or "", key.estimator or "")


def vr_scores(ctx: ReportContext) -> VrScores:
    """The family's runs (default sweep variational_reasoning; --sweep to choose) with an avg@16 evaluation."""
    sel = queries.select_runs(queries.variational_runs(ctx.runs), None, ctx.sweeps, queries.VR_SWEEP)
    finals = queries.final_values(ctx.con, [r.run_id for r in sel.runs], "val-core/")
    wanted = {acc_name(s) for s in EVAL_SPLITS}
    used = [r for r in sel.runs if wanted & set(finals.get(r.run_id, {}))]
    grouped: dict[queries.VrKey, list[queries.RunInfo]] = {}
    for r in used:
        grouped.setdefault(queries.vr_key(r), []).append(r)
    out = VrScores(sel.rule, used)
    for key in sorted(grouped, key=_key_rank):
        members = sorted(grouped[key], key=lambda r: (r.seed is None, r.seed or 0, r.run_id))
        seeds = [r.seed for r in members]
        by_seed = None not in seeds and len(set(seeds)) == len(seeds)  # else: keyed by run (nothing merged)
        out.by_key[key] = {(r.seed if by_seed else r.run_id): finals[r.run_id] for r in members}
    return out


def scale_note(runs: Sequence[queries.RunInfo]) -> str:
    """Where the runs ran, in words: CPU stand-in scale and π_θ0 stated (or the cluster's models)."""
    if not runs:
        return "no runs yet"
    scales = ", ".join(sorted({r.describe_scale() for r in runs}))
    if all(r.is_cpu for r in runs):
        return (
            f"CPU engine, {scales}, SFT stages in float32, GRPO rollouts in emulated bf16; π_θ0 = the engine's "
            f"cached base model; arithmetic stand-in splits {' / '.join(EVAL_SPLITS)}, not the paper's benchmarks"
        )
    return f"{scales}; backends {', '.join(sorted({r.describe_backend() for r in runs}))}"
