"""The one kvcached instance of an SGLang scheduler process, and how it is named.

SGLang runs one scheduler process per tensor-parallel rank; it holds the model runner,
the token-to-KV pool and the allocator, all on one thread. The pool's buffers are
created first (`buffers.py`): that makes the instance here, a `KVCache` over a
`BackingBuffer` of exactly the pool's geometry, one ledger row, one `PageAllocator`.
The allocator SGLang builds next (`allocator.py`) finds it here.

Block `b` of the kvcached allocator is SGLang's page `b` (one token slot when
page_size is 1); page 0 is the padding page (`geometry.PADDING_PAGE`), pinned as soon
as the cache exists.

With tensor parallelism (`tensor_parallel.start_shared`) only rank 0 has the `KVCache`
and allocator; every rank maps its own GPU's memory by replaying rank 0's decisions.
That module builds on this one (`replace`, `SglangInstance`), never the other way.
The instance is held in a `kvcached.supply.InstanceSlot`, as the vLLM adapter's is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvcached import config
from kvcached.allocator import PageAllocator
from kvcached.backing import BackingBuffer, BackingSet
from kvcached.cache import KVCache, start_engine_cache
from kvcached.engines.sglang.capacity import ElasticCapacity, HybridCapacity
from kvcached.engines.sglang.geometry import PoolGeometry
from kvcached.engines.sglang.refusals import Refused
from kvcached.supply import InstanceSlot

log = logging.getLogger("sglang.kvcached")


def instance_name(model: str | None) -> str:
    """KVCACHED_INSTANCE_NAME, else ``sglang-<model folder>-<pid>``."""
    return config.instance_name("sglang", model)


class SglangInstance:
    """An SGLang pool's memory and the capacity its allocator draws from.

    One rank (`start`): a `KVCache` over `backing` (allocator, ledger row, pinned
    padding page) and an `ElasticCapacity`. A tensor-parallel rank
    (`tensor_parallel.start_shared`): `backing` is this rank's own reservation, mapped
    by replaying rank 0's op log; rank 0 alone also has the `KVCache` (over a recording
    backing) and `allocator`.
    """

    def __init__(
        self,
        geometry: PoolGeometry,
        backing: BackingBuffer,
        *,
        cache: KVCache | None,
        allocator: PageAllocator | None,
        capacity: Any,
        owned: tuple[Any, ...] = (),
    ) -> None:
        self.geometry = geometry
        self.backing = backing  # the views SGLang's kernels use are over this
        self.cache = cache
        self.allocator = allocator
        #: what SGLang's allocator draws from: an ElasticCapacity or a SharedCapacity
        self.capacity = capacity
        #: SGLang's last usable page id (the rounding up to whole page ids is not)
        self.last_page = geometry.last_page
        self._owned = owned  # closed after the cache (a replica, a recording backing)
        self.closed = False
        self.pool_allocator: Any = None  # SGLang's allocator, once built (allocator.py)
        self.tree_cache: Any = None  # the scheduler's radix cache, once seen (lifecycle.py)
        #: a hybrid sliding-window model's second pool (`swa.py`): the window layers'
        self.window: WindowPool | None = None

    @property
    def name(self) -> str:
        return "follower" if self.cache is None else str(self.cache.account.name)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            stop = getattr(self.capacity, "stop", None)
            if callable(stop):
                stop()  # no rank waits for the others any more
            if self.cache is not None:
                self.cache.close()  # its fixed charge (a Mamba state pool's) too
        finally:
            for thing in self._owned:
                thing.close()

    def __repr__(self) -> str:
        return f"SglangInstance({self.name}, {self.capacity!r})"


def single(
    geometry: PoolGeometry, backend: Any, *, name: str, fixed_bytes: int = 0
) -> SglangInstance:
    """One rank's instance; `fixed_bytes` (a Mamba state pool SGLang allocated itself,
    `mamba.py`) is charged to its row at once, or the start is refused."""
    backing = geometry.backing(backend)
    cache = KVCache(layout=backing, name=name, engine="sglang", backend=backend)
    allocator = start_engine_cache(cache, "SGLang's padding page")
    try:
        charge_state(cache, fixed_bytes)
    except BaseException:
        cache.close()
        raise
    capacity = ElasticCapacity(
        allocator, last_page=geometry.last_page, page_size=geometry.page_size
    )
    return SglangInstance(geometry, backing, cache=cache, allocator=allocator, capacity=capacity)


def charge_state(cache: KVCache, fixed_bytes: int) -> None:
    """Charge a Mamba state pool SGLang allocated itself (`mamba.py`; one rank's copy,
    every rank's device charged for its own), or refuse the start."""
    if not fixed_bytes or cache.charge_fixed(fixed_bytes):
        return
    rows = [cache.account] + [row for _, row in cache.other_rows]
    headroom = min(
        row.headroom() if row.limit is None else min(row.headroom(), row.limit - row.reserved)
        for row in rows
    )
    raise Refused(
        f"SGLang's Mamba state pool holds {fixed_bytes} bytes, but the instance's "
        f"limit or the device budget has room for {headroom} more"
        + (" on its fullest device" if len(rows) > 1 else "")
        + "; raise KVCACHED_INSTANCE_LIMIT or the budget (kvctl budget), or lower "
        "--max-mamba-cache-size / --max-running-requests"
    )


@dataclass(frozen=True)
class WindowPool:
    """The sliding-window layers' pool of a hybrid model (`swa.py`): group 1 of the
    instance's cache, page ids of its own, its own stock in SGLang's window allocator."""

    geometry: PoolGeometry
    backing: BackingBuffer
    allocator: PageAllocator
    capacity: ElasticCapacity


def hybrid(
    full: tuple[PoolGeometry, BackingBuffer],
    window: tuple[PoolGeometry, BackingBuffer],
    backend: Any,
    *,
    name: str,
) -> SglangInstance:
    """One rank's instance of a hybrid sliding-window model: one cache, one ledger row,
    a group per pool (group 0 the full-attention layers', group 1 the window layers'),
    each with its padding page pinned."""
    # growth one page id at a time: a larger extent mapped for one pool could take the
    # room the joint free counts promised the other (swa.py)
    cache = KVCache(
        layout=BackingSet([full[1], window[1]]),
        name=name,
        engine="sglang",
        backend=backend,
        extent_bytes=backend.granularity,
    )
    allocator = start_engine_cache(cache, "SGLang's padding page")
    window_allocator = cache.allocators[1]
    try:
        if window_allocator.alloc_one() != 0:
            raise Refused(
                "kvcached could not map the window pool's padding page: the instance's "
                "limit or the device budget has no room for one page id "
                f"({window_allocator.group.page_id_bytes} bytes)"
            )
    except BaseException:
        cache.close()
        raise
    window_capacity = ElasticCapacity(
        window_allocator, last_page=window[0].last_page, page_size=window[0].page_size
    )
    capacity = HybridCapacity(
        allocator, window_capacity, last_page=full[0].last_page, page_size=full[0].page_size
    )
    found = SglangInstance(full[0], full[1], cache=cache, allocator=allocator, capacity=capacity)
    found.window = WindowPool(window[0], window[1], window_allocator, window_capacity)
    return found


#: this process's instance, and the model SGLang's sizing step saw (`sizing.py`)
slot: InstanceSlot[SglangInstance] = InstanceSlot()


def replace(make: Callable[[], SglangInstance]) -> SglangInstance:
    """Make this process's instance with `make()`, closing an earlier one first."""
    made = slot.replace(make)
    log.info("kvcached: %s, %r", made.name, made.backing)
    return made


def start(geometry: PoolGeometry, backend: Any, *, model: str | None) -> SglangInstance:
    """Create this process's instance (closing an earlier one)."""
    fixed = slot.planned_fixed_bytes
    return replace(lambda: single(geometry, backend, name=instance_name(model), fixed_bytes=fixed))


def start_hybrid(
    full: tuple[PoolGeometry, BackingBuffer],
    window: tuple[PoolGeometry, BackingBuffer],
    backend: Any,
    *,
    model: str | None,
) -> SglangInstance:
    """Create this process's instance of a hybrid sliding-window model (`hybrid`)."""
    return replace(lambda: hybrid(full, window, backend, name=instance_name(model)))


def current() -> SglangInstance | None:
    return slot.current()


def close() -> None:
    """Close this process's instance: pages unmapped, ledger row removed. Idempotent."""
    slot.close()
