"""Token-level figures (3, 4): unsafe-keep rates per seed and pooled corrective fractions, as the study's stats say."""

from __future__ import annotations

import numpy as np

from analysis.token_level import stats
from reports.artefact import ArtefactResult, Panel, ReportContext, Series, figure
from reports.figures.draw import empty_panel, new_figure, save_figure, suptitle
from reports.style import CRITERION_STYLE, GREY, OKABE_ITO

NO_STUDY = "no token-level study in the database\n(python -m analysis token_level)"


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
