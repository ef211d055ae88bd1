#!/usr/bin/env bash
# An interpreter with the GPU image's transformers and peft (../shared/gpu/README.md: python
# 3.12, torch 2.11+cu130, transformers 5.17, peft 0.21) over this project's environment, so
# the code that reaches into transformers' internals (the static cache's layers, the
# attention interface, the masks, Qwen3's modules) is tested on this CPU against the
# versions a GPU lease runs, before the lease: a GPU is lent rarely and briefly, and a
# break found there costs its minutes. torch stays this environment's (PyPI has no CPU
# build of 2.11). An overlay (scripts/overlay_venv.sh) over BASE's packages: only
# transformers and peft are installed here.
#
#   scripts/gpu_image_venv.sh [VENV_DIR] [BASE_PYTHON]     (defaults: .venv-gpu-image, python)
#   .venv-gpu-image/bin/python -m pytest tests/unit         # the unit tests on those versions
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-gpu-image}"
base="${2:-python}"
want_tf=5.17.0 want_peft=0.21.2
if "$venv/bin/python" -c "import sys, importlib.metadata as m; \
sys.exit((m.version('transformers'), m.version('peft')) != ('$want_tf', '$want_peft'))" 2>/dev/null; then
  echo "$venv: transformers $want_tf, peft $want_peft already there"
  exit 0
fi
scripts/overlay_venv.sh "$venv" "$base" >/dev/null
"$venv/bin/python" -m pip install --quiet "transformers==$want_tf" "peft==$want_peft"
"$venv/bin/python" -c "import transformers, peft, torch; \
print('$venv: transformers', transformers.__version__, 'peft', peft.__version__, 'torch', torch.__version__)"
