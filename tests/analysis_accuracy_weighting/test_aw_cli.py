"""`python -m analysis accuracy_weighting` end to end: a tiny base model built into a temporary cache (10 steps of
pretraining), the exact bandit, the database rows, the rerun that changes nothing, and the one-line bad input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

from analysis.__main__ import main as analysis_main


def _overrides(cache: Path) -> list[str]:
    return ["questions=2", "samples=4", "group_size=2", "base.steps=10", "base.eval_problems=8",
            f"paths.cache_dir={cache}", "bandit.group_sizes=[2,3]", "bandit.accuracies=[0.05,0.5,0.95]"]


def test_cli_end_to_end_and_rerun(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "aw.duckdb"
    assert analysis_main(["accuracy_weighting", "--db", str(db), *_overrides(tmp_path / "cache")]) == 0
    out = capsys.readouterr().out
    assert "CPU stand-in" in out and "next: " in out and "reports variational" in out.splitlines()[-1]
    assert "had no correct sample" in out
    con = duckdb.connect(str(db), read_only=True)
    try:
        n_bandit, = con.execute("SELECT count(*) FROM accuracy_weighting WHERE source = 'bandit'").fetchone()
        n_model, = con.execute("SELECT count(*) FROM accuracy_weighting WHERE source = 'model'").fetchone()
        worst, = con.execute("SELECT max(abs(measured_weight - predicted_weight) / greatest(predicted_weight, 1e-12)) "
                             "FROM accuracy_weighting WHERE source = 'bandit'").fetchone()
        model_rows = con.execute("SELECT method, question, accuracy, measured_weight FROM accuracy_weighting "
                                 "WHERE source = 'model' ORDER BY method, question").fetchall()
        analyses, = con.execute("SELECT count(*) FROM accuracy_weighting_analyses").fetchone()
    finally:
        con.close()
    assert (n_bandit, n_model, analyses) == (2 * 3 * 4, 2 * 4, 1)
    assert worst < 1e-9  # the exact bandit, every method in float64
    for method, _q, accuracy, measured in model_rows:  # reinforce / rft are p-hat exactly; no-correct rows are NULL
        if accuracy == 0:
            assert measured is None
        elif method in ("reinforce", "rft"):
            assert measured == pytest.approx(accuracy, rel=1e-4)
    # the same config again: same analysis id, nothing changes
    assert analysis_main(["accuracy_weighting", "--db", str(db), *_overrides(tmp_path / "cache")]) == 0
    assert "(unchanged; analysis row unchanged)" in capsys.readouterr().out
    # a stage's model.pt ({"state_dict", "info"}, as the base cache file is) as checkpoint: the same weights measure
    # the same rows under another analysis id
    (cached,) = (tmp_path / "cache").glob("base-cpu_s-*.pt")
    assert analysis_main(["accuracy_weighting", "--db", str(db), "--bandit-only", *_overrides(tmp_path / "cache")]) == 0
    assert analysis_main(["accuracy_weighting", "--db", str(db), *_overrides(tmp_path / "cache"),
                          f"checkpoint={cached}"]) == 0
    con = duckdb.connect(str(db), read_only=True)
    try:
        ids = [r[0] for r in con.execute("SELECT analysis_id FROM accuracy_weighting_analyses").fetchall()]
        per_id = {i: con.execute("SELECT method, question, accuracy, measured_weight FROM accuracy_weighting "
                                 "WHERE source = 'model' AND analysis_id = ? ORDER BY method, question", [i]).fetchall()
                  for i in ids}
    finally:
        con.close()
    assert len(ids) == 3 and sorted(len(v) for v in per_id.values()) == [0, 8, 8]
    base_rows, ckpt_rows = [v for v in per_id.values() if v]
    assert base_rows == ckpt_rows


def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path: Path) -> None:
    db = tmp_path / "never.duckdb"
    proc = subprocess.run([sys.executable, "-m", "analysis", "accuracy_weighting", "--db", str(db), "samples=5",
                           "group_size=2"], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "samples = 5 is not a multiple of group_size = 2" in proc.stderr
    assert not db.exists()
    proc = subprocess.run([sys.executable, "-m", "analysis", "accuracy_weighting", "--db", str(db),
                           "checkpoint=/nonexistent/run"], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2 and "does not exist" in proc.stderr and not db.exists()
    # the bandit's cases are refused as the measurement refuses them (BanditCase), before anything runs
    proc = subprocess.run([sys.executable, "-m", "analysis", "accuracy_weighting", "--db", str(db),
                           "bandit.accuracies=[0.5,1.0]"], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and not db.exists()
    assert "bandit p = 1.0 is not allowed" in proc.stderr
