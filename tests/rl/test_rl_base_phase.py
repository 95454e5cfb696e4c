"""While another process builds the base model (holds its cache lock), a run says it waits for it; then it builds
the model itself and its pretraining is the phase: a real second process holding a real flock, a real tiny build."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from rl_helpers import TINY_MODEL

from predmask.progress import read_phase, report_phases
from predmask.rl.base import base_cache_path, load_base_model
from predmask.schemas.task_schema import TaskConfig
from predmask.schemas.train_schema import BaseConfig


def test_a_run_waiting_for_the_base_model_lock_says_so_then_pretrains_it(tmp_path: Path) -> None:
    task, cfg = TaskConfig(), BaseConfig(steps=2, batch_size=2, eval_problems=2)
    lock = base_cache_path(TINY_MODEL, task, cfg, tmp_path).with_suffix(".lock")
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, sys, time
        fh = open({str(lock)!r}, "a+")
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        print("held", flush=True)
        sys.stdin.readline()
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    phase_file = tmp_path / "phase.json"
    built: dict[str, object] = {}
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"

        def build() -> None:
            with report_phases(phase_file):
                built.update(load_base_model(TINY_MODEL, task, cfg, cache_dir=tmp_path, progress=False)[1])

        worker = threading.Thread(target=build)
        worker.start()
        deadline, phase = time.monotonic() + 60, None
        while phase is None and time.monotonic() < deadline:
            phase = read_phase(phase_file)
            time.sleep(0.05)
        assert phase is not None and phase.text() == "waiting for base model tiny (another run builds it)"
        assert worker.is_alive()
    finally:
        holder.communicate("\n", timeout=60)
    worker.join(timeout=300)
    assert not worker.is_alive() and built["built"] is True
    assert read_phase(phase_file) is None and not phase_file.exists()
