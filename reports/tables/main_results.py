"""Table 2: final, best and mean (AUC) validation accuracy per setting and method over seeds, each predictive mask's
paired difference against its DPPO reference and the difference its seeds can detect, and collapses; and the page's
headline drawn from the same cells. The numbers are analysis.training.stats'; this module only lays them out.
"""

from __future__ import annotations

from collections.abc import Sequence

from analysis.results import curves
from analysis.training import stats as training_stats
from predmask.command_text import sweep_command
from reports import queries
from reports.artefact import ArtefactResult, ReportContext
from reports.cells import DETECTABLE_HEADER, detectable, detectable_note, pct
from reports.labels import method_label, split_size_text, sweep_delta
from reports.style import method_rank
from reports.tables.render import TextTable, table

COLLAPSE_DOC = "docs/results.md"


def _diff(d: training_stats.PairedDifference | None, is_reference: bool) -> str:
    if is_reference:
        return "reference"
    return "—" if d is None else d.text(scale=100.0)


def _collapsed(r: training_stats.MethodResult) -> str:
    seeds = r.collapsed
    which = f" (seed {', '.join(str(k) for k in seeds)})" if seeds else ""
    return f"{len(seeds)}/{r.n} seeds{which}"


SettingResults = list[tuple[queries.PanelKey, dict[str, training_stats.MethodResult]]]


def main_results(
    ctx: ReportContext, runs: Sequence[queries.RunInfo]
) -> tuple[SettingResults, list[queries.RunInfo]]:
    """Per setting (panel order), each method's results over its seeds from the runs' validation curves; and the
    runs they come from (those with a validation curve)."""
    val = curves.validation_by_run(ctx.con, [r.run_id for r in runs])
    out: SettingResults = []
    used: list[queries.RunInfo] = []
    for key in queries.panel_keys(runs):
        if key.model is None:
            out.append((key, {}))
            continue
        members = [r for r in queries.runs_in_panel(runs, key) if r.run_id in val]
        groups = curves.by_method_and_seed(members, val, rank=method_rank)
        results = training_stats.setting_results({str(m): g for m, g in groups.items()})
        out.append((key, results))
        used += [r for r in members if str(r.method) in results]
    return out, used


def main_results_table(results: SettingResults, n_runs: int, n_cpu: int, split_size: str = "") -> TextTable:
    references = {r.vs_final.reference for _, rs in results for r in rs.values() if r.vs_final is not None}
    rows = []
    for key, by_method in results:
        setting = key.one_line
        if not by_method:
            rows.append([setting, "no runs with validation", "0"] + ["—"] * 8)
        for method, r in by_method.items():
            ref = r.vs_final.reference if r.vs_final is not None else None
            rows.append(
                [
                    setting,
                    method_label(method),
                    str(r.n),
                    pct(r.final),
                    pct(r.best),
                    pct(r.auc),
                    method_label(ref) if ref else "—",
                    _diff(r.vs_final, method in references),
                    _diff(r.vs_auc, method in references),
                    detectable(r.vs_final),
                    _collapsed(r),
                ]
            )
    note = (
        f"From {n_runs} run(s) ({n_cpu} on the CPU engine: small stand-in models, emulated precision; not the "
        "paper's scale). Validation accuracy = mean of the two AIME avg@16 scores (CPU: their stand-in splits"
        f"{'; ' + split_size if split_size else ''}). "
        f"Each accuracy cell: {training_stats.interval_note()} (half-width after ±; one seed: no interval). "
        "final = the last evaluated step; best = the highest evaluation; AUC = trapezoid area under the "
        "validation curve over steps divided by the step span (a mean accuracy over the run). Δ = predictive mask "
        "minus the method it is paired with (the ratio-direction mask of the same divergence and support), "
        "per seed, in percentage points: mean [95% t-interval] (seeds with Δ > 0). "
        f"{detectable_note()}. Collapsed: validation accuracy stays below half of its best for the rest of the run "
        f"(defined in {COLLAPSE_DOC})."
    )
    return TextTable(
        title="Table 2: main results (validation accuracy over seeds)",
        note=note,
        header=[
            "setting",
            "method",
            "seeds",
            "final val acc",
            "best val acc",
            "AUC (mean val acc)",
            "paired with",
            "Δ final (pp)",
            "Δ AUC (pp)",
            DETECTABLE_HEADER,
            "collapsed",
        ],
        rows=rows,
    )


def headline_table(results: SettingResults) -> TextTable:
    """Table 2's headline, from the same results and cells: per setting, the method with the highest mean final
    validation accuracy, and each predictive mask against the method it is paired with."""
    rows = []
    for key, by_method in results:
        finals = {m: r.final.mean for m, r in by_method.items() if r.final.mean is not None}
        if not finals:
            continue
        top = max(finals, key=lambda m: finals[m])
        highest = f"{method_label(top)}: {pct(by_method[top].final)}"
        pairs = [(m, r) for m, r in by_method.items() if r.vs_final is not None]
        for method, r in pairs or [(None, None)]:
            versus = "—" if r is None else f"{method_label(method)} − {method_label(r.vs_final.reference)}"
            rows.append(
                [
                    key.one_line,
                    highest,
                    versus,
                    "—" if r is None else _diff(r.vs_final, False),
                    "—" if r is None else _diff(r.vs_auc, False),
                ]
            )
    return TextTable(
        title="Headline: Table 2 in brief",
        note="The same numbers as Table 2 (accuracies in %, Δ in percentage points, per-seed pairs).",
        header=[
            "setting",
            "highest final val acc",
            "predictive mask − its pair",
            "Δ final (pp)",
            "Δ AUC (pp)",
        ],
        rows=rows,
    )


@table(f"Table 2: main results at δ = {sweep_delta(queries.MAIN_SWEEP):g}, over seeds")
def table2_main_results(ctx: ReportContext) -> ArtefactResult:
    sel = queries.select_runs(ctx.runs, sweep_delta(queries.MAIN_SWEEP), ctx.sweeps, queries.MAIN_SWEEP)
    results, runs = main_results(ctx, sel.runs)
    size = split_size_text(r.config for r in runs)
    text = main_results_table(results, len(runs), sum(r.is_cpu for r in runs), size)
    result = ArtefactResult(
        title=text.title,
        caption=(
            "Final, best and mean (AUC) validation accuracy per setting and method over seeds, the paired "
            "difference of each predictive mask against its DPPO reference with the smallest difference its seeds "
            "can detect, and collapses; Markdown and LaTeX." + (f" Validation: {size}." if size else "")
        ),
        runs=runs,
        selection_rule=sel.rule,
        stats=results,
        tables={"main": text},
        has_data=any(by_method for _, by_method in results),
        command=sweep_command(queries.MAIN_SWEEP),
    )
    result.drawn = (text,)
    return result
