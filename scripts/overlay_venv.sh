#!/usr/bin/env bash
# A venv over another interpreter's packages: a .pth file puts BASE's site-packages behind
# its own, so only what differs is installed in it (scripts/openenv_venv.sh,
# scripts/gpu_image_venv.sh). It adds them as a site directory, so their own .pth files
# run too (an editable install of retrain is one: a child process started elsewhere than
# the checkout still imports it). Prints the new venv's site-packages.
#
#   scripts/overlay_venv.sh VENV_DIR BASE_PYTHON
set -euo pipefail
venv="${1:?usage: overlay_venv.sh VENV_DIR BASE_PYTHON}"
base="${2:?usage: overlay_venv.sh VENV_DIR BASE_PYTHON}"
base_site="$("$base" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
base_prefix="$("$base" -c 'import sys; print(sys.base_prefix)')"
"$base_prefix/bin/python3" -m venv "$venv"
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "import site; site.addsitedir('$base_site')" >"$site/_retrain_base.pth"
echo "$site"
