"""Run one command on a Ray cluster built inside a submitit job (Ray head on rank 0, workers on the other ranks).

A multi-node run is ONE submitit job with ``nodes=N, tasks_per_node=1``. Every task executes the same
pickled :class:`RayJob`; inside it, :class:`submitit.JobEnvironment` says which rank it is:

* rank 0 starts the Ray head (``ray start --head --block``, fixed ``--num-cpus``, ``--num-gpus`` = the job's
  GPUs per node, the run's environment exported before the start), publishes the head address in the job's
  rendezvous folder, waits until Ray reports every node and GPU (or fails with a clear "Total available GPUs
  ... is less than total desired GPUs ..." error), runs the command (an argv list, never a shell string) as a
  subprocess with ``RAY_ADDRESS`` set, writes its exit status, tells the workers to stop, and stops only the
  Ray processes it started itself (by pid and by its own temp dir; never a machine-wide ``ray stop``);
* every other rank reads the head address, joins with ``ray start --address ... --block`` and stays up
  until rank 0 writes ``done`` (or its own Ray node dies), then stops its own Ray node.

Several emulated nodes may share one host (``scripts/slurm-emulated.sh``): each Ray node therefore gets its
own temp dir (Ray's unix sockets live there), its own worker-port range and free ports for the head's
servers, and node names that DNS does not know are resolved through ``scontrol show node`` (NodeAddr).

The rendezvous folder is ``<submitit folder>/ray/<job id>.r<SLURM_RESTART_COUNT>/`` so a requeued attempt
never reads the previous attempt's files. :meth:`RayJob.checkpoint` requeues the same callable: resuming is
the command's business (it is rerun with the same run directory).

:func:`make_executor` builds the submitit executor of a cluster config (``conf/cluster/*.yaml``).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import submitit

__all__ = [
    "CommandFailedError",
    "CommandJob",
    "JobInterrupted",
    "RayClusterError",
    "RayJob",
    "RayOptions",
    "gpus_per_node_from_env",
    "make_executor",
    "node_address",
    "ray_options",
    "setup_lines",
    "shell_join",
    "slurm_job_state",
    "wait_for_cluster",
]

# Environment every Ray process of ours gets unless the run overrides it: no token-auth warning, no usage
# stats upload (no network on the nodes), and an immediate teardown on SIGTERM (Ray 2.60 drains for 30 s first).
RAY_DEFAULT_ENV: dict[str, str] = {
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
}
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_WORKER_PORT_LOW, _WORKER_PORT_HIGH = 10002, 32767  # below Linux's ephemeral range
_POLL_S = 0.5


class RayClusterError(RuntimeError):
    """The Ray cluster of a job could not be started or did not reach its expected size."""


class CommandFailedError(RuntimeError):
    """The command run on the Ray cluster exited with a non-zero status."""


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
    """The :class:`RayOptions` of a cluster config (its optional ``ray:`` section)."""
    return RayOptions.from_mapping(_plain(cluster_cfg).get("ray"))


# ----------------------------------------------------------------------------------------------- shell text


def shell_join(argv: Sequence[str]) -> str:
    """One shell-safe line for an argv (for dry runs and logs; the jobs themselves never use a shell)."""
    return shlex.join([str(a) for a in argv])


def setup_lines(cluster_cfg: Mapping[str, Any], env: Mapping[str, str] | None = None) -> list[str]:
    """The sbatch setup lines of a cluster config: its ``setup`` lines verbatim (trusted site config such as
    ``module load``), then one ``export NAME=<shlex-quoted value>`` per entry of its ``env`` and of ``env``."""
    cfg = _plain(cluster_cfg)
    lines = [str(line) for line in (cfg.get("setup") or [])]
    merged = {**(cfg.get("env") or {}), **(env or {})}
    for name, value in merged.items():
        if not _ENV_NAME.match(str(name)):
            raise ValueError(f"bad environment variable name {name!r}: use letters, digits and _ (not first)")
        lines.append(f"export {name}={shlex.quote(str(value))}")
    return lines


# ---------------------------------------------------------------------------------------------- executors

_BACKENDS = ("local", "slurm")


def make_executor(
    folder: str | os.PathLike[str],
    cluster_cfg: Mapping[str, Any],
    *,
    name: str | None = None,
    env: Mapping[str, str] | None = None,
) -> submitit.AutoExecutor:
    """The submitit executor of a cluster config (``conf/cluster/<name>.yaml``).

    ``backend: local`` gives submitit's local executor (one process per task on this machine);
    ``backend: slurm`` gives its Slurm executor with ``nodes``, ``tasks_per_node``, ``gpus_per_node``,
    ``cpus_per_task``, ``mem_gb``, ``partition``, ``timeout_min``, ``max_num_timeout`` (requeues after a
    timeout), ``signal_delay_s``, ``slurm_additional_parameters`` and the setup lines of :func:`setup_lines`.
    ``env`` adds exports (quoted) to the sbatch script.
    """
    cfg = _plain(cluster_cfg)
    backend = cfg.get("backend")
    if backend not in _BACKENDS:
        raise ValueError(f"cluster backend {backend!r} is not one of {list(_BACKENDS)}")
    nodes = _positive_int(cfg, "nodes", 1)
    tasks_per_node = _positive_int(cfg, "tasks_per_node", 1)
    timeout_min = _positive_int(cfg, "timeout_min", 24 * 60)
    max_num_timeout = _nonnegative_int(cfg, "max_num_timeout", 3)
    params: dict[str, Any] = {"timeout_min": timeout_min, "tasks_per_node": tasks_per_node}
    if name is not None:
        params["name"] = name
    for key in ("cpus_per_task", "mem_gb"):
        if cfg.get(key) is not None:
            params[key] = cfg[key]
    if backend == "local":
        if nodes != 1:
            raise ValueError(f"the local backend runs on one node, got nodes={nodes}")
        executor = submitit.AutoExecutor(
            folder=folder, cluster="local", local_max_num_timeout=max_num_timeout
        )
        executor.update_parameters(**params)
        return executor
    gpus_per_node = _nonnegative_int(cfg, "gpus_per_node", 0)
    params.update(nodes=nodes, gpus_per_node=gpus_per_node, slurm_setup=setup_lines(cfg, env))
    if cfg.get("partition"):
        params["slurm_partition"] = str(cfg["partition"])
    if cfg.get("signal_delay_s") is not None:
        params["slurm_signal_delay_s"] = _positive_int(cfg, "signal_delay_s", 90)
    extra = cfg.get("slurm_additional_parameters") or {}
    if not isinstance(extra, Mapping):
        raise TypeError(f"slurm_additional_parameters must be a mapping, got {extra!r}")
    if extra:
        params["slurm_additional_parameters"] = dict(extra)
    executor = submitit.AutoExecutor(folder=folder, cluster="slurm", slurm_max_num_timeout=max_num_timeout)
    executor.update_parameters(**params)
    return executor


# ------------------------------------------------------------------------------------------------ the jobs


class JobInterrupted(BaseException):
    """Slurm sent SIGTERM (requeue, preemption, scancel) or submitit is requeueing after a time-out.

    A BaseException on purpose: submitit writes no result for it, so an interrupted attempt is never taken
    for the end of the run (the requeued attempt writes the result)."""


@dataclass
class _Flag:
    raised: bool = False


@contextmanager
def _interruptible() -> Iterator[_Flag]:
    """Note SIGTERM instead of dying on it; turn whatever happens after it into :class:`JobInterrupted`."""
    flag = _Flag()

    def on_sigterm(signum: int, frame: Any) -> None:
        flag.raised = True
        print("sweeps.slurm_ray: SIGTERM received, the job is being interrupted", file=sys.stderr, flush=True)

    try:
        previous = signal.signal(signal.SIGTERM, on_sigterm)
    except ValueError:  # not the main thread: leave signals alone
        previous = None
    try:
        yield flag
    except Exception as exc:
        if flag.raised:
            raise JobInterrupted(f"interrupted by SIGTERM ({type(exc).__name__}: {exc})") from exc
        raise
    else:
        if flag.raised:
            raise JobInterrupted("interrupted by SIGTERM")
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _outcome(record: Mapping[str, Any], exc: BaseException | None, flag: _Flag) -> str:
    if flag.raised or isinstance(exc, (SystemExit, KeyboardInterrupt, JobInterrupted)):
        return "interrupted"
    if exc is not None or record["returncode"] is None:
        return "error"
    return "completed" if record["returncode"] == 0 else "failed"


@dataclass
class CommandJob(submitit.helpers.Checkpointable):
    """A submitit callable that runs ``command`` once (single-task jobs: local runs, job arrays).

    command: the argv to run; it is handed to the OS as a list, so no value is ever interpreted by a shell.
    run_dir: working directory of the command; ``exit_status.json`` is written there too (atomically).
    env: added to the command's environment (and, for :class:`RayJob`, exported before ``ray start``).
    log_file: where the command's stdout/stderr go (appended); None = the submitit task log.
    check: raise :class:`CommandFailedError` when the command exits non-zero (after writing its status).
    stop_timeout_s: grace between SIGTERM and SIGKILL when the job is interrupted.

    Returns the exit status record ``{"job_id", "restart", "command", "returncode", "outcome", "started",
    "finished", "error"}`` with outcome ``completed`` / ``failed`` (non-zero exit) / ``error`` (could not
    run) / ``interrupted`` (SIGTERM or requeue: then the job raises :class:`JobInterrupted` and submitit
    records no result). :meth:`checkpoint` (called by submitit on preemption/time-out) requeues the same
    callable; resuming is the command's business.
    """

    command: Sequence[str]
    run_dir: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    log_file: str | None = None
    check: bool = True
    stop_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if isinstance(self.command, (str, bytes)) or not self.command:
            raise ValueError(f"command must be a non-empty argv list, got {self.command!r}")
        self.command = [str(a) for a in self.command]
        for name in self.env:
            if not _ENV_NAME.match(str(name)):
                raise ValueError(
                    f"bad environment variable name {name!r}: use letters, digits and _ (not first)"
                )
        self.env = {str(k): str(v) for k, v in self.env.items()}

    def __call__(self) -> dict[str, Any]:
        job_env = submitit.JobEnvironment()
        if job_env.num_tasks != 1:
            raise ValueError(
                f"CommandJob runs one task, got {job_env.num_tasks}: use RayJob for multi-node runs"
            )
        record = self._new_record(str(job_env.job_id), _restart_count())
        with _interruptible() as interrupted:
            exc: BaseException | None = None
            try:
                record["returncode"] = self._run_command(extra_env={})
            except BaseException as err:  # SystemExit from submitit's time-out handler included
                exc = err
                raise
            finally:
                self._finish(record, exc, interrupted, None)
        return self._checked(record)

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        """Requeue the same callable; the command resumes from its own checkpoints in ``run_dir``."""
        return submitit.helpers.DelayedSubmission(self, *args, **kwargs)

    # ------------------------------------------------------------------------------------------ parts

    def _new_record(self, job_id: str, restart: int) -> dict[str, Any]:
        return {
            "job_id": job_id,
            "restart": restart,
            "command": list(self.command),
            "returncode": None,
            "outcome": None,
            "started": time.time(),
            "finished": None,
            "error": None,
        }

    def _finish(
        self, record: dict[str, Any], exc: BaseException | None, flag: _Flag, rendezvous: Path | None
    ) -> None:
        record["finished"] = time.time()
        record["outcome"] = _outcome(record, exc, flag)
        if exc is not None:
            record["error"] = f"{type(exc).__name__}: {exc}"
        if rendezvous is not None:
            _write_json(rendezvous / "exit_status.json", record)
        if self.run_dir is not None:
            Path(self.run_dir).mkdir(parents=True, exist_ok=True)
            _write_json(Path(self.run_dir) / "exit_status.json", record)

    def _run_command(self, extra_env: Mapping[str, str]) -> int:
        """Run the command to completion; on any interruption, end its whole process group."""
        env = {**os.environ, **self.env, **extra_env}
        cwd = None
        if self.run_dir is not None:
            Path(self.run_dir).mkdir(parents=True, exist_ok=True)
            cwd = self.run_dir
        out: Any = None
        if self.log_file is not None:
            Path(self.log_file).parent.mkdir(parents=True, exist_ok=True)
            out = open(self.log_file, "ab")  # noqa: SIM115 - handed to the child, closed right after
        try:
            proc = subprocess.Popen(
                self.command,
                env=env,
                cwd=cwd,
                stdout=out,
                stderr=subprocess.STDOUT if out else None,
                start_new_session=True,
            )
        finally:
            if out is not None:
                out.close()
        try:
            return proc.wait()
        finally:
            if proc.poll() is None:
                _terminate_group(proc, self.stop_timeout_s)

    def _checked(self, record: dict[str, Any]) -> dict[str, Any]:
        if self.check and record["returncode"] != 0:
            raise CommandFailedError(
                f"command exited with status {record['returncode']}: {shell_join(self.command)[:300]}"
            )
        return record


@dataclass
class RayJob(CommandJob):
    """A submitit callable for one multi-node job: a Ray cluster over its tasks, then ``command`` on rank 0.

    Fields as :class:`CommandJob`, plus ``ray`` (:class:`RayOptions`). ``env`` is exported before
    ``ray start`` so every Ray worker inherits it. Rank 0 returns the exit status record (plus
    ``ray_address``, ``ray_nodes``, ``ray_gpus``), also written to ``run_dir`` and to the job's rendezvous
    folder; the other ranks return ``{"rank": r, "role": "worker", ...}``. Submitit's ``job.result()``
    refuses multi-task jobs: use ``job.results()[0]``.
    """

    ray: RayOptions = field(default_factory=RayOptions)

    def __call__(self) -> dict[str, Any]:
        ctx = _JobContext.from_environment(submitit.JobEnvironment(), self.ray)
        ctx.rendezvous.mkdir(parents=True, exist_ok=True)
        with _interruptible() as interrupted:
            if ctx.rank == 0:
                record = self._run_head(ctx, interrupted)
            else:
                return self._run_worker(ctx)
        return self._checked(record)

    def _ray_env(self) -> dict[str, str]:
        return {**RAY_DEFAULT_ENV, **self.env}

    def _run_head(self, ctx: _JobContext, interrupted: _Flag) -> dict[str, Any]:
        node: _RayNode | None = None
        record = self._new_record(ctx.job_id, ctx.restart)
        exc: BaseException | None = None
        try:
            ip = node_address(ctx.hostnames[0])
            port = self.ray.port or _free_port(ip)
            address = f"{ip}:{port}"
            node = _RayNode.start(ctx, self._ray_env(), ip, head_port=port)
            _wait_port(ip, port, node, self.ray.start_timeout_s)
            _write_json(ctx.rendezvous / "head.json", {"address": address, "pid": node.proc.pid})
            want_gpus = ctx.gpus_per_node * ctx.num_nodes
            seen = wait_for_cluster(
                address, ctx.num_nodes, want_gpus, self.ray.start_timeout_s, ctx.rendezvous
            )
            record.update(
                ray_address=address, ray_nodes=seen["nodes"], ray_gpus=seen["gpus"], ray_ready=time.time()
            )
            record["returncode"] = self._run_command(extra_env={**self._ray_env(), "RAY_ADDRESS": address})
        except BaseException as err:  # SystemExit from submitit's time-out handler included
            exc = err
            raise
        finally:
            self._finish(record, exc, interrupted, ctx.rendezvous)
            (ctx.rendezvous / "done").touch()
            stopped = [ctx.rendezvous / f"stopped-{r}" for r in range(1, ctx.num_nodes)]
            _wait_files(stopped, self.ray.stop_timeout_s)
            if node is not None:
                node.stop(keep_temp=self.ray.keep_temp or record["outcome"] != "completed")
        return record

    def _run_worker(self, ctx: _JobContext) -> dict[str, Any]:
        node: _RayNode | None = None
        head_file, done = ctx.rendezvous / "head.json", ctx.rendezvous / "done"
        try:
            if not _wait_files([head_file], self.ray.start_timeout_s, give_up=[done]):
                if done.exists():  # the head gave up before publishing its address
                    return {"rank": ctx.rank, "role": "worker", "joined": False}
                raise RayClusterError(
                    f"rank {ctx.rank}: no Ray head address in {head_file} after {self.ray.start_timeout_s:.0f} s"
                )
            address = json.loads(head_file.read_text())["address"]
            ip = node_address(ctx.hostnames[ctx.node_index])
            node = _RayNode.start(ctx, self._ray_env(), ip, join=address)
            while not done.exists() and node.proc.poll() is None:
                time.sleep(_POLL_S)
            return {"rank": ctx.rank, "role": "worker", "joined": True, "ray_exit": node.proc.poll()}
        finally:
            if node is not None:
                node.stop(keep_temp=self.ray.keep_temp)
            (ctx.rendezvous / f"stopped-{ctx.rank}").touch()


# -------------------------------------------------------------------------------------------- Ray plumbing


@dataclass(frozen=True)
class _JobContext:
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
    def from_environment(cls, job_env: Any, options: RayOptions) -> _JobContext:
        job_id = str(job_env.job_id)
        restart = _restart_count()
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
class _RayNode:
    """One `ray start --block` process of ours (its own session, its own temp dir)."""

    proc: subprocess.Popen[bytes]
    temp_dir: Path
    log_path: Path
    stop_timeout_s: float

    @classmethod
    def start(
        cls,
        ctx: _JobContext,
        env: Mapping[str, str],
        ip: str,
        *,
        head_port: int | None = None,
        join: str | None = None,
    ) -> _RayNode:
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
            f"--dashboard-agent-listen-port={_free_port(ip)}",
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
                args.append(f"--dashboard-port={_free_port(ip)}")
        else:
            args.append(f"--address={join}")
        ctx.temp_dir.mkdir(parents=True, exist_ok=True)
        log_path = ctx.rendezvous / f"ray-rank{ctx.rank}.log"
        with open(log_path, "ab") as log:
            log.write(f"$ {shell_join(args)}\n".encode())
            log.flush()
            proc = subprocess.Popen(
                args, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        node = cls(proc=proc, temp_dir=ctx.temp_dir, log_path=log_path, stop_timeout_s=opts.stop_timeout_s)
        return node

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
                _kill_group(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        _kill_group(self.proc.pid, signal.SIGKILL)
        for pid in _pids_using_dir(str(self.temp_dir)):
            _kill_pid(pid, signal.SIGKILL)
        if not keep_temp:
            _rmtree(self.temp_dir)


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
    """Wait until the Ray cluster at ``address`` has ``want_nodes`` alive nodes and ``want_gpus`` GPUs.

    Connects from a short-lived subprocess (so the caller never becomes a Ray driver). Returns
    ``{"nodes": n, "gpus": g, "ok": True}``; raises :class:`RayClusterError` naming both counts otherwise.
    """
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


def slurm_job_state(job_id: str) -> str:
    """Slurm state of a job (``PENDING``, ``RUNNING``, ``COMPLETED``, ``CANCELLED``, ...) without accounting.

    submitit's ``job.state`` asks ``sacct``, which needs slurmdbd (absent on the emulated cluster: it
    says UNKNOWN there). This asks ``squeue``, then ``scontrol show job`` (which remembers ended jobs for
    MinJobAge seconds); ``UNKNOWN`` when Slurm no longer knows the job.
    """
    out = subprocess.run(
        ["squeue", "-h", "-j", str(job_id), "-o", "%T"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    states = out.stdout.split()
    if out.returncode == 0 and states:
        return states[0]
    out = subprocess.run(
        ["scontrol", "show", "job", str(job_id)], capture_output=True, text=True, timeout=60, check=False
    )
    match = re.search(r"\bJobState=(\S+)", out.stdout)
    return match.group(1) if match else "UNKNOWN"


def node_address(node_name: str) -> str:
    """IPv4 address of a Slurm node: DNS/hosts first, else the NodeAddr that ``scontrol show node`` reports
    (emulated clusters name their nodes node1..node4 while they all live on one host)."""
    try:
        return socket.gethostbyname(node_name)
    except OSError:
        pass
    try:
        out = subprocess.run(
            ["scontrol", "show", "node", node_name], capture_output=True, text=True, timeout=30, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    match = re.search(r"\bNodeAddr=(\S+)", out)
    if match:
        try:
            return socket.gethostbyname(match.group(1))
        except OSError:
            pass
    raise RayClusterError(
        f"cannot resolve node {node_name!r}: not in DNS/hosts and no usable NodeAddr from scontrol"
    )


def gpus_per_node_from_env(environ: Mapping[str, str]) -> int:
    """GPUs per node of the current Slurm job (``SLURM_GPUS_PER_NODE``, e.g. ``8`` or ``h20:8``), else 0."""
    raw = environ.get("SLURM_GPUS_PER_NODE", "")
    match = re.search(r"(\d+)$", raw.split(",")[0].split("(")[0])
    return int(match.group(1)) if match else 0


# ------------------------------------------------------------------------------------------- small helpers


def _plain(cfg: Mapping[str, Any] | Any) -> dict[str, Any]:
    """A plain dict from a mapping or an OmegaConf DictConfig (resolved)."""
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(cfg, DictConfig):
            return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        pass
    if not isinstance(cfg, Mapping):
        raise TypeError(f"cluster config must be a mapping, got {type(cfg).__name__}")
    return dict(cfg)


def _positive_int(cfg: Mapping[str, Any], key: str, default: int) -> int:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"cluster {key} must be a positive integer, got {value!r}")
    return value


def _nonnegative_int(cfg: Mapping[str, Any], key: str, default: int) -> int:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"cluster {key} must be an integer >= 0, got {value!r}")
    return value


def _restart_count() -> int:
    """How many times Slurm has requeued the current job (0 on the first attempt and outside Slurm)."""
    return int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def _free_port(ip: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((ip, 0))
        return int(sock.getsockname()[1])


def _wait_port(ip: str, port: int, node: _RayNode, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if node.proc.poll() is not None:
            raise RayClusterError(f"ray head exited with status {node.proc.returncode}:\n{node.log_tail()}")
        try:
            with socket.create_connection((ip, port), timeout=1):
                return
        except OSError:
            time.sleep(_POLL_S)
    raise RayClusterError(
        f"ray head not listening on {ip}:{port} after {timeout_s:.0f} s:\n{node.log_tail()}"
    )


def _wait_files(paths: Sequence[Path], timeout_s: float, give_up: Sequence[Path] = ()) -> bool:
    """True once every path exists; False after ``timeout_s`` or as soon as a ``give_up`` path exists."""
    deadline = time.monotonic() + timeout_s
    while True:
        if all(p.exists() for p in paths):
            return True
        if any(p.exists() for p in give_up) or time.monotonic() >= deadline:
            return all(p.exists() for p in paths)
        time.sleep(_POLL_S)


def _terminate_group(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    _kill_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _pids_using_dir(path: str) -> list[int]:
    """Pids of the processes with an argument that is ``path`` or lies under it (our job-and-rank-unique Ray
    temp dir: its session's raylet, GCS, agents and workers); ``/tmp/ray-1-r0-1`` never matches ``...-10``."""
    me, found = os.getpid(), []
    under, exact = (path.rstrip("/") + "/").encode(), (path.rstrip("/") + "\0").encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if under in cmdline or exact in cmdline:
            found.append(int(entry.name))
    return found


def _rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
