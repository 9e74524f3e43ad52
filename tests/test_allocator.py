"""Page allocator: page-aware allocation, growth in extents, limits, the pool, exhaustion."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest

from kvcached.allocator import LocalAccount, LocalBudget, PageAllocator
from kvcached.backend import Page
from kvcached.backends.host import HostBackend
from kvcached.errors import InvalidArgument
from kvcached.layout import KVGroup, KVLayout

G = 4096  # host granularity: one page id per segment is one OS page
BPP = 16  # 2 heads x 16 dims x fp16 x 4 tokens = 256 B blocks, 16 per 4 KiB page
SEGMENTS = 4  # K and V of 2 layers
PAGE_ID = SEGMENTS * G  # physical bytes of one page id


class CountingHost(HostBackend):
    """A host backend that records its driver calls, the thread that made each, and
    whether the watched allocator's lock was held during any of them."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.calls: list[tuple[str, str]] = []
        self.map_batches: list[int] = []
        self.watch: PageAllocator | None = None
        self.lock_held_in_driver = False
        self.create_delay = 0.0

    def _note(self, name: str) -> None:
        self.calls.append((name, threading.current_thread().name))
        if self.watch is not None and self.watch._lock.locked():
            self.lock_held_in_driver = True

    def synchronize(self) -> None:
        self._note("sync")

    def _create(self, nbytes: int) -> Any:
        self._note("create")
        if self.create_delay:
            time.sleep(self.create_delay)
        return super()._create(nbytes)

    def _release(self, handle: Any, nbytes: int) -> None:
        self._note("release")
        super()._release(handle, nbytes)

    def _map_batch(self, items: Sequence[tuple[int, Page]]) -> None:
        self._note("map")
        self.map_batches.append(len(items))
        super()._map_batch(items)

    def _unmap_batch(self, ranges: Sequence[tuple[int, int]]) -> None:
        self._note("unmap")
        super()._unmap_batch(ranges)


@pytest.fixture
def backend() -> Iterator[CountingHost]:
    b = CountingHost(budget=256 << 20, granularity=G)
    yield b
    b.close()


@pytest.fixture
def group(backend: CountingHost) -> Iterator[KVGroup]:
    layout = KVLayout.uniform(
        backend, 2, num_kv_heads=2, head_dim=16, dtype="float16", block_size=4,
        max_tokens=64 * BPP * 4,
    )  # fmt: skip
    (g,) = layout.groups
    assert g.blocks_per_page == BPP and g.page_id_bytes == PAGE_ID and g.num_pages == 64
    yield g
    layout.close()


def make(group: KVGroup, **kwargs: Any) -> PageAllocator:
    kwargs.setdefault("extent_bytes", G)
    kwargs.setdefault("pool_low", 0)
    kwargs.setdefault("pool_high", 0)
    kwargs.setdefault("release_delay", 0)
    kwargs.setdefault("background", False)
    return PageAllocator(group, **kwargs)


def wait_until(predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.005)


def tag(group: KVGroup, block: int, value: int) -> None:
    """Write `value` into every segment's bytes of `block` (through raw views)."""
    backend = group.segments[0].reservation.backend
    for s in group.segments:
        view = backend.view(s.reservation, s.offset + block * group.block_bytes, (64,), "int32")
        view.fill_(value)


def read_tag(group: KVGroup, block: int) -> set[int]:
    backend = group.segments[0].reservation.backend
    values: set[int] = set()
    for s in group.segments:
        view = backend.view(s.reservation, s.offset + block * group.block_bytes, (64,), "int32")
        values.update(int(v) for v in view.unique())
    return values


def check_consistent(alloc: PageAllocator, account: LocalAccount | None = None) -> None:
    """The books of one snapshot balance; with `account` (and nothing running in other
    threads), the account is charged exactly what the allocator holds."""
    st = alloc.stats()
    assert st.used_blocks + st.free_blocks == st.capacity_blocks
    assert st.capacity_blocks == st.mapped_pages * BPP
    assert st.reserved_bytes == st.mapped_pages * PAGE_ID + st.releasing_bytes
    if account is not None:
        assert st.inflight_bytes == st.releasing_bytes == 0
        assert account.charged == st.reserved_bytes
        assert sum(n for _, n in alloc.extents()) == st.mapped_pages


# ---------------------------------------------------------------------------- basics
def test_alloc_and_free(group: KVGroup) -> None:
    account = LocalAccount()
    with make(group, account=account) as alloc:
        blocks = alloc.alloc(40)
        assert blocks is not None and len(set(blocks)) == 40
        assert all(0 <= b < group.num_blocks for b in blocks)
        one = alloc.alloc_one()
        assert one is not None and one not in blocks
        assert alloc.used_blocks == 41
        assert alloc.alloc(0) == []
        check_consistent(alloc, account)
        alloc.free(blocks)
        alloc.free_one(one)
        assert alloc.used_blocks == 0
        check_consistent(alloc, account)
        again = alloc.alloc(41)
        assert again is not None and set(again) == {*blocks, one}  # same pages, reused
    assert account.charged == 0


def test_partly_used_pages_are_filled_first(group: KVGroup) -> None:
    with make(group) as alloc:
        blocks = alloc.alloc(3 * BPP)  # pages 0, 1, 2 full
        assert blocks == list(range(3 * BPP))
        alloc.free(range(0, 5))  # page 0: 5 free
        alloc.free(range(BPP, BPP + 2))  # page 1: 2 free
        alloc.free(range(2 * BPP, 3 * BPP))  # page 2: all free
        first = alloc.alloc_one()
        assert first is not None and group.page_of(first) == 1  # the fewest free blocks
        batch = alloc.alloc(3)
        assert batch is not None
        assert [group.page_of(b) for b in batch] == [1, 0, 0]
        # page 2 stayed whole, so it can go back
        assert alloc.trim(keep=0) == 1 * PAGE_ID
        assert alloc.extents() == [(0, 1), (1, 1)]


def test_fresh_pages_open_at_the_lowest_page_id(group: KVGroup) -> None:
    with make(group, extent_bytes=8 * G) as alloc:
        blocks = alloc.alloc(8 * BPP)
        assert blocks is not None
        alloc.free([b for b in blocks if group.page_of(b) in (2, 5)])
        got = alloc.alloc(BPP + 1)
        assert got is not None
        assert {group.page_of(b) for b in got} == {2, 5}
        assert sum(group.page_of(b) == 2 for b in got) == BPP  # page 2 was used up first


def test_block_ids_from_numpy_are_accepted(group: KVGroup) -> None:
    with make(group) as alloc:
        blocks = alloc.alloc(20)
        assert blocks is not None
        alloc.free(np.array(blocks[:10], dtype=np.int64))
        alloc.free_one(np.int32(blocks[10]))
        assert alloc.used_blocks == 9
        again = alloc.alloc(11)
        assert again is not None and all(type(b) is int for b in again)


# -------------------------------------------------------------------- fast path, locking
def test_warm_pool_fast_path_makes_no_driver_call(backend: CountingHost, group: KVGroup) -> None:
    with make(group, extent_bytes=4 * G, pool_low=8 * PAGE_ID, pool_high=16 * PAGE_ID) as alloc:
        alloc.maintain()
        assert alloc.stats().empty_pages >= 8
        backend.calls.clear()
        held: list[int] = []
        for i in range(2000):
            if i % 3 == 2 and held:
                alloc.free_one(held.pop(random.randrange(len(held))))
            else:
                block = alloc.alloc_one()
                assert block is not None
                held.append(block)
            if len(held) > 5 * BPP:
                alloc.free(held[: 4 * BPP])
                del held[: 4 * BPP]
        batch = alloc.alloc(3 * BPP)
        assert batch is not None
        alloc.free(batch)
        assert backend.calls == []


def test_no_lock_is_held_across_a_driver_call(backend: CountingHost, group: KVGroup) -> None:
    alloc = make(group, extent_bytes=2 * G, pool_low=2 * PAGE_ID, pool_high=4 * PAGE_ID)
    backend.watch = alloc
    blocks = alloc.alloc(10 * BPP)  # growth in the caller
    assert blocks is not None
    alloc.maintain()  # pool refill
    alloc.set_limit(6 * PAGE_ID)  # releases and drains
    alloc.free(blocks)
    alloc.maintain()  # releases drained extents
    alloc.set_limit(None)
    alloc.resize(12 * PAGE_ID)
    alloc.trim(keep=0)
    alloc.resize(0)
    alloc.close()
    assert {name for name, _ in backend.calls} == {"create", "map", "sync", "unmap", "release"}
    assert not backend.lock_held_in_driver


def test_release_waits_for_the_device_before_unmapping(
    backend: CountingHost, group: KVGroup
) -> None:
    # a kernel in flight may still read a block the engine has just freed
    with make(group) as alloc:
        blocks = alloc.alloc(3 * BPP)
        assert blocks is not None
        alloc.free(blocks)
        backend.calls.clear()
        alloc.trim(keep=0)
        names = [name for name, _ in backend.calls]
        assert names[0] == "sync" and names.count("sync") == 1
        assert names.count("unmap") == 3 * 2  # 3 extents x 2 layer reservations


def test_growth_maps_one_page_per_segment_with_one_call_per_layer(
    backend: CountingHost, group: KVGroup
) -> None:
    with make(group, extent_bytes=8 * G) as alloc:
        backend.calls.clear()
        assert alloc.alloc_one() is not None
        assert [c for c, _ in backend.calls].count("create") == SEGMENTS
        assert backend.map_batches == [2, 2]  # one map_many per layer, K and V together
        assert alloc.extents() == [(0, 8)]
        assert alloc.reserved_bytes == 8 * PAGE_ID
        for reservation, offsets in group.reservations:
            assert reservation.mappings() and len(reservation.mappings()) == len(offsets)
            for offset in offsets:
                assert reservation.is_mapped(offset, 8 * G)
                assert not reservation.is_mapped(offset + 8 * G, G)
        # the next extent comes only once these 8 page ids are used up
        assert alloc.alloc(8 * BPP - 1) is not None
        assert alloc.extents() == [(0, 8)]
        assert alloc.alloc_one() is not None
        assert alloc.extents() == [(0, 8), (8, 8)]


# ------------------------------------------------------------------------- exhaustion
def test_own_limit_exhausts_cleanly(group: KVGroup) -> None:
    account = LocalAccount()
    with make(group, account=account, extent_bytes=4 * G, limit=6 * PAGE_ID) as alloc:
        blocks = alloc.alloc(6 * BPP)  # 4 + 2 page ids: the second extent is cut to fit
        assert blocks is not None
        assert alloc.extents() == [(0, 4), (4, 2)]
        assert alloc.alloc_one() is None
        assert alloc.alloc(3) is None
        assert alloc.used_blocks == 6 * BPP
        check_consistent(alloc, account)
        alloc.free(blocks[:3])
        assert alloc.alloc(3) is not None
        assert alloc.alloc(1000 * BPP) is None  # more than the virtual range: exhausted too
        check_consistent(alloc, account)


def test_a_request_the_limit_can_never_hold_maps_nothing(
    backend: CountingHost, group: KVGroup
) -> None:
    with make(group, limit=10 * PAGE_ID) as alloc:
        assert alloc.alloc(10 * BPP + 1) is None
        assert alloc.alloc(group.num_blocks + 1) is None
        assert alloc.reserved_bytes == 0 and backend.calls == []
        assert alloc.alloc(10 * BPP) is not None


def test_account_and_shared_budget_exhaust_cleanly(backend: CountingHost) -> None:
    layout = KVLayout.uniform(
        backend, 2, num_kv_heads=2, head_dim=16, dtype="float16", block_size=4, max_tokens=4096
    )
    (group,) = layout.groups
    budget = LocalBudget(total=8 * PAGE_ID)
    a_account, b_account = budget.account(), budget.account(limit=3 * PAGE_ID)
    a = make(group, account=a_account, extent_bytes=2 * G)
    layout2 = KVLayout.uniform(
        backend, 2, num_kv_heads=2, head_dim=16, dtype="float16", block_size=4, max_tokens=4096
    )
    b = make(layout2.groups[0], account=b_account, extent_bytes=2 * G)
    b_blocks = b.alloc(3 * BPP)
    assert b_blocks is not None
    assert b.alloc_one() is None  # b's own account limit
    a_blocks = a.alloc(5 * BPP)
    assert a_blocks is not None
    assert a.alloc_one() is None  # the shared budget is spent
    assert budget.charged == 8 * PAGE_ID
    b.free(b_blocks)
    assert b.trim(keep=0) == 3 * PAGE_ID
    assert a.alloc(3 * BPP) is not None  # b's bytes went back to the budget
    check_consistent(a, a_account)
    check_consistent(b, b_account)
    a.close()
    b.close()
    assert budget.charged == 0
    layout.close()
    layout2.close()


def test_backend_out_of_memory_is_exhausted_with_nothing_lost() -> None:
    # the device holds 3 page ids; the allocator and its account know nothing of it
    backend = HostBackend(budget=256 << 20, granularity=G, memory_limit=3 * PAGE_ID)
    layout = KVLayout.uniform(
        backend, 2, num_kv_heads=2, head_dim=16, dtype="float16", block_size=4, max_tokens=4096
    )
    (group,) = layout.groups
    account = LocalAccount()
    alloc = make(group, account=account, extent_bytes=8 * G)
    blocks = alloc.alloc(BPP)  # 8 page ids fail, 4 fail, 2 fit
    assert blocks is not None
    assert alloc.extents() == [(0, 2)]
    for b in blocks:
        tag(group, b, b + 1)
    more = alloc.alloc(2 * BPP)  # needs a third page id: 8, 4, 2 fail, 1 fits
    assert more is not None
    assert alloc.extents() == [(0, 2), (2, 1)]
    assert alloc.alloc_one() is None  # the device is full
    assert alloc.alloc(5) is None
    assert alloc.used_blocks == 3 * BPP
    assert account.charged == alloc.reserved_bytes == backend.created_bytes == 3 * PAGE_ID
    assert all(read_tag(group, b) == {b + 1} for b in blocks)  # nothing lost
    alloc.free(more[:2])
    assert alloc.alloc(2) is not None
    alloc.close()
    assert account.charged == 0 and backend.created_bytes == 0
    layout.close()
    backend.close()


# ---------------------------------------------------------------------------- limits
def test_lowering_the_limit_releases_free_extents_and_drains_busy_ones(group: KVGroup) -> None:
    account = LocalAccount()
    alloc = make(group, account=account)
    blocks = alloc.alloc(3 * BPP)  # page ids 0, 1, 2 full
    assert blocks is not None
    alloc.resize(6 * PAGE_ID)  # and 3 empty ones
    assert alloc.reserved_bytes == 6 * PAGE_ID
    for b in blocks:
        tag(group, b, 1000 + b)
    assert alloc.set_limit(4 * PAGE_ID)  # empty extents go at once, highest first
    assert alloc.extents() == [(0, 1), (1, 1), (2, 1), (3, 1)]
    assert not alloc.set_limit(2 * PAGE_ID)  # must wait for one busy page id
    st = alloc.stats()
    assert st.draining_extents == 1 and st.reserved_bytes == 3 * PAGE_ID
    assert alloc.extents() == [(0, 1), (1, 1), (2, 1)]  # a page in use is never unmapped
    assert all(read_tag(group, b) == {1000 + b} for b in blocks)
    assert alloc.alloc_one() is None  # nothing from the draining extent, and no growth
    draining = [b for b in blocks if group.page_of(b) == 2]  # the highest of equals
    alloc.free(draining[:-1])
    alloc.maintain()
    assert alloc.reserved_bytes == 3 * PAGE_ID  # still one block busy
    alloc.free_one(draining[-1])
    alloc.maintain()
    assert alloc.reserved_bytes == 2 * PAGE_ID == account.charged
    assert alloc.extents() == [(0, 1), (1, 1)]
    assert all(read_tag(group, b) == {1000 + b} for b in blocks if group.page_of(b) < 2)
    check_consistent(alloc, account)
    alloc.close()


def test_shrink_waits_for_busy_pages(group: KVGroup) -> None:
    alloc = make(group, background=True)
    blocks = alloc.alloc(4 * BPP)
    assert blocks is not None
    outcome: list[bool] = []
    started = threading.Event()

    def shrink() -> None:
        started.set()
        outcome.append(alloc.set_limit(2 * PAGE_ID, wait=True, timeout=30))

    waiter = threading.Thread(target=shrink)
    waiter.start()
    started.wait()
    wait_until(lambda: alloc.stats().draining_extents == 2)
    assert not outcome  # it is waiting, and the busy pages are still mapped
    assert alloc.reserved_bytes == 4 * PAGE_ID
    keep = [b for b in blocks if group.page_of(b) < 2]
    alloc.free([b for b in blocks if group.page_of(b) >= 2])
    waiter.join(30)
    assert outcome == [True]
    assert alloc.reserved_bytes <= 2 * PAGE_ID
    assert all(alloc.is_allocated(b) for b in keep)
    alloc.close()


def test_raising_the_limit_again_puts_draining_extents_back(group: KVGroup) -> None:
    with make(group) as alloc:
        blocks = alloc.alloc(3 * BPP - 4)
        assert blocks is not None
        alloc.set_limit(1 * PAGE_ID)
        assert alloc.stats().draining_extents == 2
        assert alloc.alloc_one() is None
        alloc.set_limit(None)
        st = alloc.stats()
        assert st.draining_extents == 0 and st.available_blocks == 4
        got = alloc.alloc(4)
        assert got is not None and {group.page_of(b) for b in got} == {2}


def test_raising_the_limit_to_exactly_what_is_held_puts_every_draining_extent_back(
    group: KVGroup,
) -> None:
    with make(group) as alloc:
        blocks = alloc.alloc(3 * BPP)  # three extents of one page id, all busy
        assert blocks is not None
        assert not alloc.set_limit(1 * PAGE_ID)
        assert alloc.stats().draining_extents == 2
        assert alloc.set_limit(3 * PAGE_ID)  # what is held fits exactly: nothing drains
        assert alloc.stats().draining_extents == 0
        alloc.free(blocks[-4:])
        got = alloc.alloc(4)  # out of the last extent again; no room to grow
        assert got is not None and {group.page_of(b) for b in got} == {2}


class HeadroomAccount(LocalAccount):
    """A `LocalAccount` that tells its budget's headroom, as a ledger row does."""

    def headroom(self) -> int:
        total = self._budget.total
        assert total is not None
        return total - self._budget.charged


def test_the_obtainable_count_stops_at_the_device_budgets_headroom(group: KVGroup) -> None:
    budget = LocalBudget(total=5 * PAGE_ID)
    neighbour = budget.account()  # another instance on the same device
    with make(group, account=HeadroomAccount(budget=budget)) as alloc:
        assert alloc.alloc(BPP // 2) is not None  # page id 0, half used
        assert neighbour.try_charge(3 * PAGE_ID)  # the budget has room for one more
        # no limit of this allocator would stop it: only the budget does
        assert alloc.obtainable_blocks() == BPP // 2 + BPP
        assert alloc.alloc(BPP // 2 + BPP) is not None
        assert alloc.alloc_one() is None  # the count was exact
        assert alloc.obtainable_blocks() == 0
        neighbour.refund(3 * PAGE_ID)
        assert alloc.obtainable_blocks() == 3 * BPP


class GrowsWhileAsked(HeadroomAccount):
    """Reads its headroom, then lets `during` run before answering: another thread's
    growth charging the account while the count reads it (Note [An in-flight page is
    counted once])."""

    during: Any = None

    def headroom(self) -> int:
        room = super().headroom()
        during, self.during = self.during, None
        if during is not None:
            during()
        return room


def test_a_page_charged_while_the_count_reads_the_headroom_is_counted_once(
    group: KVGroup,
) -> None:
    budget = LocalBudget(total=4 * PAGE_ID)
    account = GrowsWhileAsked(budget=budget)
    with make(group, account=account) as alloc:
        assert alloc.alloc(BPP) is not None  # page id 0, full: three page ids of room
        assert alloc.obtainable_blocks() == 3 * BPP
        # as the pool thread maps ahead: one page id claimed, charged and mapped while
        # the count holds a headroom read before its charge
        account.during = lambda: alloc._grow(1, alloc._limit_now(), ahead=True)
        assert alloc.obtainable_blocks() == 3 * BPP  # not 4: that page id is one of three
        assert alloc.reserved_bytes == 2 * PAGE_ID
        got = alloc.alloc(3 * BPP)
        assert got is not None and alloc.alloc_one() is None  # the count was exact


def test_the_account_limit_is_followed_at_runtime(group: KVGroup) -> None:
    account = LocalAccount()
    alloc = make(group, account=account, background=True, poll_interval=0.01)
    blocks = alloc.alloc(2 * BPP)
    assert blocks is not None
    assert alloc.resize(5 * PAGE_ID) == 5 * PAGE_ID  # a floor the pool keeps
    account.limit = 3 * PAGE_ID  # as kvctl would, from another process
    wait_until(lambda: alloc.reserved_bytes <= 3 * PAGE_ID)
    assert alloc.effective_limit == 3 * PAGE_ID
    assert all(alloc.is_allocated(b) for b in blocks)
    assert alloc.alloc(BPP) is not None
    assert alloc.alloc_one() is None  # at the account's limit
    account.limit = None
    assert alloc.alloc_one() is not None
    alloc.close()
    assert account.charged == 0


def test_resize_counts_growth_in_flight_only_once_it_has_landed(
    backend: CountingHost, group: KVGroup
) -> None:
    # regression (a CI flake): the pool thread grew toward resize's new floor while
    # resize ran; resize counted that growth as held and returned the bytes held
    # before it landed, one page id short
    with make(group) as alloc:
        assert alloc.alloc(2 * BPP) is not None
        backend.create_delay = 0.5
        grower = threading.Thread(target=alloc.alloc, args=(BPP,))
        grower.start()
        wait_until(lambda: alloc.stats().inflight_bytes > 0)
        assert alloc.resize(3 * PAGE_ID) == 3 * PAGE_ID == alloc.reserved_bytes
        grower.join()


# ------------------------------------------------------------------------------ pool
def test_background_thread_refills_the_pool(backend: CountingHost, group: KVGroup) -> None:
    alloc = make(
        group, background=True, pool_low=3 * PAGE_ID, pool_high=6 * PAGE_ID, extent_bytes=2 * G
    )
    wait_until(lambda: alloc.stats().empty_pages >= 3)
    assert {thread for _, thread in backend.calls} == {"kvcached-pool-" + group.name}
    backend.calls.clear()
    blocks = alloc.alloc(3 * BPP)  # takes the pool below its low watermark, no driver call
    assert blocks is not None
    assert backend.calls == [] or all(
        t != threading.current_thread().name for _, t in backend.calls
    )
    wait_until(lambda: alloc.stats().empty_pages >= 3)
    assert backend.calls and all(t.startswith("kvcached-pool") for _, t in backend.calls)
    alloc.close()


class ReportingAccount(LocalAccount):
    """A `LocalAccount` that notes the thread of every `set_used`: the last step of a
    round of upkeep."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.reported_by: list[str] = []

    def set_used(self, nbytes: int) -> None:
        self.reported_by.append(threading.current_thread().name)
        super().set_used(nbytes)


def test_a_drained_extent_that_empties_wakes_the_pool_thread(
    backend: CountingHost, group: KVGroup
) -> None:
    # The pool thread polls once an hour here: only the wake that the last free gives
    # can make it release the drained extent within the wait below.
    account = ReportingAccount()
    pool_thread = "kvcached-pool-" + group.name
    with make(group, account=account, background=True, poll_interval=3600) as alloc:
        wait_until(lambda: pool_thread in account.reported_by)  # its first round is over
        blocks = alloc.alloc(2 * BPP)  # page ids 0 and 1, an extent each
        assert blocks is not None
        account.limit = 1 * PAGE_ID
        alloc.maintain()  # drains page id 1 from this thread; the pool thread sleeps on
        assert alloc.stats().draining_extents == 1
        draining = [b for b in blocks if group.page_of(b) == 1]
        alloc.free(draining[:-1])
        alloc.free_one(draining[-1])  # the drained extent is empty now
        wait_until(lambda: alloc.reserved_bytes == 1 * PAGE_ID, timeout=10)
        assert ("release", pool_thread) in backend.calls
        assert account.charged == 1 * PAGE_ID


def test_pool_gives_back_empty_extents_above_its_high_watermark(group: KVGroup) -> None:
    account = LocalAccount()
    with make(group, account=account, pool_low=2 * PAGE_ID, pool_high=3 * PAGE_ID) as alloc:
        alloc.maintain()
        assert alloc.stats().empty_pages == 2
        blocks = alloc.alloc(8 * BPP)
        assert blocks is not None
        alloc.maintain()  # refills to the low watermark
        assert alloc.stats().empty_pages == 2
        alloc.free(blocks[: 5 * BPP])  # 7 empty page ids, over the high watermark
        alloc.maintain()
        st = alloc.stats()
        assert st.empty_pages == 2  # released down to the low one, the highest first
        assert st.reserved_bytes == 5 * PAGE_ID == account.charged
        assert [start for start, _ in alloc.extents()] == [0, 1, 5, 6, 7]
        # stable: another round changes nothing
        assert alloc.maintain() == 0


def test_pool_does_not_give_back_what_a_waiting_alloc_grew(
    backend: CountingHost, group: KVGroup
) -> None:
    # regression: with pool_high 0, a pool round running while an alloc grew its second
    # extent released the first one (empty, not taken yet), and the alloc grew it again
    with make(group, extent_bytes=G) as alloc:
        seen: list[list[tuple[int, int]]] = []
        creates = 0
        original = backend._create

        def create(nbytes: int) -> Any:
            nonlocal creates
            creates += 1
            if creates == SEGMENTS + 1:  # the second extent starts: a pool round runs
                seen.append(alloc.extents())
                alloc.maintain()
            return original(nbytes)

        backend._create = create  # type: ignore[method-assign]
        assert alloc.alloc(2 * BPP) is not None
        assert seen == [[(0, 1)]]
        assert alloc.extents() == [(0, 1), (1, 1)]
        assert creates == 2 * SEGMENTS


def test_the_pool_gives_back_only_after_the_release_delay(group: KVGroup) -> None:
    with make(group, pool_low=1 * PAGE_ID, pool_high=2 * PAGE_ID, release_delay=3600) as alloc:
        blocks = alloc.alloc(6 * BPP)
        assert blocks is not None
        alloc.free(blocks)
        for _ in range(3):
            assert alloc.maintain() == 0  # over the high watermark, but not for long
        assert alloc.reserved_bytes == 6 * PAGE_ID
        assert alloc.trim() == 5 * PAGE_ID  # an explicit trim does not wait
        assert alloc.reserved_bytes == 1 * PAGE_ID


def test_refill_stops_at_the_limit(group: KVGroup) -> None:
    with make(group, limit=2 * PAGE_ID, pool_low=5 * PAGE_ID, pool_high=8 * PAGE_ID) as alloc:
        alloc.maintain()
        assert alloc.reserved_bytes == 2 * PAGE_ID


def test_resize_and_trim(backend: CountingHost, group: KVGroup) -> None:
    account = LocalAccount()
    with make(group, account=account, extent_bytes=4 * G) as alloc:
        assert alloc.resize(10 * PAGE_ID) == 10 * PAGE_ID  # 4 + 4 + 2
        assert alloc.extents() == [(0, 4), (4, 4), (8, 2)]
        assert alloc.stats().floor == 10 * PAGE_ID
        alloc.maintain()
        assert alloc.reserved_bytes == 10 * PAGE_ID  # the pool keeps the floor
        blocks = alloc.alloc(BPP)
        assert blocks is not None
        assert alloc.trim(keep=0) == 0  # the floor holds
        assert alloc.resize(3 * PAGE_ID) == 4 * PAGE_ID  # the busy first extent stays
        assert alloc.trim(keep=0) == 0
        alloc.free(blocks)
        assert alloc.resize(0) == 0
        assert account.charged == 0


def test_used_bytes_are_reported_to_the_account(group: KVGroup) -> None:
    account = LocalAccount()
    with make(group, account=account) as alloc:
        blocks = alloc.alloc(10)
        assert blocks is not None
        alloc.maintain()
        assert account.used == 10 * group.block_id_bytes
        alloc.free(blocks)
        alloc.maintain()
        assert account.used == 0


# --------------------------------------------------------------------------- bad input
def test_bad_frees_change_nothing(group: KVGroup) -> None:
    with make(group) as alloc:
        blocks = alloc.alloc(20)
        assert blocks is not None
        before = alloc.stats()
        with pytest.raises(InvalidArgument, match="not allocated"):
            alloc.free([blocks[0], 500])
        with pytest.raises(InvalidArgument, match="twice"):
            alloc.free([blocks[1], blocks[1]])
        with pytest.raises(InvalidArgument, match="not allocated"):
            alloc.free([blocks[2], -1])
        with pytest.raises(InvalidArgument, match="int"):
            alloc.free([blocks[3], 1.5])  # type: ignore[list-item]
        with pytest.raises(InvalidArgument, match="int"):
            alloc.free(["a"])  # type: ignore[list-item]
        with pytest.raises(InvalidArgument, match="iterable"):
            alloc.free(None)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match="not allocated"):
            alloc.free_one(500)
        with pytest.raises(InvalidArgument, match="int"):
            alloc.free_one(2.0)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match="int"):
            alloc.free_one(True)
        assert alloc.stats() == before
        assert all(alloc.is_allocated(b) for b in blocks)
        alloc.free(blocks)
        with pytest.raises(InvalidArgument, match="not allocated"):
            alloc.free_one(blocks[0])  # double free
        with pytest.raises(InvalidArgument, match="count"):
            alloc.alloc(-1)
        with pytest.raises(InvalidArgument, match="count"):
            alloc.alloc(2.0)  # type: ignore[arg-type]


def test_bad_construction(group: KVGroup) -> None:
    with pytest.raises(InvalidArgument, match="KVGroup"):
        PageAllocator(object())  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="BudgetAccount"):
        PageAllocator(group, account=object())  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="pool_high"):
        make(group, pool_low=2 * PAGE_ID, pool_high=PAGE_ID)
    with pytest.raises(InvalidArgument, match="extent_bytes"):
        make(group, extent_bytes=-1)
    with pytest.raises(InvalidArgument, match="poll_interval"):
        make(group, poll_interval=0)
    with pytest.raises(InvalidArgument, match="release_delay"):
        make(group, release_delay=-1)
    with make(group) as alloc:
        with pytest.raises(InvalidArgument, match="limit"):
            alloc.set_limit(-5)
        with pytest.raises(InvalidArgument, match="resize"):
            alloc.resize(-1)


def test_settings_give_the_defaults(group: KVGroup, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvcached.config import reload_settings

    monkeypatch.setenv("KVCACHED_EXTENT_SIZE", str(4 * G))
    monkeypatch.setenv("KVCACHED_POOL_LOW", "0")
    monkeypatch.setenv("KVCACHED_POOL_HIGH", str(8 * PAGE_ID))
    reload_settings()
    with PageAllocator(group, background=False) as alloc:
        assert alloc.alloc_one() is not None
        assert alloc.extents() == [(0, 4)]
        assert alloc.maintain() == 0  # pool_low 0: nothing mapped ahead


# ---------------------------------------------------------------------------- lifetime
def test_close_returns_everything(backend: CountingHost) -> None:
    layout = KVLayout.uniform(
        backend, 3, num_kv_heads=2, head_dim=16, dtype="float16", block_size=4, max_tokens=4096
    )
    account = LocalAccount()
    alloc = PageAllocator(
        layout.groups[0], account=account, extent_bytes=2 * G, pool_low=2 * PAGE_ID,
        pool_high=4 * PAGE_ID,
    )  # fmt: skip
    blocks = alloc.alloc(50)
    assert blocks is not None
    wait_until(lambda: alloc.stats().empty_pages >= 2)
    alloc.close()
    assert account.charged == 0 and account.used == 0
    assert backend.live_counts == (3, 0) and backend.created_bytes == 0
    assert all(not r.mappings() for r, _ in layout.groups[0].reservations)
    with pytest.raises(InvalidArgument, match="closed"):
        alloc.alloc(1)
    with pytest.raises(InvalidArgument, match="closed"):
        alloc.alloc_one()
    alloc.free(blocks)  # a no-op after close
    alloc.free_one(blocks[0])
    alloc.close()  # idempotent
    layout.close()
    assert backend.live_counts == (0, 0)


# ------------------------------------------------------------------------- concurrency
def test_threads_allocating_and_freeing_never_share_a_block(group: KVGroup) -> None:
    account = LocalAccount(limit=40 * PAGE_ID)
    alloc = make(
        group, account=account, background=True, extent_bytes=2 * G, pool_low=2 * PAGE_ID,
        pool_high=6 * PAGE_ID, poll_interval=0.005,
    )  # fmt: skip
    owners: dict[int, int] = {}
    owners_lock = threading.Lock()
    errors: list[str] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        mine: list[int] = []
        for _ in range(1500):
            op = rng.random()
            if op < 0.3:
                got = alloc.alloc(rng.randint(1, 40))
            elif op < 0.55:
                one = alloc.alloc_one()
                got = None if one is None else [one]
            else:
                got = None
                if mine:
                    rng.shuffle(mine)
                    cut = rng.randint(1, len(mine))
                    give, mine[:] = mine[:cut], mine[cut:]
                    with owners_lock:
                        for b in give:
                            del owners[b]
                    alloc.free(give) if len(give) > 1 else alloc.free_one(give[0])
            if got:
                with owners_lock:
                    for b in got:
                        if b in owners:
                            errors.append(f"block {b} handed to {seed} and {owners[b]}")
                        owners[b] = seed
                mine.extend(got)
            if seed == 0 and rng.random() < 0.01:
                alloc.set_limit(rng.choice([None, 8 * PAGE_ID, 20 * PAGE_ID]))
        with owners_lock:
            for b in mine:
                del owners[b]
        alloc.free(mine)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert alloc.used_blocks == 0
    check_consistent(alloc)  # one snapshot balances even while the pool thread works
    alloc.set_limit(None)
    assert alloc.last_error is None
    alloc.close()
    assert account.charged == 0


def test_concurrent_growth_charges_once_per_extent(backend: CountingHost, group: KVGroup) -> None:
    backend.create_delay = 0.01  # slow driver: the threads overlap in growth
    account = LocalAccount(limit=6 * PAGE_ID)
    alloc = make(group, account=account, extent_bytes=2 * G)
    results: list[list[int] | None] = []

    def grab() -> None:
        results.append(alloc.alloc(2 * BPP))

    threads = [threading.Thread(target=grab) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    won = [r for r in results if r is not None]
    assert len(won) == 3  # 6 page ids hold three requests of two
    assert len({b for r in won for b in r}) == 6 * BPP
    assert account.charged == alloc.reserved_bytes == 6 * PAGE_ID
    check_consistent(alloc, account)
    alloc.close()


# --------------------------------------------------------------------------- accounts
def test_local_account_and_budget() -> None:
    budget = LocalBudget(total=100)
    a, b = budget.account(limit=60), budget.account()
    assert a.try_charge(60) and not a.try_charge(1)
    assert not b.try_charge(41) and b.try_charge(40)
    assert budget.charged == 100 and a.refused == 1 and b.refused == 1
    a.refund(30)
    assert b.try_charge(30) and budget.charged == 100
    with pytest.raises(InvalidArgument, match="refund"):
        a.refund(31)
    a.limit = 10  # lower than charged: no new charge, nothing taken back
    assert not a.try_charge(1) and a.charged == 30
    a.set_used(7)
    assert a.used == 7
    with pytest.raises(InvalidArgument, match="limit"):
        LocalAccount(limit=-1)
    from kvcached.accounting import BudgetAccount

    assert isinstance(a, BudgetAccount)


class GatedHost(CountingHost):
    """A host backend whose maps wait for `gate` while `hold` is set (growth that stays
    in flight: charged, created, not yet mapped), and its unmaps while `hold_unmaps` is
    (a release in flight: unmapping, not yet refunded), for as long as a test needs."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.hold = self.hold_unmaps = False
        self.gate = threading.Event()
        self.entered = threading.Event()

    def _wait_for_the_gate(self, held: bool) -> None:
        if held:
            self.entered.set()
            self.gate.wait(30)

    def _map_batch(self, items: Sequence[tuple[int, Page]]) -> None:
        self._wait_for_the_gate(self.hold)
        super()._map_batch(items)

    def _unmap_batch(self, ranges: Sequence[tuple[int, int]]) -> None:
        self._wait_for_the_gate(self.hold_unmaps)
        super()._unmap_batch(ranges)


@pytest.fixture
def gated() -> Iterator[tuple[GatedHost, KVGroup]]:
    """A GatedHost and one small layer group over it, closed after the test."""
    backend = GatedHost(budget=256 << 20, granularity=G)
    layout = KVLayout.uniform(
        backend, 2, num_kv_heads=2, head_dim=16, dtype="float16", block_size=4,
        max_tokens=64 * BPP * 4,
    )  # fmt: skip
    (group,) = layout.groups
    yield backend, group
    backend.gate.set()
    layout.close()
    backend.close()


def test_pause_growth_waits_for_the_pool_threads_growth_in_flight_and_stops_the_refill(
    gated: tuple[GatedHost, KVGroup],
) -> None:
    # regression: vLLM's sleep capped the allocator while its pool thread was mapping an
    # extent charged a moment before; the extent landed after the trim (and on a GPU
    # during vLLM's own check that its sleep freed memory)
    backend, group = gated
    account = LocalAccount()
    backend.hold = True
    alloc = make(group, account=account, background=True, pool_low=PAGE_ID, pool_high=PAGE_ID)
    try:
        assert backend.entered.wait(30)  # the pool thread's refill: charged, not mapped
        assert account.charged == PAGE_ID and alloc.reserved_bytes == 0
        paused = threading.Thread(target=alloc.pause_growth)
        paused.start()
        paused.join(0.2)
        assert paused.is_alive()  # the growth in flight has not landed: still waiting
        backend.gate.set()
        paused.join(30)
        assert not paused.is_alive() and alloc.growth_paused
        assert alloc.stats().inflight_bytes == 0 and alloc.reserved_bytes == PAGE_ID
        alloc.set_limit(0)  # the sleep's trim: nothing can land after it
        assert alloc.reserved_bytes == 0 and account.charged == 0
        alloc.set_limit(None)
        assert alloc.maintain() == 0  # paused: the pool is not refilled...
        assert alloc.reserved_bytes == 0
        block = alloc.alloc_one()  # ...but an alloc still grows on demand
        assert block is not None and alloc.reserved_bytes == PAGE_ID
        alloc.free([block])
        alloc.set_limit(0)
        alloc.set_limit(None)
        assert alloc.reserved_bytes == 0
        alloc.resume_growth()
        wait_until(lambda: alloc.reserved_bytes == PAGE_ID)  # the refill is back
        assert not alloc.growth_paused
    finally:
        backend.gate.set()
        alloc.close()


def test_wait_released_waits_for_a_release_another_thread_has_in_flight(
    gated: tuple[GatedHost, KVGroup],
) -> None:
    # regression: the serve supervisor lowers a vLLM instance's row limit to 0 and then
    # sleeps it; the pool thread was still unmapping what the limit released, so the
    # sleep returned with those bytes still reserved
    backend, group = gated
    account = LocalAccount()
    alloc = make(group, account=account)
    try:
        block = alloc.alloc_one()
        assert block is not None
        alloc.free([block])
        assert alloc.reserved_bytes == PAGE_ID
        backend.hold_unmaps = True
        trim = threading.Thread(target=alloc.set_limit, args=(0,))
        trim.start()
        assert backend.entered.wait(30)  # that thread's release: unmapping, not refunded
        assert alloc.reserved_bytes == PAGE_ID and alloc.stats().releasing_bytes == PAGE_ID
        waiter = threading.Thread(target=alloc.wait_released)
        waiter.start()
        waiter.join(0.2)
        assert waiter.is_alive()  # the release in flight has not landed: still waiting
        backend.gate.set()
        waiter.join(30)
        trim.join(30)
        assert not waiter.is_alive() and alloc.reserved_bytes == 0 and account.charged == 0
        alloc.wait_released()  # nothing in flight: returns at once
    finally:
        backend.gate.set()
        alloc.close()
