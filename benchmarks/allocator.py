"""Fast-path cost of the page allocator with a warm pool (no driver call on these paths).

Times, through the public API of `kvcached.allocator.PageAllocator`:

* ``alloc_one+free_one``: one block out and back, mean over many rounds (target <= 2 us);
* ``alloc(1)+free``: the same through the list API;
* ``alloc(1000)+free``: a 1,000-block batch out and back (target <= 100 us);
* ``alloc_one latency`` and ``alloc(16) latency``: per-call p50 / p99 / p99.9 / max with
  the pool kept warm (target p99 <= 50 us).

The allocator runs as an engine would run it: its pool thread on, blocks of a
36-layer, 8-KV-head, head-dim-128 bf16 model (block_size 16). Prints one JSON object
per line:

    {"bench": "allocator", "backend": "host", "case": "alloc_one+free_one",
     "us": 0.61, "target_us": 2.0, "ok": true, ...}

    python benchmarks/allocator.py [--backend host|cuda] [--rounds 200000]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time
from typing import Any

import kvcached
from kvcached.allocator import LocalAccount, PageAllocator
from kvcached.layout import KVLayout

GiB = 1 << 30


def emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def mean_us(fn: Any, rounds: int) -> float:
    start = time.perf_counter()
    fn(rounds)
    return (time.perf_counter() - start) / rounds * 1e6


def wait_idle(allocator: PageAllocator, warm_pages: int) -> None:
    """Until the pool thread has nothing in flight and the pool is warm."""
    deadline = time.monotonic() + 120
    while True:
        st = allocator.stats()
        if st.inflight_bytes == 0 and st.releasing_bytes == 0 and st.empty_pages >= warm_pages:
            return
        if time.monotonic() > deadline:
            raise SystemExit("the pool did not settle in 120 s")
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default=None, help="host, cuda, ... (default: auto)")
    parser.add_argument("--rounds", type=int, default=200_000, help="single-block rounds")
    parser.add_argument("--batch-rounds", type=int, default=2_000)
    parser.add_argument("--samples", type=int, default=100_000, help="latency samples")
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()

    backend = kvcached.get_backend(args.backend)
    layout = KVLayout.uniform(
        backend,
        args.layers,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        dtype="bfloat16",
        block_size=args.block_size,
        max_tokens=64 * GiB // (2 * args.layers * args.kv_heads * args.head_dim * 2),
    )
    group = layout.groups[0]
    bpp = group.blocks_per_page
    warm_pages = -(-1100 // bpp) + 2  # room for the 1,000-block batch and then some
    allocator = PageAllocator(
        group,
        account=LocalAccount(),
        pool_low=warm_pages * group.page_id_bytes,
        pool_high=2 * warm_pages * group.page_id_bytes,
    )
    common = {
        "bench": "allocator",
        "backend": backend.name,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "layers": args.layers,
        "blocks_per_page": bpp,
        "page_id_mib": group.page_id_bytes / (1 << 20),
    }
    wait_idle(allocator, warm_pages)  # the pool thread warms it
    held = allocator.alloc(3)  # some pages partly used, as in a running engine
    assert held is not None
    gc.collect()
    gc.disable()  # collector pauses are the engine's, not the allocator's

    def single(n: int) -> None:
        alloc_one, free_one = allocator.alloc_one, allocator.free_one
        for _ in range(n):
            free_one(alloc_one())  # type: ignore[arg-type]

    def single_list(n: int) -> None:
        alloc, free = allocator.alloc, allocator.free
        for _ in range(n):
            free(alloc(1))  # type: ignore[arg-type]

    def batch(n: int) -> None:
        alloc, free = allocator.alloc, allocator.free
        for _ in range(n):
            free(alloc(1000))  # type: ignore[arg-type]

    for fn in (single, batch):  # warm caches and code paths
        fn(1000 if fn is single else 20)
    wait_idle(allocator, warm_pages)  # the refill those rounds started is done
    us = mean_us(single, args.rounds)
    emit(**common, case="alloc_one+free_one", us=round(us, 3), target_us=2.0, ok=us <= 2.0)
    us = mean_us(single_list, args.rounds)
    emit(**common, case="alloc(1)+free", us=round(us, 3), target_us=2.0, ok=us <= 2.0)
    us = mean_us(batch, args.batch_rounds)
    emit(**common, case="alloc(1000)+free", us=round(us, 2), target_us=100.0, ok=us <= 100.0)

    for case, count in (("alloc_one latency", 1), ("alloc(16) latency", 16)):
        samples: list[float] = []
        outstanding: list[int] = []
        clock = time.perf_counter_ns
        calls = 0
        while len(samples) < args.samples:
            start = clock()
            got = allocator.alloc_one() if count == 1 else allocator.alloc(count)
            samples.append((clock() - start) / 1000)
            calls += 1
            if got is None:
                raise SystemExit("exhausted during the latency run")
            if isinstance(got, int):
                outstanding.append(got)
            else:
                outstanding.extend(got)
            if len(outstanding) >= 512:  # keep the pool warm: give back, untimed
                allocator.free(outstanding)
                outstanding.clear()
        allocator.free(outstanding)
        samples.sort()

        def pct(p: float, s: list[float] = samples) -> float:
            return round(s[min(len(s) - 1, int(p * len(s)))], 2)

        p99 = pct(0.99)
        emit(
            **common,
            case=case,
            samples=len(samples),
            mean_us=round(statistics.fmean(samples), 3),
            p50_us=pct(0.50),
            p99_us=p99,
            p999_us=pct(0.999),
            max_us=round(samples[-1], 1),
            target_p99_us=50.0,
            ok=p99 <= 50.0,
        )
    gc.enable()
    allocator.free(held)
    allocator.close()
    layout.close()


if __name__ == "__main__":
    main()
