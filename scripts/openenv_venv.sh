#!/usr/bin/env bash
# An interpreter with OpenEnv (openenv 0.4.1) for the tests of `[environment] provider =
# "openenv"`. openenv cannot share the project's environment unchanged: its gradio
# dependency needs pillow < 13 and tomlkit < 0.15 (the project's has newer ones), and
# openenv 0.10 needs a newer mcp than verifiers 0.4.0 pins. So this venv is an overlay
# (scripts/overlay_venv.sh): a .pth file puts BASE's site-packages (torch, transformers,
# verifiers, retrain's deps) behind its own, and only openenv and what it adds are
# installed here, with verifiers and mcp held at the versions BASE has. Tests find it at
# .venv-openenv/bin/python (tests/openenv_python.py). ~1 minute, once.
#
#   scripts/openenv_venv.sh [VENV_DIR] [BASE_PYTHON]
#       (defaults: .venv-openenv, the python on PATH)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-openenv}"
base="${2:-python}"
if "$venv/bin/python" -c 'import sys, importlib.metadata as m; sys.exit(m.version("openenv") != "0.4.1")' \
  2>/dev/null; then
  echo "$venv: openenv 0.4.1 already there"
  exit 0
fi
scripts/overlay_venv.sh "$venv" "$base" >/dev/null
verifiers="$("$base" -c 'import importlib.metadata as m; print(m.version("verifiers"))')"
mcp="$("$base" -c 'import importlib.metadata as m; print(m.version("mcp"))')"
"$venv/bin/python" -m pip install --quiet "openenv==0.4.1" "verifiers==$verifiers" "mcp==$mcp"
echo "$venv: openenv 0.4.1 installed over $base's packages"
