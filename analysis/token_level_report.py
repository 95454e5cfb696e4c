"""The token-level study's tables: this run beside the paper's numbers (math.md §5), and the checks beyond it.

Reads one study's seeds from the results database (read-only) and renders rich tables. The paper's column is
labelled as the paper's (Qwen3 scale, real bf16/FP8 mismatch); this run's as what it is (model, emulated precision).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import duckdb
import polars as pl
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from analysis.token_level_stats import (
    PAPER,
    PairSummary,
    first_order,
    mean_se,
    pair_summaries,
    sign_accuracy,
    tail_flips,
)

__all__ = ["StudyData", "beyond_table", "load_study", "paper_table", "print_report"]


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
    con: duckdb.DuckDBPyConnection, study_id: str, seeds: Sequence[int], config: Mapping[str, Any]
) -> StudyData:
    seed_list = [int(s) for s in seeds]
    s = query_frame(
        con,
        "SELECT * FROM token_level_seeds WHERE study_id = ? AND list_contains(?, seed) ORDER BY seed",
        [study_id, seed_list],
    )
    t = query_frame(
        con,
        "SELECT * FROM token_level_tokens WHERE study_id = ? AND list_contains(?, seed) "
        "ORDER BY seed, sequence, position",
        [study_id, seed_list],
    )
    return StudyData(study_id, dict(config), s, t)


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{100 * v:.1f}%"


def _pct_se(m: tuple[float | None, float | None, int]) -> str:
    mean, se, _n = m
    if mean is None:
        return "—"
    return f"{100 * mean:.1f}% ± {100 * se:.1f}" if se is not None else f"{100 * mean:.1f}%"


def _run_label(config: Mapping[str, Any]) -> str:
    return str(config.get("label", "this run"))


def paper_table(data: StudyData) -> Table:
    """math.md §5: outside / disagreement sizes, unsafe-keep rates, seeds where predictive is lower, corrective."""
    seeds = data.seeds.get_column("seed").to_list() if data.seeds.height else []
    pairs = {p.predictive: p for p in pair_summaries(data.tokens, seeds)} if seeds else {}
    t = Table(
        title=f"Token-level study {data.study_id}: the paper vs this run",
        title_justify="left",
        caption=escape(
            f"this run: {_run_label(data.config)}; δ={data.config.get('delta')}, "
            f"K={data.config.get('top_k')}, {data.config.get('sequences')} sequences/seed.\n"
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
    t.add_column("paper (Qwen3, 61 seeds)", justify="right")
    t.add_column("this run: aggregated tail", justify="right")
    t.add_column("uniform tail", justify="right")
    t.add_column("exact tail", justify="right")

    def per_pair(fn: Any) -> list[str]:
        return [
            fn(pairs[c]) if c in pairs else "—"
            for c in ("predictive", "predictive_uniform", "predictive_exact")
        ]

    n = len(seeds)
    outside = float(data.seeds.get_column("n_outside").mean()) if n else 0.0
    t.add_row("seeds", str(PAPER["seeds"]), *[str(n)] * 3)
    t.add_row(
        "tokens outside the trust region / seed",
        f"{PAPER['outside_per_seed']:,.0f}",
        *[f"{outside:,.1f}"] * 3,
    )
    t.add_row(
        "disagreement set / seed",
        f"{PAPER['disagree_per_seed']:.0f}",
        *per_pair(lambda p: f"{p.disagree_mean:.1f}"),
    )
    t.add_row(
        "unsafe-keep, predictive (mean ± SE)",
        _pct(PAPER["unsafe_keep_predictive"]),
        *per_pair(lambda p: _pct_se(p.unsafe_predictive)),
    )
    t.add_row(
        "unsafe-keep, ratio (mean ± SE)",
        _pct(PAPER["unsafe_keep_ratio"]),
        *per_pair(lambda p: _pct_se(p.unsafe_ratio)),
    )
    t.add_row(
        "seeds where predictive is lower",
        f"{PAPER['seeds_predictive_lower']:.0f} of {PAPER['seeds']:.0f}",
        *per_pair(lambda p: f"{p.seeds_predictive_lower} of {p.seeds_compared}"),
    )
    t.add_row(
        "corrective, predictive (pooled)",
        _pct(PAPER["corrective_predictive"]),
        *per_pair(lambda p: f"{_pct(p.corrective_predictive)} of {p.kept_predictive}"),
    )
    t.add_row(
        "corrective, ratio (pooled)",
        _pct(PAPER["corrective_ratio"]),
        *per_pair(lambda p: f"{_pct(p.corrective_ratio)} of {p.kept_ratio}"),
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
    fo = first_order(tok, float(data.config.get("ratio_cap", 10.0))) if has_ref else {}
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
            _pct_se(acc[crit]) if crit in acc else "—",
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
    out_min = int(s.get_column("n_outside").min())
    d_mean, _, _ = mean_se(s.get_column("n_disagree").to_list())
    zero = int((s.get_column("n_outside") == 0).sum())
    return (
        f"{s.height} seeds; outside tokens per seed: min {out_min}, mean {float(s.get_column('n_outside').mean()):.1f}"
        f" (seeds with none: {zero}); disagreement set per seed: mean {d_mean or 0:.1f}, min "
        f"{int(s.get_column('n_disagree').min())}"
    )


def print_report(data: StudyData, console: Console) -> None:
    console.print(paper_table(data))
    extra = beyond_table(data)
    if extra is not None:
        console.print(extra)
    console.print(seed_line(data))


def pairs_as_dicts(pairs: Sequence[PairSummary]) -> list[dict[str, Any]]:
    return [p.__dict__ for p in pairs]
