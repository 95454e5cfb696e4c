"""`python -m analysis token_level` end to end on a tiny CPU policy: bad input, the table, reruns, the same rows.

The policy is a 1-layer Qwen3 briefly pretrained on a one-operation arithmetic task (a few seconds; conftest's
``checkpoint`` fixture) and passed as ``checkpoint=``, so that rollouts earn some reward and the study has advantages
to work with.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import duckdb
import pytest
from token_level_helpers import tiny_study_overrides

from analysis.token_level.cli import ingest, main
from analysis.token_level.compute.fanout import SeedFiles, WorkerSpec, run_worker
from analysis.token_level.compute.step_settings import StepSettings
from analysis.token_level.compute.study_config import compose_study, settings_of, study_id_of
from analysis.token_level.summary.study_stats import seed_summary, study_summary


def _overrides(checkpoint: Path) -> list[str]:
    return tiny_study_overrides(checkpoint)


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--seeds", "0"], "--seeds must be >= 1, got 0"),
        (["--seeds", "2", "delta=-0.1"], "delta must be a finite number > 0 (the trust-region threshold on D; delta=inf would never bind, i.e. no trust region at all), got -0.1"),
        (["--seeds", "2", "staleness=-1"], "staleness must be an integer >= 0, got -1"),
        (["--seeds", "2", "betas=[0.9,1.5]"], "betas must be two numbers in [0, 1), got [0.9, 1.5]"),
        (["--seeds", "2", "update_path=sideways"], "update_path must be one of auto, split, direct, got 'sideways'"),
        (["--seeds", "2", "top_k=five"], "bad value for top_k: 'five' is not an integer (top_k takes an integer)"),
        (["--seeds", "2", "grad_clip=off"], "bad value for grad_clip: 'off' is not a float (grad_clip takes a float)"),
        (["--seeds", "2", "launcher.threads=2.5"], "bad value for launcher.threads: '2.5' is not an integer"),
        (
            ["--seeds", "2", "checkpoint=/nonexistent/policy.pt"],
            "checkpoint /nonexistent/policy.pt does not exist",
        ),
        (["--seeds", "2", "model=no_such_model"], "unknown model 'no_such_model'; valid:"),
        (["--seeds", "2", "precision=fp4"], "unknown precision 'fp4'; valid:"),
        (["--seeds", "2", "sequences=10"], "sequences must be a positive multiple of group_size"),
        (["--seeds", "2", "--cluster", "nowhere"], "unknown cluster 'nowhere'; valid:"),
        (["--seeds", "2", "no_such_key=1"], "unknown config key 'no_such_key' (conf/token_level.yaml and its groups)"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(
    argv: list[str],
    needle: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PREDMASK_DB", raising=False)
    rc = main([*argv, "--db", str(tmp_path / "db.duckdb"), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and needle in err, err
    assert _files(tmp_path) == []


def test_the_settings_are_the_composed_step_settings() -> None:
    """StudySettings takes every step setting from the composed config (typed by the schema), none from elsewhere."""
    cfg = compose_study(["lr=2e-3", "micro_batch=8", "delta=1", "betas=[0.5,0.75]"])
    s = settings_of(cfg, vocab_size=99)
    assert {f.name: getattr(s, f.name) for f in dataclasses.fields(StepSettings)} == {
        f.name: cfg[f.name] for f in dataclasses.fields(StepSettings)
    }
    assert (s.lr, s.micro_batch, s.delta, s.betas, s.vocab_size) == (2e-3, 8, 1.0, [0.5, 0.75], 99)
    assert isinstance(s.delta, float)  # the schema converted the override `delta=1`
    with pytest.raises(ValueError, match="minibatches must be an integer >= 1, got 0"):
        dataclasses.replace(s, minibatches=0)


def _stored(db: Path) -> tuple[list[int], int]:
    con = duckdb.connect(str(db), read_only=True)
    try:
        seeds = [r[0] for r in con.execute("SELECT seed FROM token_level_seeds ORDER BY seed").fetchall()]
        tokens = con.execute("SELECT count(*) FROM token_level_tokens").fetchone()
        return seeds, int(tokens[0]) if tokens else 0
    finally:
        con.close()


def _token_rows(db: Path) -> list[tuple]:
    con = duckdb.connect(str(db), read_only=True)
    try:
        return con.execute(
            "SELECT * EXCLUDE (study_id) FROM token_level_tokens ORDER BY seed, sequence, position"
        ).fetchall()
    finally:
        con.close()


def _headline(db: Path) -> list[str]:
    """The headline cells of the stored study as study_stats.py prints them, read from the database file."""
    con = duckdb.connect(str(db), read_only=True)
    try:
        summary = study_summary(con.sql("SELECT * FROM token_level_seeds").pl())
    finally:
        con.close()
    cells = [summary.outside.count()]
    for pair in summary.pairs.values():
        u = pair.unsafe_keep
        cells += [
            pair.disagree.count(),
            u.pred_mean.pct(),
            u.ratio_mean.pct(),
            f"{u.n_lower} of {u.n_paired}",
        ]
        cells += [pair.corrective_pred.pct(), pair.corrective_ratio.pct()]
    return cells


def test_study_end_to_end_reruns_and_recovery(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    db, out = tmp_path / "db.duckdb", tmp_path / "out"
    common = ["--db", str(db), "--out", str(out), *_overrides(checkpoint)]
    monkeypatch.setenv("COLUMNS", "400")  # one line per table row: every cell printed whole
    assert main(["--seeds", "2", "--inline", *common]) == 0
    text = capsys.readouterr().out
    assert "paper (Qwen3, 61 seeds)" in text and "CPU stand-in" in text and "emulation" in text
    seeds, n_tokens = _stored(db)
    assert seeds == [0, 1] and n_tokens > 0
    # the CLI prints the numbers study_stats.py computes from the database file, each mean with its seeds
    cells = _headline(db)
    assert cells[0] != "—" and "(n = 2 seeds)" in cells[0]
    for cell in cells:
        assert cell in text, (cell, text)

    # a rerun with more seeds runs only the new one and leaves the finished seeds' files alone
    study_dir = next(p for p in out.iterdir() if p.is_dir())
    files = SeedFiles(study_dir)
    before = {s: files.row_path(s).stat().st_mtime_ns for s in (0, 1)}
    assert main(["--seeds", "3", "--inline", *common]) == 0
    assert "2 stored, 0 finished on disk, 1 to run" in capsys.readouterr().out
    assert {s: files.row_path(s).stat().st_mtime_ns for s in (0, 1)} == before
    assert _stored(db)[0] == [0, 1, 2]

    # a worker that finished seed 3 before the main process died: its files are ingested, nothing is recomputed
    cfg = compose_study(_overrides(checkpoint))
    assert study_id_of(cfg) == study_dir.name
    assert run_worker(WorkerSpec(cfg, str(study_dir), (3,))) == [3]
    mtime = files.row_path(3).stat().st_mtime_ns
    assert main(["--seeds", "4", "--inline", *common]) == 0
    assert "3 stored, 1 finished on disk, 0 to run" in capsys.readouterr().out
    assert files.row_path(3).stat().st_mtime_ns == mtime
    assert _stored(db)[0] == [0, 1, 2, 3]

    # the same seeds in a fresh database and folder give the same token rows
    db2, out2 = tmp_path / "db2.duckdb", tmp_path / "out2"
    assert (
        main(["--seeds", "2", "--inline", "--db", str(db2), "--out", str(out2), *_overrides(checkpoint)]) == 0
    )
    first = [r for r in _token_rows(db) if r[0] in (0, 1)]
    assert first == _token_rows(db2)


@pytest.mark.slow
def test_a_worker_writes_what_it_computed_and_the_ingest_summarises_it(checkpoint: Path, tmp_path: Path) -> None:
    """A seed's file holds its response-token count, batch facts and timings and no statistic; the stored row adds
    the counts and rates of its token rows, recounted here with numpy from the token file."""
    cfg = compose_study([*_overrides(checkpoint), "sequences=64", "lr=0.02", "delta=0.05"])
    study_dir = tmp_path / study_id_of(cfg)
    assert run_worker(WorkerSpec(cfg, str(study_dir), (0,))) == [0]
    files = SeedFiles(study_dir)
    written, tokens = files.read_row(0), files.read_tokens(0)
    assert {"seed", "n_tokens", "seconds", "cpu_seconds", "host"} <= set(written)
    assert not set(written) & (set(seed_summary(tokens, 1)) - {"n_tokens"})

    db = tmp_path / "db.duckdb"
    assert ingest(db, study_dir.name, cfg, study_dir, [0]) == 1
    con = duckdb.connect(str(db), read_only=True)
    try:
        row = con.sql("SELECT * FROM token_level_seeds").pl().row(0, named=True)
    finally:
        con.close()
    assert {k: row[k] for k in written} == written
    keep_ratio = tokens["keep_ratio"].to_numpy().astype(bool)
    keep_pred = tokens["keep_pred_agg"].to_numpy().astype(bool)
    kept = (keep_pred != keep_ratio) & keep_pred
    unsafe = kept & (tokens["dd_pred_agg"].to_numpy() > 0)
    assert row["n_outside"] == tokens.height
    assert row["n_disagree"] == int((keep_pred != keep_ratio).sum()) > 0
    assert (row["n_keep_predictive"], row["n_unsafe_predictive"]) == (int(kept.sum()), int(unsafe.sum()))
    assert row["unsafe_keep_predictive"] == (unsafe.sum() / kept.sum() if kept.any() else None)


def test_submitit_local_workers(checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Seeds fan out to submitit's local executor (separate processes); the main process ingests their files."""
    db, out = tmp_path / "db.duckdb", tmp_path / "out"
    rc = main(["--seeds", "3", "--workers", "2", "--db", str(db), "--out", str(out), *_overrides(checkpoint)])
    assert rc == 0, capsys.readouterr().err
    assert "2 worker(s) on local" in capsys.readouterr().out
    assert _stored(db)[0] == [0, 1, 2]


@pytest.mark.slurm
def test_slurm_job_array(
    slurm_cluster: dict, checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On the emulated Slurm cluster the seeds run as a job array (one task per seed); the main process ingests."""
    db, out = tmp_path / "db.duckdb", tmp_path / "out"
    rc = main(
        [
            "--seeds",
            "2",
            "--cluster",
            "slurm_emulated",
            "--db",
            str(db),
            "--out",
            str(out),
            *_overrides(checkpoint),
        ]
    )
    text = capsys.readouterr()
    assert rc == 0, text.err
    assert "2 worker(s) on slurm_emulated" in text.out
    assert _stored(db)[0] == [0, 1]
    submission = next(out.rglob("*_submission.sh")).read_text()
    assert "#SBATCH --array=0-1" in submission and "--exclusive" not in submission


def test_a_failing_seed_costs_only_itself(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A seed that raises is reported; the worker's other seeds finish and are stored; the exit status is 1."""
    from analysis.token_level.compute import backend

    real = backend.run_seed

    def flaky(b, cfg, settings, seed):
        if seed == 1:
            raise FloatingPointError("injected failure")
        return real(b, cfg, settings, seed)

    monkeypatch.setattr(backend, "run_seed", flaky)
    db = tmp_path / "db.duckdb"
    rc = main(
        ["--seeds", "3", "--inline", "--db", str(db), "--out", str(tmp_path / "out"), *_overrides(checkpoint)]
    )
    err = capsys.readouterr().err
    assert rc == 1
    assert "1 seed(s) failed (1); seed 1: FloatingPointError: injected failure" in err
    assert "1 of 3 seeds are not stored" in err
    assert _stored(db)[0] == [0, 2]


def _not_a_database(root: Path) -> Path:
    path = root / "notes.duckdb"
    path.write_text("not a database\n")
    return path


def _under_a_file(root: Path) -> Path:
    (root / "plain").write_text("x")
    return root / "plain" / "db.duckdb"


@pytest.mark.parametrize(
    ("make_db", "needle"),
    [
        (lambda root: root, "is a directory; give a file path such as"),
        (_not_a_database, "exists but is not a DuckDB database"),
        (_under_a_file, "is a file, not a folder"),
    ],
    ids=["directory", "not-duckdb", "parent-is-a-file"],
)
def test_a_bad_database_path_is_refused_before_any_seed(
    make_db,
    needle: str,
    checkpoint: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The database path is checked before the study prepares anything: no seed file, no config.json, no cache."""
    monkeypatch.chdir(tmp_path)
    db = make_db(tmp_path)
    before = _files(tmp_path)
    rc = main(["--seeds", "2", "--inline", "--db", str(db), "--out", str(tmp_path / "out"), *_overrides(checkpoint)])
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and needle in err and str(db) in err, err
    assert "to run" not in captured.out  # refused before the study's plan was printed
    assert _files(tmp_path) == before and not (tmp_path / "out").exists()


def test_a_piped_study_prints_a_progress_line_per_seed_and_names_the_next_command(
    checkpoint: Path, tmp_path: Path
) -> None:
    """A real `python -m analysis token_level` whose output is a pipe: plain progress lines (one per finished seed
    with the progress interval at 0, then the final one) on stdout and in the study's log file, the table, and the
    command that draws the figures."""
    import os
    import re
    import subprocess
    import sys

    db, out = tmp_path / "db.duckdb", tmp_path / "out"
    env = {**os.environ, "PREDMASK_PROGRESS_INTERVAL_S": "0", "COLUMNS": "200"}
    argv = ["--seeds", "2", "--inline", "--db", str(db), "--out", str(out), *_overrides(checkpoint)]
    proc = subprocess.run(
        [sys.executable, "-m", "analysis", "token_level", *argv],
        cwd=tmp_path, env=env, capture_output=True, text=True, check=False, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    study_id = study_id_of(compose_study(_overrides(checkpoint)))
    shape = re.compile(
        rf"^token-level study {study_id}: (\d)/2 seeds \(\d+%\) seed (\d) done \[elapsed [0-9hms]+(, eta [0-9hms]+)?\]$"
    )
    lines = proc.stdout.splitlines()
    seen = [(m.group(1), m.group(2)) for m in map(shape.match, lines) if m]
    assert seen == [("1", "0"), ("2", "1"), ("2", "1")], proc.stdout  # each seed, then the final line
    log = out / study_id / "study.log"  # the study's log file holds the same lines
    assert f"progress: {log}" in lines
    assert log.read_text().splitlines() == [line for line in lines if shape.match(line)]
    assert lines[-1] == f"next: python -m reports paper --study {study_id} --db {db}"
    assert _stored(db)[0] == [0, 1]
