"""predmask.verl.stages and the launcher's watch on them, without verl: the stage marks around an ``@auto_await``
coroutine method (the shape of verl 0.9.1's ``AgentLoopManager.generate_sequences`` and
``CheckpointEngineManager.update_weights``), the timeout check, the one line, and the launcher ending a hung run."""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from predmask.rundir import STAGE_FILE, read_status
from predmask.verl import stages
from predmask.verl.launch import StageWatch, kept_status
from predmask.verl.settings import PluginSettings


def auto_await(func):  # verl.utils.ray_utils.auto_await's contract, cases 1 and 2
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        coro = func(*args, **kwargs)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(coro)
        return coro

    return wrapper


def test_the_manager_methods_mark_their_stage_while_they_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stage_file = tmp_path / "stage.json"
    monkeypatch.setenv(stages.STAGE_ENV, str(stage_file))
    seen: list[str | None] = []

    class AgentLoopManager:
        @auto_await
        async def generate_sequences(self, prompts: int) -> int:
            seen.append(json.loads(stage_file.read_text())["stage"])
            return prompts + 1

    module = SimpleNamespace(AgentLoopManager=AgentLoopManager, auto_await=auto_await)
    stages.install_rollout_stage(module)
    stages.install_rollout_stage(module)  # idempotent
    manager = AgentLoopManager()
    assert manager.generate_sequences(1) == 2  # called as verl's trainer calls it: no running loop
    assert seen == ["rollout"] and json.loads(stage_file.read_text())["stage"] is None

    async def caller() -> int:  # awaited from a coroutine, as verl's async callers do
        return await manager.generate_sequences(5)

    assert asyncio.run(caller()) == 6 and seen == ["rollout", "rollout"]
    assert inspect.iscoroutinefunction(AgentLoopManager.generate_sequences.__wrapped__)


def test_no_stage_file_no_marks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(stages.STAGE_ENV, raising=False)
    with stages.stage_mark(stages.WEIGHT_SYNC):
        pass
    assert list(tmp_path.iterdir()) == []


def test_a_stage_past_its_timeout_is_hung(tmp_path: Path) -> None:
    path = tmp_path / "stage.json"
    assert stages.hung_stage(path, 10) is None  # no file yet
    path.write_text(json.dumps({"stage": "weight sync", "since": 100.0}))
    assert stages.hung_stage(path, 10, now=105.0) is None
    assert stages.hung_stage(path, 10, now=111.0) == ("weight sync", 11.0)
    path.write_text(json.dumps({"stage": None, "since": 0.0}))
    assert stages.hung_stage(path, 10, now=111.0) is None
    line = stages.hang_line("weight sync", 11.0, 10, 3)
    assert "\n" not in line and line.startswith("verl's weight sync hung: running for 11 s after step 3, longer than ")
    assert "predmask.stage_timeout_s=10" in line and "cluster.stage_timeout_s" in line


def test_stage_timeout_must_be_positive() -> None:
    assert PluginSettings(stage_timeout_s=30).stage_timeout_s == 30
    with pytest.raises(ValueError, match="predmask.stage_timeout_s must be"):
        PluginSettings(stage_timeout_s=0)


def test_the_launcher_ends_a_hung_stage_with_its_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The status thread sees a rollout marked 5 s ago with a 1 s timeout: one ``error:`` line, SIGINT to this
    process (verl's main thread), status.json ``failed`` with the line, exit status 1; a stale mark of an earlier
    attempt is removed first."""
    stale = tmp_path / STAGE_FILE
    stale.write_text(json.dumps({"stage": "rollout", "since": 0.0}))
    watch = StageWatch.of(tmp_path, 1.0)
    assert watch is not None and not stale.exists() and StageWatch.of(tmp_path, None) is None
    previous = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit) as ended, kept_status(tmp_path, 4, every_s=0.1, watch=watch):
            stale.write_text(json.dumps({"stage": "rollout", "since": time.time() - 5, "pid": os.getpid()}))
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # verl blocked in the rollout; the SIGINT ends the wait
                time.sleep(0.05)
            pytest.fail("the watch did not interrupt the hung stage")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert ended.value.code == 1
    status = read_status(tmp_path)
    assert status["status"] == "failed" and status["error"] == watch.line
    assert watch.line.startswith("verl's rollout hung: running for ")
    assert capsys.readouterr().err.splitlines() == [f"error: {watch.line}"]
