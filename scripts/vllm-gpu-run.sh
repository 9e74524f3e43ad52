#!/usr/bin/env bash
# The vLLM half of the GPU plan, on the H200 device after the recipe in
# ../shared/device-vllm (vLLM 0.26 wheels installed into /tmp/site, the random
# Qwen3-0.6B-shaped model in /tmp/m-q06). Installs kvcached from this tree as a
# distribution (so vLLM finds its plugin entry point), then runs the steps named:
#   overhead8b the 8B shape, 2K-6K prompts, 256 new tokens, REPEATS (21) pairs, V1: the
#              run that can decide the overhead target (benchmarks/paired_ratios.py)
#   latency    benchmarks/serve_latency.py: one served model (LATENCY_MODEL, /tmp/m-q06),
#              vLLM alone vs with kvcached, the same KV (LATENCY_KV, 16GiB), Poisson
#              arrivals at LATENCY_RATES for LATENCY_SECONDS each; needs .whl-serve
#   overhead   benchmarks/vllm_overhead.py for RUNNERS (default v2,v1): greedy-token
#              equality with and without kvcached (deterministic mode), offline
#              throughput side by side, alternating, REPEATS (default 3) batches each
#   multi      benchmarks/vllm_multi_instance.py: 3 instances on the GPU, bursty
#              phase-shifted load, kvcached vs. a static split of the same memory
#   sleep      benchmarks/vllm_sleep_wake.py: vLLM's sleep mode (level 1, and a level-2
#              check that must change the tokens) with kvcached and vLLM alone, in
#              SLEEP_PAIRS (default 2) alternating process pairs of SLEEP_ROUNDS (3)
#              rounds each, on /tmp/m-q06; SLEEP_Q8B=1 also on a Qwen3-8B-shaped model
#              (/tmp/m-q8b, made first if missing, 16 GiB of bf16; one pair:
#              SLEEP_Q8B_PAIRS), SLEEP_Q06=0 skips the 0.6B model (to run the 8B alone);
#              SLEEP_RUNNER=v1|v2 picks the model runner (default: vLLM's)
#   serve      benchmarks/serve_multi_model.py: `kvcached serve` with three Qwen3-0.6B-shaped
#              models and one Qwen3-8B-shaped (/tmp/m-q8b, made first if missing; its burst
#              rate a quarter of the others') behind the router, against a static split of
#              the same KV memory (SERVE_BUDGET, default 8GiB) with plain vLLM; SERVE_MODES
#              (default "kvcached static") picks the set-ups, SERVE_RATES the burst rates,
#              SERVE_PREFIX_CACHING=on turns vLLM's prefix cache on in both.
#              Needs vLLM's API server: the command must carry .whl-serve (uvicorn & co.)
#   sweep      the per-configuration characterization (issue 22): vllm_overhead.py over
#              the cells of SWEEP_CELLS (default: all, about 20 min, so split them over
#              calls), REPEATS (11) alternating batches each, fewer where a cell's pairs
#              would pass CELL_S (420) less 30 s, into $OUT/sweep.jsonl, each summary
#              with its `config` (label, model, lengths, extent size, runner) and, per
#              side, the median seconds a batch spent in each part of the engine's steps,
#              and whether vLLM alone's KV pool held the batch (else it is pressure);
#              SECOND_BASELINE=1 then starts a second vLLM-alone process (SECOND_BASELINE_S,
#              150 s, kept for it) whose tokens say whether vLLM agrees with itself
#   connectors benchmarks/vllm_connectors.py --device gpu on /tmp/m-q06, the trials of
#              CONNECTOR_TRIALS (default offloading; also lmcache, capacity) (issue 21):
#              offloading: tokens with the CPU tier, vLLM alone and kvcached, loaded blocks
#              swapped, stores of unheld blocks, a tight limit; lmcache: the same with
#              LMCacheConnectorV1 (needs .whl-lmcache carried by this or an earlier
#              command); capacity: a preempting batch under a tight limit, with and
#              without the OffloadingConnector's tier; capacity-alone: the same batch on
#              vLLM alone with a pool of the limit's size (one trial per command: each
#              takes about 4 min)
#   pd         benchmarks/vllm_pd.py --device gpu on /tmp/m-q06: a prefill/decode pair with
#              the NixlConnector (kv_buffer_device=cpu), plain and under kvcached (issue 21),
#              PD_ROUNDS (16) alternating rounds of PD_BATCH (16) prompts of PD_PROMPT_LEN
#              (1024) tokens, PD_MAX_TOKENS (64) new; eager (four engine starts with
#              torch.compile pass 4 min; PD_EAGER=0 for CUDA graphs). Needs NIXL: an earlier command of the
#              same machine carried .whl-nixl (nixl + nixl-cu13 for Python 3.12, ~57 MiB)
#              and ran install-into-site.sh, or this one carries it. PD_S (500) bounds
#              the run; one cut short gets $OUT/vllm_pd_summary.jsonl of its finished rounds.
#              PD_OFFLOAD_GIB=G puts both producers on the MultiConnector (NIXL and an
#              OffloadingConnector tier of G GiB): the trial that would serve it on 0.26
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
    overhead8b)  # issue 22: GPU-bound, KV reads dominating, >= 20 pairs, CUDA graphs on
        timeout "${OVERHEAD_S:-540}" python3 "$repo/benchmarks/vllm_overhead.py" /tmp/m-q8b \
            --repeats "${REPEATS:-21}" --runners "${RUNNERS:-v1}" --prompts "${PROMPTS:-32}" \
            --prompt-len 2048 --prompt-len-max 6144 --max-tokens 256 --max-model-len 8192 \
            --gpu-mem 0.4 --budget 40GiB --log "$out/vllm_overhead_8b.log" \
            --out "$out/vllm_overhead_8b.jsonl" | grep -v '"bench": "vllm_overhead",' || status=1
        python3 "$repo/benchmarks/vllm_overhead.py" x --summarize "$out/vllm_overhead_8b.jsonl"
        ;;
    latency)  # issue 22: Poisson arrivals up to and past saturation, vanilla vs kvcached
        KEEP_LOGS="$out/serve_latency_logs" timeout "${LATENCY_S:-560}" python3 "$repo/benchmarks/serve_latency.py" \
            --model "${LATENCY_MODEL:-/tmp/m-q06}" --kv "${LATENCY_KV:-16GiB}" \
            --rates "${LATENCY_RATES:-8,16,32,64,128}" --seconds "${LATENCY_SECONDS:-20}" \
            --out "$out/serve_latency.jsonl" || status=1
        ;;
    sweep)
        # cell: model, runner, prompts, prompt lengths (min max), new tokens, extent size
        cells="q06-short-v1 q06-short-v2 q06-long-v1 q06-long-2MiB q06-long-64MiB q8b-short-v1 q8b-long-v2"
        for cell in ${SWEEP_CELLS:-$cells}; do
            case $cell in
            q06-short-v1)   set -- /tmp/m-q06 v1 256 128 128 128 32MiB ;;
            q06-short-v2)   set -- /tmp/m-q06 v2 256 128 128 128 32MiB ;;
            q06-long-v1)    set -- /tmp/m-q06 v1 64 2048 4096 256 32MiB ;;
            q06-long-2MiB)  set -- /tmp/m-q06 v1 64 2048 4096 256 2MiB ;;
            q06-long-64MiB) set -- /tmp/m-q06 v1 64 2048 4096 256 64MiB ;;
            q8b-short-v1)   set -- /tmp/m-q8b v1 128 512 512 128 32MiB ;;
            q8b-long-v2)    set -- /tmp/m-q8b v2 32 2048 6144 256 32MiB ;;
            *) echo "unknown sweep cell $cell"; status=2; continue ;;
            esac
            cell_s=${CELL_S:-420}  # pairs stop 30 s before the timeout: a summary
            spare=30 second=()
            if [ -n "${SECOND_BASELINE:-}" ]; then  # its start and two batches come last
                spare=$((30 + ${SECOND_BASELINE_S:-150})) second=(--second-baseline)
            fi
            KVCACHED_EXTENT_SIZE=$7 timeout "$cell_s" python3 \
                "$repo/benchmarks/vllm_overhead.py" "$1" --label "$cell" --runners "$2" \
                --repeats "${REPEATS:-11}" --seconds $((cell_s - spare)) "${second[@]}" --prompts "$3" \
                --prompt-len "$4" --prompt-len-max "$5" --max-tokens "$6" --max-model-len 8192 \
                --gpu-mem 0.4 --budget 40GiB --step-times --log "$out/sweep.log" \
                --out "$out/sweep.jsonl" | grep -v '"bench": "vllm_overhead",' | cut -c1-400 || status=1
        done
        ;;
    pd)
        timeout "${PD_S:-500}" python3 "$repo/benchmarks/vllm_pd.py" --device gpu \
            --model /tmp/m-q06 --rounds "${PD_ROUNDS:-16}" --batch "${PD_BATCH:-16}" \
            --prompt-len "${PD_PROMPT_LEN:-1024}" --max-tokens "${PD_MAX_TOKENS:-64}" \
            --max-model-len 2048 --budget 16GiB --gpu-mem 0.12 --out "$out/vllm_pd.jsonl" \
            $([ "${PD_EAGER:-1}" = 1 ] && echo --eager) \
            ${PD_OFFLOAD_GIB:+--producer-offload-gib "$PD_OFFLOAD_GIB"} || status=1
        # a run its time limit cut short has no summary line of its own: summarize the
        # rounds it finished (the 2026-12-03 and 2026-12-04 runs both were cut)
        tail -n 1 "$out/vllm_pd.jsonl" | grep -q '"run": "summary"' ||
            python3 "$repo/benchmarks/vllm_pd.py" --summarize "$out/vllm_pd.jsonl" \
                > "$out/vllm_pd_summary.jsonl"
        ;;
    connectors)
        for trial in ${CONNECTOR_TRIALS:-offloading}; do
            name=vllm_connectors_gpu
            [ "$trial" = offloading ] || name=vllm_connectors_gpu_$trial
            timeout "${CONNECTORS_S:-540}" python3 "$repo/benchmarks/vllm_connectors.py" \
                --device gpu --trial "$trial" --model /tmp/m-q06 --out "$out/$name.jsonl" \
                | cut -c1-600 || status=1
        done
        ;;
    multi)
        python3 "$repo/benchmarks/vllm_multi_instance.py" /tmp/m-q06 --dtype bfloat16 \
            --instances 3 --budget 6GiB --gpu-mem 0.25 --seconds "${SECONDS_PER_MODE:-45}" \
            --period 30 --burst-rate 40 --quiet-rate 2 --prompt-len 1024:2048 \
            --output-len 128:256 --max-num-seqs 256 --out "$out/vllm_multi_instance.jsonl" \
            > "$out/vllm_multi_instance.log" 2>&1 || status=1
        grep -h '"mode"\|compare' "$out/vllm_multi_instance.log" | tail -n 6
        ;;
    sleep)
        if [ "${SLEEP_Q06:-1}" = 1 ]; then
            python3 "$repo/benchmarks/vllm_sleep_wake.py" /tmp/m-q06 \
                --pairs "${SLEEP_PAIRS:-2}" --rounds "${SLEEP_ROUNDS:-3}" \
                --runner "${SLEEP_RUNNER:-default}" --child-timeout 240 \
                --log "$out/vllm_sleep_wake.log" --out "$out/vllm_sleep_wake.jsonl" \
                | grep '_summary\|"error"' || status=1
        fi
        if [ "${SLEEP_Q8B:-0}" = 1 ]; then
            if [ ! -f /tmp/m-q8b/config.json ]; then
                make=$repo/.devwheels/tools/make_random_model.py
                [ -f "$make" ] || make=$repo/../shared/device-vllm/make_random_model.py
                python3 "$make" /tmp/m-q8b qwen3-8b > "$out/make_q8b.log" 2>&1 \
                    || { tail -n 20 "$out/make_q8b.log"; status=1; }
            fi
            python3 "$repo/benchmarks/vllm_sleep_wake.py" /tmp/m-q8b \
                --pairs "${SLEEP_Q8B_PAIRS:-1}" --rounds "${SLEEP_ROUNDS:-3}" \
                --runner "${SLEEP_RUNNER:-default}" --child-timeout 420 \
                --log "$out/vllm_sleep_wake_q8b.log" --out "$out/vllm_sleep_wake_q8b.jsonl" \
                | grep '_summary\|"error"' || status=1
        fi
        ;;
    serve)
        if [ ! -f /tmp/m-q8b/config.json ]; then
            make=$repo/.devwheels/tools/make_random_model.py
            [ -f "$make" ] || make=$repo/../shared/device-vllm/make_random_model.py
            python3 "$make" /tmp/m-q8b qwen3-8b > "$out/make_q8b.log" 2>&1 \
                || { tail -n 20 "$out/make_q8b.log"; status=1; }
        fi
        for mode in ${SERVE_MODES:-kvcached static}; do
            python3 "$repo/benchmarks/serve_multi_model.py" --mode "$mode" \
                --budget "${SERVE_BUDGET:-8GiB}" --rates "${SERVE_RATES:-2,4,8,16,32}" \
                --model a=/tmp/m-q06 --model b=/tmp/m-q06 --model c=/tmp/m-q06 \
                --model big=/tmp/m-q8b@0.25 --gpu-mem 0.1,big=0.2 \
                --prefix-caching "${SERVE_PREFIX_CACHING:-off}" \
                --out "$out/serve_multi_model.jsonl" --keep-logs "$out/serve-logs" \
                > "$out/serve_multi_model_$mode.log" 2>&1 || status=1
            grep -h '"burst_rate"\|"summary"\|"error"\|"wake"' "$out/serve_multi_model_$mode.log" \
                | cut -c1-400 | tail -n 12
        done
        ;;
    *) echo "unknown step $step (overhead, overhead8b, latency, sweep, connectors, multi, sleep, serve)"
       status=2 ;;
    esac
done
exit $status
