#!/usr/bin/env bash
# The SGLang column of docs/compatibility.md, on the H200 device, in ONE command.
# Prerequisite: the recipe in ../shared/device-sglang has installed SGLang 0.5.16 into
# /tmp/site-sglang (Python 3.12, transformers 5.12.1 shadowing the device's 5.17.0), as
# scripts/sglang-gpu-run.sh assumes; .whl/ carries pydantic_settings and python_dotenv
# if that site lacks them. Installs kvcached from this tree into the site (SGLang finds
# its plugin by entry point), checks SGLang sees the plugin, then runs
# tests/matrix/harness.py --engine sglang --gpu: per architecture, one SGLang Engine
# without and one with kvcached (ENABLE_KVCACHED=1), each in a fresh process
# (tests/sglang_engine/generate.py), deterministic, radix cache on, the same gpu-scale
# models as the vLLM-GPU column. Writes $OUT/sglang-gpu.json (copy it to
# tests/matrix/results/ and run scripts/render_compatibility.py) and
# $OUT/matrix-sglang-gpu.log.
#   bash scripts/matrix-sglang-gpu.sh [ROW ...]      # default: every row
# Budget: each process imports SGLang (~25 s) and starts an Engine (~90 s the first time
# on a fresh machine, JIT kernels and CUDA graphs; ~45 s later); a refused or unsupported
# row stops before its graphs. Rows that would start past DEADLINE seconds (default 420)
# are recorded as not run ("out of time") and runs are killed at DEADLINE + 60 s, so the
# command stays within 8 min. The whole column takes about three commands:
#   bash scripts/matrix-sglang-gpu.sh standard-gqa
#   bash scripts/matrix-sglang-gpu.sh sliding-window-hybrid hybrid-linear-attention cross-layer-kv-sharing
#   bash scripts/matrix-sglang-gpu.sh heterogeneous-kv-groups mla
# Each command carries the rows of the commands before it on the same machine (kept in
# $KEEP, default /tmp/kvcached-matrix/sglang-gpu.json), so the last $OUT/sglang-gpu.json
# holds the whole column; a row cut by the deadline keeps its earlier result, if any.
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$repo/gpu-out}
site=${SITE:-/tmp/site-sglang}
keep=${KEEP:-/tmp/kvcached-matrix/sglang-gpu.json}
mkdir -p "$out" "$(dirname "$keep")"
bash "$repo/scripts/install-into-site.sh" "$site" \
    || { echo "kvcached into $site failed"; exit 1; }
export PYTHONPATH=$site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 KVCACHED_BACKEND=cuda \
    SGLANG_USE_SGL_FA3_KERNEL=1 TVM_FFI_CACHE_DIR=/tmp/tvm-ffi-cache
cd /tmp  # not the repository root, whose kvcached/ folder would shadow the installed one
python3 - <<'PY' || { echo "the plugin is not visible to SGLang"; exit 1; }
from importlib.metadata import entry_points, version
import kvcached, transformers
found = [ep.value for ep in entry_points(group="sglang.srt.plugins")]
print("sglang", version("sglang"), "transformers", transformers.__version__,
      "kvcached", kvcached.__file__, "plugins", found)
assert "kvcached.engines.sglang:register" in found, found
PY
python3 "$repo/tests/matrix/harness.py" --engine sglang --gpu --deadline "${DEADLINE:-420}" \
    --keep "$keep" --out "$out/sglang-gpu.json" "$@" \
    2>&1 | tee "$out/matrix-sglang-gpu.log"
status=${PIPESTATUS[0]}
[ -f "$out/sglang-gpu.json" ] && cp "$out/sglang-gpu.json" "$keep"
exit "$status"
