"""A study's criteria judged on all its tokens (docs/math.md §5.1): the three tables ingest stores per study and the
judgements the report prints, from one function.

A ground truth is carried when its column holds at least one finite value: a database keeps a column for every
study once one study has it, so an older study's rows hold it as NULL. Nothing is judged unless the own-update truth
(``analysis.token_columns.OWN_UPDATE``) is carried; then the tables are empty and ``reason`` says why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import polars as pl

from analysis.paired import BOOTSTRAP_SEED, RESAMPLES
from analysis.token_columns import CONTEXT_ID, OWN_UPDATE
from analysis.token_level.summary.criteria import (
    AGREEMENT_COLUMNS,
    CRITERIA_COLUMNS,
    PER_SEED_COLUMNS,
    TRUTHS,
    Judgement,
    agreement_table,
    criteria_table,
    judge_all,
    per_seed_table,
)
from analysis.training.stats import CONFIDENCE

#: stored table -> its columns (besides ``study_id``), as criteria.py builds them
STUDY_TABLES: dict[str, dict[str, pl.DataType]] = {
    "token_level_criteria": CRITERIA_COLUMNS,
    "token_level_criteria_seeds": PER_SEED_COLUMNS,
    "token_level_sign_agreement": AGREEMENT_COLUMNS,
}


def carried(tokens: pl.DataFrame, column: str) -> bool:
    """Whether the token rows carry ``column``: present, with at least one finite (or non-null integer) value."""
    if column not in tokens.columns:
        return False
    values = tokens.get_column(column).drop_nulls()
    if values.dtype.is_float():
        values = values.filter(values.is_finite())
    return values.len() > 0


@dataclass(frozen=True)
class StudyJudgement:
    """Every judgement of one study's tokens and the three tables they make (empty, with ``reason``, when the
    tokens carry no own-update truth)."""

    judgements: tuple[Judgement, ...]
    tables: dict[str, pl.DataFrame]
    reason: str | None  # why nothing was judged; None when judged

    def of(self, token_set: str, truth: str) -> dict[str, Judgement]:
        """criterion -> its judgement against ``truth`` on ``token_set`` (empty when not judged)."""
        return {j.criterion: j for j in self.judgements if j.token_set == token_set and j.truth == truth}


def _unjudged(reason: str) -> StudyJudgement:
    return StudyJudgement((), {t: pl.DataFrame(schema=cols) for t, cols in STUDY_TABLES.items()}, reason)


def judge_study(
    tokens: pl.DataFrame,
    *,
    level: float = CONFIDENCE,
    resamples: int = RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
) -> StudyJudgement:
    """The criteria judged on a study's outside tokens (all seeds given), with the three tables."""
    if tokens.height == 0:
        return _unjudged("the study has no token outside the trust region")
    if not carried(tokens, OWN_UPDATE):
        return _unjudged(
            f"its token rows carry no own-update ground truth ({OWN_UPDATE}): they were computed before the study "
            "stored per-token ground truths; rerun the study into a fresh database (--db) to measure it"
        )
    dropped = [c for c in (*TRUTHS, CONTEXT_ID) if c in tokens.columns and not carried(tokens, c)]
    frame = tokens.drop(dropped)
    kw: dict[str, Any] = {"level": level, "resamples": resamples, "seed": seed}
    judgements = tuple(judge_all(frame, **kw))
    tables = {
        "token_level_criteria": criteria_table(judgements),
        "token_level_criteria_seeds": per_seed_table(judgements),
        "token_level_sign_agreement": agreement_table(frame, **kw),
    }
    return StudyJudgement(judgements, tables, None)


def study_tables(tokens: Any) -> dict[str, pl.DataFrame]:
    """The three stored tables of a study from its token rows (a polars frame or anything ``pl.from_arrow``
    reads): ``analysis.store.upsert_token_level``'s ``derive``."""
    frame = tokens if isinstance(tokens, pl.DataFrame) else pl.from_arrow(tokens)
    if not isinstance(frame, pl.DataFrame):
        raise TypeError(f"study_tables needs token rows as a table, got {type(tokens).__name__}")
    return judge_study(frame).tables
