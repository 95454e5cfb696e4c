"""Stand-in for VeRL's trainer in the Slurm tests: small CPU programs run as the command of a submitted job.

Modes (each writes its findings as JSON to --out, atomically):
  probe  connect to the Ray cluster of $RAY_ADDRESS, run one task pinned to every alive node, report nodes/GPUs;
  steps  a resumable counter: one "training step" per --sleep seconds up to --total, progress saved after
         every step in --state, every executed step logged with the Slurm restart count in --log;
  argv   record its own argv (after --) and one environment variable, to check quoting end to end;
  square compute x*x (a job-array element);
  step   what Slurm gave its job step: the argv of the srun that launched it (``scontrol show step`` names its
         host and pid; the emulated nodes are this host) and the job's CPUs and memory request.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path


def write_json(path: str, data: object) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    Path(tmp).write_text(json.dumps(data))
    os.replace(tmp, path)


def probe(out: str) -> None:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ray.init(logging_level="ERROR", log_to_driver=False)  # address from RAY_ADDRESS
    alive = [n for n in ray.nodes() if n["Alive"]]

    @ray.remote(num_cpus=1)
    def where() -> dict:
        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    refs = [
        where.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=n["NodeID"], soft=False)
        ).remote()
        for n in alive
    ]
    ran = ray.get(refs, timeout=120)
    write_json(
        out,
        {
            "ray_address": os.environ.get("RAY_ADDRESS"),
            "alive_nodes": sorted(n["NodeID"] for n in alive),
            "gpus": ray.cluster_resources().get("GPU", 0.0),
            "task_nodes": sorted(r["node_id"] for r in ran),
        },
    )
    ray.shutdown()


def steps(state: str, log: str, total: int, sleep: float, out: str) -> None:
    start = json.loads(Path(state).read_text())["step"] if Path(state).exists() else 0
    attempt = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    print(f"attempt {attempt}: resuming at step {start} of {total}", flush=True)
    for step in range(start, total):
        time.sleep(sleep)
        with open(log, "a") as f:
            f.write(json.dumps({"attempt": attempt, "step": step}) + "\n")
        write_json(state, {"step": step + 1})
    write_json(out, {"attempt": attempt, "started_at": start, "final_step": total})


def _scontrol(*what: str) -> str:
    return subprocess.run(["scontrol", "show", *what], capture_output=True, text=True, check=True, timeout=30).stdout


def step(out: str) -> None:
    job, step_id = os.environ["SLURM_JOB_ID"], os.environ["SLURM_STEP_ID"]
    shown = _scontrol("step", f"{job}.{step_id}")
    srun_pid = re.search(r"SrunHost:Pid=\S+:(\d+)", shown)
    argv = (Path(f"/proc/{srun_pid[1]}/cmdline").read_bytes().split(b"\0")[:-1] if srun_pid else [])
    fields = dict(re.findall(r"\b(NumCPUs|CPUs/Task|MinMemoryNode|OverSubscribe)=(\S+)", _scontrol("job", job)))
    write_json(out, {"srun": [a.decode() for a in argv], "job": fields})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["probe", "steps", "argv", "square", "step"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--state")
    parser.add_argument("--log")
    parser.add_argument("--total", type=int, default=10)
    parser.add_argument("--sleep", type=float, default=0.5)
    parser.add_argument("--x", type=int, default=0)
    parser.add_argument("--env-name", default="PREDMASK_TEST_VALUE")
    parser.add_argument("rest", nargs="*")
    if "--" in sys.argv:  # everything after -- is recorded verbatim, whatever it looks like
        cut = sys.argv.index("--")
        args, rest = parser.parse_args(sys.argv[1:cut]), sys.argv[cut + 1 :]
    else:
        args, rest = parser.parse_args(), []
    if args.mode == "probe":
        probe(args.out)
    elif args.mode == "steps":
        steps(args.state, args.log, args.total, args.sleep, args.out)
    elif args.mode == "step":
        step(args.out)
    elif args.mode == "argv":
        write_json(args.out, {"argv": rest, "env": os.environ.get(args.env_name), "cwd": os.getcwd()})
    else:
        write_json(args.out, {"x": args.x, "square": args.x * args.x, "job": os.environ.get("SLURM_JOB_ID")})


if __name__ == "__main__":
    main()
