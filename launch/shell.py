"""Shell text for sbatch scripts and logs: argv quoting and environment-variable names."""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def shell_join(argv: Sequence[str]) -> str:
    """One shell-safe line for an argv (for dry runs and logs; the jobs themselves never use a shell)."""
    return shlex.join([str(a) for a in argv])


def check_env_name(name: object) -> str:
    """``name`` as a string when it is a valid environment variable name, else a one-line ValueError."""
    if not _ENV_NAME.match(str(name)):
        raise ValueError(f"bad environment variable name {name!r}: use letters, digits and _ (not first)")
    return str(name)
