"""Token-level figures: unsafe-keep rates per seed (3), pooled corrective fractions (4), and the statistics against
the measured drift over the drift grid (9, beyond the paper), as the study's stats say."""

from __future__ import annotations

import numpy as np
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from analysis.store.token_level import grid_cells
from analysis.token_level.summary import stats
from reports import data, labels
from reports.artefact import (
    DRIFT_COMMAND,
    STUDY_COMMAND,
    ArtefactResult,
    Panel,
    ReportContext,
    Series,
    figure,
)
from reports.figures.draw import empty_panel, legend_below, new_figure, save_figure, suptitle
from reports.style import CRITERION_STYLE, GREY, OKABE_ITO

NO_STUDY = f"no token-level study in the database\n({STUDY_COMMAND})"


def _study_title(ctx: ReportContext) -> str:
    s = ctx.study
    return f"this database: {s.describe()}; study {s.study_id}, {s.n_seeds} seeds" if s else "no study"


def _selection(ctx: ReportContext) -> str:
    return f"study {ctx.study.study_id}" if ctx.study else "no token-level study"


def _mean_label(m: stats.MeanSE) -> str:
    """A mean as the statistics returned it, on three lines: value, standard error, the seeds it is over."""
    mean, se = m.value()
    spread = f"\n± {100 * se:.1f} SE" if m.se is not None else ""
    return f"{100 * mean:.1f}%{spread}\n(n = {m.n} {m.over})"


@figure("fig3_unsafe_keep", "Figure 3: unsafe-keep rate per seed, ratio vs predictive", source="study")
def fig3_unsafe_keep(ctx: ReportContext) -> ArtefactResult:
    result = ArtefactResult(
        name="fig3_unsafe_keep",
        command=STUDY_COMMAND,
        title="Figure 3: unsafe-keep rate on the disagreement set",
        caption=(
            "Per seed, among disagreement tokens (outside the trust region, where the ratio and predictive "
            "(aggregated-tail) criteria decide differently) that a criterion keeps, the fraction whose divergence "
            "grew after one optimiser step with that criterion's mask (ΔD > 0). Left: each seed's pair joined by a "
            "grey line, mean ± standard error over the paired seeds (those where both criteria kept a "
            "disagreement token). Right: per-seed difference predictive − ratio, sorted. Seeds where a criterion "
            "kept no disagreement token have no rate and are left out of both."
        ),
        study=ctx.study,
        selection_rule=_selection(ctx),
    )
    left, right = Panel(title="unsafe-keep rate per seed"), Panel(title="predictive − ratio per seed")
    result.panels = [left, right]
    headline = ctx.summary.headline if ctx.summary is not None else None
    if ctx.study is None:
        left.note = right.note = NO_STUDY
    elif headline is None or headline.unsafe_keep.n_paired == 0:
        left.note = right.note = "no seed has both unsafe-keep rates"
    else:
        pair = result.stats = headline.unsafe_keep
        left.series = [
            Series("ratio", pair.seeds, pair.ratio, yerr=np.array([pair.ratio_mean.value()[1]])),
            Series("predictive", pair.seeds, pair.pred, yerr=np.array([pair.pred_mean.value()[1]])),
        ]
        diff = pair.pred - pair.ratio
        order = np.argsort(diff, kind="stable")
        right.series = [Series("difference", pair.seeds[order], diff[order])]
        result.has_data = True
    if ctx.draw:
        result.files = _draw_fig3(ctx, result)
    return result


def _draw_fig3(ctx: ReportContext, result: ArtefactResult) -> list:
    fig, (ax, bx) = new_figure(1, 2, panel_w=3.6, panel_h=3.0)
    left, right = result.panels
    for axis, panel in ((ax, left), (bx, right)):
        axis.set_title(panel.title)
        if not panel.series:
            empty_panel(axis, panel.note or "no data")
    if left.series:
        pair: stats.Paired = result.stats
        r, p = 100 * pair.ratio, 100 * pair.pred
        for a, b in zip(r, p):
            ax.plot([0, 1], [a, b], color=GREY, alpha=0.35, linewidth=0.7)
        for x, vals, crit, m in ((0, r, "ratio", pair.ratio_mean), (1, p, "predictive", pair.pred_mean)):
            colour = CRITERION_STYLE[crit][1]
            mean, se = m.value()
            at = x + (-0.18 if x == 0 else 0.18)
            ax.scatter(np.full(len(vals), x), vals, s=10, color=colour, alpha=0.6, zorder=3)
            ax.errorbar(
                [at],
                [100 * mean],
                yerr=[100 * se if np.isfinite(se) else 0],
                fmt="D",
                color=colour,
                capsize=4,
                markersize=6,
                zorder=4,
            )
            ax.annotate(
                _mean_label(m),
                (at, 100 * mean),
                xytext=(-10 if x == 0 else 10, 0),
                textcoords="offset points",
                fontsize=7,
                color=colour,
                va="center",
                ha="right" if x == 0 else "left",
            )
        ax.set_xticks([0, 1], [CRITERION_STYLE["ratio"][0], CRITERION_STYLE["predictive"][0]])
        ax.set_xlim(-0.6, 1.6)
        ax.set_ylabel("unsafe-keep rate (%)")
        d = 100 * right.series[0].y
        colours = [OKABE_ITO["blue"] if v < 0 else OKABE_ITO["vermillion"] if v > 0 else GREY for v in d]
        bx.bar(np.arange(len(d)), d, color=colours, width=0.85)
        bx.axhline(0, color="black", linewidth=0.8)
        bx.set_xlabel("seeds, sorted by difference")
        bx.set_ylabel("predictive − ratio (percentage points)")
        bx.set_xticks([])
        bx.text(
            0.02,
            0.97,
            f"predictive lower on {pair.n_lower} of {pair.n_paired} paired seeds",
            transform=bx.transAxes,
            va="top",
            fontsize=8,
        )
    suptitle(fig, result.title, _study_title(ctx))
    fig.tight_layout()
    return save_figure(fig, ctx.out, result.name, ctx.formats)


@figure("fig4_corrective", "Figure 4: pooled corrective fraction per criterion", source="study")
def fig4_corrective(ctx: ReportContext) -> ArtefactResult:
    result = ArtefactResult(
        name="fig4_corrective",
        command=STUDY_COMMAND,
        title="Figure 4: corrective fraction of kept disagreement tokens, pooled over seeds",
        caption=(
            "Pooled over all seeds: among disagreement tokens a criterion keeps, the fraction whose divergence "
            "shrank after one optimiser step with that criterion's mask (ΔD < 0), with 95% Wilson intervals. "
            "The ratio criterion is judged on its disagreement set with the aggregated-tail predictive criterion; "
            "each predictive criterion on its own disagreement set with the ratio criterion. Pooled, so not the "
            "complement of Figure 3's per-seed mean. Counts from the per-seed rows (token_level_seeds)."
        ),
        study=ctx.study,
        selection_rule=_selection(ctx),
    )
    panel = Panel(title="corrective fraction (pooled)")
    result.panels = [panel]
    if ctx.summary is None:
        panel.note = NO_STUDY
    else:
        pooled = result.stats = ctx.summary.corrective
        crits = [c for c in stats.CRITERIA if c in pooled]
        if not crits:
            panel.note = "no kept disagreement tokens in this study"
        else:
            frac = np.array([pooled[c].fraction for c in crits])
            lo_hi = np.array([pooled[c].interval for c in crits])
            panel.series = [
                Series(
                    "corrective fraction",
                    np.array(crits, dtype=object),
                    frac,
                    yerr=np.stack([frac - lo_hi[:, 0], lo_hi[:, 1] - frac]),
                )
            ]
            result.has_data = True
    if ctx.draw:
        result.files = _draw_fig4(ctx, result)
    return result


def _draw_fig4(ctx: ReportContext, result: ArtefactResult) -> list:
    fig, (ax,) = new_figure(1, 1, panel_w=6.0, panel_h=3.2)
    panel = result.panels[0]
    ax.set_title(panel.title)
    if not panel.series:
        empty_panel(ax, panel.note or "no data")
    else:
        s = panel.series[0]
        crits = list(s.x)
        xs = np.arange(len(crits))
        ax.bar(
            xs,
            100 * s.y,
            yerr=100 * s.yerr,
            capsize=4,
            width=0.6,
            color=[CRITERION_STYLE[c][1] for c in crits],
            error_kw={"elinewidth": 1},
        )
        pooled: dict[str, stats.Pooled] = result.stats
        for x, c, v in zip(xs, crits, s.y):
            ax.text(
                x,
                2,
                f"{100 * v:.1f}%\n{pooled[c].k}/{pooled[c].n}",
                ha="center",
                va="bottom",
                fontsize=7,
                color="white",
            )
        ax.set_xticks(xs, [CRITERION_STYLE[c][0].replace(", ", ",\n") for c in crits])
        ax.set_ylim(0, 100)
        ax.set_ylabel("corrective fraction (%)")
    suptitle(fig, result.title, _study_title(ctx))
    fig.tight_layout()
    return save_figure(fig, ctx.out, result.name, ctx.formats)


# ------------------------------------------------------------------------------------- fig9: drift grid

NO_GRID = f"no drift grid in the database\n({DRIFT_COMMAND})"
PRECISION_MARKERS: tuple[str, ...] = ("o", "s", "^", "D", "v")
#: fig9's panels: title -> the drift point's statistic of each series ("" when the panel has one per precision)
FIG9_PANELS: dict[str, dict[str, str]] = {
    "disagreement share of outside tokens (pooled)": {"": "disagreement"},
    "unsafe-keep rate (mean over paired seeds)": {
        "predictive": "unsafe_keep_predictive",
        "ratio": "unsafe_keep_ratio",
    },
    "corrective fraction (pooled)": {"predictive": "corrective_predictive", "ratio": "corrective_ratio"},
}
#: the paper's value of each statistic (analysis.token_level.summary.stats owns the numbers)
_PAPER_VALUE = {
    "disagreement": stats.paper_disagreement_share,
    "unsafe_keep_predictive": lambda: stats.PAPER_TOKEN_LEVEL["unsafe_keep_predictive"],
    "unsafe_keep_ratio": lambda: stats.PAPER_TOKEN_LEVEL["unsafe_keep_ratio"],
    "corrective_predictive": lambda: stats.PAPER_TOKEN_LEVEL["corrective_predictive"],
    "corrective_ratio": lambda: stats.PAPER_TOKEN_LEVEL["corrective_ratio"],
}


def _statistic(point: stats.DriftPoint, name: str) -> float:
    value = getattr(point, name)
    out = value.fraction if isinstance(value, stats.Pooled) else value.mean
    return float("nan") if out is None else float(out)


def _series_label(precision: str, part: str) -> str:
    return f"{labels.precision_label(precision)}: {part}" if part else labels.precision_label(precision)


@figure(
    "fig9_drift_sensitivity",
    "Figure 9: the token-level statistics against the measured drift",
    source="study",
)
def fig9_drift_sensitivity(ctx: ReportContext) -> ArtefactResult:
    lo, hi = stats.paper_share_outside()
    result = ArtefactResult(
        name="fig9_drift_sensitivity",
        command=DRIFT_COMMAND,
        title="Figure 9 (beyond the paper): token-level statistics against the share of tokens outside the trust region",
        caption=(
            f"Each point is one cell of the drift grid ({DRIFT_COMMAND}: lr × staleness, one marker and "
            "line per precision), a token-level study of its own; x is its measured share of response tokens "
            "outside the trust region (D_pre > δ), pooled over its seeds, log scale. Disagreement share: "
            "disagreement tokens (aggregated-tail predictive vs ratio) / outside tokens, pooled; unsafe-keep: mean "
            "over the paired seeds; corrective: pooled over seeds. Cells with no outside token cannot sit on a log "
            "axis and are left out (counted in the panel). The paper's point (Qwen3, 61 seeds) is its reported "
            "value of each statistic drawn across a grey band of x: the paper does not report its share outside, "
            f"only 1,435 outside tokens per 1,024 responses; the band is 1,435 / (1,024 × L) = {100 * lo:.3f}%–"
            f"{100 * hi:.3f}% for an ASSUMED mean response length L of {stats.PAPER_RESPONSE_LENGTHS[1]:,}–"
            f"{stats.PAPER_RESPONSE_LENGTHS[0]:,} tokens."
        ),
        study=None,
        selection_rule="the drift grid stored last (token_level_grid)",
    )
    result.panels = [Panel(title=t) for t in FIG9_PANELS]
    cells = grid_cells(ctx.con)
    if cells.height == 0:
        for p in result.panels:
            p.note = NO_GRID
    else:
        result.selection_rule = (
            f"drift grid {cells['grid_name'][0]} {cells['grid_id'][0]} (the one stored last)"
        )
        points = [
            (row["precision"], stats.drift_point(data.seed_rows(ctx.con, row["study_id"])))
            for row in cells.iter_rows(named=True)
        ]
        result.stats = points
        precisions = list(dict.fromkeys(p for p, _ in points))
        for panel, parts in zip(result.panels, FIG9_PANELS.values()):
            for prec in precisions:
                pts = [pt for p, pt in points if p == prec]
                x = np.array([pt.share_outside.fraction or 0.0 for pt in pts])
                keep = x > 0
                order = np.argsort(x[keep], kind="stable")
                for part, name in parts.items():
                    y = np.array([_statistic(pt, name) for pt in pts])[keep][order]
                    panel.series.append(Series(_series_label(prec, part), x[keep][order], y, method=name))
                dropped = int((~keep).sum())
                if dropped:
                    panel.note = (panel.note + "; " if panel.note else "") + (
                        f"{labels.precision_label(prec)}: {dropped} cell(s) with no outside token"
                    )
            for part, name in parts.items():
                panel.series.append(
                    Series(
                        f"{stats.PAPER_LABEL}{': ' + part if part else ''}",
                        np.array([lo, hi]),
                        np.full(2, _PAPER_VALUE[name]()),
                        method=name,
                    )
                )
        result.has_data = any(s.x.size for s in result.panels[0].series[: len(precisions)])
    if ctx.draw:
        result.files = _draw_fig9(ctx, result)
    return result


def _draw_fig9(ctx: ReportContext, result: ArtefactResult) -> list:
    fig, axes = new_figure(1, len(result.panels), panel_w=3.9, panel_h=3.4)
    lo, hi = stats.paper_share_outside()
    precisions: list[str] = []
    for ax, panel in zip(axes, result.panels):
        ax.set_title(panel.title, fontsize=8)
        if not panel.series:
            empty_panel(ax, panel.note or "no data")
            continue
        ax.axvspan(100 * lo, 100 * hi, color=GREY, alpha=0.18, linewidth=0)
        for s in panel.series:
            is_paper = s.label.startswith(stats.PAPER_LABEL)
            crit = "ratio" if s.label.endswith("ratio") else "predictive"
            colour = CRITERION_STYLE[crit][1] if s.label.endswith(("predictive", "ratio")) else "black"
            if is_paper:
                ax.plot(100 * s.x, 100 * s.y, color=colour, linewidth=3, alpha=0.6, solid_capstyle="butt")
                mid = 100 * np.sqrt(lo * hi)
                ax.plot([mid], [100 * s.y[0]], marker="*", color=colour, markersize=11, linestyle="")
                continue
            prec = s.label.split(":")[0]
            if prec not in precisions:
                precisions.append(prec)
            marker = PRECISION_MARKERS[precisions.index(prec) % len(PRECISION_MARKERS)]
            style = "--" if crit == "ratio" and s.label.endswith("ratio") else "-"
            ax.plot(
                100 * s.x,
                100 * s.y,
                marker=marker,
                linestyle=style,
                color=colour,
                markersize=4,
                linewidth=0.9,
                alpha=0.85,
                label=s.label,
            )
        ax.set_xscale("log")
        ax.set_xlabel("tokens outside the trust region (% of response tokens)", fontsize=7)
        ax.set_ylabel("%")
        ys = np.concatenate([100 * x.y for x in panel.series])
        top = float(np.nanmax(ys)) if np.isfinite(ys).any() else 100.0
        ax.set_ylim(0, 100 if top > 30 else 1.25 * top)
        if panel.note:
            ax.text(0.02, 0.97, panel.note, transform=ax.transAxes, va="top", fontsize=6)
    handles: dict[str, object] = {}
    for ax in axes:
        for line in ax.get_lines():
            lab = line.get_label()
            if not lab.startswith("_") and lab not in handles:
                handles[lab] = line
    handles[
        f"{stats.PAPER_LABEL}: reported value (★), over the band of x it implies (assumed response length)"
    ] = Line2D([0], [0], marker="*", color="black", linestyle="", markersize=9)
    handles["band: paper's share outside, 1,435 / (1,024 × L), L assumed"] = Patch(color=GREY, alpha=0.18)
    fig.subplots_adjust(top=0.8, bottom=0.36, wspace=0.28)
    legend_below(fig, handles, ncol=3)
    suptitle(fig, result.title, f"{result.selection_rule}; CPU stand-in with emulated precision vs the paper")
    return save_figure(fig, ctx.out, result.name, ctx.formats)
