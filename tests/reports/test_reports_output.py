"""The written report: valid PNG/PDF files, the tables, the index page, the CLI and its clear failures."""

from __future__ import annotations

import re
import subprocess
import sys

from report_database import EVAL_SIZE, build_study_only_db

import reports.__main__ as cli
from analysis.store import connect
from predmask.command_text import MAIN_COMPARISON, command
from reports import artefact_registry
from reports.paper import build_paper

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_every_figure_is_a_valid_png_and_pdf(paper):
    figs = artefact_registry.artefacts("figure")
    by_name = {r.name: r for r in paper.results}
    for art in figs:
        files = {f.suffix: f for f in by_name[art.name].files}
        assert set(files) == {".png", ".pdf"}, art.name
        assert files[".png"].read_bytes()[:8] == PNG_MAGIC
        pdf = files[".pdf"].read_bytes()
        assert pdf[:5] == b"%PDF-" and b"%%EOF" in pdf[-32:]
    assert not list(paper.index.parent.glob(".*.tmp"))  # atomic writes left no temporaries


def test_index_references_every_figure_and_table(paper):
    page = paper.index.read_text()
    refs = set(re.findall(r"(?:src|href)='([^'#]+)'", page))
    for art in artefact_registry.artefacts():
        result = next(r for r in paper.results if r.name == art.name)
        assert result.files, art.name
        for f in result.files:
            assert f.name in refs, f.name
            assert f.exists()
    # per figure, the runs it drew from with scale, backend and emulated precision
    assert page.count("runs drawn from") >= 6
    assert "cpu_moe (CPU stand-in for Qwen3-30B-A3B-Base)" in page
    assert "FP8 Rollout (emulated on CPU)" in page and "local (CPU engine)" in page


def test_token_level_summary_keeps_paper_and_database_apart(paper):
    page = paper.index.read_text()
    assert "paper (Qwen3, 61 seeds)" in page and "this database (CPU engine" in page
    summary = next(r for r in paper.results if r.name == "token_level_summary").tables["summary"]
    assert summary.header[1] == "paper (Qwen3, 61 seeds)" and summary.header[2].startswith("this database (")
    rows = {row[0]: row[1:] for row in summary.rows}
    assert rows["tokens outside the trust region per seed (mean ± SE)"][0] == "1,435"
    assert rows["tokens outside the trust region per seed (mean ± SE)"][1].startswith("9.2")  # (6+1+10+20)/4
    assert rows["disagreement set per seed (mean ± SE)"][1].startswith("2.8")  # 11/4 = 2.75
    assert rows["unsafe-keep rate, predictive aggregated (mean ± SE over paired seeds)"][0] == "34.2%"
    assert rows["unsafe-keep rate, ratio (mean ± SE over paired seeds)"] == [
        "36.9%",
        "40.0% ± 5.8 (n = 3 paired seeds)",
    ]
    assert rows["seeds where predictive is lower"] == ["38 of 61", "2 of 3 paired seeds"]
    assert rows["corrective fraction, predictive aggregated (pooled)"] == ["65.1%", "66.7% (2/3)"]
    assert rows["corrective fraction, ratio (pooled)"] == ["62.9%", "66.7% (2/3)"]
    assert rows["unsafe-keep rate, predictive uniform (mean ± SE over paired seeds)"] == [
        "not reported",
        "0.0% (n = 1 paired seeds)",
    ]
    assert rows["corrective fraction, predictive uniform (pooled)"] == ["not reported", "100.0% (1/1)"]
    assert rows["unsafe-keep rate, predictive exact tail (mean ± SE over paired seeds)"][1] == "—"
    md = (paper.index.parent / "token_level_summary.md").read_text()
    assert "| corrective fraction, ratio (pooled) | 62.9% | 66.7% (2/3) |" in md


def test_table1_from_the_run_configs(paper):
    out = paper.index.parent
    md = (out / "table1_hyperparameters.md").read_text()
    tex = (out / "table1_hyperparameters.tex").read_text()
    header = next(line for line in md.splitlines() if line.startswith("| hyperparameter"))
    cols = [c.strip() for c in header.strip("|").split("|")]
    assert cols[1].startswith("Qwen3-4B-Base · BF16") and "cpu_s" in cols[1]
    row = lambda key: [
        c.strip()
        for c in next(line for line in md.splitlines() if line.startswith(f"| {key} |")).strip("|").split("|")
    ]
    assert cols[-1] == "source"  # where each value comes from (reports/tables/value_sources.py)
    assert row("model.hidden_size")[1:4] == ["32", "48", "48"]  # 4B (cpu_s), 30B rollout, 30B e2e (cpu_moe)
    assert row("model.hidden_size")[4].startswith("ours: the CPU stand-in model")
    assert row("top_k")[4].startswith("paper")
    assert row("delta")[1] == "0.05 / 0.15"  # the 4B setting ran at both thresholds
    assert row("trainer.lr")[1:4] == ["0.001"] * 3
    assert "data_path" not in md and "run_dir" not in md  # where a run lives is not a hyperparameter
    m_header = next(line for line in md.splitlines() if line.startswith("| parameter"))
    m_cols = [c.strip() for c in m_header.strip("|").split("|")]
    assert m_cols[1:] == [
        "GRPO clip-higher",
        "DPPO-TopK-KL",
        "Predictive (aggregated tail)",
        "Predictive (uniform tail)",
        "source",
    ]
    m_row = next(line for line in md.splitlines() if line.startswith("| eps_high |"))
    assert [c.strip() for c in m_row.strip("|").split("|")][1:5] == ["0.28", "—", "—", "—"]
    cap = next(line for line in md.splitlines() if line.startswith("| ratio_cap |"))
    assert cap.strip("|").split("|")[-1].strip().startswith("ours:")  # the CPU engine's cap (the cluster: the recipe's)
    # every method's anchor, recorded or its default (the divergence methods' configs do not carry it)
    a_row = next(line for line in md.splitlines() if line.startswith("| anchor |"))
    assert [c.strip() for c in a_row.strip("|").split("|")][1:5] == ["old", "rollout", "rollout", "rollout"]
    assert r"model.hidden\_size" in tex and r"\begin{tabular}" in tex and "Qwen3-4B-Base $\\cdot$ BF16" in tex


def test_cli_paper_one_artefact_and_list(report_db, tmp_path, capsys):
    assert (
        cli.main(["paper", "--db", str(report_db), "--out", str(tmp_path / "o"), "--only", "fig4_corrective"])
        == 0
    )
    assert (tmp_path / "o" / "fig4_corrective.png").read_bytes()[:8] == PNG_MAGIC
    assert "fig4_corrective.png" in (tmp_path / "o" / "index.html").read_text()
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == f"report page: {tmp_path / 'o' / 'index.html'}"  # the last line names the page, nothing after
    assert cli.main(["list", "--db", str(report_db)]) == 0
    out = capsys.readouterr().out
    for art in artefact_registry.artefacts():
        assert art.name in out
    assert "study st_tokens" in out


def test_unknown_study_and_artefact_are_one_line_errors(report_db, tmp_path, capsys):
    assert cli.main(["paper", "--db", str(report_db), "--out", str(tmp_path), "--study", "nope"]) == 1
    err = capsys.readouterr().err
    assert "unknown study 'nope'" in err and "Traceback" not in err
    assert cli.main(["paper", "--db", str(report_db), "--out", str(tmp_path), "--only", "fig9"]) == 1
    assert "unknown artefact 'fig9'" in capsys.readouterr().err


def test_empty_and_missing_database_give_one_clear_line(tmp_path):
    empty = tmp_path / "empty.duckdb"
    connect(empty).close()
    for db in (empty, tmp_path / "missing.duckdb"):
        proc = subprocess.run(
            [sys.executable, "-m", "reports", "paper", "--db", str(db), "--out", str(tmp_path / "o")],
            check=False,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode != 0
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
        assert "Traceback" not in proc.stderr
    assert "is empty" in proc.stderr or "does not exist" in proc.stderr
    assert not (tmp_path / "o" / "index.html").exists()


def test_study_without_runs_draws_empty_training_panels(tmp_path):
    db = build_study_only_db(tmp_path / "study_only.duckdb")
    paper = build_paper(db, tmp_path / "o", only=["fig1_main_comparison", "fig3_unsafe_keep"])
    fig1, fig3 = paper.results
    assert not fig1.has_data and all(p.series == [] for p in fig1.panels) and len(fig1.panels) == 4
    assert fig3.has_data and fig3.stats.n_lower == 1
    assert (tmp_path / "o" / "fig1_main_comparison.png").read_bytes()[:8] == PNG_MAGIC


def test_paper_ends_with_next_lines_naming_the_commands_that_fill_its_empty_artefacts(tmp_path, capsys):
    """A database with a study and no training runs: the page's empty training artefacts are named after it with
    the command that fills them (the main comparison's sweep), and the study's artefacts are not."""
    db = build_study_only_db(tmp_path / "study_only.duckdb")
    cli.main(["paper", "--db", str(db), "--out", str(tmp_path / "o"), "--only", "fig1_main_comparison,fig3_unsafe_keep"])
    out = capsys.readouterr().out.strip().splitlines()
    page = next(i for i, line in enumerate(out) if line.startswith("report page: "))
    nxt = out[page + 1 :]
    assert nxt == [f"next: {command(MAIN_COMPARISON)}   (fills fig1_main_comparison)"], out  # the owner's spelling


def test_every_main_figure_and_table_and_the_page_state_the_evaluation_split_size(paper):
    """fig1, fig2, fig5-fig8 and Table 2 draw runs that record task.eval_size = EVAL_SIZE: each caption (the page's
    text for it) and Table 2's note state it; the variational and token-level artefacts have their own units."""
    stated = f"n = {EVAL_SIZE} problems per evaluation split"
    names = ["fig1_main_comparison", "fig2_tight_threshold", "fig5_training_reward", "fig6_aime24_aime25",
             "fig7_response_length", "fig8_ppo_kl_clipfrac", "table2_main_results"]
    by_name = {r.name: r for r in paper.results}
    assert [n for n in names if stated not in by_name[n].caption] == []
    assert paper.index.read_text().count(stated) >= len(names)
    assert stated in (paper.index.parent / "table2_main_results.md").read_text()


def test_split_size_text_is_a_range_when_runs_differ_and_empty_when_none_records_one():
    from reports.labels import split_size_text

    assert split_size_text([{"task": {"eval_size": 30}}, {"task": {"eval_size": 8}}, {}]) == (
        "n = 8–30 problems per evaluation split")
    assert split_size_text([{}, {"task": "arithmetic"}, {"task": {"eval_size": "30"}}]) == ""
