"""The CPU trainer's command line for one run of a sweep (the job that runs it is the launch layer's CommandJob;
the trainer itself holds the run directory's writer lock for its whole life)."""

from __future__ import annotations

import sys
from pathlib import Path

from predmask.verl.overrides import hydra_value  # plain config translation: imports no verl
from sweeps.compose import RunSpec


def trainer_argv(spec: RunSpec, run_dir: Path, python: str | None = None) -> list[str]:
    """The CPU trainer's command line for a run: the sweep's own overrides plus the run directory, quoted for Hydra's
    override grammar (a path may hold spaces, quotes, ``$``, ``=``, ``,`` or brackets); ``python`` is the job's
    interpreter (default: this host's)."""
    path = str(run_dir.resolve())
    return [python or sys.executable, "-m", "predmask.rl.train", *spec.overrides, f"run_dir={hydra_value(path)}"]
