"""Training-curve figures (1, 2, 5-8): a panel per model-precision setting, a line per method (mean over seeds)."""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from analysis.results import curves
from analysis.training import stats as training_stats
from predmask import metrics
from predmask.command_text import sweep_command
from predmask.methods import method_anchor
from predmask.rl.task import EVAL_SPLITS
from reports import queries
from reports.artefact import ArtefactResult, Panel, ReportContext, Series
from reports.cells import detectable, detectable_note, interval_caption
from reports.figures.draw import figure, finish, panel_axes, titled_grid
from reports.labels import method_label, setting_label, split_size_text, sweep_delta
from reports.queries import MAIN_SWEEP, TIGHT_SWEEP
from reports.style import method_marker, method_rank, method_style

MAX_COLS = 4
LEGEND_COLS = 3  # legend labels carry seeds and coincidence marks: fewer, wider columns
BAND_ALPHA = 0.18
IDENTICAL_STYLE = (0, (3, 3))  # a line identical to an earlier method's: dashed over it, so both colours show
MARKERS_PER_LINE = 8  # about this many markers on each line; a panel's lines take turns, so no two share a point
FINAL_MARKER = "D"  # hollow, at a line's last step: the mean of the seeds' unsmoothed final values (Table 2's final)

#: the range a metric's values can take (None: unbounded on that side); a band is clipped to it. predmask.metrics
#: says what a metric means but has no range field: this table is the one owner of these ranges until it has.
#: actor/ppo_kl is a mean of log-ratios over sampled tokens (a k1 estimate): it can be negative, so it is unbounded.
VALUE_RANGE: dict[str, tuple[float | None, float | None]] = {
    metrics.CLIPFRAC: (0.0, 1.0),
    metrics.CLIPFRAC_LOWER: (0.0, 1.0),
    metrics.RESPONSE_LENGTH_MEAN: (0.0, None),
    metrics.RESPONSE_LENGTH_CLIP_RATIO: (0.0, 1.0),
    metrics.TOPK_TAIL_MASS_MEAN: (0.0, 1.0),
    metrics.MISMATCH_TOPK_KL: (0.0, None),
}
ACCURACY_RANGE = (0.0, 1.0)  # validation accuracies (avg@n) are fractions
#: how a ratio's anchor reads in a legend (predmask.methods.ANCHORS)
ANCHOR_TEXT = {"old": "π_old", "rollout": "μ"}


@dataclass(frozen=True)
class MetricRow:
    """A row of a per-setting figure: label, y-axis label, the metric names it reads, how it reads them, and the
    smoothing its curves get by default."""

    label: str
    ylabel: str
    names: tuple[str, ...]  # literal metric names this row reads ("" for the AIME rows, found per run)
    kind: str = "metric"  # "metric" | "val_mean" | "aime24" | "aime25"
    smoothing: training_stats.Smoothing = training_stats.STEP_SMOOTHING
    anchored: bool = False  # the metric is taken against each method's ratio anchor: the legend names it

    @property
    def value_range(self) -> tuple[float | None, float | None]:
        """The range this row's values can take (its bands are clipped to it)."""
        return ACCURACY_RANGE if self.kind != "metric" else VALUE_RANGE.get(self.names[0], (None, None))


def _smoothing(ctx: ReportContext, row: MetricRow) -> training_stats.Smoothing:
    return training_stats.RAW if ctx.raw else row.smoothing


def _method_note(ctx: ReportContext, rows: Sequence[MetricRow]) -> str:
    """How the lines are made: mean, band, smoothing, coincidence marks (the figure's subtitle)."""
    smoothing = sorted({_smoothing(ctx, row).describe() for row in rows})
    how = (
        "raw values (no smoothing)"
        if ctx.raw
        else f"each seed smoothed first: {'; '.join(smoothing)} (--raw for raw values)"
    )
    return (
        f"line: {training_stats.interval_note()} (shaded, clipped to the quantity's range; one seed: no band); "
        f"{how}; every method has its own marker, staggered so coinciding lines all show; a hollow diamond at a "
        "line's end: the mean of the seeds' unsmoothed final values (Table 2's final); a line identical to an "
        "earlier method's is dashed over it and named in the legend"
    )


def _line_label(
    method: str | None, keys: Sequence[Hashable], identical_to: str | None, anchor: str | None = None
) -> str:
    """ "DPPO-TopK-KL (3 seeds)"; runs that are not one per seed (runs of several sweeps) are counted as runs;
    `anchor`: "; ppo_kl vs μ"."""
    n = len(keys)
    what = "seed" if all(isinstance(k, int) for k in keys) else "run"
    text = f"{method_label(method)} ({n} {what}{'' if n == 1 else 's'}"
    if anchor:
        text += f"; {metrics.PPO_KL.split('/')[-1]} vs {anchor}"
    return text + (f"; identical to {method_label(identical_to)})" if identical_to else ")")


def _anchors(runs: Sequence[queries.RunInfo]) -> dict[str | None, str]:
    """method -> the anchor its runs' ratio uses ("π_old", "μ"; several joined by "/")."""
    found: dict[str | None, set[str]] = {}
    for run in runs:
        section = run.config.get("method") if isinstance(run.config, dict) else None
        if not isinstance(section, dict) or "name" not in section:
            continue
        try:
            anchor = method_anchor(section)
        except (KeyError, ValueError):  # a method this checkout does not know: no anchor to name
            continue
        found.setdefault(run.method, set()).add(ANCHOR_TEXT.get(anchor, anchor))
    return {m: "/".join(sorted(a)) for m, a in found.items()}


def _clip(values: np.ndarray, value_range: tuple[float | None, float | None]) -> np.ndarray:
    lo, hi = value_range
    return np.clip(values, -np.inf if lo is None else lo, np.inf if hi is None else hi)


def seed_final(seeds: Mapping[Hashable, curves.Series]) -> float | None:
    """The mean over seeds of each seed's unsmoothed final value: the number Table 2 prints as "final"."""
    finals = [s.final for steps, values in seeds.values() if (s := training_stats.run_summary(steps, values))]
    return training_stats.t_interval(finals).mean


def _row_series(
    ctx: ReportContext, runs: Sequence[queries.RunInfo], rows: Sequence[MetricRow]
) -> dict[tuple[str, str], curves.Series]:
    """(run_id, row label) -> raw series for every row, reading each metric once."""
    ids = [r.run_id for r in runs]
    aime = curves.aime_series(ctx.con, ids) if any(row.kind != "metric" for row in rows) else {}
    raw = curves.metric_series(ctx.con, ids, sorted({n for row in rows for n in row.names}))
    out: dict[tuple[str, str], curves.Series] = {}
    for run in runs:
        for row in rows:
            found = aime.get(run.run_id, {})
            if row.kind == "metric":
                series = raw.get((run.run_id, row.names[0]))
            elif row.kind == "val_mean":
                series = curves.validation_series(found)
            else:
                series = found.get(row.kind)
            if series is not None and len(series[0]):
                out[(run.run_id, row.label)] = series
    return out


def _panel_lines(
    groups: dict[str | None, dict[Hashable, curves.Series]],
    smoothing: training_stats.Smoothing,
    value_range: tuple[float | None, float | None] = (None, None),
    anchors: Mapping[str | None, str] | None = None,
) -> tuple[list[Series], int, dict[str, float]]:
    """One line per method (mean over its seeds, band clipped to `value_range`, coincidence mark), the points left
    out because not every seed logged their step, and each line's unsmoothed final (label -> seed_final)."""
    marks = training_stats.coincidences({str(m): g for m, g in groups.items()})
    lines: list[Series] = []
    finals: dict[str, float] = {}
    left_out = 0
    for method, seeds in groups.items():
        curve = training_stats.seed_curve(seeds, smoothing)
        if curve is None:
            continue
        left_out += curve.n_left_out
        ref = marks.get(str(method))
        label = _line_label(method, curve.keys, ref, (anchors or {}).get(method))
        final = seed_final(seeds)
        if final is not None:
            finals[label] = final
        lines.append(
            Series(
                label,
                curve.steps,
                curve.mean,
                method=method,
                band=(
                    None
                    if curve.lo is None or curve.hi is None
                    else (_clip(curve.lo, value_range), _clip(curve.hi, value_range))
                ),
                seeds=curve.values,
                seed_keys=curve.keys,
                identical_to=ref,
            )
        )
    return lines, left_out, finals


def _detectable_text(
    key: queries.PanelKey, groups: dict[str | None, dict[Hashable, curves.Series]]
) -> str | None:
    """ "setting: each predictive mask − its pair: the difference its seeds can detect" from a panel's validation
    curves (the paired final accuracies Table 2 prints); None when no predictive mask has its pair here."""
    results = training_stats.setting_results({str(m): g for m, g in groups.items()})
    pairs = [
        f"{method_label(m)} − {method_label(r.vs_final.reference)}: {detectable(r.vs_final)}"
        for m, r in results.items()
        if r.vs_final is not None
    ]
    return f"{setting_label(key.paper_model, key.precision)}: {' | '.join(pairs)}" if pairs else None


def _per_setting_figure(
    ctx: ReportContext,
    *,
    title: str,
    caption: str,
    rows: Sequence[MetricRow],
    default_sweep: str = MAIN_SWEEP,
    state_detectable: bool = False,
) -> ArtefactResult:
    """One panel per model-precision setting (× one row per metric), one line per method; the runs at the δ of
    `default_sweep`, from that sweep unless the user chose others. `state_detectable`: each panel of a
    validation row also states the paired difference its seeds can detect (Figure 1)."""
    sel = queries.select_runs(ctx.runs, sweep_delta(default_sweep), ctx.sweeps, default_sweep)
    keys = queries.panel_keys(sel.runs)
    series = _row_series(ctx, sel.runs, rows)
    note = _method_note(ctx, rows)
    command = sweep_command(default_sweep)
    result = ArtefactResult(
        title=title,
        caption=f"{caption} {note[0].upper()}{note[1:]}. {interval_caption('seeds')}",
        selection_rule=sel.rule,
        command=command,
    )
    used: set[str] = set()
    anchors = _anchors(sel.runs) if any(row.anchored for row in rows) else {}
    finals: list[dict[str, float]] = []  # per panel: label -> unsmoothed final
    for row in rows:
        for key in keys:
            panel = Panel(title=key.title, row=row.label)
            in_panel = queries.runs_in_panel(sel.runs, key)
            members = [r for r in in_panel if (r.run_id, row.label) in series]
            groups = curves.by_method_and_seed(
                members, {r.run_id: series[(r.run_id, row.label)] for r in members}, rank=method_rank
            )
            panel.series, left_out, panel_finals = _panel_lines(
                groups, _smoothing(ctx, row), row.value_range, anchors
            )
            finals.append(panel_finals)
            if state_detectable and row.kind == "val_mean":
                panel.text = _detectable_text(key, groups)
            used.update(r.run_id for r in members)
            if key.model is None:
                panel.note = f"no runs for this setting\n({command})"
            elif not panel.series:
                panel.note = f"no {row.label} logged by the {len(in_panel)} run(s) of this setting\n({command})"
            elif left_out:
                panel.note = f"{left_out} logged point(s) on steps that not every seed logged are left out"
            result.panels.append(panel)
    result.runs = [r for r in sel.runs if r.run_id in used]
    result.has_data = bool(used)
    # the subtitle: the selection with the validation size, how the lines are made, then (Figure 1) what the
    # seeds can detect: what the numbers mean, then one line per panel
    head = [result.title, sel.rule, note]
    if size := split_size_text(r.config for r in result.runs):
        result.caption += f" Validation: {size}."
        head[1] += f"; validation: {size}"
    if detectable := [p.text for p in result.panels if p.text]:
        result.caption += f" {detectable_note()}."
        head += [f"{detectable_note()}.", *detectable]
    if ctx.draw:
        result.drawn = render_per_setting(result, head, [row.ylabel for row in rows], len(keys), finals)
    return result


def marker_slots(n_points: int, n_lines: int, index: int, per_line: int = MARKERS_PER_LINE) -> list[int]:
    """The points of line `index` (of a panel's `n_lines`) that carry its markers: about `per_line` of them, the
    lines taking turns (line j on the points j, j + n_lines, ... scaled to the stride), so two lines on the same
    steps never put a marker on the same point while each has at least as many points as there are lines."""
    if n_points <= 0:
        return []
    stride = n_lines * max(1, math.ceil(n_points / (n_lines * per_line)))
    start = index * (stride // n_lines)
    return list(range(start, n_points, stride)) if start < n_points else [index % n_points]


def render_per_setting(
    result: ArtefactResult,
    title: Sequence[str],
    ylabels: Sequence[str],
    n_settings: int,
    finals: Sequence[Mapping[str, float]] = (),
) -> Figure:
    """The figure of a per-setting result (open; the caller saves it), titled by `title`, a row of panels per
    y label: per panel, each line with its band, its staggered markers and a hollow diamond at its end for its
    unsmoothed final (`finals`, aligned with the panels). Artists carry gids for tests: "line:<label>",
    "band:<label>", "final:<label>"."""
    n_cols = min(MAX_COLS, max(n_settings, 1))
    setting_rows = math.ceil(n_settings / n_cols)
    labels = result.series_labels()
    fig, axes = titled_grid(setting_rows * len(ylabels), n_cols, title, len(labels), LEGEND_COLS)
    handles: dict[str, object] = {}
    used: set[int] = set()
    for i, panel in enumerate(result.panels):
        r_idx, s_idx = divmod(i, n_settings)
        index = (r_idx * setting_rows + s_idx // n_cols) * n_cols + s_idx % n_cols
        used.add(index)
        ax = axes[index]
        panel_axes(ax, panel)
        panel_finals = finals[i] if i < len(finals) else {}
        for j, s in enumerate(panel.series):
            colour, ls = method_style(s.method, j)
            if s.identical_to is not None:
                ls = IDENTICAL_STYLE
            elif s.band is not None:
                band = ax.fill_between(s.x, s.band[0], s.band[1], color=colour, alpha=BAND_ALPHA, linewidth=0)
                band.set_gid(f"band:{s.label}")
            (line,) = ax.plot(
                s.x,
                s.y,
                color=colour,
                linestyle=ls,
                label=s.label,
                zorder=3 + j,
                marker=method_marker(s.method, j),
                markersize=4,
                markevery=marker_slots(len(s.x), len(panel.series), j),
                gid=f"line:{s.label}",
            )
            handles.setdefault(s.label, line)
            if len(s.x) and s.label in panel_finals:  # the unsmoothed final, where the line ends
                ax.plot(
                    s.x[-1:],
                    [panel_finals[s.label]],
                    marker=FINAL_MARKER,
                    markersize=5,
                    markerfacecolor="none",
                    markeredgecolor=colour,
                    linestyle="none",
                    zorder=4 + len(panel.series),
                    gid=f"final:{s.label}",
                )
        if panel.series:
            ax.set_xlabel("training step")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))
        if s_idx % n_cols == 0:
            ax.set_ylabel(ylabels[r_idx])
    for k, ax in enumerate(axes):
        if k not in used:
            ax.set_visible(False)
    return finish(fig, title, handles, LEGEND_COLS)


VAL_ROW = MetricRow(
    "validation accuracy",
    "val acc (mean of AIME24/25 avg@16)",
    (),
    "val_mean",
    training_stats.VAL_SMOOTHING,
)
_VAL_CAPTION = (
    f"Validation accuracy = mean of the two AIME avg@16 scores ({metrics.val_acc('<aime24>', 16)} and "
    f"{metrics.val_acc('<aime25>', 16)}; on the CPU engine its stand-in splits {' / '.join(EVAL_SPLITS)}), "
    "on the steps where both were evaluated, against training step. One panel per model-precision setting, "
    "one line per method on the steps all its seeds logged."
)


@figure(f"Figure 1: main comparison at δ = {sweep_delta(MAIN_SWEEP):g}")
def fig1_main_comparison(ctx: ReportContext) -> ArtefactResult:
    return _per_setting_figure(
        ctx,
        title="Figure 1: main comparison (validation accuracy)",
        caption=_VAL_CAPTION,
        rows=[VAL_ROW],
        state_detectable=True,
    )


@figure(f"Figure 2: tight threshold δ = {sweep_delta(TIGHT_SWEEP):g}")
def fig2_tight_threshold(ctx: ReportContext) -> ArtefactResult:
    return _per_setting_figure(
        ctx,
        title="Figure 2: tight threshold (validation accuracy)",
        caption=_VAL_CAPTION,
        rows=[VAL_ROW],
        default_sweep=TIGHT_SWEEP,
    )


@figure("Figure 5: training reward")
def fig5_training_reward(ctx: ReportContext) -> ArtefactResult:
    return _per_setting_figure(
        ctx,
        title=f"Figure 5: training reward ({metrics.SCORE_MEAN})",
        caption=f"Mean training reward of each step's rollout batch ({metrics.SCORE_MEAN}) of the main-comparison runs.",
        rows=[MetricRow("training reward", metrics.SCORE_MEAN, (metrics.SCORE_MEAN,))],
    )


@figure("Figure 6: AIME24 and AIME25 accuracy, separately")
def fig6_aime24_aime25(ctx: ReportContext) -> ArtefactResult:
    return _per_setting_figure(
        ctx,
        title="Figure 6: AIME24 and AIME25 avg@16, separately",
        caption=(
            f"Top row: AIME24 avg@16 (CPU engine: {EVAL_SPLITS[0]}); bottom row: AIME25 avg@16 ({EVAL_SPLITS[1]}), "
            "for the main-comparison runs."
        ),
        rows=[
            MetricRow("AIME24", "AIME24 avg@16", (), "aime24", training_stats.VAL_SMOOTHING),
            MetricRow("AIME25", "AIME25 avg@16", (), "aime25", training_stats.VAL_SMOOTHING),
        ],
    )


@figure("Figure 7: response length")
def fig7_response_length(ctx: ReportContext) -> ArtefactResult:
    return _per_setting_figure(
        ctx,
        title="Figure 7: mean response length",
        caption=(
            f"Mean response length in tokens of each step's rollouts ({metrics.RESPONSE_LENGTH_MEAN}), main comparison."
        ),
        rows=[MetricRow("response length", metrics.RESPONSE_LENGTH_MEAN, (metrics.RESPONSE_LENGTH_MEAN,))],
    )


@figure("Figure 8: PPO-KL and clip fraction")
def fig8_ppo_kl_clipfrac(ctx: ReportContext) -> ArtefactResult:
    return _per_setting_figure(
        ctx,
        title="Figure 8: PPO-KL and clip fraction",
        caption=(
            f"Top row: {metrics.PPO_KL}, the mean of log anchor − log π over response tokens, where the anchor is "
            "each method's ratio anchor, named in its legend entry (π_old for GRPO clip-higher, μ, the rollout "
            "policy, for the divergence methods: predmask.methods.method_anchor), so the lines measure different "
            "gaps; a mean of log-ratios over sampled tokens, it can be negative and its band is not clipped. "
            f"Bottom row: {metrics.CLIPFRAC} (masked / tokens with A ≠ 0, in [0, 1]), main comparison."
        ),
        rows=[
            MetricRow("PPO-KL", f"{metrics.PPO_KL} (vs anchor)", (metrics.PPO_KL,), anchored=True),
            MetricRow("clip fraction", metrics.CLIPFRAC, (metrics.CLIPFRAC,)),
        ],
    )
