"""Fixtures of the results-library tests: the reports' known-values database (tests/reports/report_database.py),
built once through the real ingest, and the library opened on it with each backend."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# the database builder lives beside the report tests; this folder reuses it rather than keeping a second one
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reports"))

from report_database import build_db


@pytest.fixture(scope="session")
def results_db(tmp_path_factory) -> Path:
    return build_db(tmp_path_factory.mktemp("resultsdb"))


@pytest.fixture
def res(results_db):
    from analysis.results import open_results

    return open_results(results_db)


@pytest.fixture
def res_pl(results_db):
    from analysis.results import open_results

    return open_results(results_db, backend="polars")


@pytest.fixture
def sql(results_db):
    """A separate read-only connection for the direct SQL the frames are checked against."""
    import duckdb

    con = duckdb.connect(str(results_db), read_only=True)
    yield con
    con.close()
