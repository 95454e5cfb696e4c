"""Both criteria judged on the same tokens, as the token-level figures and the summary table read it (docs/math.md
§5.1): on the aggregated-tail disagreement set, against the own-update ground truth, from the rows ingest stored
(``token_level_criteria``, ``token_level_criteria_seeds``) and ``analysis.token_level.summary.study_stats.drift_point``.
Nothing is computed here: the rows are selected and handed on."""

from __future__ import annotations

from dataclasses import dataclass

import duckdb
import numpy as np
import polars as pl

from analysis.token_columns import HEADLINE, RATIO
from analysis.token_level.summary import study_stats as stats
from analysis.token_level.summary.report import StudyData, measured_at
from reports import queries

#: the two criteria compared on the same tokens: the ratio criterion and the aggregated-tail predictive criterion
PAIR: tuple[str, str] = (RATIO, HEADLINE)
CRITERIA_TABLE, SEEDS_TABLE = "token_level_criteria", "token_level_criteria_seeds"


def not_judged(what: str) -> str:
    """Why ``what`` (a study, a cell) has no same-token judgement to show."""
    return (
        f"{what}: not judged on the same tokens (its token rows carry no own-update ground truth, "
        f"{stats.OWN_UPDATE}; studies run before the ground truths were stored)"
    )


def measured(con: duckdb.DuckDBPyConnection, study_id: str) -> str:
    """The share of response tokens outside the trust region the study was measured at, beside the paper's band
    (``analysis.token_level.summary.report.measured_at``)."""
    seeds = queries.seed_rows(con, study_id)
    if stats.share_outside(seeds).fraction is None:
        return "at a share of response tokens outside the trust region it did not store (no token counts)"
    return measured_at(StudyData(study_id, {}, seeds, pl.DataFrame()))


def drift_point(con: duckdb.DuckDBPyConnection, study_id: str) -> stats.DriftPoint:
    """The study's drift point with its stored judgement (the balanced accuracies are None when it has none)."""
    return stats.drift_point(queries.seed_rows(con, study_id), queries.study_table(con, CRITERIA_TABLE, study_id))


@dataclass(frozen=True)
class SameTokens:
    """One study's judgement of the two criteria of ``PAIR`` on the disagreement set against the own update."""

    study_id: str
    point: stats.DriftPoint  # pooled balanced accuracies with their seed-cluster intervals, paired difference
    seeds: np.ndarray  # every judged seed, ascending
    balanced: dict[str, np.ndarray]  # criterion -> balanced accuracy per seed (NaN: undefined), as ``seeds``
    constant_balanced: float | None  # the constant predictor's balanced accuracy (None: the set is one class)
    constant_class: str  # "rises" (drop every token) or "falls" (keep every token)
    paired_note: str  # why the paired tests are weak or 1.0, "" otherwise
    where: str  # the share of response tokens outside the trust region the study was measured at

    @property
    def paired(self) -> np.ndarray:
        """Which of ``seeds`` have both criteria's balanced accuracy (the seeds of the paired difference)."""
        return np.isfinite(self.balanced[PAIR[0]]) & np.isfinite(self.balanced[PAIR[1]])


def _rows(frame: pl.DataFrame, criterion: str) -> pl.DataFrame:
    return frame.filter(
        (pl.col("token_set") == stats.DISAGREE_SET)
        & (pl.col("truth") == stats.OWN_UPDATE)
        & (pl.col("criterion") == criterion)
    )


def same_tokens(con: duckdb.DuckDBPyConnection, study_id: str) -> SameTokens | None:
    """The study's same-token judgement as stored; None when it has none (``not_judged`` says why)."""
    point = drift_point(con, study_id)
    criteria = queries.study_table(con, CRITERIA_TABLE, study_id)
    per_seed = queries.study_table(con, SEEDS_TABLE, study_id)
    if point.balanced_ratio is None or criteria.height == 0 or per_seed.height == 0:
        return None
    ratio = _rows(criteria, PAIR[0]).row(0, named=True)
    seeds_of = {c: _rows(per_seed, c).sort("seed") for c in PAIR}
    seeds = seeds_of[PAIR[0]].get_column("seed").to_numpy()
    if not np.array_equal(seeds, seeds_of[PAIR[1]].get_column("seed").to_numpy()):
        raise ValueError(f"study {study_id}: {SEEDS_TABLE} holds different seeds for {PAIR[0]} and {PAIR[1]}")
    balanced = {
        c: f.get_column("balanced_accuracy").cast(pl.Float64).fill_null(float("nan")).to_numpy()
        for c, f in seeds_of.items()
    }
    note = _rows(criteria, PAIR[1]).get_column("vs_ratio_balanced_note").to_list()
    return SameTokens(
        study_id=study_id,
        point=point,
        seeds=seeds,
        balanced=balanced,
        constant_balanced=ratio["constant_balanced_accuracy"],
        constant_class=ratio["constant_class"],
        paired_note=(note[0] or "") if note else "",
        where=measured(con, study_id),
    )
