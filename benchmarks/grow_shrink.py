"""How fast KV capacity grows and shrinks, and how fast freed memory reaches a neighbour.

For a 36-layer, 8-KV-head, head-dim-128 bf16 model (block_size 16; 72 layer buffers),
through the public API of `kvcached.allocator.PageAllocator`:

* ``grow``/``shrink`` via ``resize``: ms to map ~N GiB of capacity and to give it back,
  per extent size (2 MiB is one handle per page id per buffer, the no-extent baseline);
* ``grow``/``shrink`` via ``alloc``: the same driven by an engine's demand: ``alloc`` of
  N GiB of blocks from a cold pool, then ``free`` and ``trim``;
* ``grow``/``shrink`` via ``driver`` and ``driver in place``: the same number of
  handles as one growth step (one per segment) made and mapped, then unmapped and
  released, by the raw driver calls alone, in a range of their own and where the
  allocator puts them: the floor kvcached's figures stand on, in the same run;
* ``handoff``: ms from the moment instance A frees its last block to the moment instance
  B can charge those bytes to its own account (A's pool thread releases the emptied
  extent and refunds it). The accounts come from `kvcached.ledger` when it provides
  one, else from an in-process `LocalBudget` (the line says which).

Targets: <= 2 ms per GiB to grow and to shrink (on an H200 with the cuda backend; the
host backend commits and zeroes RAM, which costs far more). One JSON object per line:

    {"bench": "grow_shrink", "backend": "host", "case": "grow", "via": "resize",
     "extent_mib": 32, "gib": 1.125, "ms": 80.1, "ms_per_gib": 71.2, ...}

    python benchmarks/grow_shrink.py [--backend host|cuda] [--sizes 1,4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from vmm_ops import RAW_DRIVERS  # benchmarks/, this script's folder

import kvcached
from kvcached.accounting import BudgetAccount
from kvcached.allocator import LocalAccount, LocalBudget, PageAllocator
from kvcached.backend import Backend
from kvcached.layout import KVGroup, KVLayout

MiB, GiB = 1 << 20, 1 << 30
LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 36, 8, 128, 16


def emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def model(backend: Backend, max_gib: float) -> KVLayout:
    per_token = 2 * LAYERS * KV_HEADS * HEAD_DIM * 2
    return KVLayout.uniform(
        backend, LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype="bfloat16",
        block_size=BLOCK_SIZE, max_tokens=int(max_gib * GiB) // per_token,
    )  # fmt: skip


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return (time.perf_counter() - start) * 1e3, result


def manual_allocator(group: KVGroup, account: LocalAccount, extent_mib: int) -> PageAllocator:
    """No pool and no background thread: every grow and shrink is the call being timed."""
    return PageAllocator(
        group, account=account, extent_bytes=extent_mib * MiB, pool_low=0, pool_high=0,
        release_delay=0, background=False,
    )  # fmt: skip


def bench_resize(backend: Backend, group: KVGroup, extent_mib: int, gib: float, rounds: int,
                 common: dict[str, Any]) -> None:  # fmt: skip
    account = LocalAccount()
    alloc = manual_allocator(group, account, extent_mib)
    grow, shrink, grown = [], [], 0
    for _ in range(rounds):
        ms, grown = timed(lambda: alloc.resize(int(gib * GiB)))
        grow.append(ms)
        handles = len(alloc.extents()) * len(group.segments)
        ms, left = timed(lambda: alloc.resize(0))
        shrink.append(ms)
        assert left == 0 and account.charged == 0
    alloc.close()
    report(common, "resize", extent_mib, grown, handles, grow, shrink)


def bench_alloc(backend: Backend, group: KVGroup, extent_mib: int, gib: float, rounds: int,
                common: dict[str, Any]) -> None:  # fmt: skip
    account = LocalAccount()
    alloc = manual_allocator(group, account, extent_mib)
    blocks_wanted = -(-int(gib * GiB) // group.block_id_bytes)
    grow, shrink, grown, handles = [], [], 0, 0
    for _ in range(rounds):
        ms, blocks = timed(lambda: alloc.alloc(blocks_wanted))
        assert blocks is not None, "exhausted"
        grow.append(ms)
        grown = alloc.reserved_bytes
        handles = len(alloc.extents()) * len(group.segments)

        def give_back(blocks: list[int] = blocks) -> int:
            alloc.free(blocks)
            return alloc.trim(keep=0)

        ms, _ = timed(give_back)
        shrink.append(ms)
        assert account.charged == 0
    alloc.close()
    report(common, "alloc", extent_mib, grown, handles, grow, shrink)


def bench_driver(backend: Backend, group: KVGroup, extent_mib: int, rounds: int,
                 common: dict[str, Any]) -> None:  # fmt: skip
    """The driver's own floor for one growth step of this model: one handle of
    `extent_mib` per segment, created and mapped (with access granted) by the raw driver
    calls `vmm_ops.py` times, then unmapped and released; no kvcached code between.

    Both rows create every handle first and then map them in the allocator's order, as
    `PageAllocator._build` does: ``driver`` side by side in one range of its own,
    ``driver in place`` where the allocator maps them, at the start of each segment in
    the layout's per-layer reservations. A difference between the two is the
    placement's, and what is left between the second and the allocator's rows is
    kvcached's. (In h100-2026-12-05d and -05e the ``driver`` row made its handles one by one,
    each created then mapped: there the difference is placement and order together.)"""
    raw = RAW_DRIVERS[backend.name](backend)
    size = extent_mib * MiB
    handles = len(group.segments)
    in_place = [reservation.address + offset
                for reservation, offsets in group.reservations for offset in offsets]  # fmt: skip
    for via in ("driver", "driver in place"):
        grow, shrink = [], []
        for _ in range(rounds):
            if via == "driver":
                base = raw.reserve(size * handles, backend.granularity)
                addresses = [base + i * size for i in range(handles)]
            else:
                addresses = in_place
            made: list[Any] = []

            def build(addresses: list[int] = addresses, made: list[Any] = made) -> None:
                made.extend(raw.create(size) for _ in addresses)
                for address, handle in zip(addresses, made, strict=True):
                    raw.map(address, size, handle)

            def tear_down(addresses: list[int] = addresses, made: list[Any] = made) -> None:
                backend.synchronize()  # as the allocator's release does
                for address, handle in zip(addresses, made, strict=True):
                    raw.unmap(address, size)
                    raw.release(handle, size)

            grow.append(timed(build)[0])
            shrink.append(timed(tear_down)[0])
            if via == "driver":
                raw.free(addresses[0], size * handles)
        report(common, via, extent_mib, size * handles, handles, grow, shrink)


def report(common: dict[str, Any], via: str, extent_mib: int, nbytes: int, handles: int,
           grow: list[float], shrink: list[float]) -> None:  # fmt: skip
    gib = nbytes / GiB
    for case, times in (("grow", grow), ("shrink", shrink)):
        ms = statistics.median(times)
        emit(
            **common, case=case, via=via, extent_mib=extent_mib, gib=round(gib, 3),
            handles=handles, ms=round(ms, 3), ms_min=round(min(times), 3),
            ms_per_gib=round(ms / gib, 3), target_ms_per_gib=2.0, ok=ms / gib <= 2.0,
        )  # fmt: skip


@contextmanager
def two_accounts(budget: int) -> Iterator[tuple[BudgetAccount, BudgetAccount, str]]:
    """Two instances' accounts on one device budget: from the ledger if it exists."""
    try:
        from kvcached.ledger import Ledger
    except ImportError:
        shared = LocalBudget(total=budget)
        yield shared.account(), shared.account(), "LocalBudget (no kvcached.ledger)"
        return
    folder = tempfile.mkdtemp(prefix="kvcached-bench-")
    ledger = Ledger.open(f"bench-{os.getpid()}", budget, directory=folder)
    try:
        a = ledger.register("bench-a", "bench")
        b = ledger.register("bench-b", "bench")
        yield a, b, "kvcached.ledger"
        a.close()
        b.close()
    finally:
        ledger.close()
        shutil.rmtree(folder, ignore_errors=True)


def bench_handoff(group: KVGroup, extent_mib: int, rounds: int, release_delay: float,
                  common: dict[str, Any]) -> None:  # fmt: skip
    extent_pages = max(1, extent_mib * MiB // group.page_bytes)
    extent_bytes = extent_pages * group.page_id_bytes
    with two_accounts(extent_bytes + extent_bytes // 2) as (account_a, account_b, kind):
        a = PageAllocator(
            group, account=account_a, extent_bytes=extent_mib * MiB, pool_low=0,
            pool_high=0, release_delay=release_delay, background=True,
        )  # fmt: skip
        times = []
        for _ in range(rounds):
            blocks = a.alloc(extent_pages * group.blocks_per_page)  # one whole extent
            assert blocks is not None, "exhausted"
            assert not account_b.try_charge(extent_bytes)  # the budget is A's now
            start = time.perf_counter()
            a.free(blocks)  # the last block of A
            while not account_b.try_charge(extent_bytes):
                time.sleep(20e-6)  # let A's pool thread run
            times.append((time.perf_counter() - start) * 1e3)
            account_b.refund(extent_bytes)
        a.close()
    ms = statistics.median(times)
    emit(
        **common, case="handoff", account=kind, extent_mib=extent_mib,
        gib=round(extent_bytes / GiB, 3), release_delay_s=release_delay, ms=round(ms, 3),
        ms_min=round(min(times), 3), ms_max=round(max(times), 3),
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default=None, help="host, cuda, ... (default: auto)")
    parser.add_argument("--sizes", default="1,4", help="GiB to grow by, comma-separated")
    parser.add_argument("--extents", default="2,32,64", help="extent sizes in MiB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--handoff-rounds", type=int, default=5)
    args = parser.parse_args()
    sizes = [float(s) for s in args.sizes.split(",")]
    extents = [int(e) for e in args.extents.split(",")]

    backend = kvcached.get_backend(args.backend)
    common = {
        "bench": "grow_shrink",
        "backend": backend.name,
        "model": f"{LAYERS}L x {KV_HEADS}h x {HEAD_DIM}d bf16, block {BLOCK_SIZE}",
        "granularity_mib": backend.granularity / MiB,
    }
    layout = model(backend, max(sizes) * 2 + 8)
    (group,) = layout.groups
    for extent_mib in extents:
        for gib in sizes:
            bench_resize(backend, group, extent_mib, gib, args.rounds, common)
            bench_alloc(backend, group, extent_mib, gib, args.rounds, common)
        if backend.name in RAW_DRIVERS:
            bench_driver(backend, group, extent_mib, args.rounds, common)
    for extent_mib in extents[-1:]:
        for delay in (0.0, 1.0):
            bench_handoff(group, extent_mib, args.handoff_rounds, delay, common)
    layout.close()


if __name__ == "__main__":
    main()
