"""The commands' terminal output: the rich console they print through and their one-line refusals."""

from __future__ import annotations

import shutil
import sys

from rich.console import Console


def make_console(stderr: bool = False, min_width: int = 120) -> Console:
    """A console on stdout (stderr with ``stderr``) at least ``min_width`` columns wide, so a table prints whole when
    piped (rich assumes 80 columns then); long lines are not wrapped and nothing is highlighted."""
    width = max(min_width, shutil.get_terminal_size((min_width, 24)).columns)
    return Console(stderr=stderr, highlight=False, soft_wrap=True, width=width)


def error(message: str) -> None:
    """A command's refusal, ``error: <message>``, one line on stderr."""
    print(f"error: {message}", file=sys.stderr, flush=True)
