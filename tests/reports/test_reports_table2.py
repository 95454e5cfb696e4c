"""Table 2 (main results over seeds) against values computed here from the test database's known curves."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import scipy.stats
from report_database import GRPO_VAL, SEEDS, UNI_OFFSET, dppo_val

from analysis.training import stats as training_stats
from reports import cells
from reports.figures import training as training_figures
from reports.tables import main_results as main_results_table

SETTING4 = "Qwen3-4B-Base · BF16 (CPU stand-in cpu_s, emulated precision)"
ROLLOUT = "Qwen3-30B-A3B-Base · FP8 Rollout (CPU stand-in cpu_moe, emulated precision)"
E2E = "Qwen3-30B-A3B-Base · FP8 E2E (CPU stand-in cpu_moe, emulated precision)"


def half_width(values) -> float:
    x = np.asarray(values, dtype=float)
    return float(scipy.stats.t.ppf(0.975, len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x)))


def trapezoid_mean(steps, values) -> float:
    area = sum((steps[i + 1] - steps[i]) * (values[i] + values[i + 1]) / 2 for i in range(len(steps) - 1))
    return area / (steps[-1] - steps[0])


@pytest.fixture
def table2(ctx_factory):
    return main_results_table.table2_main_results(ctx_factory())


def _rows(result):
    t = result.tables["main"]
    return {(row[0], row[1]): dict(zip(t.header, row)) for row in t.rows}


def test_accuracies_are_means_with_t_intervals_over_seeds(table2):
    rows = _rows(table2)
    dppo = rows[(SETTING4, "DPPO-TopK-KL")]
    final = [dppo_val(6, k) for k in SEEDS]
    assert dppo["seeds"] == "3"
    assert dppo["final val acc"] == f"{100 * np.mean(final):.1f}% ± {100 * half_width(final):.1f}"
    assert dppo["best val acc"] == dppo["final val acc"]  # the curves rise: the best is the last
    aucs = [trapezoid_mean([2, 4, 6], [dppo_val(s, k) for s in (2, 4, 6)]) for k in SEEDS]
    assert dppo["AUC (mean val acc)"] == f"{100 * np.mean(aucs):.1f}% ± {100 * half_width(aucs):.1f}"
    assert dppo["Δ final (pp)"] == "reference" and dppo["paired with"] == "—"
    one = rows[(ROLLOUT, "Predictive (aggregated tail)")]
    assert one["seeds"] == "1" and one["final val acc"] == "70.0% (one seed, no interval)"
    assert one["Δ final (pp)"] == "—"  # no DPPO run in this setting: nothing to pair with


def test_paired_difference_against_dppo_by_seed(table2):
    rows = _rows(table2)
    uni = rows[(SETTING4, "Predictive (uniform tail)")]
    diffs = np.array([UNI_OFFSET[k] for k in SEEDS])
    h = half_width(diffs)
    m = diffs.mean()
    expected = f"{100 * m:+.1f} [{100 * (m - h):+.1f}, {100 * (m + h):+.1f}] (2/3 seeds > 0)"
    assert uni["paired with"] == "DPPO-TopK-KL"
    assert uni["Δ final (pp)"] == expected and uni["Δ AUC (pp)"] == expected  # a constant offset per seed
    agg = rows[(SETTING4, "Predictive (aggregated tail)")]
    assert agg["Δ final (pp)"] == "+0.0 [+0.0, +0.0] (0/3 seeds > 0)"  # the same runs as DPPO's
    (_, by_method) = next((k, r) for k, r in table2.stats if k.title.startswith("Qwen3-4B"))
    assert by_method["predmask_kl_uniform"].vs_final.keys == SEEDS


def test_collapse_counts_per_seed(table2):
    rows = _rows(table2)
    grpo = rows[(E2E, "GRPO clip-higher")]
    assert grpo["collapsed"] == "1/3 seeds (seed 0)"  # seed 1 recovered, seed 2 never fell
    final = [GRPO_VAL[k][-1] for k in SEEDS]
    assert grpo["final val acc"] == f"{100 * np.mean(final):.1f}% ± {100 * half_width(final):.1f}"
    assert rows[(SETTING4, "DPPO-TopK-KL")]["collapsed"] == "0/3 seeds"


def test_labels_and_empty_setting(table2):
    rows = _rows(table2)
    empty = next(v for (setting, _), v in rows.items() if setting.startswith("Qwen3-8B-Base"))
    assert empty["method"] == "no runs with validation" and empty["seeds"] == "0"
    assert empty["setting"] == "Qwen3-8B-Base · BF16 (CPU stand-in cpu_m: no runs)"  # one pair of parentheses
    note = table2.tables["main"].note
    assert "CPU engine: small stand-in models, emulated precision" in note
    assert "mean ± 95% t-interval over n seeds" in note and "docs/results.md" in note
    assert {r.run_id for r in table2.runs} >= {"m_uni_s0", "m_grpo_e2e_s2"}
    assert not any(r.sweep != "main_comparison" for r in table2.runs)


def test_table2_files_and_page(paper):
    out = paper.index.parent
    md = (out / "table2_main_results.md").read_text()
    tex = (out / "table2_main_results.tex").read_text()
    assert "| setting | method | seeds |" in md and "1/3 seeds (seed 0)" in md
    assert r"$\Delta$ final (pp)" in tex and r"\begin{tabular}" in tex and "Δ" not in tex
    page = paper.index.read_text()
    assert "table2_main_results.md" in page and "Table 2: main results" in page


def paired_t_power(d: float, sd: float, n: int) -> float:
    """Two-sided paired t-test power at alpha 0.05, straight from scipy's noncentral t (independent of analysis)."""
    crit = scipy.stats.t.ppf(0.975, n - 1)
    nc = d * math.sqrt(n) / sd
    return float(scipy.stats.nct.sf(crit, n - 1, nc) + scipy.stats.nct.cdf(-crit, n - 1, nc))


def test_detectable_difference_has_80_percent_power_and_the_seeds_a_2_point_difference_needs(table2):
    rows = _rows(table2)
    column = "detectable Δ final (80% power)"
    cell = rows[(SETTING4, "Predictive (uniform tail)")][column]
    mde, n, target, needed = re.fullmatch(r"(\d+\.\d) pp with (\d+) seeds; (\d+) pp needs (\d+) seeds", cell).groups()
    sd = float(np.std([UNI_OFFSET[k] for k in SEEDS], ddof=1))  # the final-accuracy differences, by seed
    assert int(n) == len(SEEDS) and target == "2"
    lo, hi = (float(mde) - 0.05) / 100, (float(mde) + 0.05) / 100  # the cell is rounded to 0.1 pp
    assert paired_t_power(lo, sd, len(SEEDS)) < 0.8 < paired_t_power(hi, sd, len(SEEDS))
    assert paired_t_power(0.02, sd, int(needed) - 1) < 0.8 <= paired_t_power(0.02, sd, int(needed))
    # identical runs: every paired difference is 0, nothing to size; a reference and an unpaired method: no cell
    assert rows[(SETTING4, "Predictive (aggregated tail)")][column] == "n/a (the paired differences have zero SD)"
    assert rows[(SETTING4, "DPPO-TopK-KL")][column] == "—"
    assert rows[(ROLLOUT, "Predictive (aggregated tail)")][column] == "—"
    assert "two-sided paired t-test at α = 0.05 detects with 80% power" in table2.tables["main"].note


def test_one_paired_seed_cannot_size_a_difference():
    one = training_stats.paired_difference("a", {0: 0.3}, "b", {0: 0.2})
    assert cells.detectable(one) == "n/a (needs ≥ 2 seeds)"
    assert cells.detectable(None) == "—"


def test_figure_1_states_what_table_2_states_per_setting(table2, ctx_factory):
    fig1 = training_figures.fig1_main_comparison(ctx_factory())
    rows = _rows(table2)
    column = "detectable Δ final (80% power)"
    expected = " | ".join(
        f"{method} − DPPO-TopK-KL: {rows[(SETTING4, method)][column]}"
        for method in ("Predictive (aggregated tail)", "Predictive (uniform tail)")
    )
    assert fig1.panel("Qwen3-4B-Base").text == f"Qwen3-4B-Base · BF16: {expected}"
    assert [p.text for p in fig1.panels[1:]] == [None, None, None]  # no predictive mask paired in the others
    assert "80% power" in fig1.caption
