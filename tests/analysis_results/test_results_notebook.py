"""notebooks/explore_results.ipynb runs from top to bottom with nbclient on a database the test builds: the reports'
known-values runs and one token-level study, found through PREDMASK_DB as a researcher's notebook finds it."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
from report_database import STUDY_CONFIG, STUDY_SEEDS, STUDY_TOKENS, build_db

from analysis.store import connect, upsert_token_level

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "explore_results.ipynb"


@pytest.fixture(scope="module")
def one_study_db(tmp_path_factory) -> Path:
    db = build_db(tmp_path_factory.mktemp("notebookdb"), with_study=False)
    con = connect(db)
    try:
        upsert_token_level(con, "st_tokens", STUDY_CONFIG, pa.table(STUDY_SEEDS), pa.table(STUDY_TOKENS))
    finally:
        con.close()
    return db


def _text(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts.append(out["text"])
        elif "data" in out and "text/plain" in out["data"]:
            parts.append(out["data"]["text/plain"])
    return "".join(parts)


def test_the_notebook_executes(one_study_db, tmp_path, monkeypatch):
    nbclient = pytest.importorskip("nbclient")
    nbformat = pytest.importorskip("nbformat")
    monkeypatch.setenv("PREDMASK_DB", str(one_study_db))
    # the kernel's own inline backend returns the plots as PNG
    monkeypatch.delenv("MPLBACKEND", raising=False)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), (
        "commit the notebook without outputs"
    )
    client = nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # raises CellExecutionError naming the cell on any error
    code = [c for c in nb.cells if c.cell_type == "code"]
    images = [o for c in code for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) == 2, "two plots of its own"
    text = "".join(_text(c) for c in code)
    assert "predmask_kl_agg" in text and "qwen3_4b_bf16" in text  # the smoke sweep's summary
    assert "unsafe-keep, predictive" in text and "34.2%" in text  # the study beside the paper
    assert "error" not in [o.get("output_type") for c in code for o in c.get("outputs", [])]
