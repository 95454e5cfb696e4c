"""vr_traces and the estimator registry on real DuckDB files: a database made with today's estimators, opened in a
fresh interpreter that registered one more estimator, gains its weight column when a writer opens it (a reader writes nothing), keeps its rows, and ingests a run with the
new column; this process's store (today's estimators) still writes to it afterwards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from analysis.store import connect, ingest_run_dir
from analysis.store.connection import table_columns
from predmask.vr_weights import ESTIMATORS, TRACE_FIELDS, weight_column

REPO = Path(__file__).resolve().parents[2]
TODAY = ("weight_acc", "weight_gml", "weight_likelihood")

CHILD = textwrap.dedent('''
    import hashlib, json, sys
    from pathlib import Path

    import torch

    from predmask.vr_weights import register_estimator


    @register_estimator("uniform", label="uniform", inputs=("correct",))
    def _uniform(answer_logp, answer_tokens, correct):
        return torch.zeros(correct.shape[0], dtype=torch.float64)


    from analysis.store import connect, ingest_run_dir
    from analysis.store.connection import table_columns

    db, run = Path(sys.argv[1]), sys.argv[2]
    digest = lambda: hashlib.sha256(db.read_bytes()).hexdigest()
    before = digest()
    con = connect(db, read_only=True)
    reader_columns = table_columns(con, "vr_traces")
    con.close()
    reader_wrote = digest() != before
    con = connect(db)
    writer_columns = table_columns(con, "vr_traces")
    old = con.execute("SELECT * EXCLUDE (weight_uniform), weight_uniform FROM vr_traces ORDER BY ALL").fetchall()
    result = ingest_run_dir(con, run)
    new = con.execute("SELECT trace, weight_uniform FROM vr_traces WHERE run_id = 'w1' ORDER BY ALL").fetchall()
    con.close()
    print(json.dumps({"reader_columns": reader_columns, "reader_wrote": reader_wrote, "writer_columns": writer_columns,
                      "old": old, "vr_traces": result.vr_traces, "warnings": result.warnings, "new": new}))
''')


def _weights_run(root: Path, name: str, estimators: tuple[str, ...]) -> Path:
    """runs/vr/<name>/: a completed weights stage whose weights.parquet has the weight columns of ``estimators``."""
    d = root / "runs" / "vr" / name
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump({"family": "variational", "stage": "weights", "seed": 2,
                                                   "method": {"name": "weights"}, "model": {"name": "cpu_s"}}))
    (d / "status.json").write_text(json.dumps({"status": "completed"}))
    (d / "metrics.jsonl").write_text(json.dumps({"step": 0, "data": {"weights/traces": 2}}) + "\n")
    fields = {"question": [0, 0], "trace": [0, 1], "trace_tokens": [3, 2], "answer_tokens": [4, 4],
              "log_prior": [-3.0, -1.0], "log_posterior": [-1.5, -0.5], "log_ratio": [-0.5, -0.25],
              "answer_logp": [-0.1, -2.0], "acc": [0.5, 0.0], "posterior_correct": [True, False]}
    assert tuple(fields) == TRACE_FIELDS
    weights = {weight_column(e): [0.25 + i / 8, 0.75 - i / 8] for i, e in enumerate(estimators)}
    pq.write_table(pa.table({**fields, **weights}), d / "weights.parquet")
    return d


def test_an_older_database_gains_a_new_estimators_weight_column_and_keeps_its_rows(tmp_path: Path) -> None:
    assert tuple(weight_column(e) for e in ESTIMATORS) == TODAY
    db = tmp_path / "old.duckdb"
    con = connect(db)
    try:
        assert ingest_run_dir(con, _weights_run(tmp_path, "w0", tuple(ESTIMATORS))).vr_traces == 2
        old_rows = con.execute("SELECT * FROM vr_traces ORDER BY ALL").fetchall()
        old_columns = table_columns(con, "vr_traces")
    finally:
        con.close()
    assert old_columns[-3:] == list(TODAY)
    run = _weights_run(tmp_path, "w1", (*ESTIMATORS, "uniform"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", CHILD, str(db), str(run)], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["reader_columns"] == old_columns and got["reader_wrote"] is False
    assert got["writer_columns"] == [*old_columns, "weight_uniform"]
    assert [tuple(r) for r in got["old"]] == [(*r, None) for r in old_rows]
    assert (got["vr_traces"], got["warnings"]) == (2, [])
    assert got["new"] == [[0, 0.25 + 3 / 8], [1, 0.75 - 3 / 8]]
    con = connect(db)  # this process's store: today's estimators, the added column left as it is
    try:
        assert table_columns(con, "vr_traces") == [*old_columns, "weight_uniform"]
        assert ingest_run_dir(con, _weights_run(tmp_path, "w2", tuple(ESTIMATORS))).vr_traces == 2
        counts = con.execute("SELECT run_id, count(*), count(weight_uniform) FROM vr_traces GROUP BY ALL "
                             "ORDER BY ALL").fetchall()
    finally:
        con.close()
    assert counts == [("w0", 2, 0), ("w1", 2, 2), ("w2", 2, 0)]
