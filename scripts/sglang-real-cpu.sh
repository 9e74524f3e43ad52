#!/usr/bin/env bash
# kvcached's SGLang hooks on SGLang 0.5.16's real pools, allocators, radix caches and
# idle check, on the CPU machine (host backend), before any device time is spent: the
# programs of tests/sglang_real/ that tests/test_sglang_real.py runs on the H200.
#   bash scripts/sglang-real-cpu.sh
# SGLang's engine cannot start here (no CUDA kernels), but the modules these programs
# use are pure Python over torch. The first run downloads SGLang 0.5.16's wheel (its
# Python 3.11 build, unpacked, not installed) and the few packages its import chain
# needs beyond the project's venv, with --no-deps, into $SGLANG_CPU_DIR (default
# /tmp/kvcached-sglang-cpu); tests/standins/ stands in for torchvision and
# tests/sglang_real/standins/ hides `kernels` (their READMEs say why). Not part of CI:
# it needs the download, and SGLang's pinned transformers beside the venv's own.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-"$root/.venv/bin/python"}
dir=${SGLANG_CPU_DIR:-/tmp/kvcached-sglang-cpu}
mkdir -p "$dir/wheel" "$dir/deps"
if [ ! -d "$dir/src/sglang" ]; then
    "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
        --implementation cp --platform manylinux_2_34_x86_64 -d "$dir/wheel" sglang==0.5.16
    "$python" -m zipfile -e "$dir"/wheel/sglang-0.5.16-*.whl "$dir/src"
fi
if [ ! -d "$dir/deps/transformers" ]; then
    # what SGLang's pool modules import beyond the venv; transformers and its hub client
    # at SGLang 0.5.16's pins (the venv's newer transformers registers names SGLang
    # registers again)
    "$python" -m pip install -q --no-deps --target "$dir/deps" \
        transformers==5.12.1 tokenizers==0.22.2 "huggingface-hub>=1.5.0,<2.0" orjson gguf \
        ipython traitlets ipython-pygments-lexers jedi parso matplotlib-inline pexpect \
        ptyprocess prompt-toolkit wcwidth stack-data asttokens executing pure-eval decorator
fi
programs="$root/tests/sglang_real"
export PYTHONPATH="$programs:$dir/src:$programs/standins:$root/tests/standins:$dir/deps"
export ENABLE_KVCACHED=1 KVCACHED_BACKEND=host PYTHONWARNINGS=ignore
status=0
run() {  # run BUDGET PROGRAM ARGS...: one program in a fresh process and ledger
    local budget=$1 ledger
    shift
    ledger=$(mktemp -d)
    if KVCACHED_LEDGER_DIR=$ledger KVCACHED_BUDGET=$budget "$python" "$programs/$1" "${@:2}" \
        >"$ledger/out.log" 2>&1; then
        echo "ok: $* ($(tail -n 1 "$ledger/out.log"))"
    else
        echo "FAILED: $*"
        tail -n 25 "$ledger/out.log"
        status=1
    fi
    rm -rf "$ledger"
}
run 4GiB pool_allocator_radix.py 1 cpu
run 4GiB pool_allocator_radix.py 16 cpu
run 6MiB mamba_hybrid.py cpu  # less than the attention pool's 8 MiB, as on the H200
run 96MiB swa_hybrid.py cpu  # less than the two pools' 144 MiB, more than either's
exit "$status"
