"""kvcached's own host time per growth step of the page allocator, without a device.

`grow_shrink.py` times a growth step on a GPU, where the driver's calls are most of it
and the host's speed moves the rest. This measures the rest alone: the allocator over a
`CudaBackend` built without a device (as `vmm_bookkeeping.py` does) whose driver
primitives (`_create`, `_release`, `_map_batch`, `_unmap_batch`, the per-page calls)
return at once. Each round grows a 36-layer, 8-KV-head, head-dim-128 bf16 model by one
extent through `alloc` (one page per segment, 72 pages) and shrinks it again through
`free` and `trim`; what is timed is the allocator's and the backend's bookkeeping:
charging, the extent's page book, the checks, locks and records of every page.

Prints one JSON line per run of `--rounds` rounds (medians per step):

    {"bench": "grow_bookkeeping", "run": "summary", "grow_us": 136.0, "shrink_us": 117.0,
     "handles": 72, "label": "...", ...}

    python benchmarks/grow_bookkeeping.py [--rounds 300] [--extent-mib 32] [--label NAME]

To compare two trees, run it from each in turn (fresh processes, alternating) with
`--label`, as `vmm_bookkeeping.py`'s docstring says.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from typing import Any

from vmm_bookkeeping import deviceless_cuda_backend  # benchmarks/, this script's folder

from kvcached.allocator import LocalAccount, PageAllocator
from kvcached.layout import KVLayout

MiB, GiB = 1 << 20, 1 << 30
LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 36, 8, 128, 16


def _nothing(*args: Any) -> None:
    return None


def stubbed_backend() -> Any:
    """A deviceless CUDA backend whose every driver primitive returns at once."""
    backend = deviceless_cuda_backend()
    addresses = itertools.count(1)
    backend._reserve = lambda nbytes: next(addresses) << 40
    backend._create = lambda nbytes: object()
    for primitive in ("_free", "_release", "_map_batch", "_unmap_batch", "_make_current"):
        setattr(backend, primitive, _nothing)
    backend.synchronize = _nothing
    return backend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--extent-mib", type=int, default=32)
    parser.add_argument("--label", default="", help="names this tree in the output")
    args = parser.parse_args()

    backend = stubbed_backend()
    per_token = 2 * LAYERS * KV_HEADS * HEAD_DIM * 2
    layout = KVLayout.uniform(
        backend, LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype="bfloat16",
        block_size=BLOCK_SIZE, max_tokens=40 * GiB // per_token,
    )  # fmt: skip
    (group,) = layout.groups
    allocator = PageAllocator(
        group, account=LocalAccount(), extent_bytes=args.extent_mib * MiB, pool_low=0,
        pool_high=0, release_delay=0, background=False,
    )  # fmt: skip
    blocks = max(1, (args.extent_mib * MiB // group.page_bytes) * group.blocks_per_page)
    grow, shrink = [], []
    for _ in range(args.rounds + 20):  # the first 20 warm up
        start = time.perf_counter_ns()
        taken = allocator.alloc(blocks)
        grown = time.perf_counter_ns()
        if taken is None or len(allocator.extents()) != 1:
            raise AssertionError("one alloc of an extent's blocks did not grow one extent")
        allocator.free(taken)
        allocator.trim(keep=0)
        done = time.perf_counter_ns()
        if allocator.extents():
            raise AssertionError("the extent was not released")
        grow.append((grown - start) / 1e3)
        shrink.append((done - grown) / 1e3)
    allocator.close()
    grow, shrink = grow[20:], shrink[20:]
    summary = {
        "bench": "grow_bookkeeping",
        "run": "summary",
        "label": args.label,
        "rounds": args.rounds,
        "extent_mib": args.extent_mib,
        "handles": len(group.segments),
        "blocks": blocks,
        "grow_us": round(statistics.median(grow), 2),
        "shrink_us": round(statistics.median(shrink), 2),
        "grow_us_per_handle": round(statistics.median(grow) / len(group.segments), 3),
    }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
