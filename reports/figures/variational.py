"""The variational-reasoning family's figures: accuracy and pass@k per recipe, accuracy weighting, length bias.

Every figure states its scale (the CPU engine's π_θ0 is its cached base model) and its evaluation splits with
their size, and carries the hint-use gate in its title.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import numpy as np
import polars as pl
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from analysis.training import stats as training_stats
from predmask import metrics
from predmask.command_text import command
from predmask.rl.task import EVAL_SPLITS
from reports import queries
from reports.artefact import ArtefactResult, Panel, ReportContext, Series
from reports.cells import interval_caption
from reports.figures.draw import figure, finish, panel_axes, titled_grid
from reports.labels import WEIGHTING_ORDER, weighting_method_label
from reports.style import GREY, VR_DATA_STYLE, VR_UNKNOWN_DATA, method_style
from reports.vr_scores import (
    AT_N,
    SWEEP_COMMAND,
    VrScores,
    acc_name,
    mdd_note,
    regime_rank,
    scale_note,
    vr_scores,
)

PASS_KS: tuple[int, ...] = tuple(range(1, AT_N + 1))
WEIGHTING_COMMAND = command("analysis accuracy_weighting")
#: the one line saying what fills this family's artefacts (printed when the database has none of its data)
MISSING_HINT = (
    f"no variational-reasoning data in the database: `{SWEEP_COMMAND}` runs the family (each run is ingested as "
    f"it ends), then `{WEIGHTING_COMMAND}` measures the accuracy weighting"
)
BAND_ALPHA = 0.18
LEGEND_COLS = 2
SEED_DOT = 7  # marker size of the per-seed points


def _seeds_text(keys: Sequence[Hashable]) -> str:
    what = "seed" if all(isinstance(k, int) for k in keys) else "run"
    return f"{what}{'' if len(keys) == 1 else 's'} {', '.join(str(k) for k in keys)}"


def _split_title(split: str) -> str:
    return f"{split} (stand-in split)" if split in EVAL_SPLITS else split


def _key_series(key: queries.VrKey, seed_keys: Sequence[Hashable], x, y, **kw) -> Series:
    """A comparison key's series, its label naming the seeds it is over."""
    label = f"{key.label} ({_seeds_text(seed_keys)})"
    return Series(label, np.array(x, dtype=float), np.array(y), method=key.method, seed_keys=tuple(seed_keys), **kw)


def _split_panels(
    result: ArtefactResult,
    scores: VrScores,
    what: str,
    series: Callable[[int, queries.VrKey, str], Series | None],
) -> None:
    """A panel per evaluation split, in it ``series(i, key, split)`` of each comparison key that has one; an empty
    panel says it has no ``what`` yet."""
    for split in scores.splits:
        found = [series(i, key, split) for i, key in enumerate(scores.by_key)]
        panel = Panel(title=_split_title(split), series=[s for s in found if s is not None])
        if not panel.series:
            panel.note = f"no {what} on {split} yet\n({SWEEP_COMMAND})"
        result.panels.append(panel)


def title_lines(result: ArtefactResult, scores: VrScores, *lines: str) -> list[str]:
    """A figure's title lines: its (gated) title, the scale and splits, the selection, then ``lines``."""
    note = scale_note(result.runs, scores.splits)
    return [result.title, f"{note}; selection: {result.selection_rule}", *lines]


def _gate_caption(scores: VrScores) -> str:
    """The hint use per regime, for a caption ('' when not measured)."""
    return f" Hint use: {text}." if (text := scores.hint_text()) else ""


def _style(key: queries.VrKey, index: int) -> tuple[str, str, str, bool]:
    """(colour, line style, marker, filled) of a comparison key: the method's colour, the data setting's mark."""
    colour, ls = method_style(key.method, index)
    marker, filled, data_ls = VR_DATA_STYLE.get(key.data, VR_UNKNOWN_DATA)
    return colour, (data_ls if key.data else ls), marker, filled


def _key_panels(axes, panels: Sequence[Panel], keys: list[queries.VrKey]):
    """Each titled panel with series, each series with its key and style; an empty one shows its note."""
    for ax, panel in zip(axes, panels):
        if not panel_axes(ax, panel):
            continue
        found = [(s, next(k for k in keys if s.label.startswith(k.label + " ("))) for s in panel.series]
        yield ax, [(s, key, *_style(key, keys.index(key))) for s, key in found]


def _layout(n_panels: int, n_labels: int, title: Sequence[str], ax_w: float = 3.4, rows: int = 1):
    n_cols = max(1, -(-n_panels // rows))
    return titled_grid(rows, n_cols, title, n_labels, LEGEND_COLS, ax_w=ax_w, ax_h=2.2, bottom=0.7)


# ------------------------------------------------------------------------------------------- vr_accuracy


@figure("Variational reasoning: avg@16 per recipe, over seeds")
def vr_accuracy(ctx: ReportContext) -> ArtefactResult:
    scores = vr_scores(ctx)
    result = scores.result(
        "Variational reasoning: avg@16 per method, data setting and estimator",
        (
            f"Final avg@{AT_N} ({acc_name('<split>')}) on each held-out evaluation split, per method (VR recipes by "
            f"data setting and estimator): {training_stats.interval_note()} as a bar with its interval, each seed "
            f"a dot, the seeds named in the legend. {mdd_note(scores.runs, scores.seed_count())}. "
            f"{interval_caption('seeds')}{_gate_caption(scores)}"
        ),
        has_data=bool(scores.runs),
    )

    def bar(i: int, key: queries.VrKey, split: str) -> Series | None:
        vals = scores.values(key, acc_name(split))
        if not vals:
            return None
        iv = training_stats.t_interval(vals.values())
        yerr = None if iv.half_width is None else np.array([iv.half_width])
        return _key_series(key, list(vals), [float(i)], [iv.mean], yerr=yerr, seeds=np.array(list(vals.values())))

    _split_panels(result, scores, "avg@16", bar)
    if ctx.draw:
        result.drawn = _draw_accuracy(ctx, result, scores)
    return result


def _draw_accuracy(ctx: ReportContext, result: ArtefactResult, scores: VrScores) -> Figure:
    keys = list(scores.by_key)
    title = title_lines(result, scores, f"bar: {training_stats.interval_note()}; dots: seeds")
    fig, axes = _layout(len(result.panels), len(keys), title, ax_w=max(3.4, 0.45 * len(keys) + 1.0))
    handles: dict[str, object] = {}
    for ax, series in _key_panels(axes, result.panels, keys):
        for s, key, colour, _, marker, filled in series:
            x = float(s.x[0])
            bar = ax.bar(
                x, s.y[0], width=0.7, color=colour if filled else "white", edgecolor=colour,
                hatch=None if filled else "//", alpha=0.85, label=key.label,
            )
            if s.yerr is not None:
                ax.errorbar(x, s.y[0], yerr=s.yerr[0], color="black", capsize=3, linewidth=1)
            jitter = np.linspace(-0.15, 0.15, len(s.seeds)) if len(s.seeds) > 1 else np.zeros(1)
            ax.scatter(x + jitter, s.seeds, s=SEED_DOT, color=GREY, zorder=4, marker=marker)
            handles.setdefault(s.label, bar)
        ax.set_xticks(range(len(keys)))
        ax.set_xticklabels([str(i + 1) for i in range(len(keys))])
        ax.set_xlabel("method (numbered as in the legend)")
        ax.set_ylabel(f"avg@{AT_N}")
        ax.set_ylim(0, 1)
    numbered = {f"{i + 1}: {label}": h for i, (label, h) in enumerate(handles.items())}
    return finish(fig, title, numbered, LEGEND_COLS)


# ------------------------------------------------------------------------------------------ vr_pass_at_k


@figure("Variational reasoning: pass@k, k = 1..16")
def vr_pass_at_k(ctx: ReportContext) -> ArtefactResult:
    scores = vr_scores(ctx)
    result = scores.result(
        f"Variational reasoning: pass@k for k = 1..{AT_N}",
        (
            f"pass@k ({metrics.val_pass('<split>', 1)} … pass@{AT_N}, the unbiased estimator from {AT_N} "
            f"samples per problem) of each method's final model on each evaluation split: line = mean over "
            f"seeds, band = {training_stats.INTERVAL_NAME} (one seed: no band). {interval_caption('seeds')}"
            f"{_gate_caption(scores)}"
        ),
    )

    def curve(_: int, key: queries.VrKey, split: str) -> Series | None:
        per_seed = scores.by_key[key]
        names = [metrics.val_pass(split, k) for k in PASS_KS]
        seeds = [s for s, m in per_seed.items() if all(n in m for n in names)]
        if not seeds:
            return None
        values = np.array([[per_seed[s][n] for n in names] for s in seeds])
        mean, lo, hi = training_stats.t_band(values)
        return _key_series(key, seeds, PASS_KS, mean, band=None if len(seeds) < 2 else (lo, hi), seeds=values)

    _split_panels(result, scores, f"pass@1..{AT_N}", curve)
    result.has_data = any(p.series for p in result.panels)
    if ctx.draw:
        result.drawn = _draw_pass(ctx, result, scores)
    return result


def _draw_pass(ctx: ReportContext, result: ArtefactResult, scores: VrScores) -> Figure:
    keys = list(scores.by_key)
    title = title_lines(result, scores, f"line: {training_stats.interval_note()} (shaded)")
    labels = result.series_labels()
    fig, axes = _layout(len(result.panels), len(labels), title)
    handles: dict[str, object] = {}
    for ax, series in _key_panels(axes, result.panels, keys):
        for s, _, colour, ls, marker, filled in series:
            if s.band is not None:
                ax.fill_between(s.x, s.band[0], s.band[1], color=colour, alpha=BAND_ALPHA, linewidth=0)
            (line,) = ax.plot(s.x, s.y, color=colour, linestyle=ls, marker=marker, markersize=3,
                              markerfacecolor=colour if filled else "white", label=s.label)
            handles.setdefault(s.label, line)
        ax.set_xlabel("k")
        ax.set_ylabel("pass@k")
        ax.set_xticks([1, 2, 4, 8, 16])
    return finish(fig, title, handles, LEGEND_COLS)


# -------------------------------------------------------------------------------- vr_accuracy_weighting

WEIGHT_SOURCES: tuple[str, ...] = ("model", "bandit")


@figure("Accuracy weighting: measured vs predicted weight against accuracy")
def vr_accuracy_weighting(ctx: ReportContext) -> ArtefactResult:
    found = queries.latest_weighting(ctx.con)
    result = ArtefactResult(
        title="Accuracy weighting: the weight each objective puts on ∇log p(correct | x), against accuracy p",
        caption=(
            "Top row (source 'model', real batches): each dot one training question, its measured weight (the "
            "projection of the method's per-question gradient on the estimated ∇log p) at the question's measured "
            "accuracy; the line the closed form of docs/math.md §9 at that accuracy. Bottom row (source 'bandit'): "
            "the exact check on a one-question bandit with known p. Questions without a correct sample have no "
            f"weight and are not drawn. {interval_caption('none')}"
        ),
        selection_rule=f"analysis {found.analysis_id}" if found else "no accuracy-weighting analysis",
        command=WEIGHTING_COMMAND,
    )
    rows = found.rows if found is not None else None
    methods: list[str] = []
    if rows is not None and rows.height:
        order = {m: i for i, m in enumerate(WEIGHTING_ORDER)}
        methods = sorted(set(rows["method"].to_list()), key=lambda m: (order.get(m, len(order)), m))
    for source in WEIGHT_SOURCES:
        for method in methods or ["(none)"]:
            panel = Panel(title=weighting_method_label(method) if methods else "no analysis", row=source)
            if rows is not None and methods:
                part = rows.filter((rows["method"] == method) & (rows["source"] == source)).sort("accuracy")
                part = part.filter(part["accuracy"].is_not_null())
                for label, column in (("measured", "measured_weight"), ("predicted (closed form)", "predicted_weight")):
                    have = part.filter(part[column].is_not_null())
                    if have.height:
                        x, y = have["accuracy"].to_numpy(), have[column].to_numpy()
                        panel.series.append(Series(label, x, y, method=method))
            if not panel.series:
                panel.note = f"no {source} rows\n({WEIGHTING_COMMAND})"
            result.panels.append(panel)
    result.has_data = any(p.series for p in result.panels)
    if ctx.draw:
        result.drawn = _draw_weighting(ctx, result, found, methods)
    return result


def _weighting_scale(found: queries.WeightingAnalysis | None) -> str:
    if found is None:
        return "no analysis yet"
    model = found.config.get("model")
    model = model.get("name") if isinstance(model, dict) else model
    where = f"model {model}" if model else "the analysis's model"
    return f"analysis {found.analysis_id}: {where} on the CPU engine (stand-in scale), arithmetic stand-in questions"


def _draw_weighting(
    ctx: ReportContext, result: ArtefactResult, found: queries.WeightingAnalysis | None, methods: list[str]
) -> Figure:
    n_methods = max(1, len(methods))
    title = [result.title, _weighting_scale(found), "dots: measured; line: predicted (closed form)"]
    fig, axes = _layout(len(result.panels), 2, title, ax_w=2.6, rows=len(WEIGHT_SOURCES))
    handles: dict[str, object] = {}
    for i, (ax, panel) in enumerate(zip(axes, result.panels)):
        if not panel_axes(ax, panel, f"{panel.title}\n({panel.row})"):
            continue
        method = panel.series[0].method
        colour, _ = method_style(method, methods.index(method) if method in methods else i)
        for s in panel.series:
            if s.label == "measured":
                art = ax.scatter(s.x, s.y, s=10, color=colour, alpha=0.6, label=s.label, zorder=3)
            else:
                (art,) = ax.plot(s.x, s.y, color="black", linewidth=1.2, label=s.label, zorder=4)
            handles.setdefault(s.label, art)
        ax.set_xlabel("accuracy p")
        if i % n_methods == 0:
            ax.set_ylabel("weight on ∇log p")
    return finish(fig, title, handles, LEGEND_COLS)


# -------------------------------------------------------------------------------------- vr_length_bias

#: (panel title, x column, y column, x label, y label) of the length-bias figure, from vr_traces
LENGTH_PANELS: tuple[tuple[str, str, str, str, str], ...] = (
    ("trace length vs trace log-ratio", "trace_tokens", "log_ratio", "trace length |z| (tokens)",
     "(log π_θ0(z|x) − log q_φ(z|x,y′)) / |z|"),
    ("answer length vs answer log-likelihood", "answer_tokens", "answer_logp", "answer length |y′| (tokens)",
     "log π_θ0(y′|x,z)"),
)


def weights_runs(selected: Sequence[queries.RunInfo], scores: VrScores) -> list[queries.RunInfo]:
    """The weights-stage runs of the selected sweeps' runs (default variational_reasoning) that the compared finals
    read (``inputs.weights``): a weights run left behind by a changed upstream setting (a rerun prior) is not drawn
    twice beside its successor. All of them when no compared final names one."""
    stage = [r for r in selected if r.config.get("stage") == "weights"]
    read = {str(inputs.get("weights")) for r in scores.runs if isinstance(inputs := r.config.get("inputs"), dict)}
    return [r for r in stage if r.run_id in read] or stage


@figure("Variational reasoning: length against log-likelihood (length bias)")
def vr_length_bias(ctx: ReportContext) -> ArtefactResult:
    sel = queries.select_runs(queries.variational_runs(ctx.runs), None, ctx.sweeps, queries.VR_SWEEP)
    scores = vr_scores(ctx)
    runs = weights_runs(sel.runs, scores)
    rows = queries.vr_trace_rows(ctx.con, [r.run_id for r in runs])
    result = ArtefactResult(
        title=scores.gated_title(
            "Length bias: trace length vs the per-token log-ratio, answer length vs the answer log-likelihood"
        ),
        caption=(
            "Each dot one sampled trace of the weights stage (vr_traces): left, its length against its per-token "
            "log-likelihood ratio (the log of the importance ratio's geometric mean); right, the hinted answer's "
            "length against its log-likelihood under π_θ0 given the trace. Pearson's r (analysis.training.stats) "
            f"in each panel's title. {interval_caption('none')}{_gate_caption(scores)}"
        ),
        runs=[r for r in runs if rows.height and r.run_id in set(rows["run_id"].to_list())],
        selection_rule=sel.rule + "; stage weights",
        command=SWEEP_COMMAND,
    )
    corrs: dict[str, training_stats.Correlation] = {}
    per_regime: list[str] = []
    by_regime = _rows_by_regime(rows, runs, scores)
    for title, xcol, ycol, _, _ in LENGTH_PANELS:
        panel = Panel(title=title)
        if rows.height:
            x, y = rows[xcol].to_numpy().astype(float), rows[ycol].to_numpy().astype(float)
            corr = training_stats.correlation(x, y)
            corrs[title] = corr
            panel.title = f"{title}\n{corr.text()}" + (" (all regimes)" if len(by_regime) > 1 else "")
            for regime, part in by_regime.items():
                rx, ry = part[xcol].to_numpy().astype(float), part[ycol].to_numpy().astype(float)
                panel.series.append(Series(regime or "traces", rx, ry))
                if regime is not None:
                    corrs[f"{title}, {regime}"] = corr_r = training_stats.correlation(rx, ry)
                    per_regime.append(f"{title}, {regime}: {corr_r.text()}")
        else:
            panel.note = f"no vr_traces rows yet\n({SWEEP_COMMAND}, then ingest)"
        result.panels.append(panel)
    result.stats = corrs
    result.has_data = bool(rows.height)
    if per_regime:
        result.caption += f" Per regime (a colour each): {'; '.join(per_regime)}."
    if ctx.draw:
        result.drawn = _draw_length(ctx, result, scores)
    return result


def _rows_by_regime(
    rows: pl.DataFrame, runs: Sequence[queries.RunInfo], scores: VrScores
) -> dict[str | None, pl.DataFrame]:
    """The vr_traces rows by the regime of their weights run (one None entry when no ablation varies one)."""
    if not rows.height:
        return {}
    regime = {r.run_id: scores.regime_of_run(r) for r in runs}
    found = {regime.get(rid) for rid in rows["run_id"].unique().to_list()}
    if found == {None}:
        return {None: rows}
    return {g: rows.filter(rows["run_id"].is_in([rid for rid, reg in regime.items() if reg == g]))
            for g in sorted(found, key=regime_rank)}


def _draw_length(ctx: ReportContext, result: ArtefactResult, scores: VrScores) -> Figure:
    title = title_lines(result, scores)
    labels = result.series_labels()
    legend = len(labels) > 1
    fig, axes = _layout(len(result.panels), len(labels) if legend else 0, title)
    handles: dict[str, object] = {}
    for ax, panel, (_, _, _, xlabel, ylabel) in zip(axes, result.panels, LENGTH_PANELS):
        if not panel_axes(ax, panel):
            continue
        for i, s in enumerate(panel.series):
            colour = method_style(None, i)[0] if legend else method_style("vr_acc")[0]
            ax.scatter(s.x, s.y, s=6, alpha=0.4, color=colour, linewidths=0, label=s.label)
            handles.setdefault(s.label, Line2D([], [], marker="o", linestyle="", color=colour, markersize=5))
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
    return finish(fig, title, handles if legend else {}, LEGEND_COLS)
