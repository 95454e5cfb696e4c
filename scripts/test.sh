#!/usr/bin/env bash
# The project's test command: install into .venv (scripts/install.sh, extras dev,verl), start the emulated Slurm
# cluster when run as root, run pytest with .venv's interpreter (arguments are passed to pytest).
# Slurm tests skip with one line saying why when the cluster cannot run (as an ordinary user: it needs root),
# except under CI=true, where they must run. The fast subset skips the tests marked slow (tests/conftest.py SLOW)
# and the Slurm ones: bash scripts/test.sh -m "not slow and not slurm".
set -uo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${EXTRAS:-dev,verl}" bash scripts/install.sh || { echo "test.sh: install failed" >&2; exit 1; }

started_slurm=0  # a cluster that was already up is left running
if [ "$(id -u)" = 0 ] && [ -x scripts/slurm-emulated.sh ]; then
  if bash scripts/slurm-emulated.sh status >/dev/null 2>&1; then
    echo "test.sh: the emulated Slurm cluster is already running; it is left running"
  elif bash scripts/slurm-emulated.sh start; then
    started_slurm=1
  elif [ "${CI:-}" = true ]; then
    echo "test.sh: the emulated Slurm cluster did not start (required under CI=true)" >&2; exit 1
  else
    echo "test.sh: emulated Slurm cluster not started; Slurm tests will be skipped" >&2
  fi
fi
if [ -z "${SLURM_CONF:-}" ] && [ -f "${PREDMASK_SLURM_DIR:-/tmp/predmask-slurm}/slurm.conf" ]; then
  export SLURM_CONF="${PREDMASK_SLURM_DIR:-/tmp/predmask-slurm}/slurm.conf"
fi
stop() { [ "$started_slurm" = 1 ] && bash scripts/slurm-emulated.sh stop >/dev/null 2>&1; return 0; }
trap stop EXIT

# the venv's bin first on PATH, as an activated env has it: `python` is then the venv's interpreter, the spelling
# the commands' printed next steps use (predmask.command_text), and tools the tests call (tensorboard, ...) are the venv's
export PATH="$PWD/.venv/bin:$PATH"
.venv/bin/python -m pytest "$@"
rc=$?
if [ "$rc" = 5 ]; then
  echo "test.sh: pytest collected no tests: that is a failure here" >&2
  exit 1
fi
exit "$rc"
