"""A real piped `python -m sweeps smoke` (one tiny CPU-engine run) whose runs root, base-model cache and database all
lie in a folder named with a space, a non-ASCII letter and Hydra's and the shell's punctuation (``'``, ``$``, ``=``,
``,``, ``[``): the run directory reaches the trainer as a quoted Hydra override, the run completes and is ingested,
and the piped output carries plain progress lines (runs done / total, the running run's step, elapsed) and ends by
naming the next command."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from analysis.store import connect

REPO = Path(__file__).resolve().parents[2]
ODD = "a b ä'$=,[x"
#: one run of two steps on a base model built in seconds
TINY = ["smoke", "method=dppo_topk_kl", "trainer.steps=2", "trainer.val_every=2", "trainer.save_every=2",
        "trainer.val_n=2", "base.steps=40", "base.eval_problems=16", "task.eval_size=8",
        "trainer.train_batch_size=4", "trainer.ppo_mini_batch_size=2", "rollout.n=4"]
LINE = re.compile(r"sweep smoke: (\d)/1 runs \((\d+)%\)(?: ([0-9a-f]{12}) step (\d+)/(\d+|\?))? "
                  r"\[elapsed \w+(?:, eta \w+)?\]")


@pytest.mark.slow
def test_a_piped_sweep_in_an_oddly_named_folder_runs_ingests_and_shows_steady_progress(tmp_path: Path) -> None:
    odd = tmp_path / ODD
    odd.mkdir()
    db, runs = odd / "results" / "db.duckdb", odd / "runs"
    env = {**os.environ, "PYTHONPATH": str(REPO), "PREDMASK_RUNS": str(runs), "PREDMASK_CACHE": str(odd / "cache"),
           "OMP_NUM_THREADS": "1", "PREDMASK_PROGRESS_INTERVAL_S": "0.2"}
    env.pop("PREDMASK_DB", None)
    proc = subprocess.run([sys.executable, "-m", "sweeps", *TINY, "--db", str(db)], cwd=odd, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900, check=False)
    out = proc.stdout.splitlines()
    assert proc.returncode == 0, "\n".join(out[-40:])

    (run_dir,) = [p for p in (runs / "smoke").iterdir() if p.is_dir() and not p.name.startswith(".")]
    assert (run_dir / "checkpoints").is_dir() and (run_dir / "metrics.jsonl").read_text().count("\n") == 3
    con = connect(db, read_only=True)
    try:
        assert con.execute("SELECT run_id, status, run_dir FROM runs").fetchall() == [
            (run_dir.name, "completed", str(run_dir.resolve()))]
        assert con.execute("SELECT max(step) FROM metrics").fetchall() == [(2,)]
    finally:
        con.close()

    progress = [m for m in map(LINE.fullmatch, out) if m]
    assert len(progress) >= 3, out  # while the run builds its base model and trains, and the final line
    running = [m for m in progress if m.group(1) == "0"]
    assert running and all(m.group(3) == run_dir.name for m in running)
    assert {m.group(5) for m in running} <= {"?", "2"}
    assert progress[-1].group(1, 2) == ("1", "100")
    assert out[-1] == f"next: python -m reports paper --db {shlex.quote(str(db))}"
