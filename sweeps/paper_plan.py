"""`python -m sweeps paper`: run every step the paper's report needs on the embedded default, with time estimates."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass

from predmask.command_text import (
    ACCURACY_WEIGHTING,
    DRIFT,
    MAIN_COMPARISON,
    PAPER,
    PAPER_STEPS,
    STUDY,
    TIGHT_THRESHOLD,
    VARIATIONAL,
    command,
    sweep_command,
)

#: where and when the minutes below were measured (README.md records each command's measured time)
MEASURED_ON = "2 cores, 2026-12-02"


@dataclass(frozen=True)
class Estimate:
    """How long one step takes on the embedded default from nothing done; ``basis`` says measured or estimated."""

    minutes: float
    measured: bool
    basis: str


#: the one table of step times from nothing done (minutes on MEASURED_ON), keyed by the step's command
ESTIMATES: dict[str, Estimate] = {
    MAIN_COMPARISON: Estimate(27.1, True, "48 runs, the three base models' pretraining included"),
    TIGHT_THRESHOLD: Estimate(20.0, False, "36 runs at main_comparison's time per run, base models cached"),
    STUDY: Estimate(1.4, True, "61 seeds x 1,024 sequences"),
    DRIFT: Estimate(5.9, True, "27 cells x 4 seeds"),
    VARIATIONAL: Estimate(7.5, True, "37 runs, 3 seeds"),
    ACCURACY_WEIGHTING: Estimate(0.25, True, "15 s"),
    PAPER: Estimate(1.0, False, "every figure, table and the page; not timed"),
}

#: TEST-ONLY: a JSON list of argv lists, one per step, run in place of the steps' commands (the plan still names the
#: real ones). Lets a test run the step machinery on tiny stand-ins; never set it otherwise.
STANDINS_ENV = "PREDMASK_PAPER_STANDINS"


def resume_command() -> str:
    return sweep_command("paper")


def plan_lines() -> list[str]:
    """The plan as printed before any step runs: one line per step with its estimate, then the total."""
    width = max(len(command(step)) for step in PAPER_STEPS)
    head = (f"{resume_command()}: {len(PAPER_STEPS)} steps on the embedded default, in order; a rerun skips "
            f"finished work (minutes on {MEASURED_ON}, from nothing done)")
    lines = [head]
    for i, step in enumerate(PAPER_STEPS, 1):
        est = ESTIMATES[step]
        kind = "measured" if est.measured else "estimate"
        lines.append(f"  {i}. {command(step).ljust(width)}  {est.minutes:>5g} min  {kind}: {est.basis}")
    total = sum(ESTIMATES[step].minutes for step in PAPER_STEPS)
    guessed = sum(not ESTIMATES[step].measured for step in PAPER_STEPS)
    lines.append(f"  total {'':{width - 3}}  {total:>5.1f} min  ({guessed} of {len(PAPER_STEPS)} steps estimated, "
                 "the others measured)")
    return lines


def step_argvs() -> list[list[str]]:
    """What each step runs: ``<this interpreter> -m <step>``, or the test-only stand-ins of STANDINS_ENV."""
    raw = os.environ.get(STANDINS_ENV)
    if raw is None:
        return [[sys.executable, "-m", *shlex.split(step)] for step in PAPER_STEPS]
    standins = json.loads(raw)
    if not (isinstance(standins, list) and len(standins) == len(PAPER_STEPS)
            and all(isinstance(a, list) and a and all(isinstance(x, str) for x in a) for a in standins)):
        raise ValueError(f"{STANDINS_ENV} must be a JSON list of {len(PAPER_STEPS)} argv lists, got {raw!r}")
    return standins


def _wait(proc: subprocess.Popen[bytes]) -> int:
    """Wait for a step; on Ctrl-C (or a closed terminal) pass one SIGINT to it, wait for it to stop, re-raise."""
    try:
        return proc.wait()
    except KeyboardInterrupt:
        while True:
            try:
                proc.send_signal(signal.SIGINT)  # the step stops as on its own Ctrl-C (a sweep cancels its runs)
                proc.wait()
                break
            except KeyboardInterrupt:  # pressed again: pass it on again, still wait for the step
                continue
        raise


def run_plan(dry_run: bool = False) -> int:
    """Print the plan; unless ``dry_run``, run its steps one by one. Returns 0, the first failing step's exit
    status (128 + signal when a signal ended it), or 130 on Ctrl-C."""
    print("\n".join(plan_lines()), flush=True)
    if dry_run:
        print(f"dry run: nothing ran; {resume_command()} runs these steps", flush=True)
        return 0
    argvs = step_argvs()
    n = len(PAPER_STEPS)
    for i, (step, argv) in enumerate(zip(PAPER_STEPS, argvs, strict=True), 1):
        try:
            print(f"\n=== step {i}/{n}: {command(step)} (about {ESTIMATES[step].minutes:g} min)", flush=True)
            # a session of its own: a terminal's Ctrl-C reaches only this process, which passes the step one SIGINT
            status = _wait(subprocess.Popen(argv, start_new_session=True))
        except KeyboardInterrupt:
            print(f"interrupted in step {i}/{n} ({command(step)}); rerun {resume_command()} to resume "
                  "(finished work is skipped)", file=sys.stderr, flush=True)
            return 130
        if status != 0:
            code = 128 - status if status < 0 else status
            print(f"step {i}/{n} failed (exit {code}): {command(step)}; fix the cause above, then rerun "
                  f"{resume_command()} (finished work is skipped)", file=sys.stderr, flush=True)
            return code
    print(f"\nall {n} steps done ({command(PAPER)} said above where the report is)", flush=True)
    return 0
