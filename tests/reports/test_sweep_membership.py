"""A run two sweeps hold is a run of each, for every reader of the database: the variational ablation vr_hint_use
holds the main sweep's runs (its hinted arm has variational_reasoning's run ids), so with both ingested into one
database, in either order, `--sweep vr_hint_use` and `--sweep variational_reasoning` each list every seed that ran
(reports' select_runs and the results table, the library's sweep filter, the page's runs per sweep).

Run directories written here (runs/<sweep>/<run_id>/, CPU engine), ingested by the store's real ingest:
  variational_reasoning: vr_prior, vr_acc_aw_s{0,1,2} (shared), vr_grpo_s{0,1}
  vr_hint_use:           vr_prior, vr_acc_aw_s{0,1,2} (shared, the same directories), vr_acc_bm_s{0,1,2}
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest
import yaml
from variational_database import LAST_STEP, MODEL, eval_metrics, stage_config

from analysis.results import open_results
from analysis.store import connect, ingest_paths
from reports import queries, summary
from reports.artefact import ReportContext

A, B = queries.VR_SWEEP, "vr_hint_use"
SHARED = ("vr_prior", *(f"vr_acc_aw_s{s}" for s in range(3)))
ONLY = {A: tuple(f"vr_grpo_s{s}" for s in range(2)), B: tuple(f"vr_acc_bm_s{s}" for s in range(3))}
HELD = {A: {*SHARED, *ONLY[A]}, B: {*SHARED, *ONLY[B]}}


def _write(root: Path, sweep: str, run_id: str, cfg: dict, base: float, seed: int) -> None:
    d = root / "runs" / sweep / run_id
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    (d / "status.json").write_text(json.dumps({"status": "completed", "step": LAST_STEP, "total_steps": LAST_STEP,
                                               "updated": 1.7e9, "error": None}))
    lines = [{"step": s, "data": {"train/loss": 1.0 / s}} for s in range(1, LAST_STEP)]
    lines.append({"step": LAST_STEP, "data": eval_metrics(base, seed)})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def _build(root: Path, order: tuple[str, str]) -> Path:
    """The two sweep folders (the shared runs copied, as a sweep that runs them again writes them), ingested one
    sweep after the other in ``order`` into one database."""
    _write(root, A, "vr_prior", stage_config("prior", {"name": "prior"}), 0.2, 0)
    for seed in range(3):
        _write(root, A, f"vr_acc_aw_s{seed}", stage_config(
            "final", {"name": "vr_acc", "estimator": "acc", "data": "all_weighted"}, seed), 0.5, seed)
        _write(root, B, f"vr_acc_bm_s{seed}", stage_config(
            "final", {"name": "vr_acc", "estimator": "acc", "data": "best_mixed"}, seed), 0.45, seed)
    for seed in range(2):
        _write(root, A, f"vr_grpo_s{seed}", {"seed": seed, "method": {"name": "grpo"}, "model": dict(MODEL),
                                             "precision": {"name": "bf16"}, "cluster": {"name": "local"}}, 0.38, seed)
    for run_id in SHARED:
        shutil.copytree(root / "runs" / A / run_id, root / "runs" / B / run_id)
    db = root / "results.duckdb"
    with connect(db) as con:
        for sweep in order:
            assert not ingest_paths(con, [root / "runs" / sweep]).refused
    return db


@pytest.fixture(scope="module", params=[(A, B), (B, A)], ids=["main-then-ablation", "ablation-then-main"])
def db(request, tmp_path_factory) -> Path:
    return _build(tmp_path_factory.mktemp("membership"), request.param)


@pytest.fixture
def runs(db):
    with duckdb.connect(str(db), read_only=True) as con:
        return queries.load_runs(con)


def test_every_run_lists_each_sweep_that_holds_it(runs):
    assert {r.run_id: r.sweeps for r in runs} == {
        **dict.fromkeys(SHARED, (A, B)), **dict.fromkeys(ONLY[A], (A,)), **dict.fromkeys(ONLY[B], (B,))}


@pytest.mark.parametrize("sweep", [A, B])
def test_select_runs_by_sweep_lists_the_shared_runs(runs, sweep):
    chosen = queries.select_runs(runs, None, [sweep], None)
    assert {r.run_id for r in chosen.runs} == HELD[sweep]
    assert f"sweep in {{{sweep}}}" in chosen.rule
    family = queries.select_runs(queries.variational_runs(runs), None, [sweep], A)
    assert {r.run_id for r in family.runs} == HELD[sweep]
    both = queries.select_runs(runs, None, [A, B], None).runs
    assert sorted(r.run_id for r in both) == sorted(HELD[A] | HELD[B])  # each run once


def test_the_default_sweep_holds_its_shared_runs(runs):
    chosen = queries.select_runs(queries.variational_runs(runs), None, None, A)
    assert {r.run_id for r in chosen.runs} == HELD[A] and "default for this figure" in chosen.rule


@pytest.mark.parametrize("sweep", [A, B])
def test_the_results_table_has_every_seed_of_the_sweep(db, sweep):
    from reports.vr_scores import vr_scores

    with duckdb.connect(str(db), read_only=True) as con:
        scores = vr_scores(ReportContext(con=con, out=Path("unused"), draw=False, sweeps=(sweep,)))
    seeds = {(k.method, k.data): sorted(v) for k, v in scores.by_key.items()}
    assert seeds[("vr_acc", "all_weighted")] == [0, 1, 2]
    assert (("vr_acc", "best_mixed") in seeds) == (sweep == B) and (("grpo", None) in seeds) == (sweep == A)


def test_the_page_counts_a_shared_run_in_each_sweep(runs):
    rows = {row[0]: row for row in summary.sweeps_table(runs).rows}
    assert rows[A][1:3] == [str(len(HELD[A])), "3 (0, 1, 2)"]
    assert rows[B][1:3] == [str(len(HELD[B])), "3 (0, 1, 2)"]


def test_the_library_filters_by_every_sweep_that_holds_a_run(db):
    res = open_results(db, backend="polars")
    assert res.sweeps() == [A, B]
    for sweep in (A, B):
        frame = res.runs(sweep=sweep)
        assert set(frame.get_column("run_id").to_list()) == HELD[sweep]
        assert set(frame.get_column("sweep").to_list()) == {sweep}
    every = {r["run_id"]: r["sweeps"] for r in res.runs().iter_rows(named=True)}
    assert every["vr_acc_aw_s0"] == f"{A}, {B}" and every["vr_grpo_s0"] == A
    assert set(res.runs(sweep=[B, A]).get_column("run_id").to_list()) == HELD[A] | HELD[B]
    shared_metrics = res.metrics("train/loss", sweep=B).get_column("run_id").unique().to_list()
    assert set(shared_metrics) == HELD[B]


def test_the_variational_report_of_the_ablation_shows_every_seed(db, tmp_path):
    """`python -m reports variational --sweep vr_hint_use`, a real process: the shared arm has its 3 seeds."""
    out = subprocess.run(
        [sys.executable, "-m", "reports", "variational", "--db", str(db), "--out", str(tmp_path), "--sweep", B],
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    md = (tmp_path / "vr_results.md").read_text()
    rows = {}
    for line in md.split("### Variational reasoning: the paper's own headline")[0].splitlines():
        if line.startswith("| ") and not line.startswith("| method"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[1]] = cells[3]  # data setting -> seeds
    assert rows["all K traces, weighted"] == rows["best trace + original data"] == "3"
