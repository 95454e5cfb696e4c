"""Slurm queries (``squeue``, ``scontrol``) and what a task reads from its Slurm environment.

submitit's ``job.state`` asks ``sacct``, which needs slurmdbd (absent on the emulated cluster); these ask the
controller directly, so they work with or without accounting.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
from collections.abc import Mapping

#: Slurm job states of a job that is still queued or running (a job in any other state has ended)
LIVE_STATES = ("PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING", "RESIZING", "SUSPENDED")


class NodeAddressError(RuntimeError):
    """A Slurm node name that neither DNS nor ``scontrol show node`` resolves to an address."""


def _ask(*argv: str, timeout: int = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)


def slurm_job_state(job_id: str) -> str:
    """Slurm state of a job without accounting: ``squeue``'s, else ``scontrol show job``'s (which remembers
    ended jobs for MinJobAge seconds), else ``UNKNOWN``."""
    out = _ask("squeue", "-h", "-j", str(job_id), "-o", "%T")
    states = out.stdout.split()
    if out.returncode == 0 and states:
        return states[0]
    out = _ask("scontrol", "show", "job", str(job_id))
    match = re.search(r"\bJobState=(\S+)", out.stdout)
    return match.group(1) if match else "UNKNOWN"


def node_address(node_name: str) -> str:
    """IPv4 address of a Slurm node: DNS/hosts first, else the NodeAddr that ``scontrol show node`` reports
    (emulated clusters name their nodes node1..node4 while they all live on one host)."""
    with contextlib.suppress(OSError):
        return socket.gethostbyname(node_name)
    try:
        out = _ask("scontrol", "show", "node", node_name, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    match = re.search(r"\bNodeAddr=(\S+)", out)
    if match:
        with contextlib.suppress(OSError):
            return socket.gethostbyname(match.group(1))
    raise NodeAddressError(
        f"cannot resolve node {node_name!r}: not in DNS/hosts and no usable NodeAddr from scontrol"
    )


def gpus_per_node_from_env(environ: Mapping[str, str]) -> int:
    """GPUs per node of the current Slurm job (``SLURM_GPUS_PER_NODE``, e.g. ``8`` or ``h20:8``), else 0."""
    raw = environ.get("SLURM_GPUS_PER_NODE", "")
    match = re.search(r"(\d+)$", raw.split(",")[0].split("(")[0])
    return int(match.group(1)) if match else 0


def restart_count() -> int:
    """How many times Slurm has requeued the current job (0 on the first attempt and outside Slurm)."""
    return int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
