#!/usr/bin/env bash
# The SGLang half of the GPU plan, on the H200 device after the recipe in
# ../shared/device-sglang (SGLang 0.5.16 installed into /tmp/site-sglang, the random
# Qwen3-0.6B-shaped model in /tmp/m-q06). Installs kvcached from this tree into that
# site as a distribution (so SGLang's entry-point lookup finds the plugin), then runs:
#   overhead   benchmarks/sglang_overhead.py: two Engines side by side, throughput ratio,
#              start-up, greedy equality (also under pool pressure), a corrupted run
#   overhead8b the same on the Qwen3-8B shape (/tmp/m-q8b: make it first with the vLLM
#              recipe's make_random_model.py, preset qwen3-8b), 2K-6K-token prompts, 256
#              new tokens, REPEATS (21) pairs: the run that can decide the target (issue 22)
#   sweep      the SGLang side of the per-configuration characterization (issue 22):
#              benchmarks/sglang_overhead.py --cell for each of SWEEP_CELLS (default: all
#              of the script's SWEEP_CELLS, 0.6B and 8B shapes, short and long prompts,
#              2/32/64 MiB extents; /tmp/m-q8b for the q8b cells), REPEATS (11) pairs, each
#              cell bounded by CELL_S (420) seconds, its pairs stopping 90 s before, into
#              $OUT/sweep/sglang_overhead.jsonl; equality checked on every batch;
#              MEM_FRACTION (0.4) is SGLang alone's pool: on an 80 GB card q8b-long
#              needs 0.5 for the batch to fit it (the summary says whether it did)
#   multi      benchmarks/sglang_multi_instance.py: two SGLang instances, one ledger
#   colocated  the same with an SGLang and a vLLM instance (vLLM from /tmp/site, the
#              vLLM recipe's site; kvcached is installed there too)
#   latency    benchmarks/serve_latency.py --engine sglang: SGLang's API server alone and
#              with kvcached, the same KV (LATENCY_KV, 16GiB), Poisson arrivals at
#              LATENCY_RATES (8,16,32,64,128) for LATENCY_SECONDS (20) each, up to and
#              past saturation (issue 22); the client needs httpx: carry .whl-serve
#              (docs/gpu-testing.md says which wheels)
#   real       the `gpu` tests of tests/test_sglang_real.py: the hooks on SGLang's real
#              pools, allocators, radix caches and idle check (hybrid Mamba included),
#              on CUDA (scripts/sglang-real-cpu.sh runs the same programs on CPU first)
# Each step gets its own KVCACHED_LEDGER_DIR and writes JSON lines under $OUT/<step>/.
# TP=2 runs both overhead engines with two tensor-parallel ranks (a two-GPU machine).
# Two commands of < 10 minutes each (device time is scarce; each Engine start is 50-95 s):
#   bash scripts/sglang-gpu-run.sh overhead
#   bash scripts/sglang-gpu-run.sh multi colocated
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$repo/gpu-out}
model=${MODEL:-/tmp/m-q06}
steps=${*:-overhead multi colocated}
mkdir -p "$out"

bash "$repo/scripts/install-into-site.sh" /tmp/site-sglang \
    || { echo "STEP install: kvcached into /tmp/site-sglang failed"; exit 1; }
case " $steps " in *" colocated "*)
    if [ -d /tmp/site ]; then
        bash "$repo/scripts/install-into-site.sh" /tmp/site \
            || echo "STEP install: kvcached into /tmp/site failed"
    else
        echo "STEP colocated: /tmp/site (the vLLM recipe's site) is missing: skipped"
        steps=${steps//colocated/}
    fi ;;
esac

export PYTHONPATH=/tmp/site-sglang PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 \
    SGLANG_USE_SGL_FA3_KERNEL=1 TVM_FFI_CACHE_DIR=/tmp/tvm-ffi-cache
cd /tmp  # not the repository root, whose kvcached/ folder would shadow the installed one
python3 - <<'PY' || { echo "STEP check: the plugin is not visible to SGLang"; exit 1; }
from importlib.metadata import entry_points, version
import kvcached, kvcached.engines.sglang as plugin
found = [ep.value for ep in entry_points(group="sglang.srt.plugins")]
print("sglang", version("sglang"), "kvcached", kvcached.__file__, "plugins", found)
assert "kvcached.engines.sglang:register" in found, found
PY
status=0
for step in $steps; do
    dir="$out/$step"
    mkdir -p "$dir"
    export KVCACHED_LEDGER_DIR="/tmp/kvcached-ledger-$step"
    rm -rf "$KVCACHED_LEDGER_DIR" && mkdir -p "$KVCACHED_LEDGER_DIR"
    echo "STEP $step: begins $(date -u +%T)"
    case "$step" in
    overhead)
        python3 "$repo/benchmarks/sglang_overhead.py" "$model" --out-dir "$dir" \
            --repeats "${REPEATS:-3}" --tp-size "${TP:-1}" > "$dir/run.log" 2>&1 ;;
    overhead8b)
        timeout "${OVERHEAD_S:-540}" python3 "$repo/benchmarks/sglang_overhead.py" \
            /tmp/m-q8b --out-dir "$dir" --repeats "${REPEATS:-21}" --prompts 32 \
            --prompt-len 2048 --prompt-len-max 6144 --max-tokens 256 --context-length 8192 \
            --mem-fraction 0.4 --budget 40GiB --skip pressure > "$dir/run.log" 2>&1 ;;
    sweep)
        cells=$(python3 "$repo/benchmarks/sglang_overhead.py" --list-cells)
        for cell in ${SWEEP_CELLS:-$cells}; do
            cell_s=${CELL_S:-420}
            timeout "$cell_s" python3 "$repo/benchmarks/sglang_overhead.py" --cell "$cell" \
                --out-dir "$dir" --repeats "${REPEATS:-11}" --seconds $((cell_s - 90)) \
                --mem-fraction "${MEM_FRACTION:-0.4}" --budget 40GiB --skip pressure,corrupt \
                >> "$dir/run.log" 2>&1 || { echo "STEP sweep: cell $cell failed"; status=1; }
            grep -h '"step": "summary"' "$dir/sglang_overhead.jsonl" | tail -n 1 | cut -c1-400
        done
        true ;;
    multi)
        python3 "$repo/benchmarks/sglang_multi_instance.py" "$model" --out-dir "$dir" \
            --engines sglang,sglang --seconds "${SECONDS_LOAD:-60}" > "$dir/run.log" 2>&1 ;;
    colocated)
        python3 "$repo/benchmarks/sglang_multi_instance.py" "$model" --out-dir "$dir" \
            --engines sglang,vllm --seconds "${SECONDS_LOAD:-60}" > "$dir/run.log" 2>&1 ;;
    latency)  # the servers' logs are kept: a failed request's cause is in them
        KEEP_LOGS="$dir/logs" timeout "${LATENCY_S:-560}" python3 "$repo/benchmarks/serve_latency.py" \
            --engine sglang --model "$model" --kv "${LATENCY_KV:-16GiB}" \
            --rates "${LATENCY_RATES:-8,16,32,64,128}" --seconds "${LATENCY_SECONDS:-20}" \
            --out "$dir/serve_latency.jsonl" > "$dir/run.log" 2>&1 ;;
    real)
        python3 -P -m pytest -q -p no:cacheprovider -rfEs -m gpu \
            "$repo/tests/test_sglang_real.py" > "$dir/run.log" 2>&1 ;;
    *)
        echo "STEP $step: unknown (overhead, overhead8b, sweep, multi, colocated, latency, real)"
        status=2
        continue ;;
    esac
    rc=$?
    [ $rc -ne 0 ] && status=$rc
    echo "STEP $step: rc=$rc $(date -u +%T); last lines of $dir/run.log:"
    tail -n 25 "$dir/run.log"
done
echo "=== summary"
grep -h -E '"step": "(startup|summary|pressure_check|corrupt_check|started|served)"' \
    "$out"/*/*.jsonl 2>/dev/null
exit $status
