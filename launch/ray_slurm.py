"""Ray inside a Slurm allocation: the ``ray:`` options of a cluster config, what a task knows about its job,
one ``ray start --block`` node of ours (start, wait, stop), and the wait for the whole cluster.

Several emulated nodes may share one host: each Ray node therefore gets its own temp dir (Ray's unix sockets
live there), its own worker-port range and free ports for the head's servers.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launch.executor import plain_config
from launch.procs import POLL_S, free_port, kill_group, kill_pid, pids_using_dir
from launch.shell import shell_join
from launch.slurm import gpus_per_node_from_env, restart_count

# Environment every Ray process of ours gets unless the run overrides it: no token-auth warning, no usage
# stats upload (no network on the nodes), and an immediate teardown on SIGTERM (Ray 2.60 drains for 30 s first).
RAY_DEFAULT_ENV: dict[str, str] = {
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
}
_WORKER_PORT_LOW, _WORKER_PORT_HIGH = 10002, 32767  # below Linux's ephemeral range


class RayClusterError(RuntimeError):
    """The Ray cluster of a job could not be started or did not reach its expected size."""


@dataclass(frozen=True)
class RayOptions:
    """How each task starts its Ray node (the ``ray:`` section of a cluster config)."""

    num_cpus: int = 1  # fixed --num-cpus per node: Ray's CPU detection is wrong inside Slurm allocations
    num_gpus: int | None = None  # per node; None = the job's GPUs per node (SLURM_GPUS_PER_NODE), else 0
    port: int = 0  # GCS port of the head; 0 = a free port (several heads may share a host)
    object_store_memory: int | None = None  # bytes per node; None = Ray's default (30 % of RAM)
    start_timeout_s: float = 300.0  # how long the head waits for every node and GPU to join
    stop_timeout_s: float = 30.0  # how long a node may take to stop before it is killed
    include_dashboard: bool = False
    temp_root: str = "/tmp"  # per-node Ray temp dirs go under it; keep it short (unix socket paths)
    worker_port_span: int = 1000  # size of each node's worker-port range
    keep_temp: bool = False  # keep the per-node Ray temp dirs (logs) even after a clean run

    def __post_init__(self) -> None:
        if self.num_cpus < 1:
            raise ValueError(f"ray.num_cpus must be >= 1, got {self.num_cpus}")
        if self.num_gpus is not None and self.num_gpus < 0:
            raise ValueError(f"ray.num_gpus must be >= 0 or null, got {self.num_gpus}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"ray.port must be 0 (free port) or a TCP port, got {self.port}")
        if self.object_store_memory is not None and self.object_store_memory < 75 * 2**20:
            raise ValueError(
                f"ray.object_store_memory must be >= 75 MiB (Ray's minimum), got {self.object_store_memory}"
            )
        if self.start_timeout_s <= 0 or self.stop_timeout_s <= 0:
            raise ValueError("ray.start_timeout_s and ray.stop_timeout_s must be > 0")
        if not 10 <= self.worker_port_span <= (_WORKER_PORT_HIGH - _WORKER_PORT_LOW) // 4:
            raise ValueError(f"ray.worker_port_span must be in [10, 5691], got {self.worker_port_span}")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | None) -> RayOptions:
        """Build from a config mapping; unknown keys are an error naming the allowed ones."""
        values = dict(values or {})
        allowed = set(cls.__dataclass_fields__)
        unknown = sorted(set(values) - allowed)
        if unknown:
            raise ValueError(f"unknown ray option(s) {unknown}; allowed: {sorted(allowed)}")
        return cls(**values)


def ray_options(cluster_cfg: Mapping[str, Any]) -> RayOptions:
    """The :class:`RayOptions` of a cluster config (its optional ``ray:`` section); on the local backend, where no
    Slurm says the job's GPUs, ``num_gpus: null`` is the config's ``gpus_per_node``."""
    cfg = plain_config(cluster_cfg)
    ray = dict(cfg.get("ray") or {})
    if ray.get("num_gpus") is None and cfg.get("backend") == "local":
        ray["num_gpus"] = int(cfg.get("gpus_per_node") or 0)
    return RayOptions.from_mapping(ray)


@dataclass(frozen=True)
class JobContext:
    """What a task needs to know about its job (pure data, built from submitit's JobEnvironment)."""

    job_id: str
    restart: int
    rank: int
    node_index: int
    num_nodes: int
    hostnames: list[str]
    gpus_per_node: int
    rendezvous: Path
    options: RayOptions

    @classmethod
    def from_environment(cls, job_env: Any, options: RayOptions) -> JobContext:
        job_id = str(job_env.job_id)
        restart = restart_count()
        folder = Path(job_env.paths.folder)
        gpus = options.num_gpus if options.num_gpus is not None else gpus_per_node_from_env(os.environ)
        hostnames = list(job_env.hostnames)
        if len(hostnames) < job_env.num_nodes:
            raise RayClusterError(f"job {job_id}: {len(hostnames)} hostnames for {job_env.num_nodes} nodes")
        return cls(
            job_id=job_id,
            restart=restart,
            rank=int(job_env.global_rank),
            node_index=int(job_env.node),
            num_nodes=int(job_env.num_nodes),
            hostnames=hostnames,
            gpus_per_node=gpus,
            rendezvous=folder / "ray" / f"{job_id}.r{restart}",
            options=options,
        )

    @property
    def temp_dir(self) -> Path:
        safe = re.sub(r"[^A-Za-z0-9]", "-", self.job_id)
        return Path(self.options.temp_root) / f"ray-{safe}-r{self.restart}-{self.rank}"

    def worker_ports(self) -> tuple[int, int]:
        """This node's worker-port range: distinct for the ranks of a job (and usually across jobs)."""
        span = self.options.worker_port_span
        slots = (_WORKER_PORT_HIGH - _WORKER_PORT_LOW + 1) // span
        job_number = int(re.sub(r"\D", "", self.job_id) or 0)
        slot = (job_number * max(self.num_nodes, 1) + self.rank) % slots
        low = _WORKER_PORT_LOW + slot * span
        return low, low + span - 1


@dataclass
class RayNode:
    """One `ray start --block` process of ours (its own session, its own temp dir)."""

    proc: subprocess.Popen[bytes]
    temp_dir: Path
    log_path: Path
    stop_timeout_s: float

    @classmethod
    def start(
        cls,
        ctx: JobContext,
        env: Mapping[str, str],
        ip: str,
        *,
        head_port: int | None = None,
        join: str | None = None,
    ) -> RayNode:
        opts = ctx.options
        low, high = ctx.worker_ports()
        args = [
            sys.executable,
            "-m",
            "ray.scripts.scripts",
            "start",
            "--block",
            "--disable-usage-stats",
            f"--node-ip-address={ip}",
            f"--num-cpus={opts.num_cpus}",
            f"--num-gpus={ctx.gpus_per_node}",
            f"--temp-dir={ctx.temp_dir}",
            f"--min-worker-port={low}",
            f"--max-worker-port={high}",
            "--node-manager-port=0",
            "--object-manager-port=0",
            f"--dashboard-agent-listen-port={free_port(ip)}",
        ]
        if opts.object_store_memory is not None:
            args.append(f"--object-store-memory={opts.object_store_memory}")
        if head_port is not None:
            args += [
                "--head",
                f"--port={head_port}",
                f"--include-dashboard={str(opts.include_dashboard).lower()}",
            ]  # no --ray-client-server-port: it needs ray[client]; the minimal ray starts no client server
            if opts.include_dashboard:
                args.append(f"--dashboard-port={free_port(ip)}")
        else:
            args.append(f"--address={join}")
        ctx.temp_dir.mkdir(parents=True, exist_ok=True)
        log_path = ctx.rendezvous / f"ray-rank{ctx.rank}.log"
        with open(log_path, "ab") as log:
            log.write(f"$ {shell_join(args)}\n".encode())
            log.flush()
            proc = subprocess.Popen(
                args, env=node_env({**os.environ, **env}), stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return cls(proc=proc, temp_dir=ctx.temp_dir, log_path=log_path, stop_timeout_s=opts.stop_timeout_s)

    def wait_listening(self, ip: str, port: int, timeout_s: float) -> None:
        """Return once this head node accepts connections on ``ip:port``; raise if it exits or times out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RayClusterError(
                    f"ray head exited with status {self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                with socket.create_connection((ip, port), timeout=1):
                    return
            except OSError:
                time.sleep(POLL_S)
        raise RayClusterError(
            f"ray head not listening on {ip}:{port} after {timeout_s:.0f} s:\n{self.log_tail()}"
        )

    def log_tail(self, n: int = 15) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def stop(self, *, keep_temp: bool) -> None:
        """SIGTERM our `ray start --block` (it tears its node down), then kill whatever of ours is left."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                kill_group(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        kill_group(self.proc.pid, signal.SIGKILL)
        for pid in pids_using_dir(str(self.temp_dir)):
            kill_pid(pid, signal.SIGKILL)
        if not keep_temp:
            shutil.rmtree(self.temp_dir, ignore_errors=True)


def node_env(env: Mapping[str, str]) -> dict[str, str]:
    """A Ray node's environment: ``env`` without an empty ``CUDA_VISIBLE_DEVICES`` (a job whose GPUs are scheduling
    tokens, as on a CPU machine: Ray refuses ``--num-gpus=N`` beside an empty list of visible devices)."""
    return {k: v for k, v in env.items() if not (k == "CUDA_VISIBLE_DEVICES" and not v.strip())}


_PROBE = r"""
import json, sys, time
import ray
address, want_nodes, want_gpus, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
deadline = time.monotonic() + timeout
ray.init(address=address, logging_level="ERROR", log_to_driver=False)
while True:
    alive = [n for n in ray.nodes() if n.get("Alive")]
    gpus = sum(n.get("Resources", {}).get("GPU", 0.0) for n in alive)
    ok = len(alive) >= want_nodes and gpus >= want_gpus
    if ok or time.monotonic() > deadline:
        break
    time.sleep(0.5)
print(json.dumps({"nodes": len(alive), "gpus": gpus, "ok": ok}), flush=True)
ray.shutdown()
"""


def wait_for_cluster(
    address: str, want_nodes: int, want_gpus: float, timeout_s: float, log_dir: Path | None = None
) -> dict[str, Any]:
    """Wait until the Ray cluster at ``address`` has ``want_nodes`` alive nodes and ``want_gpus`` GPUs, asking
    from a short-lived subprocess (the caller never becomes a Ray driver); else :class:`RayClusterError`."""
    env = {**os.environ, **RAY_DEFAULT_ENV}
    env.pop("RAY_ADDRESS", None)
    args = [sys.executable, "-c", _PROBE, address, str(want_nodes), str(want_gpus), str(timeout_s)]
    try:
        out = subprocess.run(
            args, check=False, env=env, capture_output=True, text=True, timeout=timeout_s + 120
        )
    except subprocess.TimeoutExpired as exc:
        raise RayClusterError(
            f"Ray cluster at {address} did not answer within {timeout_s + 120:.0f} s"
        ) from exc
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        tail = "\n".join((out.stderr or "").splitlines()[-10:])
        raise RayClusterError(f"cannot query the Ray cluster at {address} (exit {out.returncode}):\n{tail}")
    seen = json.loads(lines[-1])
    if not seen["ok"]:
        where = f"; Ray logs of each rank: {log_dir}/ray-rank*.log" if log_dir else ""
        raise RayClusterError(
            f"Ray cluster at {address} after {timeout_s:.0f} s: {seen['nodes']} of {want_nodes} nodes alive, "
            f"total available GPUs {seen['gpus']} is less than total desired GPUs {want_gpus}"
            f" (workers that never joined?){where}"
        )
    return seen
