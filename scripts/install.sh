#!/usr/bin/env bash
# Install predmask and what its tests need into the current Python, without ever pulling a CUDA torch.
#   bash scripts/install.sh            # default: the CPU path + dev tools
#   EXTRAS=dev,verl bash scripts/install.sh
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${EXTRAS:-dev}"
PY="${PYTHON:-python3}"
# torch first, pinned to the CPU wheel this project's machines carry on disk; the project's own range
# (torch>=2.4) is then already satisfied and pip resolves nothing bigger.
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.") else 1)' 2>/dev/null; then
  "$PY" -m pip install --quiet "torch==2.13.0"
fi
"$PY" -m pip install --quiet -e ".[${EXTRAS}]"
"$PY" -c 'import predmask, torch; print(f"predmask {predmask.__version__} installed (torch {torch.__version__})")'
