"""Training-curve figures (1, 2, 5-8): a panel per model-precision setting, a line per run."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from matplotlib.ticker import MaxNLocator

from predmask import metrics
from predmask.rl.task import EVAL_SPLITS
from reports import data
from reports.artefact import ArtefactResult, Panel, ReportContext, Series, figure
from reports.figures.draw import (
    LEGEND_ROW_IN,
    empty_panel,
    grid_figure,
    legend_below,
    legend_rows,
    save_figure,
    suptitle,
    wrap_lines,
)
from reports.labels import method_label, sweep_delta
from reports.style import method_rank, method_style

MAIN, TIGHT = "main_comparison", "tight_threshold"  # the sweeps the figures draw by default
MAX_COLS = 4
# further runs (seeds) of one method in one panel: same colour, these dash patterns
REPEAT_STYLES = ((0, (5, 2)), (0, (1, 1.5)), (0, (3, 1, 1, 1)), (0, (8, 2, 2, 2)))


@dataclass(frozen=True)
class MetricRow:
    """A row of a per-setting figure: label, y-axis label, the metric names it reads, how it reads them."""

    label: str
    ylabel: str
    names: tuple[str, ...]  # literal metric names this row reads ("" for the AIME rows, found per run)
    kind: str = "metric"  # "metric" | "val_mean" | "aime24" | "aime25"


def _smoothing_note(ctx: ReportContext) -> str:
    return (
        f"smoothed: trailing mean over {ctx.smooth} logged points"
        if ctx.smooth > 1
        else "raw values (no smoothing)"
    )


def _run_label(run: data.RunInfo, duplicates: bool) -> str:
    label = method_label(run.method)
    if duplicates:
        label += f" (seed {run.seed})" if run.seed is not None else f" ({run.run_id[:8]})"
    return label


def _row_series(
    ctx: ReportContext, runs: Sequence[data.RunInfo], rows: Sequence[MetricRow]
) -> dict[tuple[str, str], data.Series]:
    """(run_id, row label) -> series for every row, reading each metric once."""
    ids = [r.run_id for r in runs]
    names = {n for row in rows for n in row.names}
    aime: dict[str, dict[str, str]] = {}
    if any(row.kind != "metric" for row in rows):
        by_run = data.metric_names_by_run(ctx.con, ids, metrics.VAL_CORE_PREFIX)
        aime = {rid: data.aime_metric_names(ns) for rid, ns in by_run.items()}
        names |= {n for m in aime.values() for n in m.values()}
    raw = data.metric_series(ctx.con, ids, sorted(names))
    out: dict[tuple[str, str], data.Series] = {}
    for run in runs:
        for row in rows:
            series: data.Series | None = None
            if row.kind == "metric":
                series = raw.get((run.run_id, row.names[0]))
            else:
                found = aime.get(run.run_id, {})
                if row.kind in ("aime24", "aime25") and row.kind in found:
                    series = raw.get((run.run_id, found[row.kind]))
                elif row.kind == "val_mean" and {"aime24", "aime25"} <= set(found):
                    a, b = raw.get((run.run_id, found["aime24"])), raw.get((run.run_id, found["aime25"]))
                    if a is not None and b is not None:
                        series = data.mean_on_common_steps(a, b)
            if series is not None and len(series[0]):
                out[(run.run_id, row.label)] = series
    return out


def _per_setting_figure(
    ctx: ReportContext,
    *,
    name: str,
    title: str,
    caption: str,
    rows: Sequence[MetricRow],
    default_sweep: str,
) -> ArtefactResult:
    """One panel per model-precision setting (× one row per metric), one line per run coloured by method; the runs
    at the δ of `default_sweep`, from that sweep unless the user chose others."""
    sel = data.select_runs(ctx.runs, sweep_delta(default_sweep), ctx.sweeps, default_sweep)
    keys = data.panel_keys(sel.runs)
    series = _row_series(ctx, sel.runs, rows)
    result = ArtefactResult(name=name, title=title, caption=caption, selection_rule=sel.rule)
    used: dict[str, data.RunInfo] = {}
    for row in rows:
        for key in keys:
            panel = Panel(title=key.title, row=row.label)
            members = sorted(
                data.runs_in_panel(sel.runs, key),
                key=lambda r: (method_rank(r.method), r.seed or 0, r.run_id),
            )
            methods = [r.method for r in members]
            for run in members:
                s = series.get((run.run_id, row.label))
                if s is None:
                    continue
                y = data.smooth(s[1], ctx.smooth)
                panel.series.append(
                    Series(
                        _run_label(run, methods.count(run.method) > 1),
                        s[0],
                        y,
                        run_id=run.run_id,
                        method=run.method,
                    )
                )
                used[run.run_id] = run
            if key.model is None:
                panel.note = "no runs for this setting"
            elif not panel.series:
                panel.note = f"no {row.label} logged by the {len(members)} run(s) of this setting"
            result.panels.append(panel)
    result.runs = [r for r in sel.runs if r.run_id in used]
    result.has_data = bool(used)
    if ctx.draw:
        result.files = _draw_per_setting(ctx, result, rows, n_settings=len(keys))
    return result


def _draw_per_setting(
    ctx: ReportContext, result: ArtefactResult, rows: Sequence[MetricRow], n_settings: int
) -> list:
    n_cols = min(MAX_COLS, max(n_settings, 1))
    setting_rows = math.ceil(n_settings / n_cols)
    labels = list(dict.fromkeys(s.label for p in result.panels for s in p.series))
    title = [result.title, f"{result.selection_rule}; {_smoothing_note(ctx)}"]
    width_in = 0.95 + n_cols * 2.7 + (n_cols - 1) * 0.6
    n_title = len(wrap_lines(title, width_in))
    fig, axes = grid_figure(
        setting_rows * len(rows),
        n_cols,
        top=0.2 * n_title + 0.55,
        bottom=0.55 + LEGEND_ROW_IN * legend_rows(len(labels)),
    )
    handles: dict[str, object] = {}
    used: set[int] = set()
    for i, panel in enumerate(result.panels):
        r_idx, s_idx = divmod(i, n_settings)
        index = (r_idx * setting_rows + s_idx // n_cols) * n_cols + s_idx % n_cols
        used.add(index)
        ax = axes[index]
        ax.set_title(panel.title)
        if not panel.series:
            empty_panel(ax, panel.note or "no data")
        seen: dict[str | None, int] = {}
        for j, s in enumerate(panel.series):
            colour, ls = method_style(s.method, j)
            k = seen[s.method] = seen.get(s.method, -1) + 1  # k-th run of this method in the panel
            ls = ls if k == 0 else REPEAT_STYLES[(k - 1) % len(REPEAT_STYLES)]
            (line,) = ax.plot(s.x, s.y, color=colour, linestyle=ls, label=s.label)
            handles.setdefault(s.label, line)
            if len(s.x):  # mark where a run that stopped early ends
                ax.plot(s.x[-1:], s.y[-1:], marker="o", markersize=2.5, color=colour, linestyle="none")
        if panel.series:
            ax.set_xlabel("training step")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))
        if s_idx % n_cols == 0:
            ax.set_ylabel(rows[r_idx].ylabel)
    for k, ax in enumerate(axes):
        if k not in used:
            ax.set_visible(False)
    suptitle(fig, *title)
    legend_below(fig, handles)
    return save_figure(fig, ctx.out, result.name, ctx.formats)


VAL_ROW = MetricRow("validation accuracy", "val acc (mean of AIME24/25 avg@16)", (), "val_mean")
_VAL_CAPTION = (
    f"Validation accuracy = mean of the two AIME avg@16 scores ({metrics.val_acc('<aime24>', 16)} and "
    f"{metrics.val_acc('<aime25>', 16)}; on the CPU engine its stand-in splits {' / '.join(EVAL_SPLITS)}), "
    "on the steps where both were evaluated, against training step. One panel per model-precision setting, "
    "one line per run coloured by method; a dot marks each run's last logged step (shorter runs end early)."
)


@figure("fig1_main_comparison", f"Figure 1: main comparison at δ = {sweep_delta(MAIN):g}")
def fig1_main_comparison(ctx: ReportContext) -> ArtefactResult:
    return _per_setting_figure(
        ctx,
        name="fig1_main_comparison",
        title="Figure 1: main comparison (validation accuracy)",
        caption=_VAL_CAPTION,
        rows=[VAL_ROW],
        default_sweep=MAIN,
    )


@figure("fig2_tight_threshold", f"Figure 2: tight threshold δ = {sweep_delta(TIGHT):g}")
def fig2_tight_threshold(ctx: ReportContext) -> ArtefactResult:
    return _per_setting_figure(
        ctx,
        name="fig2_tight_threshold",
        title="Figure 2: tight threshold (validation accuracy)",
        caption=_VAL_CAPTION,
        rows=[VAL_ROW],
        default_sweep=TIGHT,
    )


@figure("fig5_training_reward", "Figure 5: training reward")
def fig5_training_reward(ctx: ReportContext) -> ArtefactResult:
    return _per_setting_figure(
        ctx,
        name="fig5_training_reward",
        title=f"Figure 5: training reward ({metrics.SCORE_MEAN})",
        caption=f"Mean training reward of each step's rollout batch ({metrics.SCORE_MEAN}) of the main-comparison runs.",
        rows=[MetricRow("training reward", metrics.SCORE_MEAN, (metrics.SCORE_MEAN,))],
        default_sweep=MAIN,
    )


@figure("fig6_aime24_aime25", "Figure 6: AIME24 and AIME25 accuracy, separately")
def fig6_aime24_aime25(ctx: ReportContext) -> ArtefactResult:
    return _per_setting_figure(
        ctx,
        name="fig6_aime24_aime25",
        title="Figure 6: AIME24 and AIME25 avg@16, separately",
        caption=(
            f"Top row: AIME24 avg@16 (CPU engine: {EVAL_SPLITS[0]}); bottom row: AIME25 avg@16 ({EVAL_SPLITS[1]}), "
            "for the main-comparison runs."
        ),
        rows=[
            MetricRow("AIME24", "AIME24 avg@16", (), "aime24"),
            MetricRow("AIME25", "AIME25 avg@16", (), "aime25"),
        ],
        default_sweep=MAIN,
    )


@figure("fig7_response_length", "Figure 7: response length")
def fig7_response_length(ctx: ReportContext) -> ArtefactResult:
    return _per_setting_figure(
        ctx,
        name="fig7_response_length",
        title="Figure 7: mean response length",
        caption=(
            f"Mean response length in tokens of each step's rollouts ({metrics.RESPONSE_LENGTH_MEAN}), main comparison."
        ),
        rows=[MetricRow("response length", metrics.RESPONSE_LENGTH_MEAN, (metrics.RESPONSE_LENGTH_MEAN,))],
        default_sweep=MAIN,
    )


@figure("fig8_ppo_kl_clipfrac", "Figure 8: PPO-KL and clip fraction")
def fig8_ppo_kl_clipfrac(ctx: ReportContext) -> ArtefactResult:
    return _per_setting_figure(
        ctx,
        name="fig8_ppo_kl_clipfrac",
        title="Figure 8: PPO-KL and clip fraction",
        caption=(
            f"Top row: {metrics.PPO_KL} (mean of log μ − log π over response tokens); bottom row: {metrics.CLIPFRAC} "
            "(masked / tokens with A ≠ 0), main comparison."
        ),
        rows=[
            MetricRow("PPO-KL", metrics.PPO_KL, (metrics.PPO_KL,)),
            MetricRow("clip fraction", metrics.CLIPFRAC, (metrics.CLIPFRAC,)),
        ],
        default_sweep=MAIN,
    )
