"""Fixtures shared by every test folder: the emulated Slurm cluster (scripts/slurm-emulated.sh).

When the cluster is not reachable through ``sinfo`` the ``slurm`` tests are skipped with the reason, except
under ``CI=true``, where they fail: CI must start the cluster before the tests.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

PARTITION, NUM_NODES = "h20", 4
STATE_DIR = Path(os.environ.get("PREDMASK_SLURM_DIR", "/tmp/predmask-slurm"))
USABLE_STATES = {"idle", "mix", "mixed", "alloc", "allocated", "comp", "completing"}


def _unavailable(reason: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true but the Slurm tests cannot run: {reason}", pytrace=False)
    pytest.skip(reason)


def _cluster_problem() -> str | None:
    """None when the emulated cluster answers with 4 usable nodes, else why not (sets SLURM_CONF)."""
    if shutil.which("sinfo") is None:
        return "slurm-wlm is not installed (no sinfo); run scripts/slurm-emulated.sh start"
    if not os.environ.get("SLURM_CONF"):
        conf = STATE_DIR / "slurm.conf"
        if not conf.exists():
            return f"the emulated Slurm cluster is not running ({conf} missing): run scripts/slurm-emulated.sh start"
        os.environ["SLURM_CONF"] = str(conf)
    if not Path(os.environ["SLURM_CONF"]).is_file():
        return f"SLURM_CONF={os.environ['SLURM_CONF']} does not exist: run scripts/slurm-emulated.sh start"
    try:
        out = subprocess.run(
            ["sinfo", "-h", "-N", "-p", PARTITION, "-o", "%N %t"],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return "sinfo did not answer within 20 s"
    if out.returncode != 0:
        return f"sinfo failed ({out.stderr.strip().splitlines()[-1:]}): run scripts/slurm-emulated.sh start"
    usable = {
        line.split()[0]
        for line in out.stdout.splitlines()
        if line.split()[1:2] and line.split()[1] in USABLE_STATES
    }
    if len(usable) < NUM_NODES:
        return (
            f"partition {PARTITION} has {len(usable)} usable nodes, need {NUM_NODES}: {out.stdout.strip()!r}"
        )
    return None


@pytest.fixture(scope="session")
def slurm_cluster() -> dict[str, Any]:
    """The running emulated cluster (skip, or fail under CI=true, when it is not up or ray is missing)."""
    problem = _cluster_problem()
    if problem:
        _unavailable(problem)
    try:
        import ray  # noqa: F401
    except ImportError:
        _unavailable("ray is not installed (pip install 'ray>=2.40')")
    logging.getLogger("submitit").setLevel(logging.ERROR)  # sacct is unavailable here: no accounting storage
    return {
        "slurm_conf": os.environ["SLURM_CONF"],
        "partition": PARTITION,
        "nodes": NUM_NODES,
        "gpus_per_node": 8,
    }
