"""Trackers (predmask.rl.trackers, ``trainer.logger``): TensorBoard event files read back with TensorBoard's own
event reader and compared with metrics.jsonl; W&B in offline mode (WANDB_MODE=offline, no network) read back from
its offline run files; a killed and resumed run keeping one W&B run; verl's own Tracking class continuing that run
with the launcher's variables; the logger list's checks; a tracker that fails costing no metrics.jsonl line.

What is read of W&B: the ``run-<id>.wandb`` transaction log of each ``offline-run-*`` directory (what ``wandb sync``
uploads). wandb 0.31 ships no Python reader for it, so ``wandb_records`` below unframes it (LevelDB's log format:
32 KiB blocks, 7-byte record headers, full/first/middle/last fragments, after W&B's 7-byte file header) and parses
each record with wandb's own protobuf schema (``wandb.proto.wandb_internal_pb2.Record``); the history records hold
the logged values as JSON.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_rl_train import TINY, _cli, _kill_at_step, _overrides, cache_dir  # noqa: F401 - cache_dir: the tiny base-model fixture

from predmask.config import compose
from predmask.rl.trackers import WANDB_ID_FILE, Trackers
from predmask.rl.train import run
from predmask.rundir import read_metrics
from predmask.schemas.train_schema import LOGGERS, TrainerConfig, check_loggers

BOTH = "trainer.logger=[console,file,tensorboard,wandb]"


def require_extra(module: str) -> None:
    """Import an optional tracker; skip naming the extra when it is missing (fail instead when CI=true)."""
    try:
        importlib.import_module(module)
    except ImportError as exc:
        if os.environ.get("CI", "").lower() == "true":
            raise
        pytest.skip(f"{module} is not installed ({exc}): the 'trackers' extra, pip install -e '.[trackers]'")


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Both trackers installed; W&B without network or prompts; the variables also go to subprocesses."""
    require_extra("tensorboard")
    require_extra("wandb")
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    # WANDB_SERVICE: an in-process wandb.init of an earlier test exports its service for child processes to share;
    # a trainer subprocess must start its own, as a job does (a shared one would outlive the SIGKILL below)
    for key in ("WANDB_DIR", "TENSORBOARD_DIR", "WANDB_RUN_ID", "WANDB_RESUME", "WANDB_PROJECT", "WANDB_SERVICE"):
        monkeypatch.delenv(key, raising=False)
    return env


# ----------------------------------------------------------------------------------------------- readers
def tensorboard_scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] as TensorBoard shows them (its accumulator, orphaned events of a restart purged)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def wandb_records(path: Path) -> list[Any]:
    """The records of a W&B transaction log (see the module docstring); a torn last record (a killed writer) ends it."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:7] == b":W&B" + struct.pack("<HB", 0xBEE1, 0), f"{path} is not a W&B transaction log"
    out: list[Any] = []
    pos, pending, block = 7, b"", 32 * 1024
    while pos + 7 <= len(data):
        left = block - pos % block
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or kind == 0:  # a block's zero-filled tail
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        if len(chunk) < length:
            break
        pos += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
    return out


def wandb_attempts(run_dir: Path) -> list[dict[str, Any]]:
    """Each offline W&B segment under ``run_dir/wandb`` in start order: its run id and history {step: {key: value}}."""
    attempts = []
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):  # offline-run-<start time>-<id>
        records = wandb_records(path)
        run_ids = {r.run.run_id for r in records if r.WhichOneof("record_type") == "run"}
        assert run_ids <= {path.stem.removeprefix("run-")}, (path, run_ids)  # a killed segment may have no record
        history = {}
        for r in records:
            if r.WhichOneof("record_type") == "history":
                values = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
                history[r.history.step.num] = {k: v for k, v in values.items() if not k.startswith("_")}
        attempts.append({"id": path.stem.removeprefix("run-"), "history": history, "dir": path.parent.name})
    return attempts


def finite_metrics(run_dir: Path) -> dict[int, dict[str, float]]:
    return {r["step"]: {k: v for k, v in r["data"].items() if isinstance(v, int | float)}
            for r in read_metrics(run_dir / "metrics.jsonl")}


def assert_tensorboard_equals_metrics(run_dir: Path) -> None:
    metrics = finite_metrics(run_dir)
    scalars = tensorboard_scalars(run_dir / "tensorboard")
    expected: dict[str, list[tuple[int, float]]] = {}
    for step, data in sorted(metrics.items()):
        for key, value in data.items():
            expected.setdefault(key, []).append((step, float(np.float32(value))))  # TensorBoard stores float32
    assert scalars == expected


# ----------------------------------------------------------------------------------------------- the list
def test_logger_names_are_verls_and_metrics_jsonl_is_required() -> None:
    assert TrainerConfig().logger == ("console", "file")
    assert check_loggers(["console", "file", "wandb", "file"]) == ("console", "file", "wandb")
    assert check_loggers("file") == ("file",)
    assert set(LOGGERS) == {"console", "file", "tensorboard", "wandb"}
    with pytest.raises(ValueError, match=r"unknown trainer.logger 'mlflow'; allowed: console, file, tensorboard"):
        TrainerConfig.from_mapping({"logger": ["console", "file", "mlflow"]})
    with pytest.raises(ValueError, match=r"lacks 'file'.*trainer.logger=\[console,file,tensorboard\]"):
        TrainerConfig.from_mapping({"logger": ["console", "tensorboard"]})


def test_a_missing_extra_is_one_line_naming_it(cache_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    """A real interpreter where ``import wandb`` fails (``sys.modules['wandb'] = None``, Python's own way to make an
    import raise): the CLI exits 2 with one line naming the extra and writes nothing."""
    run_dir = tmp_path / "run"
    code = ("import sys; sys.modules['wandb'] = None; from predmask.rl.train import main; "
            f"sys.argv = ['train', *{_overrides(cache_dir, run_dir, BOTH)!r}]; main()")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [(
        "error: trainer.logger asks for wandb, which is not installed: it is the optional extra 'trackers' "
        "(pip install -e '.[trackers]')"
    )]
    assert not run_dir.exists()  # nothing written


# ----------------------------------------------------------------------------------------------- TensorBoard
def test_tensorboard_events_read_back_equal_metrics_jsonl(cache_dir: Path, tmp_path: Path,  # noqa: F811
                                                          offline: dict[str, str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = tmp_path / "run"
    run(compose("train", _overrides(cache_dir, run_dir, "trainer.steps=3", "trainer.val_every=2",
                                    "trainer.logger=[file,tensorboard]")))
    assert_tensorboard_equals_metrics(run_dir)
    assert "val-core/aime24_standin/acc/mean@2" in tensorboard_scalars(run_dir / "tensorboard")
    assert not (run_dir / "wandb").exists() and not (run_dir / WANDB_ID_FILE).exists()
    log = (run_dir / "train.log").read_text()
    assert "trackers: tensorboard" in log
    # TENSORBOARD_DIR, when set, is the event directory (verl's rule)
    elsewhere = tmp_path / "tb"
    monkeypatch.setenv("TENSORBOARD_DIR", str(elsewhere))
    run(compose("train", _overrides(cache_dir, tmp_path / "run2", "trainer.steps=1",
                                    "trainer.logger=[file,tensorboard]")))
    assert list(elsewhere.glob("events.out.tfevents.*")) and not (tmp_path / "run2" / "tensorboard").exists()


def test_a_tracker_turned_on_at_a_resumption_shows_the_steps_before_it(cache_dir: Path,  # noqa: F811
                                                                         tmp_path: Path,
                                                                         offline: dict[str, str]) -> None:
    """Two steps without trackers, then the same run continued to four with both: they get all five lines."""
    run_dir = tmp_path / "run"
    run(compose("train", _overrides(cache_dir, run_dir, "trainer.steps=2", "trainer.save_every=2")))
    run(compose("train", _overrides(cache_dir, run_dir, "trainer.steps=4", "trainer.save_every=2", BOTH)))
    metrics = finite_metrics(run_dir)
    assert sorted(metrics) == [0, 1, 2, 3, 4]
    assert_tensorboard_equals_metrics(run_dir)
    [attempt] = wandb_attempts(run_dir)
    assert attempt["history"] == metrics


def test_the_default_list_writes_no_tracker_files_and_console_off_prints_no_step_lines(
        cache_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: F811
    run(compose("train", _overrides(cache_dir, tmp_path / "a", "trainer.steps=1")))
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [
        ".run.lock", "checkpoints", "config.yaml", "metrics.jsonl", "status.json", "train.log"]
    assert "step 1" in capsys.readouterr().out
    run(compose("train", _overrides(cache_dir, tmp_path / "b", "trainer.steps=1", "trainer.logger=[file]")))
    out = capsys.readouterr().out
    assert "completed at step 1" in out and "step 1 " not in out and "step 0 " not in out
    assert "step 1 " in (tmp_path / "b" / "train.log").read_text()


def test_a_tracker_that_fails_costs_no_metrics_line(cache_dir: Path, tmp_path: Path,  # noqa: F811
                                                    offline: dict[str, str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """TENSORBOARD_DIR names a regular file: TensorBoard cannot open, the run says so and trains to the end."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("TENSORBOARD_DIR", str(blocker))
    run_dir = tmp_path / "run"
    run(compose("train", _overrides(cache_dir, run_dir, "trainer.steps=2", "trainer.logger=[file,tensorboard]")))
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [0, 1, 2]
    assert json.loads((run_dir / "status.json").read_text())["status"] == "completed"
    assert "tensorboard disabled for this attempt (metrics.jsonl is unaffected)" in (run_dir / "train.log").read_text()


def test_a_tracker_raising_mid_run_is_dropped_and_the_others_keep_logging(caplog: pytest.LogCaptureFixture) -> None:
    """``Trackers`` itself: the failing tracker is a test double (an OSError on its second step, as a full disk
    would give); the other one is a plain recorder."""

    class Recorder:
        next_step = 0

        def __init__(self, fail_at: int | None = None) -> None:
            self.steps: list[tuple[int, dict[str, float]]] = []
            self.fail_at, self.closed = fail_at, None

        def log(self, data: dict[str, float], step: int) -> None:
            if step == self.fail_at:
                raise OSError("No space left on device")
            self.steps.append((step, data))

        def close(self, failed: bool) -> None:
            self.closed = failed

    broken, good = Recorder(fail_at=2), Recorder()
    trackers = Trackers({"tensorboard": broken, "wandb": good})
    trainer_log = logging.getLogger("predmask.rl.train")  # the trainer's log (it does not propagate)
    trainer_log.addHandler(caplog.handler)
    try:
        for step in (1, 2, 3):
            trackers.log({"a": float(step), "b": float("nan"), "flag": True, "text": "x"}, step)
        trackers.close()
    finally:
        trainer_log.removeHandler(caplog.handler)
    assert broken.steps == [(1, {"a": 1.0})] and broken.closed is True
    assert good.steps == [(1, {"a": 1.0}), (2, {"a": 2.0}), (3, {"a": 3.0})] and good.closed is False
    assert "tensorboard failed at step 2 and is dropped" in caplog.text and "No space left" in caplog.text


# ----------------------------------------------------------------------------------------------- W&B
def test_wandb_offline_run_has_the_steps_and_the_config(cache_dir: Path, tmp_path: Path,  # noqa: F811
                                                        offline: dict[str, str]) -> None:
    run_dir = tmp_path / "run"
    run(compose("train", _overrides(cache_dir, run_dir, "trainer.steps=2", BOTH)))
    run_id = (run_dir / WANDB_ID_FILE).read_text().strip()
    [attempt] = wandb_attempts(run_dir)
    assert attempt["id"] == run_id and attempt["dir"].endswith(f"-{run_id}")
    metrics = finite_metrics(run_dir)
    assert attempt["history"] == metrics  # every step, every finite value, verl's names
    assert_tensorboard_equals_metrics(run_dir)


@pytest.mark.slow
def test_a_killed_and_resumed_run_keeps_one_wandb_run_and_tensorboard_shows_each_step_once(
        cache_dir: Path, tmp_path: Path, offline: dict[str, str]) -> None:  # noqa: F811
    """Real subprocesses: a run with both trackers SIGKILLed mid-way, then started again from its checkpoint."""
    run_dir = tmp_path / "run"
    args = _overrides(cache_dir, run_dir, "trainer.steps=12", "trainer.save_every=4", "trainer.val_every=5", BOTH)
    victim = _cli(args, cwd=tmp_path)
    _kill_at_step(victim, run_dir / "metrics.jsonl", 6)
    killed_at = read_metrics(run_dir / "metrics.jsonl")[-1]["step"]
    assert killed_at < 12, "the run finished before it was killed"
    first_id = (run_dir / WANDB_ID_FILE).read_text()

    resumed = _cli(args, cwd=tmp_path)
    out, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, out
    assert (run_dir / WANDB_ID_FILE).read_text() == first_id  # written once
    run_id = first_id.strip()
    metrics = finite_metrics(run_dir)
    assert sorted(metrics) == list(range(13))

    attempts = wandb_attempts(run_dir)
    assert len(attempts) == 2 and {a["id"] for a in attempts} == {run_id}  # one W&B run, two offline segments
    # the killed attempt's segment is cut short (W&B's service drops what it had not written); the resumed one
    # replays metrics.jsonl up to its checkpoint, then logs the rest: every step once, the values of metrics.jsonl
    assert set(attempts[0]["history"]) <= set(range(killed_at + 1))
    assert attempts[1]["history"] == metrics
    assert "resumed from step_0000" in (run_dir / "train.log").read_text()
    assert_tensorboard_equals_metrics(run_dir)  # the killed attempt's events are purged, the replay shows


@pytest.mark.verl
def test_verls_tracking_continues_the_run_with_the_launchers_variables(tmp_path: Path, offline: dict[str, str],
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """verl's own Tracking class (verl.utils.tracking, what verl's trainer logs with), started in two fresh processes
    (two attempts, as two TaskRunner actors) with the variables the launcher hands every Ray worker: one W&B id,
    files in the run directory."""
    pytest.importorskip("verl")
    from verl.utils.tracking import Tracking

    from predmask.rl.trackers import wandb_run_id
    from predmask.verl.launch import tracker_argv
    from predmask.verl.overrides import RUNTIME_ENV

    assert set(LOGGERS) <= set(Tracking.supported_backend)  # every name is one verl knows
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    argv = ["trainer.logger=[console,file,tensorboard,wandb]"]
    script = ("import sys; from verl.utils.tracking import Tracking; "
              "t = Tracking('predmask', 'exp', default_backend=['wandb', 'tensorboard', 'file'], config={'trainer': {}}); "
              "[t.log({'critic/score/mean': s / 10}, step=s) for s in range(int(sys.argv[1]), int(sys.argv[2]))]; "
              "t.finish()")
    for attempt in (1, 2):
        _, env = tracker_argv(argv, run_dir, {}, wandb_run_id(run_dir))
        env["VERL_FILE_LOGGER_PATH"] = str(run_dir / f"metrics.{attempt}.jsonl")
        proc = subprocess.run([sys.executable, "-c", script, str(3 * attempt - 2), str(3 * attempt + 1)],
                              env={**os.environ, **env}, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                              check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
    argv_out, env = tracker_argv(argv, run_dir, {}, wandb_run_id(run_dir))
    assert f"{RUNTIME_ENV}.WANDB_RUN_ID={env['WANDB_RUN_ID']}" in argv_out
    run_id = (run_dir / WANDB_ID_FILE).read_text().strip()
    attempts = wandb_attempts(run_dir)
    assert [a["id"] for a in attempts] == [run_id, run_id]
    assert [sorted(a["history"]) for a in attempts] == [[1, 2, 3], [4, 5, 6]]
    assert tensorboard_scalars(run_dir / "tensorboard")["critic/score/mean"] == [
        (s, float(np.float32(s / 10))) for s in range(1, 7)]


def test_the_wandb_id_file_is_checked(tmp_path: Path) -> None:
    from predmask.rl.trackers import wandb_run_id

    first = wandb_run_id(tmp_path)
    assert len(first) == 8 and first.isalnum() and first == wandb_run_id(tmp_path)
    (tmp_path / WANDB_ID_FILE).write_text("bad/id\n")
    with pytest.raises(ValueError, match=r"holds 'bad/id', not a W&B run id"):
        wandb_run_id(tmp_path)
