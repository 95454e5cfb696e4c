"""The variational family's report: every artefact from a fixture database built by the real ingest and upserts,
the table's numbers against an independent computation, the page, `python -m reports variational`, missing data."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import duckdb
import numpy as np
import pytest
import yaml
from scipy import stats as sps
from variational_database import (
    ANSWER_LOGP,
    ANSWER_TOKENS,
    FINAL_RUNS,
    GRPO_BASE,
    LOG_RATIO,
    PRIOR_ACC,
    SEED_STEP,
    TRACE_TOKENS,
    build_variational_db,
    final_acc,
    pass_at,
    weighting_rows,
    write_run,
)

import reports.__main__ as cli
from analysis.store import connect, ingest_paths
from predmask.config import conf_dir
from predmask.rl.task import EVAL_SPLITS
from reports.artefact import ReportContext

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
VR_ARTEFACTS = ("vr_accuracy", "vr_pass_at_k", "vr_accuracy_weighting", "vr_length_bias", "vr_results")


@pytest.fixture(scope="module")
def vr_db(tmp_path_factory) -> Path:
    return build_variational_db(tmp_path_factory.mktemp("vrdb"))


@pytest.fixture(scope="module")
def vr_out(vr_db, tmp_path_factory) -> Path:
    """`python -m reports variational` once, in process (main([...]))."""
    out = tmp_path_factory.mktemp("vrout")
    assert cli.main(["variational", "--db", str(vr_db), "--out", str(out)]) == 0
    return out


@pytest.fixture
def vr_ctx(vr_db):
    con = duckdb.connect(str(vr_db), read_only=True)
    yield ReportContext(con=con, out=Path("unused"), draw=False)
    con.close()


def conf_label(group: str, name: str) -> str:
    """A label read straight from the YAML file (independent of predmask.config)."""
    return yaml.safe_load((conf_dir() / group / f"{name}.yaml").read_text())["label"]


def interval_cell(values: list[float]) -> str:
    """Percent mean ± 95% Student-t half-width, written here from scipy (not analysis.training.stats)."""
    x = np.asarray(values, dtype=float)
    if x.size == 1:
        return f"{100 * x[0]:.1f}% (one seed, no interval)"
    half = sps.t.ppf(0.975, x.size - 1) * x.std(ddof=1) / math.sqrt(x.size)
    return f"{100 * x.mean():.1f}% ± {100 * half:.1f}"


def test_every_artefact_is_written_and_valid(vr_out):
    for name in VR_ARTEFACTS[:4]:
        png, pdf = vr_out / f"{name}.png", vr_out / f"{name}.pdf"
        assert png.read_bytes()[:8] == PNG_MAGIC, name
        assert pdf.read_bytes()[:5] == b"%PDF-" and b"%%EOF" in pdf.read_bytes()[-32:], name
    for suffix in (".md", ".tex"):
        assert (vr_out / f"vr_results{suffix}").stat().st_size > 0
    assert not list(vr_out.glob(".*.tmp"))
    # only this family was drawn: no other family's figure
    assert not (vr_out / "fig1_main_comparison.png").exists()


def test_results_table_equals_an_independent_computation(vr_out):
    md = (vr_out / "vr_results.md").read_text()
    results, paper = md.split("### Variational reasoning: the paper's own headline")
    rows = {}
    for line in results.splitlines():
        if line.startswith("| ") and not line.startswith("| method"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[(cells[0], cells[1])] = cells[2:]
    expected = [(conf_label("vr_method", n), est, data, seeds, base) for _, n, est, data, seeds, base in FINAL_RUNS]
    expected.append((conf_label("method", "grpo"), None, None, (0, 1, 2), GRPO_BASE))
    data_words = {"all_weighted": "all K traces, weighted", "best_mixed": "best trace + original data"}
    for label, est, data, seeds, base in expected:
        cells = rows[(label, data_words[data] if data else "—")]
        assert cells[0] == (est or "—") and cells[1] == str(len(seeds))
        for i, split in enumerate(EVAL_SPLITS):
            accs = [final_acc(base, s, split) for s in seeds]
            assert cells[2 + 2 * i] == interval_cell(accs), (label, data, split)
            assert cells[3 + 2 * i] == interval_cell([pass_at(a, 16) for a in accs]), (label, data, split)
    assert rows[("π_θ0 (cached base model)", "—")][2] == interval_cell([PRIOR_ACC])
    # the evaluated runs only: the posterior and weights stages have no row
    assert len(rows) == len(expected) + 1
    # the paper's headline stands apart, labelled as the paper's, with its setting
    assert "8.5%" in paper and "Bespoke-Stratos-4B" in paper and "Qwen3-4B-Base" in paper
    assert "8.5%" not in results
    assert "CPU engine" in results and "cached base model" in results


def test_accuracy_panels_use_the_last_step_and_list_the_seeds(vr_ctx):
    from reports.figures.variational import vr_accuracy, vr_pass_at_k

    res = vr_accuracy.fn(vr_ctx)
    assert res.has_data
    panel = res.panel(EVAL_SPLITS[1])
    line = next(s for s in panel.series if s.label.startswith(conf_label("method", "grpo")))
    assert line.label.endswith("(seeds 0, 1, 2)")
    np.testing.assert_allclose(line.seeds, [final_acc(GRPO_BASE, s, EVAL_SPLITS[1]) for s in (0, 1, 2)])
    assert sorted(r.method for r in res.runs).count("grpo") == 3
    assert not {"posterior", "weights"} & {r.method for r in res.runs}
    passk = vr_pass_at_k.fn(vr_ctx).panel(EVAL_SPLITS[0])
    sft = next(s for s in passk.series if s.label.startswith(conf_label("vr_method", "sft")))
    want = np.mean([[pass_at(final_acc(0.30, s, EVAL_SPLITS[0]), k) for k in range(1, 17)] for s in SEED_STEP], 0)
    np.testing.assert_allclose(sft.y, want)
    assert sft.band is not None and np.all(sft.band[0] <= sft.y) and np.all(sft.y <= sft.band[1])
    one_seed = next(s for s in passk.series if "(seed 0)" in s.label and "gml" in s.label)
    assert one_seed.band is None


def test_length_bias_prints_the_correlation_of_the_traces(vr_ctx):
    from reports.figures.variational import vr_length_bias

    res = vr_length_bias.fn(vr_ctx)
    r_trace = np.corrcoef(TRACE_TOKENS, LOG_RATIO)[0, 1]
    r_answer = np.corrcoef(ANSWER_TOKENS, ANSWER_LOGP)[0, 1]
    assert f"r = {r_trace:.2f}" in res.panels[0].title and f"r = {r_answer:.2f}" in res.panels[1].title
    np.testing.assert_allclose(res.panels[0].series[0].x, TRACE_TOKENS)
    assert [r.run_id for r in res.runs] == ["vr_weights"]


def test_accuracy_weighting_draws_measured_and_predicted(vr_ctx):
    from reports.figures.variational import vr_accuracy_weighting

    res = vr_accuracy_weighting.fn(vr_ctx)
    rows = [r for r in weighting_rows() if r["method"] == "grpo" and r["source"] == "model"]
    panel = next(p for p in res.panels if p.row == "model" and p.title == conf_label("method", "grpo"))
    measured, predicted = panel.get("measured"), panel.get("predicted (closed form)")
    drawn = sorted((r["accuracy"], r["measured_weight"]) for r in rows if r["measured_weight"] is not None)
    np.testing.assert_allclose(np.c_[measured.x, measured.y], drawn)  # the question without a weight is not drawn
    assert len(predicted.x) == len(rows)
    assert {p.row for p in res.panels} == {"model", "bandit"}


def test_page_links_every_artefact_under_the_family_heading(vr_out):
    page = (vr_out / "index.html").read_text()
    refs = set(re.findall(r"(?:src|href)='([^'#]+)'", page))
    for name in VR_ARTEFACTS:
        files = [p.name for p in vr_out.glob(f"{name}.*")]
        assert files and set(files) <= refs, name
        assert f"id='{name}'" in page
    heading = page.index("id='variational'")
    assert all(page.index(f"id='{n}'") > heading for n in VR_ARTEFACTS)
    assert "id='fig1_main_comparison'" in page  # the other sections stay on the page (data only)
    assert "none set (the CPU engine&#x27;s default)" in page  # the stage runs have no precision option
    assert "class=\"paper\"" in page  # the paper's headline is marked as the paper's
    for name in ("vr_accuracy", "vr_results"):  # open on load, the other figures one click away
        section = page[page.index(f"<section id='{name}'>"):]
        assert section.startswith(f"<section id='{name}'><details open>")
    assert page[page.index("<section id='vr_length_bias'>"):].startswith("<section id='vr_length_bias'><details>")


def _runs_without_family(root: Path) -> Path:
    cfg = {"seed": 0, "method": {"name": "grpo"}, "model": {"name": "cpu_s", "stands_in_for": "qwen3_4b_base"},
           "cluster": {"name": "local"}}
    write_run(root, "other_run", cfg, {"metrics.jsonl": json.dumps({"step": 1, "data": {"x": 1.0}}) + "\n"})
    db = root / "other.duckdb"
    con = connect(db)
    ingest_paths(con, [root / "runs"])
    con.close()
    return db


def test_missing_family_data_is_one_line_and_writes_nothing(tmp_path, capsys):
    db = _runs_without_family(tmp_path)
    out = tmp_path / "out"
    assert cli.main(["variational", "--db", str(db), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "sweeps variational_reasoning" in err[0] and "analysis accuracy_weighting" in err[0]
    assert not out.exists()
    # `paper` still draws the family's sections, each naming what fills it, and says so once
    assert cli.main(["paper", "--db", str(db), "--out", str(out), "--only", "vr_results,vr_accuracy"]) == 0
    captured = capsys.readouterr()
    assert "note: no variational-reasoning data" in captured.err
    page = (out / "index.html").read_text()
    assert page.count("sweeps variational_reasoning</code> produces it") == 2



def test_correlation_statistic_against_numpy():
    from analysis.training.stats import correlation

    x = np.array([1.0, 2.0, np.nan, 4.0, 7.0, 3.0])
    y = np.array([2.0, 1.0, 5.0, 6.0, np.inf, 4.0])
    keep = np.isfinite(x) & np.isfinite(y)
    c = correlation(x, y)
    assert c.n == 4 and c.r == pytest.approx(np.corrcoef(x[keep], y[keep])[0, 1])
    assert correlation([1, 1, 1], [1, 2, 3]).r is None and correlation([1, 2], [2, 1]).text() == "r undefined (n = 2)"
    with pytest.raises(ValueError, match="paired values"):
        correlation([1, 2, 3], [1, 2])
