#!/usr/bin/env bash
# Build (once) the Python 3.12 environment the Megatron-Bridge suite runs in, and print its python.
#   tests/bridge_env.sh [VENV]   (default: $BRIDGE_VENV, else a cache outside the checkout,
#   ~/.cache/megatron-perf-toggles/bridge-venv, so fresh clones reuse it; reused when it has the Bridge
#   asked for). BRIDGE_PIN and MCORE_PIN pick another Bridge (default 0.6.2 with megatron-core 0.19.2);
#   its default environment is then bridge-venv-<BRIDGE_PIN>, so the suite's own is never replaced.
# Python 3.12 is PYTHON312, else python3.12 on PATH, else the newest 3.12 under pyenv's root.
# Prints nothing and exits 0 when no Python 3.12 is found: the suite then skips.
set -euo pipefail
cd "$(dirname "$0")/.."
pin=${BRIDGE_PIN:-0.6.2}
cache=$HOME/.cache/megatron-perf-toggles/bridge-venv
[ "$pin" = 0.6.2 ] || cache="$cache-$pin"
venv=${1:-${BRIDGE_VENV:-$cache}}
case $venv in /*) ;; *) venv="$PWD/$venv" ;; esac  # an absolute path: callers run from anywhere
# Reused where it has that Bridge (another pin's environment is not this one).
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('megatron-bridge') != '$pin')" 2>/dev/null; then
  echo "$venv/bin/python"; exit 0
fi
is312() { [ -n "$1" ] && "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' >/dev/null 2>&1; }
py=${PYTHON312:-$(command -v python3.12 || true)}
if ! is312 "$py"; then  # absent, or a pyenv shim with no 3.12 selected
  root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
  py=$(ls -d "$root"/versions/3.12*/bin/python3.12 2>/dev/null | sort -V | tail -1 || true)
fi
is312 "$py" || exit 0
log=$(mktemp)
"$py" -m venv "$venv"
pip() { "$venv/bin/python" -m pip install -q "$@" >>"$log" 2>&1 || { cat "$log" >&2; echo "bridge_env: pip install $* failed" >&2; exit 1; }; }
if [ -n "${TORCH_INDEX_URL:-}" ]; then pip torch --index-url "$TORCH_INDEX_URL"; else pip "torch==${TORCH_PIN:-2.13.0}"; fi
pip --no-deps "megatron-bridge==$pin" "megatron-core==${MCORE_PIN:-0.19.2}"
pip --no-deps -r tests/bridge-requirements.txt
# Bridge 0.4 and 0.5 import NVIDIA ModelOpt at module level, whose import needs scipy (0.6 does not).
[ "$pin" = 0.6.2 ] || pip --no-deps "scipy==1.18.1"
echo "$venv/bin/python"
