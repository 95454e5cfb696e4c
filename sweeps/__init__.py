"""sweeps: expand named Hydra grids of runs, submit them through submitit, track and ingest them; the launch
layer they run on (executors, jobs, Ray inside Slurm, the follow loop) is the top-level package ``launch``,
which sits below both sweeps and analysis."""
