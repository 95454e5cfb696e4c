#!/usr/bin/env bash
# The project's test command: install, start the emulated Slurm cluster when this machine allows it, run pytest.
# Slurm tests skip with a reason when the cluster cannot start, except under CI=true, where they must run.
set -uo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${EXTRAS:-dev,verl}" bash scripts/install.sh || { echo "test.sh: install failed" >&2; exit 1; }

started_slurm=0
if [ "$(id -u)" = 0 ] && [ -x scripts/slurm-emulated.sh ]; then
  if bash scripts/slurm-emulated.sh start; then
    started_slurm=1
  elif [ "${CI:-}" = true ]; then
    echo "test.sh: the emulated Slurm cluster did not start (required under CI=true)" >&2; exit 1
  else
    echo "test.sh: emulated Slurm cluster not started; Slurm tests will be skipped" >&2
  fi
fi
if [ -f "${PREDMASK_SLURM_DIR:-/tmp/predmask-slurm}/slurm.conf" ]; then
  export SLURM_CONF="${PREDMASK_SLURM_DIR:-/tmp/predmask-slurm}/slurm.conf"
fi
stop() { [ "$started_slurm" = 1 ] && bash scripts/slurm-emulated.sh stop >/dev/null 2>&1; return 0; }
trap stop EXIT

python3 -m pytest "$@"
rc=$?
if [ "$rc" = 5 ]; then
  echo "test.sh: pytest collected no tests: that is a failure here" >&2
  exit 1
fi
exit "$rc"
