#!/usr/bin/env bash
# The GPU half of the test plan, for a machine with an NVIDIA GPU (the H200 device).
# Installs kvcached from this tree plus the wheels in .whl/ (dependencies the GPU
# machine lacks; see docs/gpu-testing.md) into /tmp/site, then runs the chosen steps
# and writes logs and JSON figures to $OUT (or ./gpu-out).
#   bash scripts/gpu-checks.sh [cuda] [tests] [rocm] [bench] [calls] [all]
# `calls` (also part of `bench`) times the per-page path both ways: kvcached's C calls
# (the default where the module built) and cuda.bindings (KVCACHED_COMPILED_CALLS=0).
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$repo/gpu-out}
mkdir -p "$out"
wheels=$(ls "$repo"/.whl/*.whl 2>/dev/null | grep -v '/kvcached-')
# shellcheck disable=SC2086 # a list of wheel files
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site $wheels || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --upgrade \
    --target /tmp/site "$repo" || exit 1
rm -rf "$repo/build" "$repo"/*.egg-info
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
cd /tmp  # never import the source tree: the installed package has the full layout
status=0
# banners go to stderr: a step's stdout may be the JSON lines its tee keeps
run() { echo "=== $*" >&2; "$@" || { echo "=== FAILED ($?): $*" >&2; status=1; }; }
pytest_gpu() { python3 -P -m pytest -q -p no:cacheprovider -rfEs "$@"; }
for step in "${@:-all}"; do
    case $step in
    cuda | all)
        run python3 -m kvcached.apps.cli info
        run python3 -m kvcached.apps.cli conformance --backend cuda -p no:cacheprovider \
            2>&1 | tee "$out/conformance-cuda.txt" ;;&
    tests | all)
        run pytest_gpu -m gpu "$repo/tests/test_gpu_cuda.py" "$repo/tests/test_allocator_gpu.py" \
            2>&1 | tee "$out/gpu-tests.txt" ;;&
    rocm | all)
        python3 "$repo/tests/rocm/standin.py" --variant cuda --out /tmp/hipstandin >/tmp/hip.env
        (
            # shellcheck disable=SC1091 # written just above
            . /tmp/hip.env
            export KVCACHED_BACKEND=rocm
            run python3 -m kvcached.apps.cli info
            run python3 -P -m pytest -q -p no:cacheprovider --import-mode=importlib \
                --pyargs kvcached.conformance --kvcached-backend=rocm
            run python3 "$repo/benchmarks/vmm_ops.py" --backend rocm --sizes-mib 2,64 \
                | tee "$out/vmm_ops_rocm.jsonl"
            exit $status
        ) 2>&1 | tee "$out/conformance-rocm.txt" || status=1
        run pytest_gpu -m gpu "$repo/tests/test_rocm_standin.py" \
            "$repo/tests/test_rocm_conformance.py" 2>&1 | tee -a "$out/gpu-tests.txt" ;;&
    calls | bench | all)
        run python3 -m kvcached.apps.cli info --json | tee "$out/info.json"
        run python3 "$repo/benchmarks/vmm_ops.py" --backend cuda | tee "$out/vmm_ops.jsonl"
        KVCACHED_COMPILED_CALLS=0 run python3 "$repo/benchmarks/vmm_ops.py" --backend cuda \
            | tee "$out/vmm_ops_bindings.jsonl"
        # kvcached's own host time with the driver stubbed, on this machine's host (the
        # GPU hosts run it about three times slower than the CPU machine), both forms
        for calls in bindings compiled bindings compiled; do
            run python3 "$repo/benchmarks/vmm_bookkeeping.py" --label "$(hostname)" \
                --calls $calls | tail -n 1
        done | tee "$out/vmm_bookkeeping_calls.jsonl" ;;&
    bench | all)
        run python3 "$repo/benchmarks/parallel_map.py" --backend cuda \
            | tee "$out/parallel_map.jsonl"
        run python3 "$repo/benchmarks/grow_shrink.py" --backend cuda | tee "$out/grow_shrink.jsonl"
        run python3 "$repo/benchmarks/grow_bookkeeping.py" --label "$(hostname)" \
            | tee "$out/grow_bookkeeping.jsonl"
        run python3 "$repo/benchmarks/import_time.py" --runs 11 | tee "$out/import_time.jsonl" ;;
    esac
done
exit $status
