#!/usr/bin/env bash
# Build the venv for the opt-in Tinker integration test (tests/integration/test_tinker_server.py).
#
# One venv holds both sides of the test:
#   * the server: skyrl-tx or skyrl (serve the Tinker API on CPU with a JAX backend) + CPU
#     jax/flax/optax
#   * the client: retrain (editable) + the tinker SDK version that works against that server
# plus a tiny `uv` shim, because the server's API process starts its engine with
# `uv run --extra tinker --extra jax -m <pkg>.tinker.engine ...`.
#
# Usage:   scripts/tinker_server/setup_venv.sh            (idempotent; re-run to repair)
#          TINKER_SERVER=skyrl scripts/tinker_server/setup_venv.sh   (the other tested pair)
# Env:     TINKER_SERVER    skyrl-tx (default): skyrl-tx 0.3.0 + tinker SDK 0.16.1 in .venv-tinker-server
#                           skyrl:              skyrl 0.3.0 + tinker SDK 0.24.1 in .venv-tinker-server-skyrl
#          TINKER_VENV      venv directory            (default: as above)
#          PYTHON           interpreter for the venv  (default: python3.11, else python3.12;
#                                                      python3.12 for skyrl)
#          SKYRL_TX_SPEC    server package            (default: as above)
#          TINKER_SDK_SPEC  client SDK                (default: as above)
#          TORCH_SPEC       torch requirement         (default: the CPU build the project venv has,
#                                                      else plain "torch")
#          TORCH_INDEX_URL  extra index for torch     (e.g. https://download.pytorch.org/whl/cpu)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
case "${TINKER_SERVER:-skyrl-tx}" in
    skyrl-tx)
        venv="${TINKER_VENV:-$repo/.venv-tinker-server}"
        server_spec="${SKYRL_TX_SPEC:-skyrl-tx[tinker]==0.3.0}"
        sdk_spec="${TINKER_SDK_SPEC:-tinker==0.16.1}"
        ;;
    skyrl)
        venv="${TINKER_VENV:-$repo/.venv-tinker-server-skyrl}"
        server_spec="${SKYRL_TX_SPEC:-skyrl[tinker]==0.3.0}"
        sdk_spec="${TINKER_SDK_SPEC:-tinker==0.24.1}"
        ;;
    *)
        echo "setup_venv.sh: TINKER_SERVER must be skyrl-tx or skyrl" >&2
        exit 2
        ;;
esac

if [[ "${TINKER_SERVER:-skyrl-tx}" == skyrl ]]; then
    candidates=(python3.12)  # skyrl 0.3.0 needs Python >= 3.12 (typing.TypedDict with pydantic)
else
    candidates=(python3.11 python3.12)
fi
if [[ -z "${PYTHON:-}" ]]; then
    for candidate in "${candidates[@]}"; do
        if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c 'import sys' 2>/dev/null; then
            PYTHON="$candidate"
            break
        fi
    done
fi
if [[ -z "${PYTHON:-}" ]]; then
    echo "setup_venv.sh: need ${candidates[*]} (set PYTHON=...)" >&2
    exit 1
fi

if [[ ! -x "$venv/bin/python" ]]; then
    echo "Creating $venv with $("$PYTHON" --version 2>&1)"
    "$PYTHON" -m venv "$venv"
fi
# Keep the venv out of git without touching the repo's .gitignore.
printf '*\n' > "$venv/.gitignore"
py="$venv/bin/python"
pip=("$py" -m pip install --disable-pip-version-check)

"${pip[@]}" -q --upgrade pip

# torch: peft (a skyrl-tx dependency) needs it; a CPU build avoids gigabytes of CUDA wheels.
if [[ -z "${TORCH_SPEC:-}" ]]; then
    if [[ -x "$repo/.venv/bin/python" ]] && tv="$("$repo/.venv/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null)" && [[ "$tv" == *+cpu ]]; then
        TORCH_SPEC="torch==$tv"
    else
        TORCH_SPEC="torch"
    fi
fi
if ! "$py" -c 'import torch' >/dev/null 2>&1; then
    echo "Installing $TORCH_SPEC"
    extra=()
    if [[ -n "${TORCH_INDEX_URL:-}" ]]; then
        extra=(--extra-index-url "$TORCH_INDEX_URL")
    fi
    if ! "${pip[@]}" "$TORCH_SPEC" ${extra[@]+"${extra[@]}"}; then
        if [[ "$TORCH_SPEC" != *+cpu ]]; then
            exit 1
        fi
        echo "No $TORCH_SPEC wheel for this Python here: installing ${TORCH_SPEC%+cpu} (PyPI's build brings CUDA libraries)"
        "${pip[@]}" "${TORCH_SPEC%+cpu}" ${extra[@]+"${extra[@]}"}
    fi
fi

echo "Installing the server ($server_spec + CPU jax/flax/optax) and the client SDK ($sdk_spec)"
# The package's `jax` extra pulls CUDA wheels; install the CPU pieces directly instead.
"${pip[@]}" "$server_spec" "jax[cpu]>=0.8,<1.0" "flax>=0.12.2" "optax>=0.2.5" "$sdk_spec"

echo "Installing retrain (editable) for the client side"
# jinja2: chat templates (transformers does not depend on it).
"${pip[@]}" -e "$repo[gym]" "$sdk_spec" jinja2 "pytest>=8" "pytest-timeout>=2.3"

# The uv shim: `uv run [uv options...] -m MODULE ARGS` -> `<venv python> -m MODULE ARGS`.
# server.py starts the API through it too: skyrl reads its parent's command line and wants
# `uv run ... -m skyrl.tinker.api` there, so for the API the shim stays alive as that parent.
mkdir -p "$venv/uv-shim"
cat > "$venv/uv-shim/uv" <<SHIM
#!/usr/bin/env bash
# Stand-in for \`uv run [--extra X ...] -m module args\` inside $venv (written by setup_venv.sh):
# uv's own options come before -m; everything from -m on goes to the venv's python.
args=("\$@")
for (( i = 0; i < \${#args[@]}; i++ )); do
    if [[ "\${args[i]}" == "-m" ]]; then
        if [[ "\${args[i + 1]:-}" == *.tinker.api ]]; then
            "$py" "\${args[@]:i}"
            exit \$?
        fi
        exec "$py" "\${args[@]:i}"
    fi
done
echo "uv shim: expected 'uv run ... -m MODULE ...', got: \$*" >&2
exit 2
SHIM
chmod +x "$venv/uv-shim/uv"

"$py" - <<'PY'
import importlib.metadata as md
for name in ("skyrl-tx", "skyrl", "tinker", "jax", "flax", "optax", "torch", "transformers", "retrain"):
    try:
        print(f"  {name:13s} {md.version(name)}")
    except md.PackageNotFoundError:
        pass
PY
echo "Ready: $venv"
echo "Run the opt-in test with:"
echo "  RETRAIN_TINKER_VENV=$venv $venv/bin/python -m pytest -m tinker tests/integration/test_tinker_server.py -s"
