#!/usr/bin/env bash
# The device check on a GPU machine that has torch and transformers and nothing else of the cluster stack (no verl,
# vLLM, Ray, network): prints the machine, then runs scripts/device_check.py (scripts/benchmark.py loss at Qwen3 scale,
# then the old-log-prob forward against the update on a Qwen3-0.6B-shaped model) with the given options. Output: the
# printed report, and bench.txt / bench.json / old_log_prob.json in --out, else $OUT, else results/device_check.
#   scripts/device_check.sh                                        # on the GPU: 8k, 32k, 64k tokens x 151,936
#   OUT=/tmp/dc scripts/device_check.sh --cpu                      # the CPU fallback: small sizes, a tiny model
#   OUT=/tmp/dc scripts/device_check.sh --device cpu --tokens 256 --vocab 4096   # CPU with chosen loss sizes
# Interpreter: $PYTHON, else the project's .venv (scripts/install.sh), else python / python3 on PATH.
# Exit status: that of scripts/device_check.py (0 all targets met, 1 a target failed, 2 cannot run here).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || command -v python || command -v python3)}"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
"$PYTHON" -c 'import sys, torch; print(f"python {sys.version.split()[0]}, torch {torch.__version__}, cuda {torch.version.cuda}")'
exec "$PYTHON" scripts/device_check.py "$@"
