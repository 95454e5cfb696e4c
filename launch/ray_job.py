"""The Ray job: one multi-node submitit job whose tasks form a Ray cluster, with the command run on rank 0.

The job has ``nodes=N, tasks_per_node=1``. Rank 0 starts the Ray head (fixed ``--num-cpus``, the job's GPUs
per node, the run's environment exported first), publishes its address in the job's rendezvous folder, waits
until Ray reports every node and GPU (else "Total available GPUs ... is less than total desired GPUs ..."),
runs the command with ``RAY_ADDRESS`` set, writes its exit status, tells the workers to stop, and stops only
the Ray processes it started (never a machine-wide ``ray stop``). Every other rank joins the head and stays up
until rank 0 writes ``done`` (or its own Ray node dies). The rendezvous folder is
``<submitit folder>/ray/<job id>.r<SLURM_RESTART_COUNT>/``: a requeued attempt never reads the previous
attempt's files."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import submitit

from launch.command_job import CommandJob, InterruptFlag, interruptible, write_json
from launch.procs import POLL_S, free_port, wait_files
from launch.ray_slurm import (
    RAY_DEFAULT_ENV,
    JobContext,
    RayClusterError,
    RayNode,
    RayOptions,
    wait_for_cluster,
)
from launch.slurm import node_address


@dataclass
class RayJob(CommandJob):
    """A submitit callable for one multi-node job: :class:`CommandJob`'s fields plus ``ray``. Rank 0 returns
    the exit status record (plus ``ray_address``, ``ray_nodes``, ``ray_gpus``), also written to the rendezvous
    folder; the other ranks return ``{"rank": r, "role": "worker", ...}``. Submitit's ``job.result()`` refuses
    multi-task jobs: use ``job.results()[0]``."""

    ray: RayOptions = field(default_factory=RayOptions)

    def __call__(self) -> dict[str, Any]:
        ctx = JobContext.from_environment(submitit.JobEnvironment(), self.ray)
        ctx.rendezvous.mkdir(parents=True, exist_ok=True)
        with interruptible() as interrupted:
            if ctx.rank == 0:
                record = self._run_head(ctx, interrupted)
            else:
                return self._run_worker(ctx)
        return self._checked(record)

    def _ray_env(self) -> dict[str, str]:
        return {**RAY_DEFAULT_ENV, **self.env}

    def _run_head(self, ctx: JobContext, interrupted: InterruptFlag) -> dict[str, Any]:
        node: RayNode | None = None
        try:
            with self._recorded(ctx.job_id, ctx.restart, interrupted, ctx.rendezvous) as record:
                ip = node_address(ctx.hostnames[0])
                port = self.ray.port or free_port(ip)
                address = f"{ip}:{port}"
                node = RayNode.start(ctx, self._ray_env(), ip, head_port=port)
                node.wait_listening(ip, port, self.ray.start_timeout_s)
                write_json(ctx.rendezvous / "head.json", {"address": address, "pid": node.proc.pid})
                want_gpus = ctx.gpus_per_node * ctx.num_nodes
                seen = wait_for_cluster(
                    address, ctx.num_nodes, want_gpus, self.ray.start_timeout_s, ctx.rendezvous
                )
                record.update(
                    ray_address=address, ray_nodes=seen["nodes"], ray_gpus=seen["gpus"], ray_ready=time.time()
                )
                env = {**self._ray_env(), "RAY_ADDRESS": address}
                record["returncode"] = self._run_command(extra_env=env)
        finally:
            (ctx.rendezvous / "done").touch()
            stopped = [ctx.rendezvous / f"stopped-{r}" for r in range(1, ctx.num_nodes)]
            wait_files(stopped, self.ray.stop_timeout_s)
            if node is not None:
                node.stop(keep_temp=self.ray.keep_temp or record["outcome"] != "completed")
        return record

    def _run_worker(self, ctx: JobContext) -> dict[str, Any]:
        node: RayNode | None = None
        head_file, done = ctx.rendezvous / "head.json", ctx.rendezvous / "done"
        try:
            if not wait_files([head_file], self.ray.start_timeout_s, give_up=[done]):
                if done.exists():  # the head gave up before publishing its address
                    return {"rank": ctx.rank, "role": "worker", "joined": False}
                raise RayClusterError(
                    f"rank {ctx.rank}: no Ray head address in {head_file} after {self.ray.start_timeout_s:.0f} s"
                )
            address = json.loads(head_file.read_text())["address"]
            ip = node_address(ctx.hostnames[ctx.node_index])
            node = RayNode.start(ctx, self._ray_env(), ip, join=address)
            while not done.exists() and node.proc.poll() is None:
                time.sleep(POLL_S)
            return {"rank": ctx.rank, "role": "worker", "joined": True, "ray_exit": node.proc.poll()}
        finally:
            if node is not None:
                node.stop(keep_temp=self.ray.keep_temp)
            (ctx.rendezvous / f"stopped-{ctx.rank}").touch()
