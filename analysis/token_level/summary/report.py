"""The token-level study's tables: this run beside the paper's numbers (docs/math.md §5), and the checks beyond it.

Reads one study's seeds from the results database (read-only) and renders rich tables; every number comes from
``analysis.token_level.summary.stats`` (the same functions the figures and tables of ``reports`` call). The
paper's column is labelled as the paper's (Qwen3 scale, real bf16/FP8 mismatch); this run's as what it is
(model, emulated precision).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import duckdb
import polars as pl
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from analysis.token_level.summary.stats import (
    PAPER_LABEL,
    PREDICTIVE,
    MeanSE,
    PairSummary,
    first_order,
    mean_se,
    paper_text,
    sign_accuracy,
    study_summary,
    tail_flips,
)

__all__ = ["StudyData", "beyond_table", "load_study", "paper_table", "print_report", "seed_line"]


@dataclass(frozen=True)
class StudyData:
    """One study's stored rows for a set of seeds."""

    study_id: str
    config: dict[str, Any]
    seeds: pl.DataFrame
    tokens: pl.DataFrame


def query_frame(con: duckdb.DuckDBPyConnection, sql: str, params: Sequence[Any] = ()) -> pl.DataFrame:
    """The result of one query as a polars frame (through Arrow)."""
    return con.sql(sql, params=list(params)).pl()


def load_study(
    con: duckdb.DuckDBPyConnection, study_id: str, seeds: Sequence[int] | None = None
) -> StudyData:
    """A study's config, seed rows and token rows (only ``seeds`` when given), ordered by seed."""
    found = con.execute("SELECT config FROM token_level_studies WHERE study_id = ?", [study_id]).fetchall()
    config = json.loads(found[0][0]) if found and found[0][0] else {}
    where, params = "study_id = ?", [study_id]
    if seeds is not None:
        where, params = where + " AND list_contains(?, seed)", [study_id, [int(s) for s in seeds]]
    s = query_frame(con, f"SELECT * FROM token_level_seeds WHERE {where} ORDER BY seed", params)
    t = query_frame(
        con, f"SELECT * FROM token_level_tokens WHERE {where} ORDER BY seed, sequence, position", params
    )
    return StudyData(study_id, config if isinstance(config, dict) else {}, s, t)


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{100 * v:.1f}%"


def _run_label(config: Mapping[str, Any]) -> str:
    return str(config.get("label", "this run"))


def paper_table(data: StudyData) -> Table:
    """docs/math.md §5: outside / disagreement sizes, unsafe-keep rates, seeds where predictive is lower, corrective."""
    summary = study_summary(data.seeds)
    t = Table(
        title=f"Token-level study {data.study_id}: the paper vs this run",
        title_justify="left",
        caption=escape(
            f"this run: {_run_label(data.config)}; δ={data.config.get('delta')}, "
            f"K={data.config.get('top_k')}, {data.config.get('sequences')} sequences/seed.\n"
            "Means ± SE of per-seed rates are over the paired seeds (both criteria kept a disagreement token); "
            "corrective fractions are pooled over seeds.\n"
            "Paper: Qwen3 scale, real precision mismatch."
            + (
                " A CPU stand-in reproduces the mechanism, not the paper's numbers."
                if "CPU stand-in" in _run_label(data.config)
                else ""
            )
        ),
        caption_justify="left",
    )
    t.add_column("quantity")
    t.add_column(PAPER_LABEL, justify="right")
    t.add_column("this run: aggregated tail", justify="right")
    t.add_column("uniform tail", justify="right")
    t.add_column("exact tail", justify="right")

    def per_pair(fn: Callable[[PairSummary], str]) -> list[str]:
        return [fn(summary.pairs[c]) if c in summary.pairs else "—" for c in PREDICTIVE]

    t.add_row("seeds", paper_text("seeds"), *[str(summary.n_seeds)] * 3)
    t.add_row(
        "tokens outside the trust region / seed",
        paper_text("outside_per_seed"),
        *[summary.outside.count()] * 3,
    )
    t.add_row(
        "disagreement set / seed", paper_text("disagree_per_seed"), *per_pair(lambda p: p.disagree.count())
    )
    t.add_row(
        "unsafe-keep, predictive (mean ± SE)",
        paper_text("unsafe_keep_predictive"),
        *per_pair(lambda p: p.unsafe_keep.pred_mean.pct()),
    )
    t.add_row(
        "unsafe-keep, ratio (mean ± SE)",
        paper_text("unsafe_keep_ratio"),
        *per_pair(lambda p: p.unsafe_keep.ratio_mean.pct()),
    )
    t.add_row(
        "seeds where predictive is lower",
        paper_text("seeds_predictive_lower"),
        *per_pair(lambda p: f"{p.unsafe_keep.n_lower} of {p.unsafe_keep.n_paired}"),
    )
    t.add_row(
        "corrective, predictive (pooled)",
        paper_text("corrective_predictive"),
        *per_pair(lambda p: p.corrective_pred.pct()),
    )
    t.add_row(
        "corrective, ratio (pooled)",
        paper_text("corrective_ratio"),
        *per_pair(lambda p: p.corrective_ratio.pct()),
    )
    return t


def beyond_table(data: StudyData) -> Table | None:
    """Sign accuracy on all outside tokens, tail-estimator flips against the exact tail, first-order correlation."""
    tok = data.tokens
    if tok.height == 0:
        return None
    has_ref = "dd_all" in tok.columns and tok.get_column("dd_all").null_count() < tok.height
    t = Table(
        title="Beyond the paper (same data, all outside tokens)",
        title_justify="left",
        caption=escape(
            "sign accuracy: P[A·x > 0 ⇔ ΔD_all > 0] per seed, over outside tokens with A≠0, where ΔD_all is "
            "the realised change after the unmasked step; first order: correlation of A·min(r,c)·x with ΔD_all "
            "(x = Ddot, or r−1 for the ratio criterion), pooled."
        ),
        caption_justify="left",
    )
    t.add_column("criterion")
    t.add_column("sign accuracy (mean ± SE)", justify="right")
    t.add_column("first order: Pearson", justify="right")
    t.add_column("Spearman", justify="right")
    t.add_column("sign flips vs exact tail", justify="right")
    t.add_column("keep flips vs exact", justify="right")
    acc = sign_accuracy(tok) if has_ref else {}
    fo = first_order(tok, float(data.config["ratio_cap"])) if has_ref else {}
    flips = tail_flips(tok)
    names = {
        "ratio": "ratio A(r−1)",
        "predictive": "predictive, aggregated tail",
        "predictive_uniform": "predictive, uniform tail",
        "predictive_exact": "predictive, exact tail",
    }
    flip_key = {"predictive": "aggregated", "predictive_uniform": "uniform"}
    for crit, label in names.items():
        f = flips.get(flip_key.get(crit, ""), None)
        corr = fo.get(crit, {})
        t.add_row(
            label,
            acc[crit].pct() if crit in acc else "—",
            f"{corr['pearson']:.3f}" if corr else "—",
            f"{corr['spearman']:.3f}" if corr else "—",
            f"{f['sign_flips']} of {f['tokens']} ({_pct(f['sign_flip_frac'])})" if f else "—",
            f"{f['keep_flips']}" if f else "—",
        )
    return t


def seed_line(data: StudyData) -> str:
    """One line on the per-seed sizes (the calibration targets)."""
    s = data.seeds
    if s.height == 0:
        return "no seeds stored"
    summary = study_summary(s)
    zero = int((s.get_column("n_outside") == 0).sum())
    disagree = summary.headline.disagree if summary.headline else mean_se([])
    return (
        f"{s.height} seeds; outside tokens per seed: min {int(s.get_column('n_outside').min())}, mean "
        f"{_mean(summary.outside)} (seeds with none: {zero}); disagreement set per seed: mean "
        f"{_mean(disagree)}, min {int(s.get_column('n_disagree').min())}"
    )


def _mean(m: MeanSE) -> str:
    return "—" if m.mean is None else f"{m.mean:.1f}"


def print_report(data: StudyData, console: Console) -> None:
    console.print(paper_table(data))
    extra = beyond_table(data)
    if extra is not None:
        console.print(extra)
    console.print(seed_line(data))
