#!/usr/bin/env bash
# The vLLM half of the GPU plan, on the H200 device after the recipe in
# ../shared/device-vllm (vLLM 0.26 wheels installed into /tmp/site, the random
# Qwen3-0.6B-shaped model in /tmp/m-q06). Installs kvcached from this tree as a
# distribution (so vLLM finds its plugin entry point), then runs
# benchmarks/vllm_overhead.py for the given model runners: greedy-token equality with
# and without kvcached (deterministic mode) and offline throughput, alternating.
#   bash scripts/vllm-gpu-run.sh v1 [v2] ; results in $OUT/vllm_overhead.jsonl
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$repo/gpu-out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$repo"/.whl/pydantic_settings-*.whl "$repo"/.whl/python_dotenv-*.whl
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --upgrade \
    --target /tmp/site "$repo" || exit 1
rm -rf "$repo/build" "$repo"/*.egg-info
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 VLLM_HOST_IP=127.0.0.1 HF_HUB_OFFLINE=1 \
    VLLM_USE_FLASHINFER_SAMPLER=0 KVCACHED_LEDGER_DIR=/tmp/kvcached-ledger
mkdir -p "$KVCACHED_LEDGER_DIR"
cd /tmp
runners=$(IFS=,; echo "${*:-v1}")
python3 "$repo/benchmarks/vllm_overhead.py" /tmp/m-q06 --repeats "${REPEATS:-3}" \
    --runners "$runners" --tp "${TP:-1}" --out "$out/vllm_overhead.jsonl" 2>&1 | tee "$out/vllm_overhead.log"
# On a machine with two GPUs (not run yet: no such machine was lent), tensor parallel:
#   TP=2 bash scripts/vllm-gpu-run.sh v1
