#!/usr/bin/env bash
# The vLLM-GPU column of docs/compatibility.md, on the H200 device, in ONE command.
# Prerequisite: the recipe in ../shared/device-vllm has installed vLLM 0.26 into
# /tmp/site (Python 3.12), and .whl/ carries pydantic_settings and python_dotenv as for
# scripts/vllm-gpu-run.sh. Installs kvcached from this tree (vLLM finds its plugin entry
# point), then runs tests/matrix/harness.py --gpu: per architecture, one engine start
# without and one with kvcached (up to 12 starts; models with real KV shapes, fewer layers),
# Model Runner V1. Writes $OUT/vllm-gpu.json (copy it to tests/matrix/results/ and run
# scripts/render_compatibility.py) and $OUT/matrix-gpu.log.
#   bash scripts/matrix-gpu.sh [ROW ...] [--keep FILE]   # default: every row
# The kvcached engine also runs the batch once more with held KV blocks swapped midway
# through the decode (the tokens must change): two engine starts per row.
# KV_DTYPE=fp8 (or fp8_e5m2) runs the rows with vLLM's kv_cache_dtype, both sides, into
# $OUT/vllm-gpu-$KV_DTYPE.json (not the column's file). Until such a run is equal the
# adapter refuses that dtype on CUDA: the run that shows it adds "cuda" to
# engines/vllm/refusals.py's KV_DTYPES_SHOWN_ON in the tree it carries (docs/gpu-testing.md).
# Budget: 2 engine starts per row of ~20-40 s each (enforce_eager). Rows that would start past
# DEADLINE seconds (default 420) are recorded as not run, so the command stays < 8 min;
# run those rows in a second command (bash scripts/matrix-gpu.sh mla ...) if need be.
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$repo/gpu-out}
mkdir -p "$out"
bash "$repo/scripts/install-into-site.sh" /tmp/site || exit 1
# Gemma 4's configs: vLLM 0.26 reads them with the transformers of its day; the image's
# 5.17 refuses the global head_dim it asks for (AmbiguousGlobalPerLayerAttributeError).
# A command that carried .whl-transformers (transformers 5.12.1, SGLang 0.5.16's pin, and
# the tokenizers it accepts) has them installed apart; OLD_TRANSFORMERS=1 puts them first
# on the path for this command's rows.
site=/tmp/site
if ls "$repo"/.whl-transformers/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site-transformers "$repo"/.whl-transformers/*.whl || exit 1
fi
if [ "${OLD_TRANSFORMERS:-0}" = 1 ]; then
    site=/tmp/site-transformers:/tmp/site
fi
export PYTHONPATH=$site PYTHONUNBUFFERED=1 VLLM_HOST_IP=127.0.0.1 HF_HUB_OFFLINE=1 \
    VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_USE_V2_MODEL_RUNNER=0 KVCACHED_BACKEND=cuda
# the harness runs from /tmp (so that kvcached comes from the site, not this tree): a
# relative --keep FILE is made absolute first
args=()
while [ $# -gt 0 ]; do
    case $1 in
    --keep) args+=(--keep "$(realpath -m "$2")"); shift 2 ;;
    *) args+=("$1"); shift ;;
    esac
done
cd /tmp
name=vllm-gpu
if [ -n "${KV_DTYPE:-}" ]; then  # vLLM's kv_cache_dtype for both runs, in a file of its own
    args+=(--kv-cache-dtype "$KV_DTYPE")
    name=vllm-gpu-$KV_DTYPE
fi
python3 "$repo/tests/matrix/harness.py" --gpu --deadline "${DEADLINE:-420}" \
    --out "$out/$name.json" "${args[@]}" \
    2>&1 | tee "$out/matrix-gpu.log"
