#!/usr/bin/env bash
# An interpreter with the classic verifiers API (0.3.1) for the tests that exercise it:
# the project's environment has verifiers 0.4, which ships only the v1 API, so those
# tests re-run themselves under this one (tests/unit/classic_verifiers.py finds it at
# .venv-verifiers03/bin/python). No torch in it; ~1 minute and ~0.9 GB, once.
#
#   scripts/verifiers03_venv.sh [VENV_DIR]     (default .venv-verifiers03)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-verifiers03}"
if "$venv/bin/python" -c 'import sys, verifiers; sys.exit(verifiers.__version__ != "0.3.1")' \
  2>/dev/null; then
  echo "$venv: verifiers 0.3.1 already there"
  exit 0
fi
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet "verifiers==0.3.1" numpy "tomlkit>=0.13.3,<1" \
  pytest pytest-timeout hypothesis transformers tokenizers
echo "$venv: verifiers 0.3.1 installed"
