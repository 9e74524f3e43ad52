"""Does mapping from several threads shorten a growth step?

A growth step of a per-layer layout needs one physical handle per layer buffer (72 for
a 36-layer model with separate K and V), and each handle costs a create, a map and a
set-access. This times one such step — one handle of `--handle-mib` in each of
`--buffers` reservations, created and mapped through the public Backend API — done by
1, 2, 4 and 8 threads, and the step back (unmap and release). One JSON line per case:

    {"bench": "parallel_map", "threads": 4, "grow_ms": ..., "shrink_ms": ..., ...}

    python benchmarks/parallel_map.py [--backend cuda] [--buffers 72] [--handle-mib 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import kvcached

MiB = 1 << 20


def step(backend: Any, reservations: list[Any], size: int, pool: ThreadPoolExecutor | None):
    """(grow ms, shrink ms) for one handle per reservation."""
    pages: list[Any] = [None] * len(reservations)

    def grow(i: int) -> None:
        pages[i] = backend.create(size)
        backend.map(reservations[i], 0, pages[i])

    def shrink(i: int) -> None:
        backend.unmap(reservations[i], 0, size)
        backend.release(pages[i])

    indices = range(len(reservations))
    start = time.perf_counter()
    if pool is None:
        for i in indices:
            grow(i)
    else:
        list(pool.map(grow, indices))
    middle = time.perf_counter()
    if pool is None:
        for i in indices:
            shrink(i)
    else:
        list(pool.map(shrink, indices))
    end = time.perf_counter()
    return (middle - start) * 1e3, (end - middle) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default=None)
    parser.add_argument("--buffers", type=int, default=72)
    parser.add_argument("--handle-mib", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    backend = kvcached.get_backend(args.backend)
    size = args.handle_mib * MiB
    reservations = [backend.reserve(size) for _ in range(args.buffers)]
    gib = size * args.buffers / (1 << 30)
    for threads in (1, 2, 4, 8):
        pool = ThreadPoolExecutor(threads) if threads > 1 else None
        step(backend, reservations, size, pool)  # warm-up (thread contexts, driver)
        grows, shrinks = zip(
            *(step(backend, reservations, size, pool) for _ in range(args.rounds)), strict=True
        )
        if pool is not None:
            pool.shutdown()
        grow_ms, shrink_ms = statistics.median(grows), statistics.median(shrinks)
        print(
            json.dumps(
                {
                    "bench": "parallel_map",
                    "backend": backend.name,
                    "threads": threads,
                    "buffers": args.buffers,
                    "handle_mib": args.handle_mib,
                    "gib": round(gib, 3),
                    "grow_ms": round(grow_ms, 3),
                    "shrink_ms": round(shrink_ms, 3),
                    "grow_ms_per_gib": round(grow_ms / gib, 3),
                    "shrink_ms_per_gib": round(shrink_ms / gib, 3),
                }
            ),
            flush=True,
        )
    for reservation in reservations:
        backend.free(reservation)
    backend.close()


if __name__ == "__main__":
    main()
