"""`python -m analysis`: the ingest summary, exit codes, and lazy dispatch of delegated subcommands."""

from __future__ import annotations

import subprocess
import sys
import types

import duckdb

import analysis.__main__ as cli


def test_ingest_prints_summary_and_is_idempotent(tmp_path, helpers, capsys):
    helpers.make_run(
        tmp_path,
        "s",
        "r1",
        helpers.cpu_config(),
        {"metrics.jsonl": helpers.jsonl([(1, {"a": 1.0, "t": "x"})]) + '{"step": 2'},
    )
    db = tmp_path / "cli.duckdb"
    assert cli.main(["ingest", str(tmp_path / "runs"), "--db", str(db)]) == 0
    out, err = capsys.readouterr()
    assert "1 run(s) ingested, 0 refused; 1 metric rows added, 0 changed; 1 corrupt line(s)" in out
    assert "0 non-finite and 1 non-numeric value(s) not stored" in out
    assert out.splitlines()[-1] == f"next: python -m reports paper --db {db}"
    assert "metrics.jsonl:2" in err
    assert cli.main(["ingest", str(tmp_path / "runs" / "*" / "*"), "--db", str(db), "-q"]) == 0
    out, _ = capsys.readouterr()
    assert "0 metric rows added, 0 changed" in out
    con = duckdb.connect(str(db), read_only=True)
    assert con.execute("SELECT count(*) FROM metrics").fetchall() == [(1,)]


def test_unmatched_input_exits_non_zero(tmp_path, capsys):
    assert cli.main(["ingest", str(tmp_path / "missing"), "--db", str(tmp_path / "x.duckdb")]) == 1
    err = capsys.readouterr().err
    assert "matched nothing" in err and "(python -m sweeps smoke)" in err


def test_unknown_command_and_usage(capsys):
    assert cli.main(["frobnicate"]) == 2
    assert "valid: ingest, token_level" in capsys.readouterr().err
    assert cli.main([]) == 2
    assert "token_level" in capsys.readouterr().out


def test_delegated_command_is_imported_lazily_and_gets_argv(monkeypatch):
    calls = []
    fake = types.ModuleType("fake_analysis_cmd")
    fake.main = lambda argv: calls.append(argv) or 7
    monkeypatch.setitem(sys.modules, "fake_analysis_cmd", fake)
    monkeypatch.setitem(cli.DELEGATED, "fake", ("fake_analysis_cmd", "a fake analysis"))
    assert cli.main(["fake", "--seeds", "3", "delta=0.1"]) == 7
    assert calls == [["--seeds", "3", "delta=0.1"]]


def test_missing_delegated_module_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(cli.DELEGATED, "ghost", ("analysis.no_such_module_here", "missing"))
    assert cli.main(["ghost"]) == 2
    err = capsys.readouterr().err
    assert "not available" in err and "Traceback" not in err


def test_module_entry_point_runs(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "analysis", "ingest", "--help"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and "attempt" in proc.stdout
