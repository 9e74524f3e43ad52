"""Cost of the elastic block pool's free-block count, which vLLM asks for once per
running request per step: exact every time (COUNT_REFRESH_S=0) vs. the cached count.

Host backend, a real ledger row (temporary folder), the queue over a tiny model's
BackingBuffer; rounds alternate between the two settings. Prints one JSON line per
round and a summary line.

    python benchmarks/vllm_free_count.py [--calls 20000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from types import SimpleNamespace


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    os.environ["KVCACHED_LEDGER_DIR"] = tempfile.mkdtemp(prefix="kvcached-bench-")
    from kvcached import supply  # the cached count is the core's (ElasticSupply)
    from kvcached.backends.host import HostBackend
    from kvcached.backing import BackingBuffer
    from kvcached.cache import KVCache
    from kvcached.engines.vllm import block_pool

    backend = HostBackend()
    blocks = 4096
    backing = BackingBuffer(
        backend, nbytes=2 * blocks * 65536, num_blocks=blocks, block_bytes=65536,
        segment_offsets=[0, blocks * 65536],
    )  # fmt: skip
    cache = KVCache(layout=backing, name="bench", engine="bench", backend=backend)
    allocator = cache.allocators[0]
    allocator.alloc_one()  # the null block
    pool = SimpleNamespace(blocks=[SimpleNamespace(block_id=i) for i in range(blocks)])
    queue = block_pool.ElasticFreeQueue(pool, SimpleNamespace(allocator=allocator))
    default = supply.COUNT_REFRESH_S
    per_call: dict[str, list[float]] = {"exact": [], "cached": []}
    for r in range(a.rounds):
        for mode in ("exact", "cached") if r % 2 == 0 else ("cached", "exact"):
            supply.COUNT_REFRESH_S = 0.0 if mode == "exact" else default
            t0 = time.perf_counter()
            for _ in range(a.calls):
                queue.num_free_blocks  # noqa: B018
            us = (time.perf_counter() - t0) / a.calls * 1e6
            per_call[mode].append(us)
            print(
                json.dumps(
                    {
                        "bench": "vllm_free_count",
                        "mode": mode,
                        "round": r,
                        "us_per_call": round(us, 3),
                    }
                )
            )
    exact, cached = statistics.median(per_call["exact"]), statistics.median(per_call["cached"])
    print(json.dumps({
        "bench": "vllm_free_count_summary", "us_exact": round(exact, 3),
        "us_cached": round(cached, 3), "speedup": round(exact / cached, 1),
        "ms_per_step_at_1024_requests_exact": round(exact * 1024 / 1000, 2),
        "ms_per_step_at_1024_requests_cached": round(cached * 1024 / 1000, 2),
    }))  # fmt: skip
    cache.close()


if __name__ == "__main__":
    main()
