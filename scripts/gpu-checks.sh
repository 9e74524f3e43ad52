#!/usr/bin/env bash
# The GPU half of the test plan, for a machine with an NVIDIA GPU (the H200 device).
# Expects kvcached and the wheels it needs in .whl/ (built/downloaded on the CPU
# machine: see docs/gpu-testing.md); writes logs and JSON figures to $OUT (or ./gpu-out).
# Usage: bash scripts/gpu-checks.sh [conformance|tests|bench|all]...
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$repo/gpu-out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$repo"/.whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
cd /tmp  # never import the source tree: the installed package has the full layout
status=0
run() { echo "=== $*"; "$@" || { echo "=== FAILED ($?): $*"; status=1; }; }
for step in "${@:-all}"; do
    case $step in
    conformance | all)
        run python3 -m kvcached.cli info
        run python3 -m kvcached.cli conformance --backend cuda -p no:cacheprovider -rA \
            2>&1 | tee "$out/conformance-cuda.txt" ;;&
    tests | all)
        # shellcheck disable=SC2086 # GPU_TEST_PATHS is a list
        run python3 -m pytest -q -p no:cacheprovider -m gpu ${GPU_TEST_PATHS:-$repo/tests} \
            2>&1 | tee "$out/gpu-tests.txt" ;;&
    bench | all)
        run python3 "$repo/benchmarks/vmm_ops.py" --backend cuda | tee "$out/vmm_ops.jsonl"
        run python3 "$repo/benchmarks/import_time.py" | tee "$out/import_time.jsonl" ;;
    esac
done
exit $status
