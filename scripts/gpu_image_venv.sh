#!/usr/bin/env bash
# An interpreter with the GPU image's transformers and peft (../shared/gpu/README.md: python
# 3.12, torch 2.11+cu130, transformers 5.17, peft 0.21) over this project's environment, so
# the code that reaches into transformers' internals (the static cache's layers, the
# attention interface, the masks, Qwen3's modules) is tested on this CPU against the
# versions a GPU lease runs, before the lease: a GPU is lent rarely and briefly, and a
# break found there costs its minutes. An overlay (scripts/overlay_venv.sh) over BASE's
# packages: only transformers and peft are installed here, and with WITH_TORCH=1 torch
# 2.11 too. PyPI has no CPU build of it: its CUDA build (~5 GB with its CUDA libraries,
# a few minutes' download) runs on a CPU, and is what found torch 2.11's fake-tensor
# addmm problem (retrain/kernels/precision.py `addmm_f32`).
#
#   [WITH_TORCH=1] scripts/gpu_image_venv.sh [VENV_DIR] [BASE_PYTHON]
#                                                (defaults: .venv-gpu-image, python)
#   .venv-gpu-image/bin/python -m pytest         # the suite on those versions
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-gpu-image}"
base="${2:-python}"
want_tf=5.17.0 want_peft=0.21.2 want_torch=2.11.0
want="('$want_tf', '$want_peft')"
have="(m.version('transformers'), m.version('peft'))"
if [ "${WITH_TORCH:-0}" = 1 ]; then
  want="('$want_tf', '$want_peft', '$want_torch')"
  have="(m.version('transformers'), m.version('peft'), m.version('torch').split('+')[0])"
fi
if "$venv/bin/python" -c "import sys, importlib.metadata as m; sys.exit($have != $want)" \
  2>/dev/null; then
  echo "$venv: $want already there"
  exit 0
fi
[ -x "$venv/bin/python" ] || scripts/overlay_venv.sh "$venv" "$base" >/dev/null
packages=("transformers==$want_tf" "peft==$want_peft")
[ "${WITH_TORCH:-0}" = 1 ] && packages+=("torch==$want_torch")
"$venv/bin/python" -m pip install --quiet "${packages[@]}"
"$venv/bin/python" -c "import transformers, peft, torch; \
print('$venv: transformers', transformers.__version__, 'peft', peft.__version__, 'torch', torch.__version__)"
