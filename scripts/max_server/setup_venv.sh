#!/usr/bin/env bash
# Build the Modular MAX server's own venv (`max serve`, for `[inference] engine = "max"`).
# ~2 GB, no torch. MAX's LoRA is GPU-only: on CPU it serves the base model only.
#
# Usage:  scripts/max_server/setup_venv.sh          (idempotent)
# Env:    MAX_VENV   venv directory  (default: ~/.cache/retrain/servers/max-venv)
#         MAX_SPEC   package         (default: modular==26.7.0)
#         PYTHON     interpreter     (default: python3.11)
set -euo pipefail
venv="${MAX_VENV:-${RETRAIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/retrain}/servers/max-venv}"
spec="${MAX_SPEC:-modular==26.7.0}"
PYTHON="${PYTHON:-python3.11}"
if [[ ! -x "$venv/bin/python" ]]; then
    mkdir -p "$(dirname "$venv")"
    "$PYTHON" -m venv "$venv"
fi
py="$venv/bin/python"
# modular needs a newer pip than the 23.2 that venvs start with.
"$py" -m pip install -q --disable-pip-version-check --upgrade pip
if [[ ! -x "$venv/bin/max" ]] || ! "$py" -c 'import max.driver' >/dev/null 2>&1; then
    echo "Installing $spec (~2 GB)"
    "$py" -m pip install --disable-pip-version-check "$spec"
fi
echo "Ready: $venv"
echo "Start a server with: scripts/max_server/start.sh"
