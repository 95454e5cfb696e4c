"""The run directory's files (predmask.rundir): the one metrics parser and its step rule, read alike by the trainer's
resume and by ingest; config.yaml as plain safe YAML; status.json; the attempt files."""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path

import pytest
import yaml

from predmask.rundir import (
    CORRUPT_METRICS_FILE,
    METRICS_FILE,
    YAML_LOADER,
    DamagedFileError,
    MetricsWriter,
    StatusError,
    Truncation,
    as_step,
    attempt_files,
    cut_metrics,
    last_step,
    metrics_line,
    parse_metrics,
    read_config,
    read_metrics,
    read_status,
    truncate_metrics,
    write_config,
    write_status,
)


# ----------------------------------------------------------------------------------------------- the step rule
@pytest.mark.parametrize(("value", "step"), [(0, 0), (7, 7), (4.0, 4), (-0.0, 0), (10**12, 10**12)])
def test_a_step_is_an_integer_or_an_integral_number(value: object, step: int) -> None:
    assert as_step(value) == step and type(as_step(value)) is int


@pytest.mark.parametrize("value", [4.5, 0.1, math.inf, math.nan, True, False, "3", None, [1], {"s": 1}])
def test_anything_else_is_refused_in_one_line(value: object) -> None:
    with pytest.raises(ValueError, match="is not a whole number") as info:
        as_step(value)
    assert "\n" not in str(info.value) and "allowed: a JSON integer or an integral number such as 4.0" in str(info.value)


def test_a_non_integral_step_is_one_bad_line_naming_the_step(tmp_path: Path) -> None:
    path = tmp_path / METRICS_FILE
    path.write_text('{"step": 1, "data": {"a": 1}}\n{"step": 2.5, "data": {"a": 2}}\n{"step": 3, "data": {"a": 3}}\n')
    parsed = parse_metrics(path)
    assert [(r.line, r.step) for r in parsed.records] == [(1, 1), (3, 3)]
    (bad,) = parsed.bad
    assert (bad.line, bad.text, bad.last) == (2, b'{"step": 2.5, "data": {"a": 2}}', False)
    assert bad.reason == "step 2.5 is not a whole number; allowed: a JSON integer or an integral number such as 4.0"


# ----------------------------------------------------------------------------------------------- both writers
def test_the_trainers_writer_round_trips_and_writes_null_for_non_finite(tmp_path: Path) -> None:
    path = tmp_path / METRICS_FILE
    writer = MetricsWriter(path)
    try:
        writer.log({"a": 0.25, "n": 3, "bad": math.nan, "inf": -math.inf}, step=0)
        writer.log({"a": 0.5}, step=1)
    finally:
        writer.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]  # independent: plain json
    assert lines == [{"step": 0, "data": {"a": 0.25, "n": 3, "bad": None, "inf": None}},
                     {"step": 1, "data": {"a": 0.5}}]
    assert read_metrics(path) == lines
    assert metrics_line(1, {"a": 0.5}) == path.read_text().splitlines(keepends=True)[1]


@pytest.mark.verl
def test_verls_own_file_logger_output_parses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """verl's FileLogger (orjson, numpy values, NaN as null) writes lines the one parser reads as written."""
    np = pytest.importorskip("numpy")
    tracking = pytest.importorskip("verl.utils.tracking")
    path = tmp_path / METRICS_FILE
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(path))
    logger = tracking.FileLogger("p", "e")
    logger.log({"critic/score/mean": np.float64(0.5), "val": np.float32(0.25), "nan": float("nan")}, step=0)
    logger.log({"critic/score/mean": 0.75}, step=np.int64(1))
    logger.finish()
    parsed = parse_metrics(path)
    assert parsed.bad == [] and [r.step for r in parsed.records] == [0, 1]
    assert parsed.records[0].data == {"critic/score/mean": 0.5, "val": 0.25, "nan": None}
    assert parsed.records[1].data == {"critic/score/mean": 0.75}


# ----------------------------------------------------------------------------------------------- trainer and ingest agree
#: a file with every kind of line: valid, integral float step, non-integral step, bool step, not JSON, wrong shape,
#: blank, a step going backwards, non-numeric and non-finite values, and a torn last line
MIXED = "\n".join([
    json.dumps({"step": 0, "data": {"val": 0.1}}),
    json.dumps({"step": 1, "data": {"a": 1.0, "text": "x"}}),
    json.dumps({"step": 2.0, "data": {"a": 2.0}}),
    json.dumps({"step": 2.5, "data": {"a": 99.0}}),
    json.dumps({"step": True, "data": {"a": 98.0}}),
    "not json",
    json.dumps({"step": 3}),
    "",
    json.dumps({"step": 3, "data": {"a": 3.0, "n": None}}),
    '{"step": 4, "data": {"a": NaN, "b": 4.0}}',
    '{"step": 5, "da',
])


def test_the_trainer_and_ingest_read_the_same_records_from_the_same_file(tmp_path: Path) -> None:
    from analysis.store import connect, ingest_run_dir

    run = tmp_path / "runs" / "s" / "r"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"seed": 0, "method": {"name": "dppo_topk_kl"}}))
    (run / METRICS_FILE).write_text(MIXED)

    trainer = read_metrics(run / METRICS_FILE)
    assert [r["step"] for r in trainer] == [0, 1, 2, 3, 4]
    con = connect(tmp_path / "db.duckdb")
    result = ingest_run_dir(con, run)
    stored = {(s, n): v for s, n, v in con.execute("SELECT step, name, value FROM metrics").fetchall()}
    expected = {(r["step"], k): v for r in trainer for k, v in r["data"].items()
                if isinstance(v, float) and math.isfinite(v)}
    assert stored == expected == {(0, "val"): 0.1, (1, "a"): 1.0, (2, "a"): 2.0, (3, "a"): 3.0, (4, "b"): 4.0}
    assert result.skipped_lines == len(parse_metrics(run / METRICS_FILE).bad) == 5
    assert any(":4: corrupt line (step 2.5 is not a whole number" in w for w in result.warnings)
    assert any(":11: truncated or corrupt last line" in w for w in result.warnings)

    # the trainer's resume keeps what ingest stores up to its checkpoint and quarantines what both refuse
    assert truncate_metrics(run / METRICS_FILE, 3) == Truncation(dropped=1, quarantined=5)
    assert read_metrics(run / METRICS_FILE) == trainer[:4]
    assert len((run / CORRUPT_METRICS_FILE).read_text().splitlines()) == 5
    assert last_step(run) == 3


def test_truncate_metrics_drops_lines_past_a_step_and_quarantines_a_torn_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "data": {"x": s}}) + "\n" for s in range(6)) + '{"step": 6, "da')
    assert truncate_metrics(path, 3) == Truncation(dropped=2, quarantined=1)
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2, 3]
    assert (tmp_path / CORRUPT_METRICS_FILE).read_text() == '{"step": 6, "da\n'
    assert truncate_metrics(path, 3) == Truncation(0, 0)



@pytest.mark.parametrize(("step", "kept", "lines"), [
    (3, [0, 1, 2, 3], ["dropped 2 metrics lines past step 3",
                       ("1 unparseable line(s) of metrics.jsonl moved to metrics.corrupt.jsonl; every valid line up "
                        "to step 3 is kept")]),
    (None, [], ["no checkpoint: starting from step 0, dropped 6 metrics lines of an earlier attempt",
                "1 unparseable line(s) of metrics.jsonl moved to metrics.corrupt.jsonl"]),
])
def test_a_resume_cuts_metrics_and_says_what_went(tmp_path: Path, caplog: pytest.LogCaptureFixture, step: int | None,
                                                  kept: list[int], lines: list[str]) -> None:
    """The one resume step of the trainer, the weighted SFT and a stage without steps: each line it drops and each
    line it quarantines is said, nothing is cut silently."""
    (tmp_path / METRICS_FILE).write_text(
        "".join(json.dumps({"step": s, "data": {"x": s}}) + "\n" for s in range(6)) + '{"step": 6, "da')
    with caplog.at_level("INFO", logger="predmask.test"):
        cut = cut_metrics(tmp_path, step, logging.getLogger("predmask.test"))
    assert cut == Truncation(dropped=6 - len(kept), quarantined=1)
    assert [r["step"] for r in read_metrics(tmp_path / METRICS_FILE)] == kept
    assert caplog.messages == lines
    assert [r.levelname for r in caplog.records] == ["INFO", "WARNING"]


# ----------------------------------------------------------------------------------------------- attempts
def test_a_restart_keeps_the_previous_attempts_metrics(tmp_path) -> None:
    """verl truncates its file logger's file on start; the launcher moves earlier attempts aside first."""
    from predmask.rundir import keep_previous_attempt

    metrics = tmp_path / "metrics.jsonl"
    assert keep_previous_attempt(metrics) is None
    metrics.write_text('{"step": 1, "data": {"a": 1}}\n')
    assert keep_previous_attempt(metrics) == tmp_path / "metrics.attempt-1.jsonl"
    metrics.write_text('{"step": 2, "data": {"a": 2}}\n')
    assert keep_previous_attempt(metrics) == tmp_path / "metrics.attempt-2.jsonl"
    assert not metrics.exists()
    assert (tmp_path / "metrics.attempt-1.jsonl").read_text().startswith('{"step": 1')


def test_the_kept_attempts_are_the_files_ingest_lists_oldest_first(tmp_path: Path) -> None:
    from predmask.rundir import keep_previous_attempt

    metrics = tmp_path / METRICS_FILE
    for step in range(1, 12):  # eleven attempts: attempt-10 sorts after attempt-9, not after attempt-1
        metrics.write_text(metrics_line(step, {"a": step}))
        keep_previous_attempt(metrics)
    metrics.write_text(metrics_line(12, {"a": 12}))
    (tmp_path / "metrics.attempt-x.jsonl").write_text("not an attempt\n")
    files = attempt_files(tmp_path)
    assert [f.name for f in files] == [f"metrics.attempt-{n}.jsonl" for n in range(1, 12)] + [METRICS_FILE]
    assert [read_metrics(f)[0]["step"] for f in files] == list(range(1, 13))


def test_a_logger_file_of_another_name_keeps_its_own_attempts(tmp_path: Path) -> None:
    from predmask.rundir import keep_previous_attempt

    logger = tmp_path / "verl_run.jsonl"
    logger.write_text(metrics_line(1, {"a": 1}))
    assert keep_previous_attempt(logger) == tmp_path / "verl_run.attempt-1.jsonl"


# ----------------------------------------------------------------------------------------------- config.yaml
def test_a_config_round_trips_and_its_interpolations_resolve(tmp_path: Path) -> None:
    config = {"seed": 3, "delta": 0.15, "lr": 1e-5, "name": "1e-3", "flag": "yes", "n": 8, "none": None,
              "method": {"name": "predmask_kl_agg", "delta": "${delta}"}, "sizes": (1, 2), "inf": math.inf}
    path = write_config(tmp_path, config)
    loaded = yaml.safe_load(path.read_text())  # independent: PyYAML's safe loader
    assert loaded["method"]["delta"] == "${delta}" and loaded["sizes"] == [1, 2] and loaded["name"] == "1e-3"
    assert read_config(path) == {**config, "sizes": [1, 2], "method": {"name": "predmask_kl_agg", "delta": 0.15}}


def test_a_config_with_an_object_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"config value model\.path is a PosixPath; allowed: a mapping"):
        write_config(tmp_path, {"model": {"path": Path("/x")}})
    assert not (tmp_path / "config.yaml").exists()


def test_reading_a_config_never_builds_an_object(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("seed: !!python/object/apply:os.system ['touch pwned']\n")
    with pytest.raises(DamagedFileError, match=r"^damaged: .*config.yaml, not YAML \(could not determine a constructor"):
        read_config(path)
    assert not (tmp_path / "pwned").exists()
    path.write_text("- a\n- b\n")
    with pytest.raises(DamagedFileError, match=r"config.yaml, a YAML list, not a config mapping$"):
        read_config(path)
    with pytest.raises(FileNotFoundError):
        read_config(tmp_path / "missing.yaml")


@pytest.mark.parametrize(("text", "what"), [
    ("seed: 3\nmethod: {name: [\n", r"not YAML \("),
    ("", r"empty; allowed: a config mapping"),
    ("[]\n", r"a YAML list, not a config mapping"),
    ("seed: 3\nmethod:\n  na", r"truncated \(no final newline"),
])
def test_a_damaged_config_is_one_line_naming_the_file(tmp_path: Path, text: str, what: str) -> None:
    """Invalid YAML, an empty file, a non-mapping and a file cut short mid-line (which PyYAML itself would accept
    as a shorter valid config) each read as ``damaged: <file>, <what>``, one line."""
    path = write_config(tmp_path, {"seed": 3, "method": {"name": "grpo"}})
    assert read_config(path) == {"seed": 3, "method": {"name": "grpo"}}
    path.write_text(text)
    with pytest.raises(DamagedFileError, match=rf"^damaged: {re.escape(str(path))}, {what}") as info:
        read_config(path)
    assert "\n" not in str(info.value)


def test_the_config_reader_uses_the_c_loader_when_libyaml_is_built_in() -> None:
    assert YAML_LOADER is (yaml.CSafeLoader if yaml.__with_libyaml__ else yaml.SafeLoader)


# ----------------------------------------------------------------------------------------------- status.json
def test_status_round_trips_and_a_broken_one_is_one_line(tmp_path: Path) -> None:
    assert read_status(tmp_path) == {}
    write_status(tmp_path, "failed", 3, 10, error="ValueError: x", updated=1.5)
    assert json.loads((tmp_path / "status.json").read_text()) == {
        "status": "failed", "step": 3, "total_steps": 10, "updated": 1.5, "error": "ValueError: x"}
    assert read_status(tmp_path)["step"] == 3
    (tmp_path / "status.json").write_text('{"status": "runn')
    with pytest.raises(StatusError, match=r"^damaged: .*status.json, not JSON \("):
        read_status(tmp_path)
    (tmp_path / "status.json").write_text("[1]")
    with pytest.raises(StatusError, match=r"^damaged: .*status.json, a JSON list, not an object$"):
        read_status(tmp_path)
    (tmp_path / "status.json").write_text("[]")
    with pytest.raises(DamagedFileError, match=r"^damaged: .*status.json, a JSON list, not an object$"):
        read_status(tmp_path)
    (tmp_path / "status.json").write_bytes(b"")
    with pytest.raises(DamagedFileError, match=r"^damaged: .*status.json, empty; allowed: a JSON object"):
        read_status(tmp_path)
