#!/usr/bin/env bash
# On the device: install kvcached from this tree into an engine's site (the --target
# folder its PYTHONPATH names) as a distribution, so the engine's entry-point lookup
# finds the plugin. No dependencies (the site has the engine's), except kvcached's two
# small ones from .whl/ where the command carried them (the vLLM recipe's site lacks them),
# and the API servers' from .whl-serve/.
#   bash scripts/install-into-site.sh /tmp/site
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
site=${1:?usage: install-into-site.sh SITE}
# Wheels a command carried, each folder where it did, into the site without dependencies
# (the site has the engine's): install_carried FOLDER
install_carried() {
    if ls "$repo/$1"/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$site" "$repo/$1"/*.whl || exit 1
    fi
}
# kvcached's own two (pydantic-settings, python-dotenv), which the vLLM recipe's site lacks
install_carried .whl
# vLLM's API server and kvcached serve's router (uvicorn & co.): `vllm-gpu-run.sh serve`
install_carried .whl-serve
# NIXL for the prefill/decode pair (`vllm-gpu-run.sh pd`): the `nixl` selector and
# nixl-cu13 (the selector requires the CUDA 12 build too, which the device's CUDA 13
# torch does not use)
install_carried .whl-nixl
# what vLLM 0.26 imports for the matrix's Qwen3.5 row (`matrix-gpu.sh`) and the recipe's
# site lacks: compressed-tensors 0.17.0 (its pin) and loguru
install_carried .whl-matrix
# LMCache 0.5.3 for its connector (`vllm-gpu-run.sh connectors`, CONNECTOR_TRIALS=lmcache):
# lmcache and the few of its imports the device's image and the vLLM recipe's site lack
# (aiofile, caio, uvicorn, httptools, blake3, nvtx); the rest of its dependency list,
# cloud storage and telemetry clients, is not imported by the connector
install_carried .whl-lmcache
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --upgrade \
    --target "$site" "$repo" || exit 1
rm -rf "$repo/build" "$repo"/*.egg-info
