"""`python -m launch.local_controller FOLDER`: the controller of one local job (submitit's own), started in a session
of its own so a Ctrl-C at the terminal reaches only the submitting process; that process cancels the job (one SIGINT),
and the controller stops its tasks and exits with status 130 and no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from submitit.local.local import Controller

#: the controller's exit status once cancelled (128 + SIGINT, as a shell reports a Ctrl-C)
INTERRUPTED = 130


def start_controller(folder: Path, env: Mapping[str, str]) -> subprocess.Popen[bytes]:
    """Start the controller of a local job in its own session; ``env`` holds submitit's ``SUBMITIT_LOCAL_*``
    settings of the job (its command, task count, time-out), as submitit's own local executor sets them."""
    return subprocess.Popen([sys.executable, "-m", __name__, str(folder)], env={**os.environ, **env},
                            start_new_session=True)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m launch.local_controller FOLDER", file=sys.stderr)
        return 2
    try:
        Controller(Path(argv[0])).run()  # its own clean-up (the tasks stopped) runs before the interrupt leaves it
    except KeyboardInterrupt:
        return INTERRUPTED
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
