"""The summary at the top of the report page: what ran and where, runs and seeds per sweep, the headline
results (Table 2's cells and the token-level summary's, each labelled as this database's or the paper's)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from analysis.token_level.summary import study_stats as stats
from predmask import config
from predmask.command_text import sweep_command
from reports import labels, queries
from reports.artefact import STUDY_COMMAND, ArtefactResult, ReportContext
from reports.tables import main_results
from reports.tables import token_level as token_level_table
from reports.tables.render import TextTable

#: the token-level summary's rows that the page's headline repeats (their quantity names in token_level_table.SUMMARY_ROWS)
TOKEN_HEADLINE: tuple[str, ...] = (
    "unsafe-keep rate, predictive aggregated (mean ± SE over paired seeds)",
    "unsafe-keep rate, ratio (mean ± SE over paired seeds)",
    "seeds where predictive is lower",
    "corrective fraction, predictive aggregated (pooled)",
    "corrective fraction, ratio (pooled)",
)
NO_SWEEP = "(no sweep)"


@dataclass(frozen=True)
class PageSummary:
    """The page's summary, as text: per-sweep runs, where they ran, the studies, and the two headlines."""

    ran: TextTable
    where: str
    studies: str
    training: TextTable
    training_label: str
    token_level: TextTable


def _seeds(runs: Sequence[queries.RunInfo]) -> str:
    seeds = sorted({r.seed for r in runs if r.seed is not None})
    return f"{len(seeds)} ({', '.join(str(s) for s in seeds)})" if seeds else "—"


def sweeps_table(runs: Sequence[queries.RunInfo]) -> TextTable:
    """One row per sweep of conf/sweep (those without runs too, naming the command that runs them) and per other
    sweep the database holds; a run two sweeps hold counts in each."""
    by_sweep: dict[str, list[queries.RunInfo]] = {s: [] for s in config.group_options("sweep")}
    for r in runs:
        for sweep in r.sweeps or (NO_SWEEP,):
            by_sweep.setdefault(sweep, []).append(r)
    rows = []
    for sweep, members in by_sweep.items():
        if not members:
            rows.append([sweep, "0", "—", "—", "—", "—", f"not run yet: {sweep_command(sweep)}"])
            continue
        settings = sorted({labels.setting_label(*r.setting) for r in members})
        rows.append(
            [
                sweep,
                str(len(members)),
                _seeds(members),
                str(len({r.method for r in members if r.method})),
                "; ".join(settings),
                ", ".join(sorted({r.describe_backend() for r in members})),
                "; ".join(sorted({r.describe_scale() for r in members})),
            ]
        )
    return TextTable(
        title="What ran",
        note="Runs per sweep in this database (a run two sweeps hold counts in each), with the seeds they used, "
        "where they ran and at what scale.",
        header=["sweep", "runs", "seeds", "methods", "settings", "where", "scale"],
        rows=rows,
    )


def _where_line(runs: Sequence[queries.RunInfo]) -> str:
    if not runs:
        return (
            f"No training runs in this database: {sweep_command('smoke')} (a few minutes) or "
            f"{sweep_command(queries.MAIN_SWEEP)} runs them."
        )
    n_cpu = sum(r.is_cpu for r in runs)
    parts = []
    if n_cpu:
        parts.append(f"{n_cpu} on the CPU engine (small stand-in models, emulated precision: not the paper's scale)")
    if len(runs) - n_cpu:
        parts.append(f"{len(runs) - n_cpu} on the cluster (VeRL, the paper's models, real precision)")
    return f"{len(runs)} training run(s): " + "; ".join(parts) + "."


def _studies_line(ctx: ReportContext) -> str:
    if ctx.study is None:
        return f"No token-level study in this database ({STUDY_COMMAND} runs the paper's 61 seeds)."
    return (
        f"{len(ctx.studies)} token-level stud{'y' if len(ctx.studies) == 1 else 'ies'}; the page draws "
        f"{ctx.study.study_id}: {ctx.study.n_seeds} seeds, {ctx.study.describe()}."
    )


def _training_label(runs: Sequence[queries.RunInfo]) -> str:
    if not runs:
        return f"ours: no runs with validation yet ({sweep_command(queries.MAIN_SWEEP)})"
    cpu = all(r.is_cpu for r in runs)
    where = "small-scale, CPU engine stand-in models, emulated precision" if cpu else "cluster runs"
    return (
        f"ours ({where}; {len(runs)} run(s)). The paper's training results are its figures: this toolkit holds "
        "no numbers of them to set beside these."
    )


def page_summary(ctx: ReportContext, results: Sequence[ArtefactResult]) -> PageSummary:
    """The page's summary (Table 2 computed, data only, when it was not among the artefacts drawn)."""
    table2 = next((r for r in results if r.name == "table2_main_results"), None)
    if table2 is None:
        table2 = main_results.table2_main_results(replace(ctx, draw=False))
    headline_rows = {row[0]: row for row in token_level_table.summary_rows(ctx.summary)}
    db_label = "ours: " + (ctx.study.describe() if ctx.study else f"no study yet ({STUDY_COMMAND})")
    token_level = TextTable(
        title="Headline: the token-level study",
        note="The same numbers as the token-level table below; the paper's column is the paper's, never ours.",
        header=["quantity", stats.PAPER_LABEL, db_label],
        rows=[headline_rows[q] for q in TOKEN_HEADLINE],
    )
    return PageSummary(
        ran=sweeps_table(ctx.runs),
        where=_where_line(ctx.runs),
        studies=_studies_line(ctx),
        training=main_results.headline_table(table2.stats or []),
        training_label=_training_label(table2.runs),
        token_level=token_level,
    )
