"""The cost of ``python -m sweeps status`` over many runs: N synthetic run directories of one sweep (each a real
composed smoke run's ``planned_config.yaml`` and a ``status.json``: completed, failed, or running with no writer, so
dead), shown by ``python -m sweeps status`` in a child process; its wall time and the rows it printed, checked against
N. The target: 10,000 runs in at most ``CPU_MAX_S`` seconds of the child's CPU time (one process, one thread: its
wall time on an idle machine; on a shared, busy one the wall time stretches with the load, which is printed beside)."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

from predmask.bench import stopwatch, target
from predmask.rundir import PLANNED_CONFIG_FILE, STATUS_FILE, write_config, write_status

#: the most CPU seconds ``python -m sweeps status`` may take over 10,000 runs
CPU_MAX_S = 20.0
#: the sweep whose composed run config every synthetic run carries
SWEEP = "smoke"
_REPO = Path(__file__).resolve().parents[1]
_STATES = ("completed", "failed", "running")


def write_runs(root: Path, runs: int) -> Path:
    """``runs`` run directories under ``root/<SWEEP>/``, each with the smoke sweep's first composed config (its seed
    set to the run's number) and a status.json cycling through completed, failed and running; the sweep folder."""
    from sweeps.families import expand

    config = expand(SWEEP, [])[0].config
    sweep_dir = root / SWEEP
    first = sweep_dir / "r000000"
    first.mkdir(parents=True, exist_ok=True)
    template = write_config(first, {**config, "seed": 0}, PLANNED_CONFIG_FILE).read_text()
    write_status(first, _STATES[0], 6, 6)
    status = (first / STATUS_FILE).read_text()
    for i in range(1, runs):  # the files' bytes as the writers write them, copied: building 10,000 takes seconds
        path = sweep_dir / f"r{i:06d}"
        path.mkdir(exist_ok=True)
        (path / PLANNED_CONFIG_FILE).write_text(template.replace("\nseed: 0\n", f"\nseed: {i}\n", 1))
        (path / STATUS_FILE).write_text(status.replace('"completed"', f'"{_STATES[i % len(_STATES)]}"', 1))
    return sweep_dir


def measure(root: Path, runs: int) -> dict[str, Any]:
    """Write the runs under ``root``, show them with ``python -m sweeps status`` in a child process, and return the
    run count, the child's wall and CPU seconds, the machine's load (a busy machine stretches the wall time, not the
    CPU time), the rows printed and the CPU-time target row (the 10,000-run limit, scaled up only beyond 10,000 runs)."""
    write_runs(root, runs)
    env = {**os.environ, "PREDMASK_RUNS": str(root), "PYTHONPATH": str(_REPO)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with stopwatch() as seconds:
        done = subprocess.run([sys.executable, "-m", "sweeps", "status", SWEEP], capture_output=True, text=True,
                              check=False, cwd=_REPO, env=env)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    rows = sum(1 for line in done.stdout.splitlines() if line.startswith(f"│ {SWEEP} "))
    limit = CPU_MAX_S * max(1.0, runs / 10_000)  # the whole command, start-up included: fewer runs, same limit
    return {"runs": runs, "wall_s": seconds["wall"], "cpu_s": cpu, "load": os.getloadavg()[0],
            "cores": os.cpu_count(), "ms_per_run": 1000 * seconds["wall"] / runs, "rows": rows,
            "returncode": done.returncode, "stderr": done.stderr.strip().splitlines()[-1:],
            "target": target(f"python -m sweeps status over {runs:,} runs (CPU s)", cpu, limit)}
