"""sweeps: expand named Hydra grids of runs, submit them through submitit, track and ingest them."""
