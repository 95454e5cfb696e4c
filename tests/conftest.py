"""Fixtures and hooks shared by every test folder: the emulated Slurm cluster (scripts/slurm-emulated.sh).

A test marked ``slurm`` (or using the ``slurm_cluster`` fixture) needs the cluster. When ``sinfo`` cannot reach it
those tests are skipped, except under ``CI=true``, where they fail: CI must start the cluster before the tests.
As an ordinary user the reason is the one line of ``NEEDS_ROOT`` (the cluster's daemons need root), printed once
after collection and given as every such test's skip reason.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

PARTITION, NUM_NODES = "h20", 4
STATE_DIR = Path(os.environ.get("PREDMASK_SLURM_DIR", "/tmp/predmask-slurm"))
USABLE_STATES = {"idle", "mix", "mixed", "alloc", "allocated", "comp", "completing"}
NEEDS_ROOT = (
    "SLURM TESTS SKIPPED: the emulated Slurm cluster is not running and needs root to start munge and slurmd; "
    "to run them: sudo bash scripts/test.sh, or sudo bash scripts/slurm-emulated.sh start "
    f"&& export SLURM_CONF={STATE_DIR / 'slurm.conf'}"
)


def _under_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def _unavailable(reason: str) -> None:
    if _under_ci():
        pytest.fail(f"CI=true but the Slurm tests cannot run: {reason}", pytrace=False)
    pytest.skip(reason)


def _needs_cluster(item: pytest.Item) -> bool:
    return item.get_closest_marker("slurm") is not None or "slurm_cluster" in getattr(item, "fixturenames", ())


@functools.cache
def _cluster_reason() -> str | None:
    """Why the Slurm tests cannot run (NEEDS_ROOT for an ordinary user), or None; asked once per session."""
    problem = _cluster_problem()
    if problem and os.geteuid() != 0:
        return NEEDS_ROOT
    return problem


def pytest_collection_finish(session: pytest.Session) -> None:
    """Say once, before the tests run, that the selected Slurm tests will skip and why."""
    if not any(_needs_cluster(item) for item in session.items) or _cluster_reason() is None:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    line = _cluster_reason() if not _under_ci() else f"CI=true: the Slurm tests will fail: {_cluster_reason()}"
    if reporter is not None:
        reporter.write_line(line, yellow=True, bold=True)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("slurm") is not None and _cluster_reason() is not None:
        _unavailable(_cluster_reason())  # type: ignore[arg-type]


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
    problem = _cluster_reason()
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


@pytest.fixture
def float64_default() -> Iterator[None]:
    """torch's default dtype float64 for the test (closed-form checks), restored afterwards so no other test
    inherits it; use with ``pytestmark = pytest.mark.usefixtures("float64_default")``."""
    import torch

    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Any]:
    """``tmpfs(size_mib) -> Path``: a real size-limited tmpfs under ``tmp_path``, unmounted after the test. Mounting
    needs root: without it the test is skipped with the reason; under CI=true (root on a fresh machine) a mount that
    cannot be made fails the test, as the Slurm tests do."""
    mounted: list[Path] = []

    def mount(size_mib: int) -> Path:
        why = None if os.geteuid() == 0 else "mounting a size-limited tmpfs needs root; run the tests as root"
        mnt = tmp_path / f"tmpfs-{len(mounted)}"
        mnt.mkdir()
        if why is None:
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(mnt)],
                                  capture_output=True, text=True, check=False)
            why = f"mounting a tmpfs failed here: {done.stderr.strip()}" if done.returncode else None
        if why is not None:
            if _under_ci():
                pytest.fail(f"CI=true but the full-disk test cannot run: {why}", pytrace=False)
            pytest.skip(why)
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in reversed(mounted):
        subprocess.run(["umount", "-l", str(mnt)], check=False)
