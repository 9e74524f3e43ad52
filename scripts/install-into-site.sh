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
if ls "$repo"/.whl/pydantic_settings-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "$repo"/.whl/pydantic_settings-*.whl "$repo"/.whl/python_dotenv-*.whl \
        || exit 1
fi
# vLLM's API server and kvcached serve's router (uvicorn & co.), where the command carried
# them (`vllm-gpu-run.sh serve`)
if ls "$repo"/.whl-serve/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "$repo"/.whl-serve/*.whl || exit 1
fi
# NIXL for the prefill/decode pair (`vllm-gpu-run.sh pd`), where the command carried it:
# the `nixl` selector and nixl-cu13, without dependencies (the selector requires the
# CUDA 12 build too, which the device's CUDA 13 torch does not use)
if ls "$repo"/.whl-nixl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "$repo"/.whl-nixl/*.whl || exit 1
fi
# what vLLM 0.26 imports for the matrix's Qwen3.5 row (`matrix-gpu.sh`) and the recipe's site
# lacks: compressed-tensors 0.17.0 (its pin) and loguru, where the command carried them
if ls "$repo"/.whl-matrix/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "$repo"/.whl-matrix/*.whl || exit 1
fi
# LMCache 0.5.3 for its connector (`vllm-gpu-run.sh connectors`, CONNECTOR_TRIALS=lmcache),
# where the command carried it: lmcache and the few of its imports the device's image and
# the vLLM recipe's site lack (aiofile, caio, uvicorn, httptools, blake3, nvtx), without
# dependencies (the rest of its list, cloud storage and telemetry clients, is not imported
# by the connector)
if ls "$repo"/.whl-lmcache/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "$repo"/.whl-lmcache/*.whl || exit 1
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --upgrade \
    --target "$site" "$repo" || exit 1
rm -rf "$repo/build" "$repo"/*.egg-info
