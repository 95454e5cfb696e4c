"""The variational family's final scores: per comparison key (method, data setting, estimator, regime) and seed, the
last value of every val-core metric, with the metric names, the evaluation splits found in the database, the scale
note, the hint-use gate and the minimum detectable difference its figures and its table share.

A regime (``regimes``): the traces runs' settings that differ between the selected runs, e.g.
``traces.k = 4``; a final carries its traces run's. The gate (the README): ``HintUse.failure``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, replace
from statistics import mean
from typing import Any

from analysis.results import curves
from analysis.training import stats as training_stats
from predmask import metrics
from predmask.command_text import sweep_command
from predmask.rl.task import EVAL_SPLITS
from reports import queries
from reports.artefact import ArtefactResult, ReportContext
from reports.labels import split_size_text
from reports.style import method_rank

AT_N = 16  # avg@16, pass@1..16
SWEEP_COMMAND = sweep_command(queries.VR_SWEEP)
#: the gate's thresholds (their one owner): q_φ uses its hint when it follows a decoy hint in at least this share of
#: traces and reaches the hinted answer at least this many times as often as π_θ0's own samples
DECOY_FOLLOW_MIN = 0.20
HINT_GAIN_MIN = 2.0
#: the traces runs' config sections whose differing settings name a regime
REGIME_SECTIONS: tuple[str, ...] = ("hint", "traces")
#: the difference the minimum-detectable-difference note sizes the evaluation for (3 points)
TARGET_DIFFERENCE = 0.03
NOT_MEASURED = "q_φ's hint use not measured (no traces run logged it): whether VR here used a posterior is unknown"


def acc_name(split: str) -> str:
    return metrics.val_acc(split, AT_N)


@dataclass(frozen=True)
class HintUse:
    """q_φ's hint use in one regime, each rate the mean over the traces runs (seeds) that logged it."""

    regime: str | None
    seeds: int
    decoy: float | None  # share of traces with a decoy hint whose answer is the decoy
    posterior: float | None  # share of q_φ's traces reaching the hinted (correct) answer
    prior: float | None  # share of π_θ0's samples reaching the correct answer
    hinted: bool = True  # False: hint.use = false, q_φ sees the question alone

    def failure(self, with_regime: bool = True) -> str | None:
        """Why the posterior does not beat the prior, naming the regime (None: it does, nothing was measured, or the
        regime gives q_φ no hint)."""
        if not self.hinted:
            return None
        if self.decoy is not None and self.decoy < DECOY_FOLLOW_MIN:
            why = f"decoy-following {100 * self.decoy:.1f}% < {100 * DECOY_FOLLOW_MIN:.0f}%"
        elif self.posterior is not None and self.prior is not None and self.posterior < HINT_GAIN_MIN * self.prior:
            why = (f"q_φ reaches the hinted answer in {100 * self.posterior:.1f}%, under {HINT_GAIN_MIN:g}× "
                   f"π_θ0's {100 * self.prior:.1f}%")
        else:
            return None
        where = f"{self.regime}: " if self.regime and with_regime else ""
        return f"{where}posterior ignores its hint ({why}): VR here measures a filter, not a posterior"

    def text(self) -> str:
        """The measurement in words, with the verdict."""
        def rate(x: float | None) -> str:
            return "not measured" if x is None else f"{100 * x:.1f}%"

        where = f"{self.regime}: " if self.regime else ""
        seeds = f"{self.seeds} seed{'s' if self.seeds != 1 else ''}"
        if not self.hinted:  # the regime names hint.use = false when the ablation varies it
            what = "no hint" if self.regime else "no hint (hint.use = false)"
            return (f"{where}{what}: q_φ reaches the correct answer in {rate(self.posterior)} "
                    f"(π_θ0 {rate(self.prior)}; {seeds}); not gated")
        return (f"{where}q_φ follows a decoy hint in {rate(self.decoy)}, reaches the hinted answer in "
                f"{rate(self.posterior)} (π_θ0 {rate(self.prior)}; {seeds}): "
                f"{self.failure(with_regime=False) or 'the posterior uses its hint'}")


@dataclass
class VrScores:
    """The family's evaluated runs: per comparison key (method, data setting, estimator, regime), per seed, the
    final value of every val-core metric; the selection rule; the runs used; the hint use per regime."""

    rule: str
    runs: list[queries.RunInfo] = field(default_factory=list)
    by_key: dict[queries.VrKey, dict[Hashable, dict[str, float]]] = field(default_factory=dict)
    hint_use: list[HintUse] = field(default_factory=list)
    regimes: dict[str, str | None] = field(default_factory=dict)  # traces run id -> its regime

    @property
    def splits(self) -> list[str]:
        """The evaluation splits with an avg@16 in the data (the stand-in splits first), else the stand-in ones."""
        return eval_splits(name for m in self.by_key.values() for run in m.values() for name in run)

    def gate_lines(self) -> list[str]:
        """One line per verdict that the posterior does not beat the prior, naming its regimes (none when it holds
        in every regime measured); one line when VR recipes are compared but no hint use was measured; empty: it
        beats the prior everywhere, or there is no VR recipe."""
        if not self.hint_use:
            return [NOT_MEASURED] if any(k.estimator for k in self.by_key) else []  # an estimator: a VR recipe
        grouped: dict[str, list[str]] = {}
        for h in self.hint_use:
            if (why := h.failure(with_regime=False)) is not None:
                grouped.setdefault(why, []).append(h.regime or "")
        if len(grouped) == 1 and len(next(iter(grouped.values()))) == len(self.hint_use):
            return list(grouped)  # the same verdict in every regime
        return [f"{' / '.join(r for r in regimes if r)}: {why}" if any(regimes) else why
                for why, regimes in grouped.items()]

    def gated_title(self, title: str) -> str:
        """``title`` followed by the gate's lines (every VR artefact's title: the table's, each figure's)."""
        return title + "".join(f" — {line}" for line in self.gate_lines())

    def hint_text(self) -> str:
        """Every regime's hint use in words ('' when none was measured)."""
        return "; ".join(h.text() for h in self.hint_use)

    def regime_of_run(self, run: queries.RunInfo) -> str | None:
        """The regime of a run that reads traces (a final, the weights stage): its traces run's; None otherwise."""
        inputs = run.config.get("inputs")
        return self.regimes.get(str(inputs.get("traces"))) if isinstance(inputs, dict) else None

    def seed_count(self) -> int:
        """The most seeds any compared key has (the seeds the data were sized with)."""
        return max((len(v) for v in self.by_key.values()), default=0)

    def values(self, key: queries.VrKey, name: str) -> dict[Hashable, float]:
        """seed -> final value of one metric (the seeds that logged it)."""
        return {s: m[name] for s, m in self.by_key.get(key, {}).items() if name in m}

    def result(self, title: str, caption: str, **fields: Any) -> ArtefactResult:
        """An artefact's result over these scores: its title gated, the family's runs, rule and command."""
        return ArtefactResult(
            title=self.gated_title(title),
            caption=caption,
            runs=self.runs,
            selection_rule=self.rule,
            command=SWEEP_COMMAND,
            **fields,
        )

    def interval(self, key: queries.VrKey, name: str) -> training_stats.Interval:
        return training_stats.t_interval(self.values(key, name).values())


def eval_splits(metric_names: Any) -> list[str]:
    """The sources of the avg@16 metrics among ``metric_names`` (the CPU engine's stand-in splits, the cluster's
    aime24 / aime25, ...): the stand-in splits first, the others sorted; none found: the stand-in splits."""
    found = _acc_sources(metric_names)
    return [s for s in EVAL_SPLITS if s in found] + sorted(found - set(EVAL_SPLITS)) or list(EVAL_SPLITS)


def _acc_sources(metric_names: Any) -> set[str]:
    return {m["source"] for name in metric_names if (m := metrics.VAL_ACC_RE.match(name)) and int(m["n"]) == AT_N}


def regime_rank(text: str | None) -> tuple:
    """A sort key that orders the numbers in ``text`` by value (traces.k = 2 before traces.k = 16)."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", text or ""))


def _key_rank(key: queries.VrKey) -> tuple:
    return (method_rank(key.method), key.method or "", key.data or "", key.estimator or "", regime_rank(key.regime))


def _flat(cfg: dict[str, Any], sections: Sequence[str]) -> dict[str, str]:
    return {f"{sec}.{k}": str(v).lower() if isinstance(v, bool) else str(v)
            for sec in sections if isinstance(cfg.get(sec), dict) for k, v in cfg[sec].items()}


def regimes(traces_runs: Sequence[queries.RunInfo]) -> dict[str, str | None]:
    """traces run id -> its regime: its REGIME_SECTIONS settings that differ between ``traces_runs`` (None when
    none differs)."""
    flat = {r.run_id: _flat(r.config, REGIME_SECTIONS) for r in traces_runs}
    keys = sorted({k for f in flat.values() for k in f})
    varying = [k for k in keys if len({f.get(k) for f in flat.values()}) > 1]
    return {rid: ", ".join(f"{k} = {f.get(k, '—')}" for k in varying) or None for rid, f in flat.items()}


def _mean_of(values: dict[str, dict[str, float]], run_ids: Sequence[str], name: str) -> float | None:
    got = [values[r][name] for r in run_ids if name in values.get(r, {})]
    return mean(got) if got else None


def _hinted(cfg: dict[str, Any]) -> bool:
    """Whether a traces run's q_φ saw the hint (``hint.use``, true unless the run records false)."""
    hint = cfg.get("hint")
    return not (isinstance(hint, dict) and hint.get("use") is False)


def hint_use(con: Any, traces_runs: Sequence[queries.RunInfo], regime_of: dict[str, str | None]) -> list[HintUse]:
    """Per regime, q_φ's hint use from the traces runs' metrics (VR_DECOY_HIT, VR_POSTERIOR_CORRECT,
    VR_PRIOR_CORRECT of predmask.metrics), each averaged over the runs that logged it."""
    values = queries.final_values(con, [r.run_id for r in traces_runs], "vr/")
    grouped: dict[str | None, list[str]] = {}
    for r in traces_runs:
        grouped.setdefault(regime_of[r.run_id], []).append(r.run_id)
    hinted = {r.run_id: _hinted(r.config) for r in traces_runs}
    out = [HintUse(regime, len(ids), _mean_of(values, ids, metrics.VR_DECOY_HIT),
                   _mean_of(values, ids, metrics.VR_POSTERIOR_CORRECT), _mean_of(values, ids, metrics.VR_PRIOR_CORRECT),
                   hinted=all(hinted[r] for r in ids))
           for regime, ids in grouped.items()]
    return sorted((h for h in out if {h.decoy, h.posterior, h.prior} != {None}), key=lambda h: regime_rank(h.regime))


def vr_scores(ctx: ReportContext) -> VrScores:
    """The family's runs (--sweep, else variational_reasoning) with an avg@16, and their traces' hint use."""
    sel = queries.select_runs(queries.variational_runs(ctx.runs), None, ctx.sweeps, queries.VR_SWEEP)
    finals = queries.final_values(ctx.con, [r.run_id for r in sel.runs], "val-core/")
    used = [r for r in sel.runs if _acc_sources(finals.get(r.run_id, {}))]
    traces = [r for r in sel.runs if r.config.get("stage") == "traces"]
    regime_of = regimes(traces)
    out = VrScores(sel.rule, used, hint_use=hint_use(ctx.con, traces, regime_of), regimes=regime_of)
    grouped: dict[queries.VrKey, list[queries.RunInfo]] = {}
    for r in used:
        grouped.setdefault(replace(queries.vr_key(r), regime=out.regime_of_run(r)), []).append(r)
    for key in sorted(grouped, key=_key_rank):
        members = sorted(grouped[key], key=lambda r: (r.seed is None, r.seed or 0, r.run_id))
        out.by_key[key] = curves.by_seed(members, finals)
    return out


def eval_sizes(runs: Sequence[queries.RunInfo]) -> set[int | None]:
    """The problems per evaluation split the runs recorded (``task.eval_size``; None for a run that records none)."""
    return {size if isinstance(task := r.config.get("task"), dict) and isinstance(size := task.get("eval_size"), int)
            else None for r in runs}


def split_note(runs: Sequence[queries.RunInfo], splits: Sequence[str] = EVAL_SPLITS) -> str:
    """The evaluation splits and their size in words (reports.labels.split_size_text), e.g. ``splits aime24_standin
    / aime25_standin, n = 30 problems per evaluation split``."""
    size = split_size_text(r.config for r in runs)
    return f"splits {' / '.join(splits)}" + (f", {size}" if size else " (split size not recorded)")


def mdd_note(runs: Sequence[queries.RunInfo], seeds: int) -> str:
    """The minimum detectable difference of two recipes' avg@16 at the data's split size and seeds
    (analysis.training.stats.proportion_mdd), and the split size a TARGET_DIFFERENCE needs at those seeds."""
    sizes = eval_sizes(runs)
    if len(sizes) != 1 or None in sizes or seeds < 1:
        why = ("no seeds" if seeds < 1 else "split size not recorded" if None in sizes or not sizes
               else "the runs' split sizes differ")
        return f"Minimum detectable difference: not computed ({why})"
    n = int(next(iter(sizes)))
    mdd = training_stats.proportion_mdd(n * seeds)
    needed = math.ceil(n * (mdd / TARGET_DIFFERENCE) ** 2)
    return (f"Minimum detectable difference between two recipes at n = {n} problems x {seeds} seed"
            f"{'s' if seeds != 1 else ''}: {100 * mdd:.1f} points (two-sided α = {1 - training_stats.CONFIDENCE:g}, "
            f"power {training_stats.POWER:g}, z-test of two proportions at p = 0.5; the problems' sampling only, so a "
            f"lower bound); a {100 * TARGET_DIFFERENCE:g}-point difference needs n ≥ {needed:,} problems per split "
            f"at {seeds} seed{'s' if seeds != 1 else ''}")


def scale_note(runs: Sequence[queries.RunInfo], splits: Sequence[str] = EVAL_SPLITS) -> str:
    """Where the runs ran, in words (CPU stand-in scale and π_θ0, or the cluster's models), and the splits."""
    if not runs:
        return "no runs yet"
    scales = ", ".join(sorted({r.describe_scale() for r in runs}))
    if all(r.is_cpu for r in runs):
        return (
            f"CPU engine, {scales}, SFT stages in float32, GRPO rollouts in emulated bf16; π_θ0 = the engine's "
            f"cached base model; arithmetic stand-in {split_note(runs, splits)}, not the paper's benchmarks"
        )
    return f"{scales}; backends {', '.join(sorted({r.describe_backend() for r in runs}))}; {split_note(runs, splits)}"
