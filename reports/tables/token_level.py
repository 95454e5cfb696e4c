"""The token-level study's summary table: each quantity the study measures, the paper's number beside this
database's (analysis.token_level.summary.stats computes both; this module only lays them out)."""

from __future__ import annotations

from collections.abc import Callable

from analysis.token_level.summary import stats
from reports.artefact import STUDY_COMMAND, ArtefactResult, ReportContext, table
from reports.tables.render import TextTable, write_tables

NOT_REPORTED = "not reported"

SummaryRow = tuple[str, str | None, Callable[[stats.StudySummary], str]]


def _pooled(crit: str) -> Callable[[stats.StudySummary], str]:
    return lambda s: s.corrective[crit].pct() if crit in s.corrective else "—"


def _paired_mean(crit: str, side: str) -> Callable[[stats.StudySummary], str]:
    def cell(s: stats.StudySummary) -> str:
        pair = s.pairs.get(crit)
        return "—" if pair is None else getattr(pair.unsafe_keep, side).pct()

    return cell


def _lower(s: stats.StudySummary) -> str:
    if s.headline is None:
        return "—"
    pair = s.headline.unsafe_keep
    return f"{pair.n_lower} of {pair.n_paired} paired seeds"


# (quantity, key of the paper's number or None when the paper does not report it, this study's value)
SUMMARY_ROWS: tuple[SummaryRow, ...] = (
    ("seeds", "seeds", lambda s: str(s.n_seeds)),
    ("tokens outside the trust region per seed (mean ± SE)", "outside_per_seed", lambda s: s.outside.count()),
    (
        "disagreement set per seed (mean ± SE)",
        "disagree_per_seed",
        lambda s: s.headline.disagree.count() if s.headline else "—",
    ),
    (
        "unsafe-keep rate, predictive aggregated (mean ± SE over paired seeds)",
        "unsafe_keep_predictive",
        _paired_mean("predictive", "pred_mean"),
    ),
    (
        "unsafe-keep rate, ratio (mean ± SE over paired seeds)",
        "unsafe_keep_ratio",
        _paired_mean("predictive", "ratio_mean"),
    ),
    ("seeds where predictive is lower", "seeds_predictive_lower", _lower),
    ("corrective fraction, predictive aggregated (pooled)", "corrective_predictive", _pooled("predictive")),
    ("corrective fraction, ratio (pooled)", "corrective_ratio", _pooled("ratio")),
    (
        "unsafe-keep rate, predictive uniform (mean ± SE over paired seeds)",
        None,
        _paired_mean("predictive_uniform", "pred_mean"),
    ),
    (
        "unsafe-keep rate, predictive exact tail (mean ± SE over paired seeds)",
        None,
        _paired_mean("predictive_exact", "pred_mean"),
    ),
    ("corrective fraction, predictive uniform (pooled)", None, _pooled("predictive_uniform")),
    ("corrective fraction, predictive exact tail (pooled)", None, _pooled("predictive_exact")),
)


def summary_rows(summary: stats.StudySummary | None) -> list[list[str]]:
    """One row per quantity: its name, the paper's number, this study's number ("—" without a study)."""
    return [
        [
            quantity,
            stats.paper_text(key) if key is not None else NOT_REPORTED,
            value(summary) if summary is not None else "—",
        ]
        for quantity, key, value in SUMMARY_ROWS
    ]


@table("token_level_summary", "Token-level study beside the paper's numbers", source="study")
def token_level_summary(ctx: ReportContext) -> ArtefactResult:
    result = ArtefactResult(
        title="Token-level study: this database beside the paper",
        caption="The paper's numbers and this database's, in separate, labelled columns; never mixed.",
        study=ctx.study,
        selection_rule=f"study {ctx.study.study_id}" if ctx.study else "no token-level study",
        command=STUDY_COMMAND,
    )
    if ctx.study is None or ctx.summary is None:
        note = f"No token-level study in this database ({STUDY_COMMAND}); only the paper's column."
        db_label = "this database"
    else:
        result.stats = ctx.summary
        result.has_data = ctx.summary.n_seeds > 0
        note = (
            "Left column: the paper's published numbers (Qwen3 scale, 61 seeds, docs/math.md §5). Right column: this "
            "database only. A small CPU model reproduces the mechanism, not the paper's numbers. Means of "
            "unsafe-keep rates are over the paired seeds (both criteria kept a disagreement token); pooled "
            "fractions are summed over all seeds from the per-seed counts."
        )
        db_label = f"this database ({ctx.study.describe()}; study {ctx.study.study_id})"
    text = TextTable(
        title=result.title,
        note=note,
        header=["quantity", stats.PAPER_LABEL, db_label],
        rows=summary_rows(ctx.summary),
    )
    result.tables = {"summary": text}
    if ctx.draw:
        result.files = write_tables(ctx.out, token_level_summary.name, text)
    return result
