"""The variational reports' hint-use gate, regimes, evaluation splits read from the database and the minimum
detectable difference, on run directories with known metrics ingested by the store's real ingest into DuckDB."""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow.parquet as pq
import pytest
import scipy.stats
from variational_database import EVAL_SIZE, HINT_USE, build_variational_db, stage_config, write_run

import reports.__main__ as cli
from analysis.store import connect, ingest_paths
from predmask import metrics
from reports.artefact import ReportContext
from reports.vr_scores import DECOY_FOLLOW_MIN, HINT_GAIN_MIN, NOT_MEASURED, HintUse, vr_scores

FILTER = "VR here measures a filter, not a posterior"


def _ctx(db: Path) -> ReportContext:
    return ReportContext(con=duckdb.connect(str(db), read_only=True), out=Path("unused"), draw=False)


def _ingest(root: Path) -> Path:
    db = root / "gate.duckdb"
    con = connect(db)
    try:
        ingest_paths(con, [root / "runs"])
    finally:
        con.close()
    return db


def _lines(step: int, values: dict[str, float]) -> str:
    return json.dumps({"step": step, "data": values}) + "\n"


def _evaluation(acc: float, splits: tuple[str, ...]) -> str:
    return _lines(3, {metrics.val_acc(s, 16): acc for s in splits} | {metrics.val_pass(s, 16): acc for s in splits})


def test_hint_use_thresholds_by_hand() -> None:
    ignores = HintUse(None, 3, decoy=0.02, posterior=0.38, prior=0.39)
    assert ignores.failure() == f"posterior ignores its hint (decoy-following 2.0% < 20%): {FILTER}"
    uses = HintUse("traces.k = 8", 3, decoy=DECOY_FOLLOW_MIN, posterior=HINT_GAIN_MIN * 0.39, prior=0.39)
    assert uses.failure() is None and uses.text().endswith(": the posterior uses its hint")
    weak = HintUse("traces.k = 8", 1, decoy=0.5, posterior=0.6, prior=0.39)
    assert weak.failure() == ("traces.k = 8: posterior ignores its hint (q_φ reaches the hinted answer in 60.0%, "
                              f"under 2× π_θ0's 39.0%): {FILTER}")
    assert HintUse(None, 1, decoy=0.5, posterior=0.6, prior=None).failure() is None  # no π_θ0 rate: decoy only


def test_the_fixture_database_fires_the_gate_in_every_vr_artefact(tmp_path: Path) -> None:
    db = build_variational_db(tmp_path)
    out = tmp_path / "out"
    assert cli.main(["variational", "--db", str(db), "--out", str(out)]) == 0
    decoy = 100 * sum(v[metrics.VR_DECOY_HIT] for v in HINT_USE.values()) / len(HINT_USE)
    line = f"posterior ignores its hint (decoy-following {decoy:.1f}% < 20%): {FILTER}"
    md = (out / "vr_results.md").read_text()
    assert md.splitlines()[0] == f"### Variational reasoning: final models (this database) — {line}"
    posterior = 100 * sum(v[metrics.VR_POSTERIOR_CORRECT] for v in HINT_USE.values()) / len(HINT_USE)
    assert f"reaches the hinted answer in {posterior:.1f}% (π_θ0 39.0%; 2 seeds): posterior ignores its hint" in md
    page = (out / "index.html").read_text()
    assert f"<h2>{html.escape(f'Variational reasoning: results table — {line}')}</h2>" in page
    ctx = _ctx(db)
    from reports.figures.variational import title_lines, vr_accuracy, vr_length_bias, vr_pass_at_k

    for artefact in (vr_accuracy, vr_pass_at_k, vr_length_bias):
        result = artefact.fn(ctx)
        assert result.title.endswith(f" — {line}"), artefact.name  # the page's heading and the drawn title
        assert title_lines(result, vr_scores(ctx))[0] == result.title
        assert "q_φ follows a decoy hint in 2.0%" in result.caption, artefact.name


def test_regimes_separate_the_rows_and_the_gate_fires_per_regime(tmp_path: Path) -> None:
    """Two trace counts: K = 4 with a posterior that follows its hint, K = 16 with one that does not (ordered by
    value, not as text)."""
    rates = {16: (0.05, 0.40), 4: (0.45, 0.85)}  # decoy-following, q_φ's hinted-answer rate; π_θ0's is 0.39
    accs = {16: 0.30, 4: 0.50}
    for k, (decoy, posterior) in rates.items():
        for seed in (0, 1):
            traces = {**stage_config("traces", {"name": "traces"}, seed), "traces": {"k": k, "temperature": 1.0}}
            write_run(tmp_path, f"traces_k{k}_s{seed}", traces, {"metrics.jsonl": _lines(0, {
                metrics.VR_DECOY_HIT: decoy, metrics.VR_POSTERIOR_CORRECT: posterior, metrics.VR_PRIOR_CORRECT: 0.39})})
            final = {**stage_config("final", {"name": "vr_acc", "estimator": "acc", "data": "all_weighted"}, seed),
                     "inputs": {"traces": f"traces_k{k}_s{seed}", "weights": "w"}}
            write_run(tmp_path, f"final_k{k}_s{seed}", final,
                      {"metrics.jsonl": _evaluation(accs[k] + 0.02 * seed, ("aime24_standin", "aime25_standin"))})
    scores = vr_scores(_ctx(_ingest(tmp_path)))
    assert [key.regime for key in scores.by_key] == ["traces.k = 4", "traces.k = 16"]
    assert all(len(v) == 2 for v in scores.by_key.values())  # keyed by seed within each regime
    assert scores.gate_lines() == [f"traces.k = 16: posterior ignores its hint (decoy-following 5.0% < 20%): {FILTER}"]
    assert [h.regime for h in scores.hint_use] == ["traces.k = 4", "traces.k = 16"]
    from reports.tables.variational import vr_results_table

    table = vr_results_table(scores)
    assert table.header[3] == "regime" and [row[3] for row in table.rows] == ["traces.k = 4", "traces.k = 16"]
    assert table.rows[0][5].startswith("51.0% ± ")  # mean of 0.50 and 0.52
    assert "traces.k = 4: q_φ follows a decoy hint in 45.0%" in table.note and "uses its hint" in table.note


def test_cluster_split_names_are_read_from_the_database(tmp_path: Path) -> None:
    cluster = {"cluster": {"name": "h20_4x8", "backend": "slurm"}, "model": {"name": "qwen3_4b_base"}}
    for seed, acc in ((0, 0.2), (1, 0.3)):
        cfg: dict[str, Any] = {**stage_config("eval", {"name": "sft", "label": "sft"}, seed), **cluster}
        del cfg["task"]  # the split files set the size: no task.eval_size recorded
        write_run(tmp_path, f"eval_sft_s{seed}", cfg, {"metrics.jsonl": _evaluation(acc, ("aime24", "aime25"))})
    ctx = _ctx(_ingest(tmp_path))
    scores = vr_scores(ctx)
    assert scores.splits == ["aime24", "aime25"]
    from reports.figures.variational import vr_accuracy
    from reports.tables.variational import vr_results_table

    table = vr_results_table(scores)
    assert table.header[4:] == ["aime24 avg@16", "aime24 pass@16", "aime25 avg@16", "aime25 pass@16"]
    assert table.rows[0][4].startswith("25.0% ± ")
    assert [p.title for p in vr_accuracy.fn(ctx).panels] == ["aime24", "aime25"]
    assert "splits aime24 / aime25 (split size not recorded)" in table.note
    assert "Minimum detectable difference: not computed (split size not recorded)" in table.note
    # SFT alone, no VR recipe: no hint-use verdict is owed
    assert scores.gate_lines() == [] and table.title == "Variational reasoning: final models (this database)"


def test_hint_use_ablation_gates_only_the_arm_that_sees_its_hint(tmp_path: Path) -> None:
    """hint.use on and off (conf/sweep/vr_hint_use.yaml): each arm is a regime of the table; the off arm's q_φ has
    no hint to follow, so it is reported but never gated; the on arm's failure names its regime."""
    for use, decoy in ((True, 0.04), (False, 0.01)):
        for seed in (0, 1):
            tid = f"traces_{use}_s{seed}"
            traces = {**stage_config("traces", {"name": "traces"}, seed), "hint": {"template": "{hint} {prompt}",
                                                                                  "use": use}}
            write_run(tmp_path, tid, traces, {"metrics.jsonl": _lines(0, {
                metrics.VR_DECOY_HIT: decoy, metrics.VR_POSTERIOR_CORRECT: 0.4, metrics.VR_PRIOR_CORRECT: 0.39})})
            final = {**stage_config("final", {"name": "vr_gml", "estimator": "gml", "data": "best_mixed"}, seed),
                     "inputs": {"traces": tid, "weights": "w"}}
            write_run(tmp_path, f"final_{use}_s{seed}", final, {"metrics.jsonl": _evaluation(0.3, ("aime24_standin",))})
    scores = vr_scores(_ctx(_ingest(tmp_path)))
    assert [key.regime for key in scores.by_key] == ["hint.use = false", "hint.use = true"]
    assert [h.hinted for h in scores.hint_use] == [False, True]
    assert scores.gate_lines() == [f"hint.use = true: posterior ignores its hint (decoy-following 4.0% < 20%): {FILTER}"]
    assert scores.hint_use[0].text() == ("hint.use = false: no hint: q_φ reaches the correct answer in 40.0% (π_θ0 "
                                         "39.0%; 2 seeds); not gated")


def test_vr_recipes_without_hint_use_metrics_say_so_in_the_title(tmp_path: Path) -> None:
    for seed in (0, 1):
        final = {**stage_config("final", {"name": "vr_acc", "estimator": "acc", "data": "all_weighted"}, seed),
                 "inputs": {"traces": f"t{seed}", "weights": "w"}}
        write_run(tmp_path, f"final_s{seed}", final, {"metrics.jsonl": _evaluation(0.3, ("aime24_standin",))})
    scores = vr_scores(_ctx(_ingest(tmp_path)))
    from reports.tables.variational import vr_results_table

    assert scores.hint_use == [] and scores.gate_lines() == [NOT_MEASURED]
    assert vr_results_table(scores).title.endswith(f" — {NOT_MEASURED}")


def test_length_bias_splits_its_traces_by_regime(tmp_path: Path) -> None:
    """Two weights runs reading the traces of K = 2 and K = 16: one series each (ordered by value), the pooled r in
    the panel's title, each regime's r in the stats and the caption."""
    from variational_database import N_K, N_Q, weights_table

    from reports.figures.variational import LENGTH_PANELS, vr_length_bias

    table = weights_table()
    for k in (16, 2):
        traces = {**stage_config("traces", {"name": "traces"}), "traces": {"k": k, "temperature": 1.0}}
        write_run(tmp_path, f"traces_k{k}", traces, {"metrics.jsonl": _lines(0, {metrics.VR_DECOY_HIT: 0.5})})
        weights = {**stage_config("weights", {"name": "weights"}), "inputs": {"traces": f"traces_k{k}", "prior": "p"}}
        sink = tmp_path / f"w{k}.parquet"
        pq.write_table(table if k == 2 else table.slice(0, N_K * 2), sink)  # K = 16: the first two questions
        write_run(tmp_path, f"weights_k{k}", weights, {"metrics.jsonl": _lines(1, {"weights/seconds": 1.0}),
                                                       "weights.parquet": sink.read_bytes()})
    result = vr_length_bias.fn(_ctx(_ingest(tmp_path)))
    x = np.asarray(table.column("trace_tokens").to_pylist(), dtype=float)
    y = np.asarray(table.column("log_ratio").to_pylist(), dtype=float)
    panel = result.panels[0]
    assert [s.label for s in panel.series] == ["traces.k = 2", "traces.k = 16"]
    assert [len(s.x) for s in panel.series] == [N_Q * N_K, 2 * N_K]
    title = LENGTH_PANELS[0][0]
    r16 = scipy.stats.pearsonr(x[: 2 * N_K], y[: 2 * N_K]).statistic
    assert result.stats[f"{title}, traces.k = 16"].r == pytest.approx(r16)
    pooled = scipy.stats.pearsonr(np.concatenate([x, x[: 2 * N_K]]), np.concatenate([y, y[: 2 * N_K]])).statistic
    assert result.stats[title].r == pytest.approx(pooled) and panel.title.endswith("(all regimes)")
    assert f"traces.k = 16: r = {r16:.2f}" in result.caption


def test_length_bias_draws_the_weights_runs_the_finals_read(tmp_path: Path) -> None:
    """Two weights runs of one traces run (the second left by an earlier prior): only the one a final reads."""
    from variational_database import N_K, weights_table

    from reports.figures.variational import vr_length_bias

    write_run(tmp_path, "traces", stage_config("traces", {"name": "traces"}), {"metrics.jsonl": _lines(0, {})})
    for wid, questions in (("weights_now", 4), ("weights_stale", 2)):
        weights = {**stage_config("weights", {"name": "weights"}), "inputs": {"traces": "traces", "prior": wid}}
        sink = tmp_path / f"{wid}.parquet"
        pq.write_table(weights_table().slice(0, N_K * questions), sink)
        write_run(tmp_path, wid, weights, {"metrics.jsonl": _lines(1, {"weights/seconds": 1.0}),
                                           "weights.parquet": sink.read_bytes()})
    final = {**stage_config("final", {"name": "vr_acc", "estimator": "acc", "data": "all_weighted"}),
             "inputs": {"traces": "traces", "weights": "weights_now"}}
    write_run(tmp_path, "final", final, {"metrics.jsonl": _evaluation(0.3, ("aime24_standin",))})
    result = vr_length_bias.fn(_ctx(_ingest(tmp_path)))
    assert [r.run_id for r in result.runs] == ["weights_now"]
    assert [len(s.x) for s in result.panels[0].series] == [4 * N_K]


def test_minimum_detectable_difference_is_stated_for_the_split_size_and_seeds(tmp_path: Path) -> None:
    scores = vr_scores(_ctx(build_variational_db(tmp_path)))
    from reports.tables.variational import vr_results_table

    note = vr_results_table(scores).note
    trials = EVAL_SIZE * 3  # the fixture's recipes have at most 3 seeds
    mdd = (scipy.stats.norm.ppf(0.975) + scipy.stats.norm.ppf(0.8)) * math.sqrt(0.5 / trials)
    needed = math.ceil((scipy.stats.norm.ppf(0.975) + scipy.stats.norm.ppf(0.8)) ** 2 * 0.5 / (0.03**2 * 3))
    assert f"at n = {EVAL_SIZE} problems x 3 seeds: {100 * mdd:.1f} points" in note
    assert f"needs n ≥ {needed:,} problems per split at 3 seeds" in note
    assert f"splits aime24_standin / aime25_standin, n = {EVAL_SIZE} problems per evaluation split" in note


@pytest.mark.parametrize("name", ["vr_accuracy", "vr_pass_at_k", "vr_length_bias"])
def test_every_vr_figure_names_its_split_size(tmp_path: Path, name: str) -> None:
    from reports.figures import variational

    ctx = _ctx(build_variational_db(tmp_path))
    result = getattr(variational, name).fn(ctx)
    title = variational.title_lines(result, vr_scores(ctx))
    assert any(f"n = {EVAL_SIZE} problems per evaluation split" in line for line in title)


def test_one_verdict_shared_by_regimes_is_one_line() -> None:
    from reports.vr_scores import VrScores

    same = [HintUse(f"traces.k = {k}", 2, decoy=0.026, posterior=0.38, prior=0.39) for k in (1, 2, 32)]
    assert VrScores("rule", hint_use=same).gate_lines() == [
        f"posterior ignores its hint (decoy-following 2.6% < 20%): {FILTER}"]
    mixed = [*same[:2], HintUse("traces.k = 32", 2, decoy=0.4, posterior=0.9, prior=0.39)]
    assert VrScores("rule", hint_use=mixed).gate_lines() == [
        f"traces.k = 1 / traces.k = 2: posterior ignores its hint (decoy-following 2.6% < 20%): {FILTER}"]
