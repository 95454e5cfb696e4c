"""The token-level study's summary table: each quantity the study measures, the paper's number beside this
database's (analysis.token_level.summary.study_stats computes both; this module only lays them out). The paper's
statistics come first, under the paper's definitions; then both criteria judged on the same tokens (docs/math.md
§5.1; the stored judgement as reports.same_tokens reads it), which the paper does not report."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from analysis.token_columns import HEADLINE, RATIO
from analysis.token_level.summary import study_stats as stats
from reports import queries, same_tokens
from reports.artefact import STUDY_COMMAND, ArtefactResult, ReportContext
from reports.tables.render import TextTable, table

NOT_REPORTED = "not reported"


@dataclass(frozen=True)
class StudyNumbers:
    """What the table reads of one study: its statistics under the paper's definitions, its share of response
    tokens outside the trust region, and its same-token judgement (None: not judged, ``unjudged`` says why)."""

    summary: stats.StudySummary
    share: stats.Pooled | None = None
    same: same_tokens.SameTokens | None = None
    unjudged: str = "—"


#: (quantity, the paper's cell: a key of ``stats.paper_text``, a function, or None: not reported; this study's
#: cell, or None on a heading row)
SummaryRow = tuple[str, "str | Callable[[], str] | None", "Callable[[StudyNumbers], str] | None"]


def _pct(e: stats.Estimate | stats.Pooled | None) -> str:
    return "—" if e is None else e.pct()


def _pooled(crit: str) -> Callable[[StudyNumbers], str]:
    return lambda n: _pct(n.summary.corrective.get(crit))


def _paired_mean(crit: str, side: str) -> Callable[[StudyNumbers], str]:
    return lambda n: _pct(getattr(pair.unsafe_keep, side) if (pair := n.summary.pairs.get(crit)) else None)


def _lower(n: StudyNumbers) -> str:
    if n.summary.headline is None:
        return "—"
    pair = n.summary.headline.unsafe_keep
    return f"{pair.n_lower} of {pair.n_paired} paired seeds"


def _paper_share() -> str:
    lo, hi = stats.paper_share_outside()
    long, short = stats.PAPER_RESPONSE_LENGTHS[1], stats.PAPER_RESPONSE_LENGTHS[0]
    return (
        f"{NOT_REPORTED}; {100 * lo:.3f}%–{100 * hi:.2f}% for an assumed mean response length of "
        f"{short:,}–{long:,} tokens"
    )


def _share(n: StudyNumbers) -> str:
    f = n.share.fraction if n.share is not None else None
    return (
        "—"
        if f is None
        else f"{100 * f:.3g}% ({n.share.k:,} of {n.share.n:,} response tokens, pooled over seeds)"
    )


def _judged(n: StudyNumbers) -> str:
    if n.same is None:
        return n.unjudged
    p = n.same.point
    return f"{p.judged_disagree or 0:,} tokens, {p.n_seeds} seeds"


def _same(cell: Callable[[same_tokens.SameTokens], str]) -> Callable[[StudyNumbers], str]:
    return lambda n: "—" if n.same is None else cell(n.same)


def _difference(
    cell: Callable[[same_tokens.SameTokens, stats.PairedEstimate], str],
) -> Callable[[StudyNumbers], str]:
    """A cell of the paired difference of balanced accuracies ("—" without a judgement or a difference)."""
    return _same(lambda s: "—" if (d := s.point.balanced_difference) is None else cell(s, d))


def _constant(s: same_tokens.SameTokens) -> str:
    decision = (
        "drop every token (most rise)" if s.constant_class == "rises" else "keep every token (most fall)"
    )
    value = "—" if s.constant_balanced is None else f"{100 * s.constant_balanced:.1f}%"
    return f"{value}, {decision}"


def _p_values(s: same_tokens.SameTokens, d: stats.PairedEstimate) -> str:
    p = ["—" if v is None else f"{v:.3g}" for v in (d.sign_p, d.wilcoxon_p)]
    return f"{p[0]}; {p[1]}" + (f" ({s.paired_note})" if s.paired_note else "")


PAPER_HEADING = "by the paper's definitions (different token sets per criterion):"
SAME_HEADING = (
    f"both criteria on the same tokens, the disagreement set, against the own update ({stats.OWN_UPDATE}), "
    "beyond the paper:"
)

SUMMARY_ROWS: tuple[SummaryRow, ...] = (
    ("seeds", "seeds", lambda n: str(n.summary.n_seeds)),
    ("share of response tokens outside the trust region (pooled over seeds)", _paper_share, _share),
    (PAPER_HEADING, None, None),
    (
        "tokens outside the trust region per seed (mean ± SE)",
        "outside_per_seed",
        lambda n: n.summary.outside.count(),
    ),
    (
        "disagreement set per seed (mean ± SE)",
        "disagree_per_seed",
        lambda n: n.summary.headline.disagree.count() if n.summary.headline else "—",
    ),
    (
        "unsafe-keep rate, predictive aggregated (mean ± SE over paired seeds)",
        "unsafe_keep_predictive",
        _paired_mean(HEADLINE, "pred_mean"),
    ),
    (
        "unsafe-keep rate, ratio (mean ± SE over paired seeds)",
        "unsafe_keep_ratio",
        _paired_mean(HEADLINE, "ratio_mean"),
    ),
    ("seeds where predictive is lower", "seeds_predictive_lower", _lower),
    ("corrective fraction, predictive aggregated (pooled)", "corrective_predictive", _pooled(HEADLINE)),
    ("corrective fraction, ratio (pooled)", "corrective_ratio", _pooled(RATIO)),
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
    (SAME_HEADING, None, None),
    ("disagreement tokens judged (pooled over seeds)", None, _judged),
    (
        "balanced accuracy, predictive aggregated (pooled, 95% seed-cluster bootstrap interval)",
        None,
        _same(lambda s: _pct(s.point.balanced_predictive)),
    ),
    (
        "balanced accuracy, ratio (pooled, 95% seed-cluster bootstrap interval)",
        None,
        _same(lambda s: _pct(s.point.balanced_ratio)),
    ),
    ("balanced accuracy, constant predictor (one decision for every token)", None, _same(_constant)),
    (
        "balanced accuracy, predictive − ratio per seed (mean, 95% t-interval)",
        None,
        _difference(lambda s, d: f"{d.pp()} (n = {d.n_seeds} seeds)"),
    ),
    (
        "seeds where predictive's balanced accuracy is lower / tied / higher",
        None,
        _difference(lambda s, d: f"{d.n_lower} / {d.n_tied} / {d.n_higher} of {d.n_seeds} seeds"),
    ),
    (
        "p-values of predictive vs ratio: two-sided sign test; Wilcoxon signed-rank",
        None,
        _difference(_p_values),
    ),
)


def _paper_cell(paper: str | Callable[[], str] | None) -> str:
    return NOT_REPORTED if paper is None else stats.paper_text(paper) if isinstance(paper, str) else paper()


def summary_rows(numbers: StudyNumbers | stats.StudySummary | None) -> list[list[str]]:
    """One row per quantity: its name, the paper's number, this study's number ("—" without a study; a heading
    row has empty cells). A bare StudySummary fills the paper's statistics only."""
    if isinstance(numbers, stats.StudySummary):
        numbers = StudyNumbers(numbers)
    return [
        [quantity, "", ""]
        if value is None
        else [quantity, _paper_cell(paper), value(numbers) if numbers is not None else "—"]
        for quantity, paper, value in SUMMARY_ROWS
    ]


def study_numbers(ctx: ReportContext) -> StudyNumbers | None:
    """The chosen study's numbers (None without a study)."""
    if ctx.study is None or ctx.summary is None:
        return None
    sid = ctx.study.study_id
    return StudyNumbers(
        summary=ctx.summary,
        share=stats.share_outside(queries.seed_rows(ctx.con, sid)),
        same=same_tokens.same_tokens(ctx.con, sid),
        unjudged=same_tokens.not_judged(f"study {sid}"),
    )


@table("Token-level study beside the paper's numbers", source="study")
def token_level_summary(ctx: ReportContext) -> ArtefactResult:
    result = ArtefactResult(
        title="Token-level study: this database beside the paper",
        caption="The paper's numbers and this database's, in separate, labelled columns; never mixed.",
        study=ctx.study,
        selection_rule=f"study {ctx.study.study_id}" if ctx.study else "no token-level study",
        command=STUDY_COMMAND,
    )
    numbers = study_numbers(ctx)
    if numbers is None:
        note = f"No token-level study in this database ({STUDY_COMMAND}); only the paper's column."
        db_label = "this database"
    else:
        result.stats = ctx.summary
        result.has_data = numbers.summary.n_seeds > 0
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
        rows=summary_rows(numbers),
    )
    result.tables = {"summary": text}
    result.drawn = (text,)
    return result
