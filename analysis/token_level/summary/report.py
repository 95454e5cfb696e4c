"""The token-level study's tables: both criteria judged on the same tokens (docs/math.md §5.1), this run beside the
paper's numbers under the paper's definitions (docs/math.md §5), and the checks beyond it.

Reads one study's seeds from the results database (read-only) and renders rich tables, readable at 120 columns.
Every number comes from ``study_stats`` and, for the judgement against the per-token ground truths, ``study_tables``
(whose tables ingest stores and ``reports`` reads). Each table names the share of response tokens outside the trust
region it was measured at; the paper's column is labelled as the paper's (Qwen3 scale, real bf16/FP8 mismatch).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import duckdb
import polars as pl
from rich.console import Console, RenderableType
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from analysis import token_columns
from analysis.paired import WILSON_NOTE, ClusterInterval
from analysis.token_columns import DD_ALL, HEADLINE, OWN_UPDATE, PREDICTIVE, PREDICTIVE_TAILS, RATIO, TAILS
from analysis.token_level.summary.criteria import OUTSIDE, Judgement
from analysis.token_level.summary.study_stats import (
    DISAGREE_SET,
    PAPER_LABEL,
    Estimate,
    MeanSE,
    PairSummary,
    first_order,
    mean_se,
    paper_share_outside,
    paper_text,
    share_outside,
    sign_accuracy,
    study_summary,
    tail_flips,
)
from analysis.token_level.summary.study_tables import StudyJudgement, judge_study

#: how the tables name the criteria
CRITERION_LABELS: dict[str, str] = {
    RATIO: "ratio A(r−1)",
    **{crit: f"predictive, {TAILS[tail]} tail" for crit, tail in PREDICTIVE_TAILS.items()},
}
#: how the tables name the ground truths (docs/math.md §5.1), the own update's first
TRUTH_LABELS: dict[str, str] = {
    OWN_UPDATE: "own update (SGD)",
    token_columns.OWN_UPDATE_ADAM: "own update (Adam)",
    token_columns.COUNTERFACTUAL: "counterfactual",
    DD_ALL: "realised ΔD, all kept",
}
#: the token sets the judgement prints, with the criteria compared on each
SET_CRITERIA: dict[str, tuple[str, ...]] = {
    DISAGREE_SET: (RATIO, HEADLINE),
    OUTSIDE: (RATIO, *PREDICTIVE),
}
SET_LABELS: dict[str, str] = {
    DISAGREE_SET: "disagreement set (aggregated tail)",
    OUTSIDE: "all outside tokens (A ≠ 0)",
}


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


def measured_at(data: StudyData) -> str:
    """Where the study's numbers were measured: its share of response tokens outside the trust region (pooled over
    seeds) beside the paper's band."""
    share = share_outside(data.seeds).fraction
    lo, hi = paper_share_outside()
    here = "—" if share is None else f"{100 * share:.3g}%"
    return f"at {here} of response tokens outside the trust region (paper: {100 * lo:.2g}–{100 * hi:.2g}%, assumed)"


def _ci(ci: ClusterInterval) -> str:
    """ "82.3% [75.1, 88.0]" (seed-cluster bootstrap); without an interval, the estimate and why."""
    text = Estimate(ci.estimate, ci.lo, ci.hi).pct()
    return text if ci.has_interval or ci.estimate is None else f"{text} ({ci.note})"


def _p(p: float | None) -> str:
    return "—" if p is None else f"{p:.3g}"


def titled_table(title: str, caption: str, columns: Sequence[str], left: int = 1) -> Table:
    """A table titled and captioned on the left; its first ``left`` columns left-justified, the others right."""
    t = Table(title=escape(title), title_justify="left", caption=escape(caption), caption_justify="left")
    for i, column in enumerate(columns):
        t.add_column(column, justify="left" if i < left else "right")
    return t


def _set_lines(name: str, j: Judgement) -> str:
    """The set's name and what was judged: tokens, distinct (context, token) pairs, seeds, the share that rises."""
    lines = [SET_LABELS[name], f"{j.n_tokens:,} tokens, {j.seeds.size} seeds"]
    if j.n_contexts is not None:
        lines.append(f"{j.n_contexts:,} distinct (context, token)")
    if j.n_missing:
        lines.append(f"{j.n_missing:,} without a truth, left out")
    rise = j.share_positive.estimate
    if rise is not None:
        lines.append(f"{100 * rise:.1f}% rise ({j.truth} > 0)")
    return "\n".join(lines)


def _judged_table(judged: StudyJudgement, where: str) -> Table:
    t = titled_table(
        f"Both criteria on the same tokens, judged against each token's own update ({OWN_UPDATE}), {where}",
        f"A decision is right when the criterion drops exactly the tokens whose own update raises their D "
        f"({OWN_UPDATE} > 0: first order, through the network, SGD direction). Balanced accuracy: the mean of the "
        "share of rising tokens dropped and of falling tokens kept. Intervals: 95% seed-cluster bootstrap "
        "(seeds resampled). Constant: one decision for every token, the set's majority (its balanced accuracy "
        "is 50%).",
        ("token set", "criterion", "balanced acc. [95% CI]", "accuracy [95% CI]"), left=2,
    )
    for name, crits in SET_CRITERIA.items():
        js = judged.of(name, OWN_UPDATE)
        if RATIO not in js:
            continue
        ratio = js[RATIO]
        rows = [
            (CRITERION_LABELS[c], _ci(js[c].balanced_accuracy), _ci(js[c].accuracy)) for c in crits if c in js
        ]
        const = "drop all (rises)" if ratio.constant_class == "rises" else "keep all (falls)"
        bal = ratio.constant_balanced_accuracy
        rows.append(
            (f"constant: {const}", "—" if bal is None else f"{100 * bal:.1f}%", _ci(ratio.constant_accuracy))
        )
        head = _set_lines(name, ratio).split("\n")
        head += [""] * (len(rows) - len(head))
        for i, row in enumerate(rows):
            rest = head[i:] if i == len(rows) - 1 else head[i : i + 1]
            t.add_row("\n".join(x for x in rest if x), *row, end_section=i == len(rows) - 1)
    return t


def _paired_table(judged: StudyJudgement, where: str) -> Table:
    t = titled_table(
        f"Paired over seeds: predictive − ratio, against the own update ({OWN_UPDATE}), {where}", "",
        ("token set / criterion", "rate", "mean Δ [95% t]", "lower/tied/higher", "sign p", "Wilcoxon p"), left=2,
    )
    notes: list[str] = []
    for name, crits in SET_CRITERIA.items():
        js = judged.of(name, OWN_UPDATE)
        for crit in (c for c in crits if c != RATIO and c in js):
            j = js[crit]
            label = f"{SET_LABELS[name].split(' (')[0]}:\n{CRITERION_LABELS[crit]}"
            for rate, cmp in (("balanced", j.vs_ratio_balanced), ("accuracy", j.vs_ratio_accuracy)):
                if cmp is None:
                    continue
                d = cmp.estimate
                t.add_row(
                    label,
                    rate,
                    d.pp(),
                    f"{d.n_lower}/{d.n_tied}/{d.n_higher} of {d.n_seeds}",
                    _p(d.sign_p),
                    _p(d.wilcoxon_p),
                )
                label = ""
                if cmp.note and cmp.note not in notes:
                    notes.append(cmp.note)
            t.add_section()
    t.caption = escape(
        "Δ: per seed, the criterion's rate minus the ratio criterion's (percentage points), on the seeds where both "
        "are defined; mean with its Student-t interval. lower/tied/higher: seeds where the predictive rate is below / "
        "equal to / above the ratio's. Two-sided sign test on the untied seeds; two-sided Wilcoxon signed-rank test "
        "(tied seeds dropped)." + "".join(f"\n{n}" for n in notes)
    )
    return t


def _truths_table(judged: StudyJudgement, where: str) -> Table | None:
    truths = [tr for tr in TRUTH_LABELS if judged.of(OUTSIDE, tr)]
    if len(truths) < 2:
        return None
    t = titled_table(
        f"The same tokens against each ground truth: balanced accuracy [95% CI], {where}",
        "own update: the first-order change of the token's D under its own update (SGD, or through Adam's "
        "preconditioner); counterfactual: D after the step with the token's gradient minus without it; "
        "realised ΔD: the change after the step that keeps every token (every token's update mixed in).",
        ("token set / criterion", *(f"{TRUTH_LABELS[tr]} ({tr})" for tr in truths)),
    )
    for name, crits in SET_CRITERIA.items():
        by_truth = {tr: judged.of(name, tr) for tr in truths}
        head = [f"{by_truth[tr][RATIO].n_tokens:,} tokens" if RATIO in by_truth[tr] else "—" for tr in truths]
        t.add_row(Text(SET_LABELS[name], style="bold"), *head)
        for crit in crits:
            t.add_row(
                f"  {CRITERION_LABELS[crit]}",
                *[
                    _ci(by_truth[tr][crit].balanced_accuracy) if crit in by_truth[tr] else "—"
                    for tr in truths
                ],
            )
        t.add_section()
    return t


def _agreement_table(judged: StudyJudgement, where: str) -> Table | None:
    rows = judged.tables["token_level_sign_agreement"]
    if rows.height == 0:
        return None
    t = titled_table(
        f"Sign of the own update vs the logit-space prediction A·Ḋ (the paper's §3.4 caveat), {where}",
        "Share of the outside tokens (A ≠ 0) where the network-aware truth and A·Ḋ have the same sign; 95% "
        f"seed-cluster bootstrap interval; beside it the {WILSON_NOTE}.",
        ("truth", "A·Ḋ of", "tokens", "same sign [95% CI]", "Wilson, assumes independent tokens"), left=2,
    )
    tails = {ddot: crit for crit, (ddot, _s) in PREDICTIVE.items()}
    for r in rows.iter_rows(named=True):
        lo, hi = r["agreement_wilson_indep_lo"], r["agreement_wilson_indep_hi"]
        t.add_row(
            f"{TRUTH_LABELS[r['truth']]} ({r['truth']})",
            CRITERION_LABELS[tails[r["ddot"]]].replace("predictive, ", ""),
            f"{r['n_tokens']:,}",
            Estimate(r["agreement"], r["agreement_lo"], r["agreement_hi"]).pct(),
            "—" if lo is None or hi is None else f"[{100 * lo:.1f}, {100 * hi:.1f}]",
        )
    return t


def criteria_section(data: StudyData, judged: StudyJudgement | None = None) -> list[RenderableType]:
    """The report's first section: both criteria judged on the same tokens against the own-update ground truth,
    paired over seeds, beside the other ground truths and the sign agreement; one line saying why when the
    study's tokens carry no own-update truth."""
    judged = judge_study(data.tokens) if judged is None else judged
    where = measured_at(data)
    if judged.reason is not None:
        return [
            Text(
                f"Both criteria on the same tokens: not measured for study {data.study_id}: {judged.reason}."
            )
        ]
    parts: list[RenderableType] = [_judged_table(judged, where), _paired_table(judged, where)]
    parts += [x for x in (_truths_table(judged, where), _agreement_table(judged, where)) if x is not None]
    return parts


def paper_table(data: StudyData) -> Table:
    """docs/math.md §5: outside / disagreement sizes, unsafe-keep rates, seeds where predictive is lower, corrective."""
    summary = study_summary(data.seeds)
    label = str(data.config.get("label", "this run"))
    t = titled_table(
        f"The paper's definitions (§4.2), study {data.study_id}: the paper vs this run, {measured_at(data)}",
        f"this run: {label}; δ={data.config.get('delta')}, K={data.config.get('top_k')}, "
        f"{data.config.get('sequences')} sequences/seed.\n"
        "Means ± SE of per-seed rates are over the paired seeds (both criteria kept a disagreement token); "
        "corrective fractions are pooled over seeds.\n"
        "Paper: Qwen3 scale, real precision mismatch."
        + (" A CPU stand-in reproduces the mechanism, not the paper's numbers." if "CPU stand-in" in label else ""),
        ("quantity", PAPER_LABEL, "this run: aggregated tail", "uniform tail", "exact tail"),
    )
    lo, hi = paper_share_outside()
    t.add_row("seeds", paper_text("seeds"), *[str(summary.n_seeds)] * 3)
    t.add_row("share of response tokens outside", f"{100 * lo:.2g}–{100 * hi:.2g}% (assumed)",
              *[share_outside(data.seeds).pct()] * 3)
    t.add_row("tokens outside the trust region / seed", paper_text("outside_per_seed"), *[summary.outside.count()] * 3)
    per_pair: list[tuple[str, str, Callable[[PairSummary], str]]] = [
        ("disagreement set / seed", "disagree_per_seed", lambda p: p.disagree.count()),
        ("unsafe-keep, predictive (mean ± SE)", "unsafe_keep_predictive", lambda p: p.unsafe_keep.pred_mean.pct()),
        ("unsafe-keep, ratio (mean ± SE)", "unsafe_keep_ratio", lambda p: p.unsafe_keep.ratio_mean.pct()),
        ("seeds where predictive is lower", "seeds_predictive_lower",
         lambda p: f"{p.unsafe_keep.n_lower} of {p.unsafe_keep.n_paired}"),
        ("corrective, predictive (pooled)", "corrective_predictive", lambda p: p.corrective_pred.pct()),
        ("corrective, ratio (pooled)", "corrective_ratio", lambda p: p.corrective_ratio.pct()),
    ]
    for quantity, paper, cell in per_pair:
        cells = [cell(summary.pairs[c]) if c in summary.pairs else "—" for c in PREDICTIVE]
        t.add_row(quantity, paper_text(paper), *cells)
    return t


def beyond_table(data: StudyData) -> Table | None:
    """Sign accuracy on all outside tokens, tail-estimator flips against the exact tail, first-order correlation."""
    tok = data.tokens
    if tok.height == 0:
        return None
    has_ref = DD_ALL in tok.columns and tok.get_column(DD_ALL).null_count() < tok.height
    t = titled_table(
        f"Beyond the paper (same data, all outside tokens), {measured_at(data)}",
        "sign accuracy: P[A·x > 0 ⇔ ΔD_all > 0] per seed, over outside tokens with A≠0, where ΔD_all is "
        "the realised change after the unmasked step; first order: correlation of A·min(r,c)·x with ΔD_all "
        "(x = Ddot, or r−1 for the ratio criterion), pooled.",
        ("criterion", "sign accuracy (mean ± SE)", "first order: Pearson", "Spearman", "sign flips vs exact tail",
         "keep flips vs exact"),
    )
    acc = sign_accuracy(tok) if has_ref else {}
    fo = first_order(tok, float(data.config["ratio_cap"])) if has_ref else {}
    flips = tail_flips(tok)
    flip_key = {crit: TAILS[tail] for crit, tail in PREDICTIVE_TAILS.items()}
    for crit, label in CRITERION_LABELS.items():
        f = flips.get(flip_key.get(crit, ""), None)
        corr = fo.get(crit, {})
        t.add_row(
            label,
            acc[crit].pct() if crit in acc else "—",
            f"{corr['pearson']:.3f}" if corr else "—",
            f"{corr['spearman']:.3f}" if corr else "—",
            f"{f['sign_flips']} of {f['tokens']} ({100 * f['sign_flip_frac']:.1f}%)" if f else "—",
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
    """The judgement on the same tokens first, then the paper's definitions, the checks beyond and the seed line."""
    for part in criteria_section(data):
        console.print(part)
    console.print(paper_table(data))
    extra = beyond_table(data)
    if extra is not None:
        console.print(extra)
    console.print(seed_line(data))
