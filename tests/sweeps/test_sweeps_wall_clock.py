"""The end line of a sweep's rerun prints the command's wall time, start-up included: a real `python -m sweeps`
process that sleeps 3 s before its imports (a slow start), timed from outside when its line arrives."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from predmask.rundir import write_status
from sweeps.families import expand
from sweeps.run_dirs import run_dir

REPO = Path(__file__).resolve().parents[2]
SLOW_START = "import time; time.sleep(3)\nimport runpy, sys\nsys.argv = ['sweeps', *sys.argv[1:]]\n" \
             "runpy.run_module('sweeps', run_name='__main__')"


def _seconds(text: str) -> int:
    m = re.search(r" in (?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?[ ;]", text)
    assert m, text
    h, mi, s = (int(g) if g else 0 for g in m.groups())
    return 3600 * h + 60 * mi + s


def test_a_finished_sweeps_rerun_prints_the_wall_time_since_its_start(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    for spec in expand("smoke", []):  # every run completed: the rerun only checks and skips them
        path = run_dir(spec, root)
        path.mkdir(parents=True)
        write_status(path, "completed", 1, 1)
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", SLOW_START, "smoke", "--runs-root", str(root),
                             "--db", str(tmp_path / "r.duckdb")], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout is not None
    seen, line = None, ""
    for line in proc.stdout:
        if "already done" in line:
            seen = time.monotonic() - started
            break
    proc.communicate(timeout=300)
    assert seen is not None, "no end line"
    assert "0 completed, 4 already done, 0 failed" in line
    printed = _seconds(line)
    assert printed >= 3 and abs(printed - seen) <= 2, (printed, seen, line)
