"""The ingest benchmark's measurement on a small file: a real child ingest, every row of the synthetic file stored,
and the peak memory read from the child (no timing is asserted; the numbers are the benchmark's to print)."""

from __future__ import annotations

import json

from analysis.store import ingest_bench


def test_the_benchmark_ingests_every_row_of_its_file_and_reads_the_child_peak(tmp_path):
    r = ingest_bench.measure(tmp_path, lines=40, metrics=5)
    assert r["returncode"] == 0, r["stderr"]
    assert r["rows_stored"] == r["rows_expected"] == 200
    lines = (tmp_path / "bench" / "big" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, 41))
    assert r["file_bytes"] == sum(len(line) + 1 for line in lines)
    assert 10 * 2**20 < r["peak_bytes"] < ingest_bench.PEAK_MAX_BYTES  # a Python process with DuckDB, under the bound
    assert r["target"]["pass"] and r["target"]["limit"] == 1.0
