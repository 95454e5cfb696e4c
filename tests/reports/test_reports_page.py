"""The report page: its summary, the short Table 1, the messages that name the next command, and the page itself
opened in a real headless Chromium (it renders, every image loads, the console stays free of errors)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from browser import PageReport, find_chromium, open_page
from report_database import SEEDS, UNI_OFFSET, build_study_only_db, dppo_val

from analysis.store import connect
from predmask import config
from reports import artefact_registry, queries
from reports.paper import build_paper
from reports.summary import page_summary
from reports.tables import hyperparameters

CHROMIUM = find_chromium()
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None and os.environ.get("CI", "").lower() != "true",
    reason="no chromium on PATH (apt-get install chromium); under CI=true this test runs and fails without it",
)


def _open(page: Path) -> PageReport:
    assert CHROMIUM is not None, "CI=true: the page test needs the distribution's chromium on PATH"
    return open_page(page, CHROMIUM)


# ------------------------------------------------------------------------------------------- the browser


@needs_chromium
def test_the_browser_harness_sees_console_errors_and_broken_images(tmp_path):
    """The checks below can fail: a page with a missing image and a console error is caught on both counts."""
    page = tmp_path / "broken.html"
    page.write_text(
        "<!DOCTYPE html><html><head><title>broken</title></head><body><img src='missing.png'>"
        "<script>console.error('a console error')</script></body></html>"
    )
    report = _open(page)
    assert report.facts["title"] == "broken"
    assert [i["naturalWidth"] for i in report.images] == [0]
    assert any("a console error" in e for e in report.errors)
    assert any("missing.png" in e for e in report.errors)


@needs_chromium
def test_the_page_renders_every_image_loads_no_console_errors(paper):
    report = _open(paper.index)
    assert report.errors == []
    pngs = sorted(f.name for r in paper.results for f in r.files if f.suffix == ".png")
    assert sorted(i["src"] for i in report.images) == pngs and len(pngs) == len(artefact_registry.artefacts("figure"))
    assert all(i["complete"] and i["naturalWidth"] > 0 for i in report.images), report.images
    assert report.facts["title"] == "predmask report"
    assert report.facts["sections"] == ["summary"] + [a.name for a in artefact_registry.artefacts()]
    # collapsible: the main comparison and the tables open, the other figures one click away
    assert set(report.facts["open"]) == {
        "fig1_main_comparison",
        "table1_hyperparameters",
        "table2_main_results",
        "token_level_summary",
    }
    text = report.facts["text"]
    assert text.index("Summary") < text.index("What ran") < text.index("Figure 1")


@needs_chromium
def test_a_page_with_empty_sections_renders(tmp_path):
    """A database with a token-level study and no runs: the training sections are empty and name their sweep."""
    db = build_study_only_db(tmp_path / "study_only.duckdb")
    paper = build_paper(
        db, tmp_path / "o", only=["fig2_tight_threshold", "fig3_unsafe_keep", "table1_hyperparameters"]
    )
    assert not paper.failures
    report = _open(paper.index)
    assert report.errors == []
    assert len(report.images) == 2 and all(i["naturalWidth"] > 0 for i in report.images)
    page = paper.index.read_text()
    assert "<code>python -m sweeps tight_threshold</code> produces it" in page
    assert "not run yet: python -m sweeps main_comparison" in page
    assert "No training runs in this database: python -m sweeps smoke" in page


# ------------------------------------------------------------------------------------------- the summary


def test_summary_counts_runs_and_seeds_per_sweep(ctx_factory):
    ctx = ctx_factory()
    summary = page_summary(ctx, [])
    rows = {row[0]: dict(zip(summary.ran.header, row)) for row in summary.ran.rows}
    # report_database: 3 methods x 3 seeds + 1 fp8_rollout run + 3 GRPO seeds in main_comparison
    assert rows["main_comparison"]["runs"] == str(3 * len(SEEDS) + 1 + 3)
    assert rows["main_comparison"]["seeds"] == "3 (0, 1, 2)"
    assert rows["main_comparison"]["methods"] == "4"
    assert rows["smoke"]["runs"] == "1" and rows["tight_threshold"]["runs"] == "1"
    assert {r["where"] for r in rows.values() if r["runs"] != "0"} == {"local (CPU engine)"}
    # a sweep of conf/sweep the database has no run of (the variational family's here) names its command
    assert rows["variational_reasoning"]["runs"] == "0"
    assert rows["variational_reasoning"]["scale"].endswith("-m sweeps variational_reasoning")
    assert "cpu_moe (CPU stand-in for Qwen3-30B-A3B-Base)" in rows["main_comparison"]["scale"]
    assert set(rows) == set(config.group_options("sweep"))
    assert summary.where.startswith("15 training run(s): 15 on the CPU engine")
    assert "st_tokens: 4 seeds" in summary.studies


def test_summary_headline_is_table2_and_the_token_level_table(ctx_factory):
    summary = page_summary(ctx_factory(), [])
    assert summary.training_label.startswith("ours (small-scale, CPU engine")
    rows = {(row[0].split(" (")[0], row[2]): row for row in summary.training.rows}
    uni = rows[("Qwen3-4B-Base · BF16", "Predictive (uniform tail) − DPPO-TopK-KL")]
    # the uniform runs' validation is DPPO's plus UNI_OFFSET[seed] at every evaluation
    mean_offset = sum(UNI_OFFSET.values()) / len(UNI_OFFSET)
    assert uni[3].startswith(f"{100 * mean_offset:+.1f} [") and uni[3].endswith("(2/3 seeds > 0)")
    final = sum(dppo_val(6, s) for s in SEEDS) / len(SEEDS) + mean_offset
    assert uni[1].startswith(f"Predictive (uniform tail): {100 * final:.1f}% ± ")
    agg = rows[("Qwen3-4B-Base · BF16", "Predictive (aggregated tail) − DPPO-TopK-KL")]
    assert agg[3].startswith("+0.0") and agg[3].endswith("(0/3 seeds > 0)")  # identical runs
    token = {row[0]: row[1:] for row in summary.token_level.rows}
    assert summary.token_level.header[1] == "paper (Qwen3, 61 seeds)"
    assert summary.token_level.header[2].startswith("ours: CPU engine, cpu_s")
    # paired seeds 0-2 (seed 3 has no ratio rate): predictive (0.25 + 0.5 + 0.2) / 3
    assert token["unsafe-keep rate, predictive aggregated (mean ± SE over paired seeds)"][0] == "34.2%"
    assert token["unsafe-keep rate, predictive aggregated (mean ± SE over paired seeds)"][1].startswith("31.7%")
    assert token["seeds where predictive is lower"] == ["38 of 61", "2 of 3 paired seeds"]


def test_summary_of_a_database_without_runs_or_study(tmp_path):
    db = tmp_path / "grid_only.duckdb"
    connect(db).close()
    import duckdb

    from reports.artefact import ReportContext

    con = duckdb.connect(str(db), read_only=True)
    try:
        summary = page_summary(ReportContext(con=con, out=tmp_path, draw=False), [])
    finally:
        con.close()
    assert summary.training.rows == []
    assert all(row[1] == "0" and row[-1].startswith("not run yet: python -m sweeps ") for row in summary.ran.rows)
    assert summary.studies.startswith("No token-level study in this database (python -m analysis token_level")
    assert all(row[2] == "—" for row in summary.token_level.rows)


# ------------------------------------------------------------------------------------------- Table 1


def _run(run_id: str, model: dict, precision: dict, lr: float = 1e-4) -> queries.RunInfo:
    cfg = {"model": model, "precision": precision, "trainer": {"lr": lr}, "method": {"name": "dppo_topk_kl"}}
    return queries.RunInfo(run_id, "s", "dppo_topk_kl", 0.15, model["name"], precision["name"], 0, "local", "completed", cfg)


def test_table1_shows_only_what_differs_and_applies():
    """Two settings whose runs both carry precision.fp8_activations from a default (conf/precision's files do not
    set it) and model keys of their own option files: the short table keeps what differs where it applies."""
    for name in ("bf16", "fp8_rollout"):
        assert "fp8_activations" not in yaml.safe_load((config.conf_dir() / "precision" / f"{name}.yaml").read_text())
    moe_file = yaml.safe_load((config.conf_dir() / "model" / "cpu_moe.yaml").read_text())
    assert moe_file["num_experts"] == 8
    runs = [
        _run("a", {"name": "cpu_s", "stands_in_for": "qwen3_4b_base", "hidden_size": 64, "num_experts": 8},
             {"name": "bf16", "fp8_activations": True}),
        _run("b", {"name": "cpu_moe", "stands_in_for": "qwen3_30b_a3b_base", "hidden_size": 64, "num_experts": 8},
             {"name": "fp8_rollout", "fp8_activations": True}),
    ]
    full, short, _ = hyperparameters.hyperparameter_tables(runs)
    assert full.header[-1] == "source"
    full_rows = {row[0]: row[1:-1] for row in full.rows}
    short_rows = {row[0]: row[1:] for row in short.rows}
    assert full_rows["precision.fp8_activations"] == ["true", "true"]  # the full table: everything the runs carry
    assert full_rows["trainer.lr"] == ["0.0001", "0.0001"]
    assert "precision.fp8_activations" not in short_rows  # carried only from a default: applies to neither
    assert "trainer.lr" not in short_rows and "model.hidden_size" not in short_rows  # the same in both
    assert short_rows["model.num_experts"] == ["", "8"]  # cpu_s's file does not set it: empty, and so it differs
    assert short_rows["precision.name"] == ["bf16", "fp8_rollout"]
    assert short_rows["model.name"] == ["cpu_s", "cpu_moe"]
    assert "conf/<group>/<option>.yaml" in short.note  # the rule is stated with the table


def test_applies_reads_the_option_files():
    assert hyperparameters.applies({"model": {"name": "cpu_moe"}}, "model.num_experts")
    assert not hyperparameters.applies({"model": {"name": "cpu_s"}}, "model.num_experts")
    assert not hyperparameters.applies({"precision": {"name": "bf16"}}, "precision.fp8_activations")
    assert hyperparameters.applies({"precision": {"name": "bf16"}}, "precision.name")
    assert hyperparameters.applies({"model": {"name": "qwen3_4b_base"}}, "model.batch.lr")  # nested keys of the file
    assert hyperparameters.applies({"model": {"name": "a_removed_model"}}, "model.anything")  # unknown option: as carried
    assert hyperparameters.applies({"trainer": {"lr": 1}}, "trainer.lr")  # no config group: as carried
    assert hyperparameters.applies({"setting": {"name": "qwen3_4b_bf16"}}, "setting.label")  # a _global_ option's block


def test_the_page_shows_the_short_table1_and_the_full_one_a_click_away(paper):
    page = paper.index.read_text()
    section = page[page.index("<section id='table1_hyperparameters'>") :]
    section = section[: section.index("</section>")]
    result = next(r for r in paper.results if r.name == "table1_hyperparameters")
    short, full = result.tables["differing"], result.tables["training"]
    assert 0 < len(short.rows) < len(full.rows)
    assert section.index(short.title) < section.index("<details><summary>the full table") < section.index(full.title)
    assert section.count('<td class="">trainer.lr</td>') == 1  # the full table only


# ------------------------------------------------------------------------------------------- next steps


def _paper_cli(cwd: Path, db: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PREDMASK_RUNS", "PREDMASK_DB")}
    return subprocess.run(
        [sys.executable, "-m", "reports", "paper", "--db", str(db), "--out", str(cwd / "o")],
        cwd=cwd,
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_missing_database_says_what_to_run_first(tmp_path):
    db = tmp_path / "results" / "none.duckdb"
    proc = _paper_cli(tmp_path, db)
    assert proc.returncode == 1
    (line,) = [x for x in proc.stderr.splitlines() if x.strip()]
    assert line.startswith(f"error: results database {db} does not exist: nothing has run yet: first ")
    assert f"python -m sweeps smoke --db {db}" in line and f"python -m sweeps main_comparison --db {db}" in line
    assert "ingest" not in line
    assert line.endswith(f"then python -m reports paper --db {db}")


def test_missing_database_with_run_directories_says_ingest(tmp_path):
    run = tmp_path / "runs" / "smoke" / "r1"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("seed: 0\n")
    db = tmp_path / "none.duckdb"
    proc = _paper_cli(tmp_path, db)
    assert proc.returncode == 1
    (line,) = [x for x in proc.stderr.splitlines() if x.strip()]
    assert "runs holds 1 run directory not in the database: python -m analysis ingest runs --db" in line
    assert "python -m sweeps" not in line
