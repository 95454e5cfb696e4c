"""Fixtures of the report tests: the known-values database of report_database.py, the whole report drawn once, contexts."""

from __future__ import annotations

from pathlib import Path

import pytest
from report_database import build_db


@pytest.fixture(scope="session")
def report_db(tmp_path_factory) -> Path:
    return build_db(tmp_path_factory.mktemp("reportdb"))


@pytest.fixture(scope="session")
def paper(report_db, tmp_path_factory):
    """The whole report drawn once (figures are the slow part)."""
    from reports.paper import build_paper

    out = tmp_path_factory.mktemp("out")
    result = build_paper(report_db, out)
    assert not result.failures, result.failures
    return result


@pytest.fixture
def ctx_factory(report_db):
    """A data-only ReportContext (draw=False) on the test database; closes its connections."""
    import duckdb

    from reports.artefact import ReportContext

    cons = []

    def make(**kw):
        con = duckdb.connect(str(report_db), read_only=True)
        cons.append(con)
        return ReportContext(con=con, out=Path("unused"), draw=False, **kw)

    yield make
    for c in cons:
        c.close()
