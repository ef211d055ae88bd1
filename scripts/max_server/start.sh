#!/usr/bin/env bash
# Start a Modular MAX server (`max serve`) for retrain's `[inference] engine = "max"` and wait
# until it answers. Binds 127.0.0.1 only. Foreground by default; with --background it returns
# once ready and writes the server's pid to $MAX_PIDFILE.
#
# On a CPU MAX serves the base model only (its LoRA is GPU-only), so retrain can sample from
# it but refuses to train against it (the weights could not follow the optimizer). On a GPU
# box add --enable-lora (and --max-lora-rank R) to train through it.
#
# Usage:  scripts/max_server/start.sh [--background] [extra max serve args...]
# Env:    MAX_VENV (default ~/.cache/retrain/servers/max-venv; scripts/max_server/setup_venv.sh)
#         MAX_MODEL (default: retrain's cached SmolLM2-135M safetensors copy), MAX_PORT (8000),
#         MAX_LOG, MAX_PIDFILE, MAX_READY_S (default 900: the first start compiles ~2 min)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/../lib/serve.sh"
cache="${RETRAIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/retrain}"
venv="${MAX_VENV:-$cache/servers/max-venv}"
model="${MAX_MODEL:-$cache/models/HuggingFaceTB--SmolLM2-135M-Instruct/safetensors}"
port="${MAX_PORT:-8000}"
log="${MAX_LOG:-$cache/servers/max-$port.log}"
pidfile="${MAX_PIDFILE:-$cache/servers/max-$port.pid}"
background=0
if [[ "${1:-}" == "--background" ]]; then
    background=1
    shift
fi
serve_need "MAX venv" "$venv/bin/max" "scripts/max_server/setup_venv.sh"
serve_need "model" "$model/config.json" "run retrain once (it caches SmolLM2), or set MAX_MODEL"
devices="${MAX_DEVICES:-cpu}"
# float32 on CPU: logprobs within 2e-4 of the fp32 trainer's.
cmd=("$venv/bin/max" serve --model "$model" --devices "$devices" --host 127.0.0.1 --port "$port"
     --max-length "${MAX_MAX_LENGTH:-2048}" --max-batch-size "${MAX_BATCH:-32}"
     --quantization-encoding "${MAX_ENCODING:-float32}" "$@")
export MAX_SERVE_DISABLE_TELEMETRY=1 HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
serve_run "MAX" "http://127.0.0.1:$port/v1/models" "$log" "$pidfile" "${MAX_READY_S:-900}" "$background" "${cmd[@]}"
