"""Per-seed rates in token_level_seeds equal an SQL recomputation from token_level_tokens on a real DuckDB file;
the across-seed summaries equal the same recomputation; seed files are ingested idempotently."""

from __future__ import annotations

import json
import math
from pathlib import Path

import duckdb
import pytest
from token_level_helpers import TINY_VOCAB, scored_batch, settings, tiny_backend

from analysis.token_columns import PREDICTIVE
from analysis.token_level.cli import ingest
from analysis.token_level.compute.fanout import SeedFiles
from analysis.token_level.compute.study import study_batch
from analysis.token_level.compute.study_config import study_id_of
from analysis.token_level.summary.report import query_frame
from analysis.token_level.summary.study_stats import seed_summary, study_summary

SEEDS = (0, 1, 2, 3)
CONFIG = {"delta": 0.05, "note": "test study", "cluster": {"name": "local"}}


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A study of four seeds on tiny batches, written as seed files and ingested into a fresh database."""
    root = tmp_path_factory.mktemp("tl")
    study_id = study_id_of(CONFIG)
    files = SeedFiles(root / study_id)
    s = settings(delta=0.05, group_size=4, vocab_size=TINY_VOCAB, staleness=2, minibatches=2, lr=0.05)
    for seed in SEEDS:
        backend = tiny_backend(seed=seed)
        out = study_batch(backend.policy(), scored_batch(backend, seed=seed, sequences=32, group=4), s)
        files.write(seed, out.tokens, {**seed_summary(out.tokens, out.n_tokens), "seconds": 0.0})
    path = root / "results.duckdb"
    assert ingest(path, study_id, CONFIG, root / study_id, SEEDS) == len(SEEDS)
    return path, study_id


# The same definitions as docs/math.md §5, written in SQL against the token rows.
_SQL = """
SELECT seed,
  count(*) AS n_outside,
  count(*) FILTER (WHERE keep_ratio <> {keep}) AS n_dis,
  count(*) FILTER (WHERE keep_ratio <> {keep} AND {keep}) AS n_keep_p,
  count(*) FILTER (WHERE keep_ratio <> {keep} AND {keep} AND {dd} > 0) AS n_unsafe_p,
  count(*) FILTER (WHERE keep_ratio <> {keep} AND {keep} AND {dd} < 0) AS n_corr_p,
  count(*) FILTER (WHERE keep_ratio <> {keep} AND keep_ratio) AS n_keep_r,
  count(*) FILTER (WHERE keep_ratio <> {keep} AND keep_ratio AND dd_ratio > 0) AS n_unsafe_r,
  count(*) FILTER (WHERE keep_ratio <> {keep} AND keep_ratio AND dd_ratio < 0) AS n_corr_r
FROM token_level_tokens WHERE study_id = ? GROUP BY seed ORDER BY seed
"""
_COLS = {
    "predictive": ("keep_pred_agg", "dd_pred_agg"),
    "predictive_uniform": ("keep_pred_uniform", "dd_pred_uniform"),
    "predictive_exact": ("keep_pred_exact", "dd_pred_exact"),
}


def _sql(con: duckdb.DuckDBPyConnection, study_id: str, crit: str) -> dict[int, dict]:
    keep, dd = _COLS[crit]
    cur = con.execute(_SQL.format(keep=keep, dd=dd), [study_id])
    names = [d[0] for d in cur.description]
    return {r[0]: dict(zip(names, r)) for r in cur.fetchall()}


def _rate(num: int, den: int) -> float | None:
    return num / den if den else None


def test_seed_rates_equal_sql_recomputation(db: tuple[Path, str]) -> None:
    path, study_id = db
    con = duckdb.connect(str(path), read_only=True)
    try:
        seeds = {
            r["seed"]: r
            for r in query_frame(
                con, "SELECT * FROM token_level_seeds WHERE study_id = ?", [study_id]
            ).iter_rows(named=True)
        }
        assert sorted(seeds) == list(SEEDS)
        assert sum(r["n_disagree"] for r in seeds.values()) > 0, "the study must have disagreement tokens"
        for crit, (_ddot, suffix) in PREDICTIVE.items():
            sql = _sql(con, study_id, crit)
            for seed, row in seeds.items():
                q = sql.get(seed)
                assert q is not None and row["n_outside"] == q["n_outside"]
                assert row[f"n_disagree{suffix}"] == q["n_dis"]
                assert row[f"n_keep_{crit}"] == q["n_keep_p"]
                assert row[f"n_unsafe_{crit}"] == q["n_unsafe_p"]
                assert row[f"n_corrective_{crit}"] == q["n_corr_p"]
                assert row[f"unsafe_keep_{crit}"] == _rate(q["n_unsafe_p"], q["n_keep_p"])
                ratio = f"ratio{suffix}"  # the ratio criterion on this comparison's disagreement set
                assert (row[f"n_keep_{ratio}"], row[f"n_unsafe_{ratio}"], row[f"n_corrective_{ratio}"]) == (
                    q["n_keep_r"],
                    q["n_unsafe_r"],
                    q["n_corr_r"],
                )
                assert row[f"unsafe_keep_{ratio}"] == _rate(q["n_unsafe_r"], q["n_keep_r"])
        config = con.execute(
            "SELECT config FROM token_level_studies WHERE study_id = ?", [study_id]
        ).fetchone()
        assert config is not None
        stored = json.loads(config[0])
        assert stored["note"] == "test study" and stored["delta"] == 0.05
        assert "cluster" not in stored, "launcher keys are not part of the stored study config"
    finally:
        con.close()


def test_across_seed_summaries_equal_sql(db: tuple[Path, str]) -> None:
    """study_summary on the stored seed rows equals the SQL counts summarised by hand: unsafe-keep means over the
    paired seeds (both rates defined), pooled corrective fractions, disagreement-set means over all seeds."""
    path, study_id = db
    con = duckdb.connect(str(path), read_only=True)
    try:
        summary = study_summary(
            query_frame(con, "SELECT * FROM token_level_seeds WHERE study_id = ?", [study_id])
        )
        assert summary.seeds == SEEDS
        zero = dict.fromkeys(
            ("n_dis", "n_keep_p", "n_unsafe_p", "n_corr_p", "n_keep_r", "n_unsafe_r", "n_corr_r"), 0
        )
        for crit in _COLS:
            sql = _sql(con, study_id, crit)
            rows = [sql.get(s, zero) for s in SEEDS]
            rp = [_rate(r["n_unsafe_p"], r["n_keep_p"]) for r in rows]
            rr = [_rate(r["n_unsafe_r"], r["n_keep_r"]) for r in rows]
            paired = [(a, b) for a, b in zip(rr, rp) if a is not None and b is not None]
            p = summary.pairs[crit]
            assert p.unsafe_keep.n_paired == len(paired) and p.unsafe_keep.n_seeds == len(SEEDS)
            for got, values in (
                (p.unsafe_keep.ratio_mean, [a for a, _ in paired]),
                (p.unsafe_keep.pred_mean, [b for _, b in paired]),
            ):
                assert got.n == len(values) and got.over == "paired seeds"
                if values:
                    mean = sum(values) / len(values)
                    assert got.mean == pytest.approx(mean)
                if len(values) > 1:
                    se = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values))
                    assert got.se == pytest.approx(se)
            assert p.unsafe_keep.n_lower == sum(1 for a, b in paired if b < a)
            assert (p.corrective_pred.k, p.corrective_pred.n) == (
                sum(r["n_corr_p"] for r in rows),
                sum(r["n_keep_p"] for r in rows),
            )
            assert (p.corrective_ratio.k, p.corrective_ratio.n) == (
                sum(r["n_corr_r"] for r in rows),
                sum(r["n_keep_r"] for r in rows),
            )
            assert p.disagree.mean == pytest.approx(sum(r["n_dis"] for r in rows) / len(SEEDS))
            assert p.disagree.n == len(SEEDS)
    finally:
        con.close()


def test_ingest_is_idempotent(db: tuple[Path, str], tmp_path: Path) -> None:
    path, study_id = db
    before = duckdb.connect(str(path), read_only=True)
    counts = before.execute(
        "SELECT (SELECT count(*) FROM token_level_tokens), (SELECT count(*) FROM token_level_seeds)"
    ).fetchone()
    before.close()
    ingest(path, study_id, CONFIG, path.parent / study_id, SEEDS)
    after = duckdb.connect(str(path), read_only=True)
    again = after.execute(
        "SELECT (SELECT count(*) FROM token_level_tokens), (SELECT count(*) FROM token_level_seeds)"
    ).fetchone()
    after.close()
    assert counts == again and counts is not None and counts[0] > 0
