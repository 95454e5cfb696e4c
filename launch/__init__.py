"""The launch layer: submitit executors, the jobs they run, Ray inside Slurm, Slurm queries, and the one
submit-and-follow loop that sweeps and the token-level study share. It sits below ``sweeps`` and ``analysis``
and imports neither (nor ``reports``); import from its modules."""
