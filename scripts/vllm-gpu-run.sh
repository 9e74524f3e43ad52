#!/usr/bin/env bash
# The vLLM half of the GPU plan, on the H200 device after the recipe in
# ../shared/device-vllm (vLLM 0.26 wheels installed into /tmp/site, the random
# Qwen3-0.6B-shaped model in /tmp/m-q06). Installs kvcached from this tree as a
# distribution (so vLLM finds its plugin entry point), then runs the steps named:
#   overhead   benchmarks/vllm_overhead.py for RUNNERS (default v2,v1): greedy-token
#              equality with and without kvcached (deterministic mode), offline
#              throughput side by side, alternating, REPEATS (default 3) batches each
#   multi      benchmarks/vllm_multi_instance.py: 3 instances on the GPU, bursty
#              phase-shifted load, kvcached vs. a static split of the same memory
#   bash scripts/vllm-gpu-run.sh overhead multi ; results in $OUT/*.jsonl
# On a machine with two GPUs (not run yet: no such machine was lent), tensor parallel:
#   TP=2 RUNNERS=v1 bash scripts/vllm-gpu-run.sh overhead
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$repo/gpu-out}
mkdir -p "$out"
bash "$repo/scripts/install-into-site.sh" /tmp/site || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 VLLM_HOST_IP=127.0.0.1 HF_HUB_OFFLINE=1 \
    VLLM_USE_FLASHINFER_SAMPLER=0
cd /tmp
status=0
for step in "$@"; do
    export KVCACHED_LEDGER_DIR=/tmp/kvcached-ledger-$step
    mkdir -p "$KVCACHED_LEDGER_DIR"
    case $step in
    overhead)
        python3 "$repo/benchmarks/vllm_overhead.py" /tmp/m-q06 --repeats "${REPEATS:-3}" \
            --runners "${RUNNERS:-v2,v1}" --tp "${TP:-1}" --prompts "${PROMPTS:-1024}" \
            --log "$out/vllm_overhead.log" --out "$out/vllm_overhead.jsonl" || status=1
        ;;
    multi)
        python3 "$repo/benchmarks/vllm_multi_instance.py" /tmp/m-q06 --dtype bfloat16 \
            --instances 3 --budget 6GiB --gpu-mem 0.25 --seconds "${SECONDS_PER_MODE:-45}" \
            --period 30 --burst-rate 40 --quiet-rate 2 --prompt-len 1024:2048 \
            --output-len 128:256 --max-num-seqs 256 --out "$out/vllm_multi_instance.jsonl" \
            > "$out/vllm_multi_instance.log" 2>&1 || status=1
        grep -h '"mode"\|compare' "$out/vllm_multi_instance.log" | tail -n 6
        ;;
    *) echo "unknown step $step (overhead, multi)"; status=2 ;;
    esac
done
exit $status
