"""The launch layer: submitit executors, the jobs they run, Ray inside Slurm, Slurm queries, and the one
submit-and-follow loop that sweeps and the token-level study share.

It sits below ``sweeps`` and ``analysis`` and imports neither (nor ``reports``); import from its modules:

* :mod:`launch.executor`    the submitit executor of a cluster config (``conf/cluster/*.yaml``)
* :mod:`launch.local_controller` a local job's controller: its own session, quiet when cancelled
* :mod:`launch.warm_worker` a local sweep's warm worker: imports once, forks a child per run
* :mod:`launch.command_job` :class:`CommandJob`: one command in one task, requeued on preemption
* :mod:`launch.ray_job`     :class:`RayJob`: a Ray cluster over a multi-node job, the command on rank 0
* :mod:`launch.ray_slurm`   Ray inside a Slurm allocation: options, node start/stop, cluster wait
* :mod:`launch.slurm`       Slurm queries (``squeue``, ``scontrol``) and the job's environment
* :mod:`launch.procs`       process, port and file-wait utilities
* :mod:`launch.shell`       shell text for sbatch scripts and logs
* :mod:`launch.follow`      follow submitted jobs until they end, dead jobs included
"""
