"""The paper's figures 1-8 from the results database; each returns the arrays it plotted (tests check data)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from matplotlib.ticker import MaxNLocator

from reports import data
from reports.registry import ArtefactResult, Panel, ReportContext, Series, figure
from reports.style import (
    CRITERION_STYLE,
    GREY,
    LEGEND_ROW_IN,
    OKABE_ITO,
    empty_panel,
    grid_figure,
    legend_below,
    legend_rows,
    method_rank,
    method_style,
    new_figure,
    save_figure,
    suptitle,
    wrap_lines,
)

MAIN_DELTA = 0.15
TIGHT_DELTA = 0.05
MAX_COLS = 4
# further runs (seeds) of one method in one panel: same colour, these dash patterns
REPEAT_STYLES = ((0, (5, 2)), (0, (1, 1.5)), (0, (3, 1, 1, 1)), (0, (8, 2, 2, 2)))
NO_STUDY = "no token-level study in the database\n(python -m analysis token_level)"


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
    label = method_style(run.method)[0]
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
        by_run = data.metric_names_by_run(ctx.con, ids, "val-core/")
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
    delta: float,
    default_sweep: str,
) -> ArtefactResult:
    """One panel per model-precision setting (× one row per metric), one line per run coloured by method."""
    sel = data.select_runs(ctx.runs, delta, ctx.sweeps, default_sweep)
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
            _, colour, ls = method_style(s.method, j)
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
    "Validation accuracy = mean of the two AIME avg@16 scores (val-core/<aime24>/acc/mean@16 and "
    "val-core/<aime25>/acc/mean@16; on the CPU engine its stand-in splits aime24_standin / aime25_standin), "
    "on the steps where both were evaluated, against training step. One panel per model-precision setting, "
    "one line per run coloured by method; a dot marks each run's last logged step (shorter runs end early)."
)


@figure("fig1_main_comparison", "Figure 1: main comparison at δ = 0.15")
def fig1_main_comparison(ctx: ReportContext) -> ArtefactResult:
    return _per_setting_figure(
        ctx,
        name="fig1_main_comparison",
        title="Figure 1: main comparison (validation accuracy)",
        caption=_VAL_CAPTION,
        rows=[VAL_ROW],
        delta=MAIN_DELTA,
        default_sweep="main_comparison",
    )


@figure("fig2_tight_threshold", "Figure 2: tight threshold δ = 0.05")
def fig2_tight_threshold(ctx: ReportContext) -> ArtefactResult:
    return _per_setting_figure(
        ctx,
        name="fig2_tight_threshold",
        title="Figure 2: tight threshold (validation accuracy)",
        caption=_VAL_CAPTION,
        rows=[VAL_ROW],
        delta=TIGHT_DELTA,
        default_sweep="tight_threshold",
    )


@figure("fig5_training_reward", "Figure 5: training reward")
def fig5_training_reward(ctx: ReportContext) -> ArtefactResult:
    return _per_setting_figure(
        ctx,
        name="fig5_training_reward",
        title="Figure 5: training reward (critic/score/mean)",
        caption="Mean training reward of each step's rollout batch (critic/score/mean) of the main-comparison runs.",
        rows=[MetricRow("training reward", "critic/score/mean", ("critic/score/mean",))],
        delta=MAIN_DELTA,
        default_sweep="main_comparison",
    )


@figure("fig6_aime24_aime25", "Figure 6: AIME24 and AIME25 accuracy, separately")
def fig6_aime24_aime25(ctx: ReportContext) -> ArtefactResult:
    return _per_setting_figure(
        ctx,
        name="fig6_aime24_aime25",
        title="Figure 6: AIME24 and AIME25 avg@16, separately",
        caption=(
            "Top row: AIME24 avg@16 (CPU engine: aime24_standin); bottom row: AIME25 avg@16 (aime25_standin), "
            "for the main-comparison runs."
        ),
        rows=[
            MetricRow("AIME24", "AIME24 avg@16", (), "aime24"),
            MetricRow("AIME25", "AIME25 avg@16", (), "aime25"),
        ],
        delta=MAIN_DELTA,
        default_sweep="main_comparison",
    )


@figure("fig7_response_length", "Figure 7: response length")
def fig7_response_length(ctx: ReportContext) -> ArtefactResult:
    return _per_setting_figure(
        ctx,
        name="fig7_response_length",
        title="Figure 7: mean response length",
        caption="Mean response length in tokens of each step's rollouts (response_length/mean), main comparison.",
        rows=[MetricRow("response length", "response_length/mean", ("response_length/mean",))],
        delta=MAIN_DELTA,
        default_sweep="main_comparison",
    )


@figure("fig8_ppo_kl_clipfrac", "Figure 8: PPO-KL and clip fraction")
def fig8_ppo_kl_clipfrac(ctx: ReportContext) -> ArtefactResult:
    return _per_setting_figure(
        ctx,
        name="fig8_ppo_kl_clipfrac",
        title="Figure 8: PPO-KL and clip fraction",
        caption=(
            "Top row: actor/ppo_kl (mean of log μ − log π over response tokens); bottom row: actor/pg_clipfrac "
            "(masked / tokens with A ≠ 0), main comparison."
        ),
        rows=[
            MetricRow("PPO-KL", "actor/ppo_kl", ("actor/ppo_kl",)),
            MetricRow("clip fraction", "actor/pg_clipfrac", ("actor/pg_clipfrac",)),
        ],
        delta=MAIN_DELTA,
        default_sweep="main_comparison",
    )


# ------------------------------------------------------------------------------------------ token level


def mean_se(values: np.ndarray) -> tuple[float, float, int]:
    """Mean, standard error (sample sd / sqrt(n); NaN for n < 2) and n of the finite values."""
    v = values[np.isfinite(values)]
    n = len(v)
    if n == 0:
        return float("nan"), float("nan"), 0
    se = float(np.std(v, ddof=1) / math.sqrt(n)) if n > 1 else float("nan")
    return float(np.mean(v)), se, n


def unsafe_keep_stats(seeds: dict[str, np.ndarray]) -> dict[str, object]:
    """Paired per-seed unsafe-keep rates of the ratio and predictive (aggregated) criteria and their summary."""
    seed = seeds.get("seed", np.array([]))
    ratio = seeds.get("unsafe_keep_ratio", np.full(len(seed), np.nan))
    pred = seeds.get("unsafe_keep_predictive", np.full(len(seed), np.nan))
    paired = np.isfinite(ratio) & np.isfinite(pred)
    m_r, se_r, _ = mean_se(ratio[paired])
    m_p, se_p, _ = mean_se(pred[paired])
    return {
        "seeds": seed[paired].astype(int),
        "ratio": ratio[paired],
        "predictive": pred[paired],
        "n_seeds": len(seed),
        "n_paired": int(paired.sum()),
        "mean_ratio": m_r,
        "se_ratio": se_r,
        "mean_predictive": m_p,
        "se_predictive": se_p,
        "n_predictive_lower": int((pred[paired] < ratio[paired]).sum()),
        "n_tied": int((pred[paired] == ratio[paired]).sum()),
    }


def _study_title(ctx: ReportContext) -> str:
    s = ctx.study
    return f"this database: {s.describe()}; study {s.study_id}, {s.n_seeds} seeds" if s else "no study"


@figure("fig3_unsafe_keep", "Figure 3: unsafe-keep rate per seed, ratio vs predictive", source="study")
def fig3_unsafe_keep(ctx: ReportContext) -> ArtefactResult:
    result = ArtefactResult(
        name="fig3_unsafe_keep",
        title="Figure 3: unsafe-keep rate on the disagreement set",
        caption=(
            "Per seed, among disagreement tokens (outside the trust region, where the ratio and predictive "
            "(aggregated-tail) criteria decide differently) that a criterion keeps, the fraction whose divergence "
            "grew after one optimiser step with that criterion's mask (ΔD > 0). Left: each seed's pair joined by a "
            "grey line, mean ± standard error over seeds. Right: per-seed difference predictive − ratio, sorted. "
            "Seeds where a criterion kept no disagreement token have no rate and are left out of both."
        ),
        study=ctx.study,
        selection_rule=f"study {ctx.study.study_id}" if ctx.study else "no token-level study",
    )
    left, right = Panel(title="unsafe-keep rate per seed"), Panel(title="predictive − ratio per seed")
    result.panels = [left, right]
    if ctx.study is None:
        left.note = right.note = NO_STUDY
    else:
        st = unsafe_keep_stats(data.seed_table(ctx.con, ctx.study.study_id))
        result.stats = st
        if st["n_paired"] == 0:
            left.note = right.note = "no seed has both unsafe-keep rates"
        else:
            left.series = [
                Series("ratio", st["seeds"], st["ratio"], yerr=np.array([st["se_ratio"]])),
                Series("predictive", st["seeds"], st["predictive"], yerr=np.array([st["se_predictive"]])),
            ]
            diff = st["predictive"] - st["ratio"]
            order = np.argsort(diff, kind="stable")
            right.series = [Series("difference", st["seeds"][order], diff[order])]
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
        st = result.stats
        r, p = 100 * st["ratio"], 100 * st["predictive"]
        for a, b in zip(r, p):
            ax.plot([0, 1], [a, b], color=GREY, alpha=0.35, linewidth=0.7)
        for x, vals, crit, mean, se in (
            (0, r, "ratio", st["mean_ratio"], st["se_ratio"]),
            (1, p, "predictive", st["mean_predictive"], st["se_predictive"]),
        ):
            colour = CRITERION_STYLE[crit][1]
            ax.scatter(np.full(len(vals), x), vals, s=10, color=colour, alpha=0.6, zorder=3)
            ax.errorbar(
                [x + (-0.18 if x == 0 else 0.18)],
                [100 * mean],
                yerr=[100 * se if np.isfinite(se) else 0],
                fmt="D",
                color=colour,
                capsize=4,
                markersize=6,
                zorder=4,
            )
            ax.annotate(
                f"{100 * mean:.1f}%\n± {100 * se:.1f} SE\n(n={st['n_paired']} paired)",
                (x + (-0.18 if x == 0 else 0.18), 100 * mean),
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
            f"predictive lower on {st['n_predictive_lower']} of {st['n_paired']} seeds",
            transform=bx.transAxes,
            va="top",
            fontsize=8,
        )
    suptitle(fig, result.title, _study_title(ctx))
    fig.tight_layout()
    return save_figure(fig, ctx.out, result.name, ctx.formats)


def wilson_interval(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion k/n (95% by default)."""
    if n == 0:
        return float("nan"), float("nan")
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return centre - half, centre + half


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
            "complement of Figure 3's per-seed mean."
        ),
        study=ctx.study,
        selection_rule=f"study {ctx.study.study_id}" if ctx.study else "no token-level study",
    )
    panel = Panel(title="corrective fraction (pooled)")
    result.panels = [panel]
    if ctx.study is None:
        panel.note = NO_STUDY
    else:
        counts, source = data.pooled_corrective(ctx.con, ctx.study.study_id)
        result.stats = {"counts": counts, "source": source}
        crits = [c for c in CRITERION_STYLE if c in counts]
        if not crits:
            panel.note = "no kept disagreement tokens in this study"
        else:
            frac = np.array([counts[c][0] / counts[c][1] for c in crits])
            lo_hi = np.array([wilson_interval(*counts[c]) for c in crits])
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
        counts = result.stats["counts"]
        for x, c, v in zip(xs, crits, s.y):
            ax.text(
                x,
                2,
                f"{100 * v:.1f}%\n{counts[c][0]}/{counts[c][1]}",
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
