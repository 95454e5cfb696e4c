"""Soak: a real local sweep (`python -m sweeps smoke`, two tiny CPU-engine runs) while another process keeps opening
the same DuckDB file, reading and writing it; every run completes and its metrics are in the database exactly as
its metrics file has them, once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from analysis.store import connect

REPO = Path(__file__).resolve().parents[2]
#: two runs of two steps on a base model built in seconds
SMOKE = ["smoke", "method=dppo_topk_kl,predmask_kl_agg", "trainer.steps=2", "trainer.val_every=2",
         "trainer.save_every=2", "trainer.val_n=2", "base.steps=40", "base.eval_problems=16", "task.eval_size=8",
         "trainer.train_batch_size=4", "trainer.ppo_mini_batch_size=2", "rollout.n=4"]

#: the other process: holds the file in turns as a reader and as a writer (a few tenths of a second each, a short
#: gap between), until the stop file appears; it prints how many sessions of each kind it had
HAMMER = """
import random, sys, time
from pathlib import Path
from analysis.store import connect
db, stop = Path(sys.argv[1]), Path(sys.argv[2])
rng, reads, writes = random.Random(0), 0, 0
while not stop.exists():
    read_only = rng.random() < 0.5
    con = connect(db, read_only=read_only, wait_s=600)
    if read_only:
        con.execute("SELECT count(*) FROM metrics").fetchall()
        reads += 1
    else:
        con.execute("CREATE TABLE IF NOT EXISTS soak_noise (i INTEGER)")
        con.execute("INSERT INTO soak_noise VALUES (?)", [writes])
        writes += 1
    time.sleep(rng.uniform(0.1, 0.6))
    con.close()
    time.sleep(0.15)
print(reads, writes, flush=True)
"""


@pytest.mark.slow
def test_a_sweep_survives_a_busy_database_and_ingests_every_run_once(tmp_path: Path) -> None:
    db, runs, stop = tmp_path / "db.duckdb", tmp_path / "runs", tmp_path / "stop"
    env = {**os.environ, "PYTHONPATH": str(REPO), "PREDMASK_DB": str(db), "PREDMASK_RUNS": str(runs),
           "PREDMASK_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    env.pop("PREDMASK_DB_WAIT", None)  # the store's own default wait
    connect(db).close()
    hammer = subprocess.Popen([sys.executable, "-c", HAMMER, str(db), str(stop)], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        sweep = subprocess.run([sys.executable, "-m", "sweeps", *SMOKE], cwd=tmp_path, env=env,
                               capture_output=True, text=True, timeout=600, check=False)
    finally:
        stop.touch()
        counts, _ = hammer.communicate(timeout=120)
    reads, writes = map(int, counts.split())
    assert reads > 0 and writes > 0, "the other process never got the database"
    assert sweep.returncode == 0, sweep.stdout[-3000:] + sweep.stderr[-3000:]

    run_dirs = sorted(p for p in (runs / "smoke").iterdir() if p.is_dir() and not p.name.startswith("."))
    assert len(run_dirs) == 2
    con = connect(db, read_only=True)
    try:
        stored = dict(con.execute("SELECT run_id, status FROM runs").fetchall())
        assert stored == {d.name: "completed" for d in run_dirs}
        for d in run_dirs:
            assert json.loads((d / "status.json").read_text())["status"] == "completed"
            expected: dict[tuple[int, str], float] = {}
            for line in (d / "metrics.jsonl").read_text().splitlines():
                rec = json.loads(line)
                expected.update({(rec["step"], k): float(v) for k, v in rec["data"].items() if v is not None})
            rows = con.execute("SELECT step, name, value FROM metrics WHERE run_id = ?", [d.name]).fetchall()
            assert len(rows) == len(expected)  # once each
            assert {(s, n): v for s, n, v in rows} == expected
        assert con.execute("SELECT count(*) FROM soak_noise").fetchall() == [(writes,)]
    finally:
        con.close()
