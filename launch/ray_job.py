"""The Ray job: one multi-node submitit job whose tasks form a Ray cluster, with the command run on rank 0.

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

The rendezvous folder is ``<submitit folder>/ray/<job id>.r<SLURM_RESTART_COUNT>/`` so a requeued attempt
never reads the previous attempt's files. :meth:`RayJob.checkpoint` requeues the same callable: resuming is
the command's business (it is rerun with the same run directory).
"""

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
    """A submitit callable for one multi-node job: a Ray cluster over its tasks, then ``command`` on rank 0.

    Fields as :class:`CommandJob`, plus ``ray`` (:class:`RayOptions`). ``env`` is exported before
    ``ray start`` so every Ray worker inherits it. Rank 0 returns the exit status record (plus
    ``ray_address``, ``ray_nodes``, ``ray_gpus``), also written to ``run_dir`` and to the job's rendezvous
    folder; the other ranks return ``{"rank": r, "role": "worker", ...}``. Submitit's ``job.result()``
    refuses multi-task jobs: use ``job.results()[0]``.
    """

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
        record = self._new_record(ctx.job_id, ctx.restart)
        exc: BaseException | None = None
        try:
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
            record["returncode"] = self._run_command(extra_env={**self._ray_env(), "RAY_ADDRESS": address})
        except BaseException as err:  # SystemExit from submitit's time-out handler included
            exc = err
            raise
        finally:
            self._finish(record, exc, interrupted, ctx.rendezvous)
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
