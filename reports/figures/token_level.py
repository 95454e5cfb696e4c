"""Token-level figures: unsafe-keep rates per seed (3), pooled corrective fractions (4), each beside both criteria
judged on the same tokens; and the statistics against the measured drift over the drift grid (9, 10; beyond the
paper), as the study's stats say."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Any

import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from analysis.store.token_level_tables import grid_cells
from analysis.token_columns import CRITERIA, HEADLINE, RATIO
from analysis.token_level.summary import study_stats as stats
from reports import labels, queries, same_tokens
from reports.artefact import (
    DRIFT_COMMAND,
    STUDY_COMMAND,
    ArtefactResult,
    Panel,
    ReportContext,
    Series,
)
from reports.cells import interval_caption
from reports.figures.draw import (
    LEGEND_ROW_IN,
    clear_of,
    figure,
    fit_width,
    keep_inside,
    legend_below,
    legend_rows,
    new_figure,
    panel_axes,
    suptitle,
    wrap_lines,
)
from reports.style import CRITERION_STYLE, GREY, OKABE_ITO

NO_STUDY = f"no token-level study in the database\n({STUDY_COMMAND})"


def _study_title(result: ArtefactResult) -> str:
    return f"this database: {result.study.describe()}; {result.selection_rule}" if result.study else "no study"


def _mean_label(m: stats.MeanSE) -> str:
    """A mean as the statistics returned it, on three lines: value, standard error, the seeds it is over."""
    mean, se = m.value()
    spread = f"\n± {100 * se:.1f} SE" if m.se is not None else ""
    return f"{100 * mean:.1f}%{spread}\n(n = {m.n} {m.over})"


#: the panels drawn as the paper defines its statistics: each criterion on the disagreement tokens it keeps
PAPER_DEFINITION = "paper's definition (different token sets per criterion)"
#: the panels of both criteria judged on the same tokens (docs/math.md §5.1)
SAME_TOKENS = f"same tokens: disagreement set, against the own update ({stats.OWN_UPDATE})"
SAME_TOKENS_CAPTION = (
    "Beyond the paper (docs/math.md §5.1): both criteria judged on the same tokens, the disagreement set of the "
    f"ratio and aggregated-tail predictive criteria, against each token's own update ({stats.OWN_UPDATE} > 0: "
    "keeping the token's update raises its D, to first order through the network). A criterion is right when it "
    "drops exactly the tokens whose own update raises D; balanced accuracy is the mean of the share of rising "
    "tokens dropped and of falling tokens kept, so the constant predictor (one decision for every token) scores "
    "50%. Pooled values carry 95% seed-cluster bootstrap intervals (seeds resampled), not Wilson intervals. On "
    "the disagreement set the two criteria decide oppositely on every token, so their balanced accuracies sum to "
    "100%."
)


def _estimate_label(e: stats.Estimate, extra: str = "") -> str:
    """A pooled rate on two lines: value, then its interval (as ``stats.Estimate.pct`` prints them)."""
    value, _, interval = e.pct().partition(" ")
    return f"{value}\n{interval}{extra}" if interval else f"{value}{extra}"


def _paired_dots(
    ax, values: dict[str, np.ndarray], centre: dict[str, tuple[float, float, float]], notes: dict[str, str]
) -> list:
    """Each seed's value of both criteria joined by a grey line, and beside them a summary with its interval
    (percent: ``centre`` is value, low, high; ``notes`` the summary's label); returns the summary labels."""
    texts = []
    for a, b in zip(values[RATIO], values[HEADLINE]):
        ax.plot([0, 1], [a, b], color=GREY, alpha=0.35, linewidth=0.7)
    for x, crit in enumerate(same_tokens.PAIR):
        colour = CRITERION_STYLE[crit][1]
        at = -0.2 if x == 0 else 1.2
        ax.scatter(np.full(len(values[crit]), x), values[crit], s=10, color=colour, alpha=0.6, zorder=3)
        mid, lo, hi = centre[crit]
        if not np.isfinite(mid):
            continue
        _draw_intervals(ax, [at], [lo], [hi], colour)
        ax.plot([at], [mid], marker="D", color=colour, markersize=6, linestyle="", zorder=4)
        texts.append(
            ax.annotate(
                notes[crit],
                (at, mid),
                xytext=(-10 if x == 0 else 10, 0),
                textcoords="offset points",
                fontsize=7,
                color=colour,
                va="center",
                ha="right" if x == 0 else "left",
            )
        )
    ax.set_xticks([0, 1], _tick_labels(same_tokens.PAIR))
    ax.set_xlim(-1.3, 2.3)
    return texts


def _tick_labels(crits) -> list[str]:
    return [CRITERION_STYLE[c][0].replace(", ", ",\n") for c in crits]


def _sorted_bars(ax, diff_pp: np.ndarray, good: str, text: str):
    """Per-seed differences predictive − ratio (percentage points), sorted; coloured by which criterion each seed
    favours (``good`` "negative": a lower value favours the predictive criterion); returns the text above."""
    better = diff_pp < 0 if good == "negative" else diff_pp > 0
    worse = diff_pp > 0 if good == "negative" else diff_pp < 0
    colours = [
        OKABE_ITO["blue"] if b else OKABE_ITO["vermillion"] if w else GREY for b, w in zip(better, worse)
    ]
    ax.bar(np.arange(len(diff_pp)), diff_pp, color=colours, width=0.85)
    ax.axhline(0, color="black", linewidth=0.8)
    low, high = min(0.0, float(np.min(diff_pp, initial=0.0))), max(0.0, float(np.max(diff_pp, initial=0.0)))
    span = (high - low) or 1.0
    lines = text.count("\n") + 1
    ax.set_ylim(low - 0.05 * span, high + (0.12 + 0.1 * lines) * span)  # room for the text above the bars
    ax.set_xlabel("seeds, sorted by difference")
    ax.set_ylabel("predictive − ratio (percentage points)")
    ax.set_xticks([])
    return ax.text(0.02, 0.97, text, transform=ax.transAxes, va="top", fontsize=7)


def _pair_row(ax, bx, values, centre, notes, ylabel: str, diff_pp: np.ndarray, good: str, text: str) -> list:
    """A row of Figure 3: each seed's pair with the summaries (left), the sorted differences (right); the
    placements of their texts (_finish)."""
    labels = _paired_dots(ax, values, centre, notes)
    ax.set_ylabel(ylabel)
    return [(ax, labels, None), (bx, [], _sorted_bars(bx, diff_pp, good, text))]


def _study_result(
    ctx: ReportContext, title: str, caption: str, intervals: str, panels: list[Panel], same_panels: list[Panel]
) -> tuple[ArtefactResult, str, same_tokens.SameTokens | None]:
    """A figure of the chosen study with its panels, its caption ending with where the study was measured and its
    intervals; that place ("" without a study) and the study's same-token judgement (the same-token panels say
    why there is none)."""
    result = ArtefactResult(
        command=STUDY_COMMAND, title=title, caption=caption, study=ctx.study, panels=panels,
        selection_rule="no token-level study",
    )
    if ctx.study is None:
        result.caption += " " + intervals
        for p in same_panels:
            p.note = NO_STUDY
        return result, "", None
    study = ctx.study.study_id
    where = "measured " + same_tokens.measured(ctx.con, study)
    result.caption += f" This study was {where}. {intervals}"
    tokens = stats.share_outside(queries.seed_rows(ctx.con, study)).n  # the units its numbers are over
    result.selection_rule = f"study {study}: {ctx.study.n_seeds} seeds, {tokens:,} response tokens"
    same = same_tokens.same_tokens(ctx.con, study)
    if same is None:
        note = "\n".join(textwrap.wrap(same_tokens.not_judged(f"study {study}"), 48))  # a panel's width
        for p in same_panels:
            p.note = note
    return result, where, same


@figure(
    "Figure 3: unsafe-keep rate per seed, ratio vs predictive, beside both criteria on the same tokens", "study"
)
def fig3_unsafe_keep(ctx: ReportContext) -> ArtefactResult:
    left = Panel(title=f"{PAPER_DEFINITION}:\nunsafe-keep rate per seed")
    right = Panel(title=f"{PAPER_DEFINITION}:\npredictive − ratio per seed")
    same_left = Panel(title=f"{SAME_TOKENS}:\nbalanced accuracy per seed")
    same_right = Panel(title=f"{SAME_TOKENS}:\nbalanced accuracy, predictive − ratio per seed")
    result, where, same = _study_result(
        ctx,
        "Figure 3: unsafe-keep rate on the disagreement set, and both criteria judged on the same tokens",
        (
            f"Top, the {PAPER_DEFINITION}: per seed, among disagreement tokens (outside the trust region, where "
            "the ratio and predictive (aggregated-tail) criteria decide differently) that a criterion keeps, the "
            "fraction whose divergence grew after one optimiser step with that criterion's mask (ΔD > 0). Left: "
            "each seed's pair joined by a grey line, mean ± standard error over the paired seeds (those where both "
            "criteria kept a disagreement token). Right: per-seed difference predictive − ratio, sorted. Seeds "
            "where a criterion kept no disagreement token have no rate and are left out of both. Bottom: "
            + SAME_TOKENS_CAPTION
            + " Left: each seed's balanced accuracy of both criteria joined by a grey line (seeds where both are "
            "defined), the pooled value with its interval. Right: the per-seed difference predictive − ratio, "
            "sorted, with the seeds where the predictive criterion is higher / tied / lower and the two-sided sign "
            "and Wilcoxon signed-rank tests."
        ),
        interval_caption("se", "pooled", "seeds"),
        [left, right, same_left, same_right],
        [same_left, same_right],
    )
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
        right.series = [_sorted_difference(pair.seeds, pair.pred - pair.ratio)]
        result.has_data = True
    if same is not None:
        both = same.paired
        seeds = same.seeds[both]
        per_seed = {c: same.balanced[c][both] for c in same_tokens.PAIR}
        same_left.series = [Series(c, seeds, per_seed[c], method=c) for c in same_tokens.PAIR]
        same_left.series += _pooled_series(same, np.array([0.0, 1.0]))
        same_right.series = [_sorted_difference(seeds, per_seed["predictive"] - per_seed["ratio"])]
        if not both.any():
            same_left.note = same_right.note = "no seed has both balanced accuracies"
        result.has_data = True
    if ctx.draw:
        result.drawn = _draw_fig3(result, same, where)
    return result


def _sorted_difference(seeds: np.ndarray, diff: np.ndarray) -> Series:
    order = np.argsort(diff, kind="stable")
    return Series("difference", seeds[order], diff[order])


def _pooled_series(same: same_tokens.SameTokens, constant_x: np.ndarray) -> list[Series]:
    """Both criteria's pooled balanced accuracy with its seed-cluster interval (NaN where there is none), then the
    constant predictor's at ``constant_x`` where there is one."""
    est = _estimates(same)
    values = [(est[c].value, est[c].lo, est[c].hi) for c in same_tokens.PAIR]
    pooled = _with_interval("pooled", np.array(same_tokens.PAIR, dtype=object), values)
    if same.constant_balanced is None:
        return [pooled]
    return [pooled, Series("constant predictor", constant_x, np.full(2, same.constant_balanced))]


def _with_interval(
    label: str, x: np.ndarray, values: list[tuple[Any, Any, Any]], method: str | None = None
) -> Series:
    """(value, low, high) at each x as a series with its interval (NaN where a bound is missing)."""
    v = np.array([[np.nan if b is None else b for b in t] for t in values], dtype=float).reshape(-1, 3)
    y, lo, hi = v[:, 0], v[:, 1], v[:, 2]
    return Series(label, x, y, yerr=np.stack([y - lo, hi - y]), method=method)


def _estimates(same: same_tokens.SameTokens) -> dict[str, stats.Estimate]:
    p = same.point
    empty = stats.Estimate(None, None, None)
    return {RATIO: p.balanced_ratio or empty, HEADLINE: p.balanced_predictive or empty}


def _p_value(p: float | None) -> str:
    return "—" if p is None else f"{p:.3g}"


def _paired_text(same: same_tokens.SameTokens) -> str:
    """The paired difference as the figures print it: seeds higher / tied / lower, mean Δ, the two tests."""
    d = same.point.balanced_difference
    if d is None:
        return "no seed has both balanced accuracies"
    lines = [
        f"predictive higher on {d.n_higher}, tied {d.n_tied}, lower {d.n_lower} of {d.n_seeds} seeds",
        f"mean Δ {d.pp()} (95% t)",
        f"sign test p = {_p_value(d.sign_p)}, Wilcoxon p = {_p_value(d.wilcoxon_p)}",
    ]
    if same.paired_note:
        lines.extend(textwrap.wrap(same.paired_note, 60))
    return "\n".join(lines)


def _constant_line(ax, value: float | None) -> None:
    """The constant predictor's balanced accuracy: a dotted line, named under the axis, not over the data."""
    if value is not None:
        ax.axhline(100 * value, color="black", linestyle=":", linewidth=1)
        ax.set_xlabel(f"dotted line: constant predictor ({100 * value:.0f}%)", fontsize=7)


Placement = tuple[Any, list, Any]  # (axes, labels in data coordinates, text at the top or None): _finish


def _draw_same_per_seed(
    ax, bx, result: ArtefactResult, same: same_tokens.SameTokens | None
) -> list[Placement]:
    """Fig 3's bottom row: balanced accuracy per seed, paired, with the pooled values; sorted differences."""
    panel, diff_panel = result.panels[2], result.panels[3]
    empty = same is None or not panel.series or bool(panel.note)
    for axis, p in ((ax, panel), (bx, diff_panel)):
        panel_axes(axis, p, empty=empty, fontsize=8)
    if empty:
        return []
    values = {c: 100 * panel.get(c).y for c in same_tokens.PAIR}
    est = _estimates(same)
    centre = {
        c: tuple(100 * (np.nan if v is None else v) for v in (est[c].value, est[c].lo, est[c].hi))
        for c in same_tokens.PAIR
    }
    n = same.point.judged_disagree or 0
    notes = {c: _estimate_label(est[c], f"\n(pooled, {n:,} tokens)") for c in same_tokens.PAIR}
    placements = _pair_row(
        ax, bx, values, centre, notes, "balanced accuracy (%)", 100 * diff_panel.series[0].y, "positive",
        _paired_text(same),
    )
    _constant_line(ax, same.constant_balanced)
    ax.set_ylim(-5, 105)
    return placements


def _draw_fig3(result: ArtefactResult, same: same_tokens.SameTokens | None, where: str) -> Figure:
    fig, (ax, bx, cx, dx) = new_figure(2, 2, panel_w=4.2, panel_h=3.3)
    left, right = result.panels[:2]
    placements: list[Placement] = []
    for axis, panel in ((ax, left), (bx, right)):
        panel_axes(axis, panel, fontsize=8)
    if left.series:
        pair: stats.Paired = result.stats
        means = {RATIO: pair.ratio_mean, HEADLINE: pair.pred_mean}
        centre = {}
        for crit, m in means.items():
            mean, se = m.value()
            se = se if np.isfinite(se) else 0.0
            centre[crit] = (100 * mean, 100 * (mean - se), 100 * (mean + se))
        placements += _pair_row(
            ax, bx, {RATIO: 100 * pair.ratio, HEADLINE: 100 * pair.pred}, centre,
            {c: _mean_label(m) for c, m in means.items()}, "unsafe-keep rate (%)", 100 * right.series[0].y,
            "negative", f"predictive lower on {pair.n_lower} of {pair.n_paired} paired seeds",
        )
    return _finish(fig, result, where, placements + _draw_same_per_seed(cx, dx, result, same))


def _finish(fig: Figure, result: ArtefactResult, where: str, placements: list[Placement]) -> Figure:
    """A study figure's title and layout; then, the layout final, labels in data coordinates kept inside their
    axes, and a text at the top wrapped to the axes' width and lifted clear of the bars and the other labels (no
    text over data, none past the axis)."""
    suptitle(fig, result.title, _study_title(result), where)
    fig.tight_layout()
    for ax, inside, top in placements:
        keep_inside(ax, inside)
        if top is not None:
            fit_width(ax, top)
            clear_of(ax, top, [*ax.patches, *inside])
    return fig


@figure(
    "Figure 4: pooled corrective fraction per criterion, beside both criteria on the same tokens", "study"
)
def fig4_corrective(ctx: ReportContext) -> ArtefactResult:
    panel = Panel(title=f"{PAPER_DEFINITION}:\ncorrective fraction (pooled)")
    same_panel = Panel(title=f"{SAME_TOKENS}:\nbalanced accuracy (pooled)")
    result, where, same = _study_result(
        ctx,
        "Figure 4: corrective fraction of kept disagreement tokens, pooled over seeds, and both criteria judged on "
        "the same tokens",
        (
            f"Left, the {PAPER_DEFINITION}: pooled over all seeds, among disagreement tokens a criterion keeps, "
            "the fraction whose divergence shrank after one optimiser step with that criterion's mask (ΔD < 0), "
            "with 95% Wilson intervals. The ratio criterion is judged on its disagreement set with the "
            "aggregated-tail predictive criterion; each predictive criterion on its own disagreement set with the "
            "ratio criterion. Pooled, so not the complement of Figure 3's per-seed mean. Counts from the per-seed "
            "rows (token_level_seeds). Right: "
            + SAME_TOKENS_CAPTION
            + " Bars: each criterion's balanced accuracy pooled over seeds (token_level_criteria); dotted line: "
            "the constant predictor."
        ),
        interval_caption("wilson", "pooled"),
        [panel, same_panel],
        [same_panel],
    )
    if ctx.summary is None:
        panel.note = NO_STUDY
    else:
        pooled = result.stats = ctx.summary.corrective
        crits = [c for c in CRITERIA if c in pooled]
        if not crits:
            panel.note = "no kept disagreement tokens in this study"
        else:
            values = [(pooled[c].fraction, *pooled[c].interval) for c in crits]
            panel.series = [_with_interval("corrective fraction", np.array(crits, dtype=object), values)]
            result.has_data = True
    if same is not None:
        same_panel.series = _pooled_series(same, np.array(same_tokens.PAIR, dtype=object))
        result.has_data = True
    if ctx.draw:
        result.drawn = _draw_fig4(result, same, where)
    return result


def _draw_fig4(result: ArtefactResult, same: same_tokens.SameTokens | None, where: str) -> Figure:
    fig, (ax, bx) = new_figure(1, 2, panel_w=4.6, panel_h=3.4)
    panel, same_panel = result.panels
    ax_labels: list = []
    bx_labels: list = []
    bx_top = None
    for axis, p in ((ax, panel), (bx, same_panel)):
        panel_axes(axis, p, fontsize=8)
    if panel.series:
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
        ax_labels = _bar_labels(
            ax,
            xs,
            [100 * (v + np.nan_to_num(up)) + 2 for v, up in zip(s.y, s.yerr[1])],
            [f"{100 * v:.1f}%\n{pooled[c].k}/{pooled[c].n}" for c, v in zip(crits, s.y)],
        )
        ax.set_xticks(xs, _tick_labels(crits))
        ax.set_ylim(0, 100)
        ax.set_ylabel("corrective fraction (%)")
    if same is not None and same_panel.series:
        s = same_panel.get("pooled")
        xs = np.arange(len(s.x))
        bx.bar(xs, np.nan_to_num(100 * s.y), width=0.6, color=[CRITERION_STYLE[c][1] for c in s.x])
        _draw_intervals(bx, xs, 100 * s.y - 100 * s.yerr[0], 100 * s.y + 100 * s.yerr[1], "black")
        est = _estimates(same)
        bx_labels = _bar_labels(
            bx,
            xs,
            [np.nan_to_num(y + b, nan=np.nan_to_num(y)) + 2 for y, b in zip(100 * s.y, 100 * s.yerr[1])],
            [_estimate_label(est[c]) for c in s.x],
        )
        _constant_line(bx, same.constant_balanced)
        n, k = same.point.judged_disagree or 0, same.point.n_seeds
        bx_top = bx.text(
            0.02,
            0.97,
            f"{n:,} disagreement tokens judged, {k} seeds",
            transform=bx.transAxes,
            va="top",
            fontsize=7,
        )
        bx.set_xticks(xs, _tick_labels(s.x))
        bx.set_ylim(0, 105)
        bx.set_ylabel("balanced accuracy (%)")
    return _finish(fig, result, where, [(ax, ax_labels, None), (bx, bx_labels, bx_top)])


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
#: fig9's panel of the paired difference on the same tokens (its series: each cell's ``balanced_difference``)
DIFFERENCE_PANEL = (
    "same tokens, against the own update:\nbalanced accuracy, predictive − ratio (mean over seeds)"
)


def _paper_value(name: str) -> float:
    """The paper's value of a drift point's statistic (analysis.token_level.summary.study_stats owns the numbers)."""
    return stats.paper_disagreement_share() if name == "disagreement" else stats.PAPER_TOKEN_LEVEL[name]


@dataclass(frozen=True)
class GridCell:
    """One cell of the drift grid as the drift figures read it: its row of token_level_grid, its study's drift
    point (with the stored judgement) and its same-token judgement (None when the study has none)."""

    row: dict[str, Any]
    point: stats.DriftPoint
    same: same_tokens.SameTokens | None

    @property
    def precision(self) -> str:
        return str(self.row["precision"])

    @property
    def share(self) -> float:
        """Its share of response tokens outside the trust region (0 without any)."""
        return self.point.share_outside.fraction or 0.0

    @property
    def name(self) -> str:
        """ "BF16, lr 0.0003, 7 stale updates" """
        r = self.row
        return f"{labels.precision_label(r['precision'])}, lr {r['lr']:g}, {r['staleness']} stale updates"


def grid(ctx: ReportContext, result: ArtefactResult) -> list[GridCell]:
    """The cells of the drift grid stored last, its selection rule the result's; without a grid, none and every
    panel says so."""
    cells = grid_cells(ctx.con)
    if cells.height == 0:
        result.selection_rule = "the drift grid stored last (token_level_grid)"
        for p in result.panels:
            p.note = NO_GRID
        return []
    out = []
    for row in cells.iter_rows(named=True):
        same = same_tokens.same_tokens(ctx.con, row["study_id"])
        point = same.point if same is not None else same_tokens.drift_point(ctx.con, row["study_id"])
        out.append(GridCell(row, point, same))
    result.selection_rule = f"drift grid {cells['grid_name'][0]} {cells['grid_id'][0]} (the one stored last)"
    return out


def _statistic(point: stats.DriftPoint, name: str) -> float:
    value = getattr(point, name)
    out = value.fraction if isinstance(value, stats.Pooled) else value.mean
    return float("nan") if out is None else float(out)


def _series_label(precision: str, part: str) -> str:
    return f"{labels.precision_label(precision)}: {part}" if part else labels.precision_label(precision)


def _interval_series(
    label: str, cells: list[GridCell], values: list[tuple[Any, Any, Any]], method: str
) -> Series:
    """Cells' (value, low, high) against their share outside, ascending; NaN where a bound is missing."""
    x = np.array([c.share for c in cells], dtype=float)
    order = np.argsort(x, kind="stable")
    return _with_interval(label, x[order], [values[i] for i in order], method)


def left_out(cells: list[GridCell], has_value: Any) -> str:
    """Which cells a same-token panel leaves out, and why ("" when none): not judged, no outside token (off the
    log axis), or judged without the statistic (``has_value(cell)`` False: no disagreement token, or one class)."""
    reasons: dict[str, list[str]] = {}
    for c in cells:
        if c.same is None:
            why = f"not judged, its tokens carry no own-update truth ({stats.OWN_UPDATE})"
        elif c.share <= 0:
            why = "no outside token"
        elif not has_value(c):
            why = "no balanced accuracy (disagreement set empty or of one class)"
        else:
            continue
        reasons.setdefault(why, []).append(c.name)
    return "; ".join(f"left out, {why}: {', '.join(names)}" for why, names in reasons.items())


def _has_difference(c: GridCell) -> bool:
    d = c.point.balanced_difference
    return d is not None and d.mean is not None


@figure("Figure 9: the token-level statistics against the measured drift", "study")
def fig9_drift_sensitivity(ctx: ReportContext) -> ArtefactResult:
    lo, hi = stats.paper_share_outside()
    result = ArtefactResult(
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
            f"{stats.PAPER_RESPONSE_LENGTHS[0]:,} tokens. Last panel, beyond the paper (docs/math.md §5.1): both "
            "criteria judged on the same tokens (the disagreement set) against each token's own update "
            f"({stats.OWN_UPDATE}); per cell, the per-seed difference of balanced accuracy predictive − ratio, mean "
            "over the seeds where both are defined with its 95% Student-t interval (the paper has no such number); "
            "cells whose study was not judged are left out and named in the subtitle. Figure 10 draws each "
            f"criterion's balanced accuracy. {interval_caption('seeds')}"
        ),
    )
    result.panels = [Panel(title=t) for t in FIG9_PANELS] + [Panel(title=DIFFERENCE_PANEL)]
    cells = grid(ctx, result)
    if cells:
        result.stats = [(c.precision, c.point) for c in cells]
        precisions = list(dict.fromkeys(c.precision for c in cells))
        for panel, parts in zip(result.panels, FIG9_PANELS.values()):
            for prec in precisions:
                pts = [c.point for c in cells if c.precision == prec]
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
                        np.full(2, _paper_value(name)),
                        method=name,
                    )
                )
        diff = result.panels[-1]
        for prec in precisions:
            shown = [c for c in cells if c.precision == prec and c.share > 0 and _has_difference(c)]
            d = [c.point.balanced_difference for c in shown]
            diff.series.append(
                _interval_series(
                    _series_label(prec, ""), shown, [(e.mean, e.lo, e.hi) for e in d], "balanced_difference"
                )
            )
        diff.text = left_out(cells, _has_difference)
        if not any(s.x.size for s in diff.series):
            diff.note = "no cell judged on the same tokens"
        result.has_data = any(s.x.size for s in result.panels[0].series[: len(precisions)])
    if ctx.draw:
        result.drawn = _draw_fig9(result)
    return result


def _draw_intervals(ax, xs, los, his, colour: str) -> None:
    """At each x a vertical interval from lo to hi with caps (nothing where a bound is missing)."""
    for x, lo, hi in zip(xs, los, his):
        if np.isfinite(lo) and np.isfinite(hi):
            ax.plot([x, x], [lo, hi], color=colour, linewidth=1, marker="_", markersize=7, zorder=2)


def _bar_labels(ax, xs, ys, texts) -> list:
    """A label above each bar's interval, dark on the axes' face."""
    kw = {"ha": "center", "va": "bottom", "fontsize": 7, "color": "black"}
    return [ax.text(x, y, t, **kw) for x, y, t in zip(xs, ys, texts)]


def _drift_line(ax, s: Series, precisions: list[str], colour: str, dashed: bool = False, **kw) -> Line2D:
    """A cell series in percent, marked by its precision (``precisions``: in the order met), with its intervals
    when it has them."""
    prec = s.label.split(":")[0]
    if prec not in precisions:
        precisions.append(prec)
    marker = PRECISION_MARKERS[precisions.index(prec) % len(PRECISION_MARKERS)]
    style = {"markersize": 4, "linewidth": 0.9, "alpha": 0.85, **kw}
    (line,) = ax.plot(100 * s.x, 100 * s.y, marker=marker, linestyle="--" if dashed else "-", color=colour, **style)
    if s.yerr is not None:
        _draw_intervals(ax, 100 * s.x, 100 * (s.y - s.yerr[0]), 100 * (s.y + s.yerr[1]), colour)
    return line


def _draw_difference(ax, panel: Panel, precisions: list[str]) -> None:
    """Fig 9's last panel: each cell's mean paired difference (percentage points) with its t-interval."""
    ax.axhline(0, color="black", linewidth=0.8)
    tops = [1.0]
    for s in panel.series:
        if not s.x.size:
            continue
        _drift_line(ax, s, precisions, "black")
        lo, hi = 100 * (s.y - s.yerr[0]), 100 * (s.y + s.yerr[1])
        tops.append(float(np.nanmax(np.abs(np.concatenate([lo, hi, 100 * s.y])))))
    top = min(105.0, 1.15 * max(tops))  # a difference of two balanced accuracies lies within ±100 points
    ax.set_ylim(-top, top)
    ax.set_ylabel("predictive − ratio (percentage points)", fontsize=7)


def _draw_fig9(result: ArtefactResult) -> Figure:
    fig, axes = new_figure(2, 2, panel_w=4.6, panel_h=3.3)
    lo, hi = stats.paper_share_outside()
    precisions: list[str] = []
    handles: dict[str, object] = {}
    for ax, panel in zip(axes, result.panels):
        if not panel_axes(ax, panel, empty=not any(s.x.size for s in panel.series), fontsize=8):
            continue
        ax.axvspan(100 * lo, 100 * hi, color=GREY, alpha=0.18, linewidth=0)
        ax.set_xscale("log")
        ax.set_xlabel("tokens outside the trust region (% of response tokens)", fontsize=7)
        if panel.note:
            ax.text(0.02, 0.97, panel.note, transform=ax.transAxes, va="top", fontsize=6)
        if panel.title == DIFFERENCE_PANEL:
            _draw_difference(ax, panel, precisions)
            continue
        for s in panel.series:
            is_paper = s.label.startswith(stats.PAPER_LABEL)
            crit = RATIO if s.label.endswith("ratio") else HEADLINE
            colour = CRITERION_STYLE[crit][1] if s.label.endswith(("predictive", "ratio")) else "black"
            if is_paper:
                ax.plot(100 * s.x, 100 * s.y, color=colour, linewidth=3, alpha=0.6, solid_capstyle="butt")
                mid = 100 * np.sqrt(lo * hi)
                ax.plot([mid], [100 * s.y[0]], marker="*", color=colour, markersize=11, linestyle="")
                continue
            handles.setdefault(s.label, _drift_line(ax, s, precisions, colour, crit == RATIO, label=s.label))
        ax.set_ylabel("%")
        ys = np.concatenate([100 * x.y for x in panel.series])
        top = float(np.nanmax(ys)) if np.isfinite(ys).any() else 100.0
        ax.set_ylim(0, 100 if top > 30 else 1.25 * top)
    handles[
        f"{stats.PAPER_LABEL}: reported value (★), over the band of x it implies (assumed response length)"
    ] = Line2D([0], [0], marker="*", color="black", linestyle="", markersize=9)
    handles["band: paper's share outside, 1,435 / (1,024 × L), L assumed"] = Patch(color=GREY, alpha=0.18)
    fig.subplots_adjust(top=0.84, bottom=0.2, wspace=0.28, hspace=0.5)
    legend_below(fig, handles, ncol=3)
    notes = [t for t in (result.panels[-1].text,) if t]
    suptitle(
        fig,
        result.title,
        f"{result.selection_rule}; CPU stand-in with emulated precision vs the paper",
        *notes,
    )
    return fig


# ------------------------------------------------------------------------------- fig10: criteria against drift


def _has_balanced(c: GridCell) -> bool:
    p = c.point
    return all(e is not None and e.value is not None for e in (p.balanced_predictive, p.balanced_ratio))


@figure("Figure 10: both criteria judged on the same tokens against the measured drift", "study")
def fig10_criteria_vs_drift(ctx: ReportContext) -> ArtefactResult:
    lo, hi = stats.paper_share_outside()
    result = ArtefactResult(
        command=DRIFT_COMMAND,
        title="Figure 10 (beyond the paper): both criteria judged on the same tokens against the share of tokens "
        "outside the trust region",
        caption=(
            f"Each point is one cell of the drift grid ({DRIFT_COMMAND}: lr × staleness, one marker per "
            "precision), a token-level study of its own; x is its measured share of response tokens outside the "
            "trust region, pooled over its seeds, log scale. y: each criterion's balanced accuracy on the cell's "
            "disagreement set (the tokens where the ratio and aggregated-tail predictive criteria decide "
            f"differently) against each token's own update ({stats.OWN_UPDATE} > 0: keeping its update raises its "
            "D, to first order through the network; docs/math.md §5.1), pooled over the cell's seeds, with its 95% "
            "seed-cluster bootstrap interval (seeds resampled; a cell of one seed has none). Both criteria are "
            "judged on the same tokens, which decide oppositely on every token of the set, so their balanced "
            "accuracies sum to 100%. Dotted line: the constant predictor (one decision for every token), 50%. "
            "Grey band: the paper's regime, the share outside implied by its 1,435 outside tokens per 1,024 "
            f"responses for an ASSUMED mean response length of {stats.PAPER_RESPONSE_LENGTHS[1]:,}–"
            f"{stats.PAPER_RESPONSE_LENGTHS[0]:,} tokens ({100 * lo:.3f}%–{100 * hi:.3f}%); the paper reports no "
            "balanced accuracy. Cells whose study was not judged (tokens without the own-update truth), without an "
            "outside token or without a balanced accuracy are left out and named in the subtitle. "
            + interval_caption("pooled")
        ),
    )
    panel = Panel(
        title="balanced accuracy on the disagreement set, against the own update (pooled over seeds)"
    )
    result.panels = [panel]
    cells = grid(ctx, result)
    if cells:
        shown = [c for c in cells if c.same is not None and c.share > 0 and _has_balanced(c)]
        result.stats = [(c.name, c.point) for c in shown]
        for prec in dict.fromkeys(c.precision for c in cells):
            mine = [c for c in shown if c.precision == prec]
            for crit, field in ((HEADLINE, "balanced_predictive"), (RATIO, "balanced_ratio")):
                est = [getattr(c.point, field) for c in mine]
                panel.series.append(
                    _interval_series(
                        _series_label(prec, crit), mine, [(e.value, e.lo, e.hi) for e in est], crit
                    )
                )
        constants = sorted({c.same.constant_balanced for c in shown if c.same.constant_balanced is not None})
        for value in constants:
            panel.series.append(Series("constant predictor", np.array([lo, 1.0]), np.full(2, value)))
        panel.text = left_out(cells, _has_balanced)
        result.has_data = bool(shown)
        if not shown:
            panel.note = "no cell judged on the same tokens"
    if ctx.draw:
        result.drawn = _draw_fig10(result)
    return result


def _draw_fig10(result: ArtefactResult) -> Figure:
    fig, (ax,) = new_figure(1, 1, panel_w=9.2, panel_h=4.2)
    panel = result.panels[0]
    lo, hi = stats.paper_share_outside()
    handles: dict[str, object] = {}
    if panel_axes(ax, panel, empty=not result.has_data, fontsize=8):
        ax.axvspan(100 * lo, 100 * hi, color=GREY, alpha=0.18, linewidth=0)
        ax.text(
            100 * np.sqrt(lo * hi),
            97,
            f"paper's regime\n{100 * lo:.3f}–{100 * hi:.2f}%\n(assumed)",
            ha="center",
            va="top",
            fontsize=7,
        )
        handles["paper's regime: 1,435 / (1,024 × L) of tokens outside, L assumed 1,024–8,192"] = Patch(
            color=GREY, alpha=0.18
        )
        precisions: list[str] = []
        xs = [100 * lo]
        for s in panel.series:
            if s.label == "constant predictor":
                line = ax.axhline(100 * s.y[0], color="black", linestyle=":", linewidth=1)
                handles[f"constant predictor (one decision for every token), {100 * s.y[0]:.0f}%"] = line
                continue
            if not s.x.size:
                continue
            crit = s.method or HEADLINE
            colour = CRITERION_STYLE[crit][1]
            line = _drift_line(ax, s, precisions, colour, crit == RATIO, markersize=5, linewidth=1, alpha=None)
            handles[f"{s.label.split(':')[0]}: {CRITERION_STYLE[crit][0]}"] = line
            xs.extend(100 * s.x)
        ax.set_xscale("log")
        ax.set_xlim(min(xs) / 2, max(xs) * 2)
        ax.set_ylim(0, 100)
        ax.set_xlabel("tokens outside the trust region (% of response tokens, pooled over seeds)")
        ax.set_ylabel("balanced accuracy (%)")
    notes = [t for t in (panel.text,) if t]
    head = [result.title, f"{result.selection_rule}; CPU stand-in with emulated precision", *notes]
    height = fig.get_figheight()
    title_in = 0.35 + 0.17 * len(wrap_lines(head, fig.get_figwidth()))
    legend_in = 0.75 + legend_rows(len(handles), 2) * LEGEND_ROW_IN
    fig.subplots_adjust(top=1 - title_in / height, bottom=legend_in / height, left=0.08, right=0.98)
    legend_below(fig, handles, ncol=2)
    suptitle(fig, *head)
    return fig
