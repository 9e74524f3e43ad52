"""One tensor-parallel rank of tests/test_sglang_tensor_parallel.py (a process of its own).

    python rank.py RANK RENDEZVOUS OUT SCENARIO

Two of these join one gloo group, as SGLang's TP schedulers do, and drive the SGLang
adapter's capacity the way SGLang's allocator does: the same sequence of takes and
gives on every rank (SGLang's replicas allocate in lockstep), with rank 0's news
carried on a broadcast of the "requests" between rounds (`carries_decisions`, around a
plain broadcast standing where SGLang's `_broadcast_reqs_across_ranks` stands). Rank r
reports its device as "r", so each rank's memory goes to its own ledger (host-0,
host-1); rank 1 also hosts a neighbour instance on host-1. Each rank writes what it saw
(ids, counts, its own mappings) to OUT as JSON; the test compares the ranks.

Scenarios: ``shared`` (the adapter's tensor-parallel path), ``alone`` (each rank with
its own allocator, with a different history: what the shared path prevents) and
``upkeep`` (the adapter's elastic allocator methods over a stock, and a limit lowered
on rank 0: rank 0 decides, every rank gives the same stock back, memory is released
on both devices), ``state`` (a hybrid Mamba model's state pool, one per rank: rank 0
charges a copy to each device for the instance's life, each device's limit leaves it
out, and a state that one device has no room for refuses the start on both ranks,
charging neither).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from typing import Any

import torch.distributed as dist

from kvcached.engines.sglang import instance, tensor_parallel
from kvcached.engines.sglang.geometry import PoolGeometry
from kvcached.registry import get_backend

#: 4 segments of 256-byte rows, page size 1: a kvcached page id is 8192 SGLang pages
#: (8 MiB over the 4 segments); the pool holds 8 page ids
GEOMETRY = PoolGeometry(segments=4, rows=8 * 8192, row_bytes=256, page_size=1)
PAGE_ID = 8 * 1024 * 1024
PAGES_PER_ID = 8192


def requests_broadcast(channel: Any) -> Any:
    """Stands where SGLang's request broadcast stands: rank 0's list on every rank."""

    def broadcast(_receiver: Any, reqs: Any) -> Any:
        got = channel.broadcast(reqs)
        return list(got or [])

    return broadcast


def iteration(channel: Any) -> None:
    """One scheduler iteration's broadcast, with rank 0's news if it has any."""
    reqs = [] if channel.is_leader else None
    left = tensor_parallel.carries_decisions(requests_broadcast(channel), None, reqs)
    assert left == [], left  # the news never reaches SGLang's request handling


def mapped_everywhere(found: Any, ids: list[int]) -> bool:
    """Whether every id's rows are backed by memory of this rank in every segment."""
    reservation = found.backing.reservation
    segment = found.backing.group.num_blocks * found.backing.group.block_bytes
    rows = found.geometry.row_bytes
    return all(
        reservation.is_mapped(s * segment + i * rows, rows)
        for i in ids
        for s in range(found.geometry.segments)
    )


def touch(found: Any, ids: list[int], value: int) -> list[int]:
    """Write `value` into the first byte of each id's row in segment 0, read it back."""
    raw = found.backing.raw("uint8")
    rows = found.geometry.row_bytes
    for i in ids[:64]:
        raw[i * rows] = value
    return sorted({int(raw[i * rows]) for i in ids[:64]})


def settled(capacity: Any) -> bool:
    """Rank 0: nothing held but the padding page's page id, and every op acknowledged
    (the pool thread's releases and the helper thread's alike)."""
    local = capacity.local
    return (
        not capacity.releasing()
        and local.allocator.reserved_bytes == PAGE_ID
        and not capacity.recording.pending
    )


def rows_of(name: str | None) -> dict[str, int]:
    """This instance's reserved bytes in each device's ledger, every row's with `name`
    None (read by rank 0)."""
    from kvcached.ledger import Ledger

    out = {}
    for key in ("host-0", "host-1"):
        with Ledger.open(key) as ledger:
            out[key] = sum(r.reserved for r in ledger.rows() if name in (None, r.name))
    return out


class _HostPool:
    """The attributes of SGLang's allocator that the adapter's elastic methods use (a
    stock of page ids in a tensor); SGLang's own allocation kernels are not called."""

    page_size = 1
    device = "cpu"


def upkeep(rank: int, found: Any, channel: Any) -> dict[str, Any]:
    from kvcached import supply
    from kvcached.engines.sglang.allocator import elastic_class

    pool = elastic_class(_HostPool)()
    pool.attach(found.capacity)
    found.pool_allocator, found.tree_cache = pool, None
    seen: dict[str, Any] = {}
    assert pool._top_up(3 * PAGES_PER_ID)  # the stock SGLang's allocations draw from
    iteration(channel)
    seen["stock"] = pool.stock_pages()
    seen["stock_ids"] = pool.free_pages[:: PAGES_PER_ID // 4].tolist()
    seen["mapped_stock"] = mapped_everywhere(found, pool.free_pages.tolist())
    if rank == 0:
        seen["rows_full"] = rows_of(found.cache.account.name)
        found.cache.set_limit(PAGE_ID)  # kvctl limit NAME 8MiB: rank 0's ledgers only
    supply.CHECK_S = 0.0  # every iteration decides (the test waits on it)
    for _ in range(500):
        iteration(channel)  # rank 0 decides "limit"; every rank gives its stock back
        done = channel.broadcast(settled(found.capacity) if rank == 0 else None)
        if done:
            break
        time.sleep(0.01)
    seen["settled"] = bool(done)
    seen["stock_after"] = pool.stock_pages()
    seen["available_after"] = found.capacity.available(pool.stock_pages())
    seen["mappings_after"] = [(o, p.nbytes) for o, p in found.backing.reservation.mappings()]
    if rank == 0:
        seen["rows_after"] = rows_of(found.cache.account.name)
    dist.barrier()
    instance.close()
    return seen


MIB = 1024 * 1024


def state(rank: int, channel: Any) -> dict[str, Any]:
    from kvcached.cache import KVCache
    from kvcached.layout import LayerSpec

    backend = get_backend("host")
    seen: dict[str, Any] = {}
    instance.slot.planned_fixed_bytes = 24 * MIB  # sizing.py's plan, the same on each rank
    found = tensor_parallel.start_shared(
        GEOMETRY, backend, channel, model="tp-mamba", device=str(rank)
    )
    if rank == 0:
        name = found.cache.account.name
        seen["fixed"] = found.cache.fixed_bytes
        seen["rows"] = rows_of(name)  # the state and the padding page's page id, each device
        found.cache.set_limit(48 * MIB)  # kvctl limit: the KV's share is what the state leaves
        seen["kv_limit"] = found.allocator.account.limit
    dist.barrier()
    instance.close()
    dist.barrier()
    if rank == 0:
        seen["totals_closed"] = rows_of(None)
    dist.barrier()

    # a neighbour holds 100 of rank 1's 128 MiB: a 40 MiB state fits rank 0's device only
    neighbour = None
    if rank == 1:
        neighbour = KVCache(
            [LayerSpec(num_kv_heads=1, head_dim=64, dtype="float32")],
            block_size=16, name="neighbour", engine="test", backend=backend, copies={"1": 1},
        )  # fmt: skip
        assert neighbour.charge_fixed(100 * MIB)
    dist.barrier()
    instance.slot.planned_fixed_bytes = 40 * MIB
    try:
        tensor_parallel.start_shared(
            GEOMETRY, backend, channel, model="tp-mamba-big", device=str(rank)
        )
        seen["refused"] = None
    except Exception as exc:
        seen["refused"] = str(exc)
    dist.barrier()
    if rank == 0:
        seen["totals_refused"] = rows_of(None)
    dist.barrier()
    if neighbour is not None:
        neighbour.close()
    return seen


def run(rank: int, scenario: str) -> dict[str, Any]:
    backend = get_backend("host")
    channel = tensor_parallel.ProcessGroupChannel(dist.group.WORLD, leader=0, is_leader=rank == 0)
    if scenario == "state":
        return state(rank, channel)
    if scenario == "upkeep":
        found = tensor_parallel.start_shared(
            GEOMETRY, backend, channel, model="tp", device=str(rank)
        )
        return upkeep(rank, found, channel)
    if scenario == "shared":
        found = tensor_parallel.start_shared(
            GEOMETRY, backend, channel, model="tp", device=str(rank)
        )
    else:
        found = instance.start(GEOMETRY, backend, model=f"alone-{rank}")
        if rank == 1:  # another history: some pages taken and given back in another order
            early = found.capacity.take(3000)
            found.capacity.give(early[::2])
    capacity = found.capacity
    seen: dict[str, Any] = {"rounds": []}
    rng = random.Random(7)  # the same on every rank: SGLang's replicas do the same
    held: list[int] = []
    for _ in range(24):
        if held and rng.random() < 0.4:
            back = rng.sample(held, k=rng.randint(1, len(held)))
            capacity.give(back)
            gone = set(back)
            held = [i for i in held if i not in gone]
            ids: list[int] | None = back
        else:
            ids = capacity.take(rng.randint(500, 6000))
            if ids is not None:
                held += ids
        if scenario == "shared":
            iteration(channel)
        seen["rounds"].append(
            {"ids": ids, "available": capacity.available(0), "held": capacity.held_by_engine(0)}
        )
        if rank == 0 and scenario == "shared":  # after the iteration: releases refunded
            seen.setdefault("rows_by_round", []).append(rows_of(found.cache.account.name))
    seen["mapped_held"] = mapped_everywhere(found, held)
    seen["touched"] = touch(found, held, 40 + rank)
    if scenario != "shared":
        found.close()
        return seen
    seen["mappings"] = [(o, p.nbytes) for o, p in found.backing.reservation.mappings()]

    # a neighbour on rank 1's device takes most of its budget: both ranks' counts drop
    # to what that device has left, and a take that only rank 0's device could supply
    # fails on both (nothing is over-committed on host-1)
    neighbour = None
    if rank == 1:
        from kvcached.cache import KVCache
        from kvcached.layout import LayerSpec

        neighbour = KVCache(
            [LayerSpec(num_kv_heads=1, head_dim=64, dtype="float32")],
            block_size=16,
            name="neighbour",
            engine="test",
            backend=backend,
            copies={"1": 1},
        )
        while neighbour.alloc(512) is not None:  # 4 KiB blocks: 2 MiB at a time
            pass  # until host-1's budget is spent
    dist.barrier()
    time.sleep(0.05)  # rank 0's count is cached for a few milliseconds
    before = capacity.available(0)
    iteration(channel)
    seen["available_before_neighbour"] = before
    seen["available_with_neighbour"] = capacity.available(0)
    seen["too_big"] = capacity.take(capacity.available(0) + PAGES_PER_ID)
    seen["fits"] = capacity.take(100)
    if seen["fits"]:
        held += seen["fits"]
    if rank == 0:
        seen["rows_busy"] = rows_of(found.cache.account.name)

    # everything goes back; rank 0 releases on its helper thread, which waits until every
    # rank has unmapped: the iterations carry the ops and the acknowledgements
    capacity.give(held)
    capacity.release_empty()
    for _ in range(400):
        iteration(channel)
        done = channel.broadcast(settled(capacity) if rank == 0 else None)
        if done:
            break
        time.sleep(0.01)
    iteration(channel)
    seen["released"] = bool(done)
    seen["mappings_after"] = [(o, p.nbytes) for o, p in found.backing.reservation.mappings()]
    if rank == 0:
        seen["rows_idle"] = rows_of(found.cache.account.name)
    seen["available_end"] = capacity.available(0)
    dist.barrier()
    if neighbour is not None:
        neighbour.close()
    instance.close()
    return seen


def main() -> None:
    rank, rendezvous, out, scenario = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    try:
        seen = run(rank, scenario)
    finally:
        dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(seen, f)
    os._exit(0)  # no atexit: the instance is closed already


if __name__ == "__main__":
    main()
