"""The streaming ingest's cost on one large run: a synthetic run directory whose metrics.jsonl has N lines of verl's
metric names (about 1.3 kB a line, like a long real run's), ingested by ``python -m analysis ingest`` in a child
process; its wall time, its peak memory (the child's own largest resident set, DuckDB's memory included) and the rows
stored, checked against the file. The target: a 500,000-line file under ``PEAK_MAX_BYTES``."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import duckdb
import yaml

from predmask.bench import stopwatch, target
from predmask.rundir import CONFIG_FILE, METRICS_FILE, STATUS_FILE

#: the largest peak memory an ingest may reach, whatever the file's length
PEAK_MAX_BYTES = 1 << 30
_REPO = Path(__file__).resolve().parents[2]
#: the child: ``python -m analysis ingest ARGS``, then its own peak resident set (kB) as the last line of stdout
_CHILD = ("import resource, sys\nfrom analysis.__main__ import main\ncode = main(['ingest', *sys.argv[1:]])\n"
          "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\nsys.exit(code)")
_PREFIXES = ("actor", "critic", "response_length", "timing_s", "perf", "val-core", "predmask")
_STEMS = ("pg_loss", "entropy", "kl", "clipfrac", "grad_norm", "lr", "mean", "max", "min", "score")


def write_run(root: Path, lines: int, metrics: int, seed: int = 0) -> Path:
    """A completed run directory ``root/bench/big`` whose metrics.jsonl has ``lines`` steps of ``metrics`` values."""
    run_dir = root / "bench" / "big"
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / CONFIG_FILE).write_text(yaml.safe_dump({"seed": seed, "method": {"name": "grpo"}}))
    (run_dir / STATUS_FILE).write_text(json.dumps({"status": "completed", "step": lines, "total_steps": lines}))
    # distinct names shaped like verl's (actor/pg_loss_0, critic/entropy_1, ...)
    names = [f"{_PREFIXES[i % len(_PREFIXES)]}/{_STEMS[(i // len(_PREFIXES)) % len(_STEMS)]}_{i}"
             for i in range(metrics)]
    rng = random.Random(seed)
    with open(run_dir / METRICS_FILE, "w") as fh:
        fh.writelines(json.dumps({"step": step, "data": {n: rng.random() for n in names}}) + "\n"
                      for step in range(1, lines + 1))
    return run_dir


def measure(root: Path, lines: int, metrics: int) -> dict[str, Any]:
    """Write the run under ``root``, ingest it in a child process, and return the file's size, the wall seconds,
    the child's peak resident bytes, the rows stored and expected, and the peak-memory target row."""
    run_dir = write_run(root, lines, metrics)
    db = root / "bench.duckdb"
    with stopwatch() as seconds:
        done = subprocess.run([sys.executable, "-c", _CHILD, str(run_dir), "--db", str(db), "-q"],
                              capture_output=True, text=True, check=False, cwd=_REPO)
    peak = int(done.stdout.strip().splitlines()[-1]) * 1024 if done.returncode == 0 else 0  # Linux: kB
    stored = 0
    if done.returncode == 0:
        with duckdb.connect(str(db), read_only=True) as con:
            stored = int(con.execute("SELECT count(*) FROM metrics").fetchone()[0])
    return {
        "lines": lines, "metrics": metrics, "file_bytes": (run_dir / METRICS_FILE).stat().st_size,
        "wall_s": seconds["wall"],
        "peak_bytes": peak, "rows_stored": stored, "rows_expected": lines * metrics, "returncode": done.returncode,
        "stderr": done.stderr.strip().splitlines()[-1:] if done.returncode else [],
        "target": target("ingest peak memory, GiB", peak / (1 << 30), PEAK_MAX_BYTES / (1 << 30)),
    }
