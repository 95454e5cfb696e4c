"""A hung rollout ends a verl run with one line within ``cluster.stage_timeout_s`` (predmask.verl.stages).

verl 0.9.1's own trainer on this CPU (``cluster=verl_cpu``, a local job: Ray, FSDP2, vLLM's CPU build), nothing
mocked: once the trainer marks its first rollout, the test stops (SIGSTOP) the run's vLLM server process, so the
rollout waits on a server that never answers, as verl would for ever. The launcher ends the run after the stated
timeout with one ``error:`` line naming the stage and what to do; the sweep reports that line. Needs ``.venv-verl``
(``EXTRAS=verl-cpu bash scripts/install.sh``). About 2 minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch.executor import CHECKOUT

pytestmark = [pytest.mark.verl_cpu, pytest.mark.slow]

VERL_PYTHON = CHECKOUT / ".venv-verl" / "bin" / "python"
TIMEOUT_S = 20  # cluster.stage_timeout_s of the test's run
SERVER = b"vLLMHttpServer"  # the Ray actor that serves one vLLM engine (its process title)


def _server_pids() -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if SERVER in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def test_a_rollout_whose_server_never_answers_ends_with_one_line(tmp_path: Path) -> None:
    if not VERL_PYTHON.exists():
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{VERL_PYTHON} is missing under CI=true: .ci/run must run EXTRAS=verl-cpu bash scripts/install.sh")
        pytest.skip(f"no {VERL_PYTHON}: EXTRAS=verl-cpu bash scripts/install.sh builds it")
    env = {**os.environ, "PREDMASK_DB": str(tmp_path / "db.duckdb"), "PREDMASK_RUNS": str(tmp_path / "runs"),
           "PREDMASK_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-m", "sweeps", "smoke", "cluster=verl_cpu", "method=dppo_topk_kl", "trainer.steps=2",
            "trainer.val_every=2", "trainer.save_every=2", f"cluster.stage_timeout_s={TIMEOUT_S}"]
    before = set(_server_pids())
    stopped: list[int] = []
    log = (tmp_path / "sweep.log").open("w")
    sweep = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600
        while not stopped:  # the first rollout (validation before training): stop its server
            assert sweep.poll() is None, (tmp_path / "sweep.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no rollout began in 600 s"
            marks = list((tmp_path / "runs" / "smoke").glob("*/stage.json"))
            if marks and json.loads(marks[0].read_text() or "{}").get("stage") == "rollout":
                for pid in set(_server_pids()) - before:
                    os.kill(pid, signal.SIGSTOP)
                    stopped.append(pid)
            time.sleep(0.5)
        hung_at = time.monotonic()
        code = sweep.wait(timeout=TIMEOUT_S + 180)
        ended_after = time.monotonic() - hung_at
    finally:
        if sweep.poll() is None:
            sweep.send_signal(signal.SIGINT)  # the sweep stops its local runs on Ctrl-C
            sweep.wait(timeout=120)
        for pid in stopped:  # the servers the test stopped, if Ray's teardown left one
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.close()
    out = (tmp_path / "sweep.log").read_text()
    run_dir = marks[0].parent
    status = json.loads((run_dir / "status.json").read_text())
    assert code != 0, out[-3000:]
    assert status["status"] == "failed", status
    line = status["error"]
    assert line.startswith("verl's rollout hung: running for ") and "cluster.stage_timeout_s" in line, line
    assert "vLLM server" in line and "rerun the sweep" in line, line
    assert f"error: {line}" in (run_dir / "job.log").read_text()  # the launcher's one line, once
    assert (run_dir / "job.log").read_text().count("error: verl's rollout hung") == 1
    assert line in out  # the sweep names it for the failed run
    # within the timeout, the status thread's period and the job's teardown
    assert TIMEOUT_S <= ended_after < TIMEOUT_S + 120, ended_after
