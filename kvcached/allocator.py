"""The page allocator: hands out KV blocks and maps physical memory under them on demand.

How it works
------------
A `KVLayout` group gives the allocator a virtual range per layer buffer (K, V, or a
single buffer) and one page-id space across them: page id `p` is the byte range
`[p * page_bytes, (p + 1) * page_bytes)` of every segment, and holds the blocks
`p * blocks_per_page ... (p + 1) * blocks_per_page - 1`. An engine asks for blocks; the
allocator answers with block ids whose bytes are backed by memory in every layer, and
maps more memory when it runs out. Nothing here knows about engines or devices: blocks
are ints, memory is the `Backend` seam, and the budget is a `BudgetAccount`.

Why extents. A driver charges per physical handle, not per byte, and a handle can only
be mapped whole (`cuMemMap` takes no offset into a handle). On an H200, growing by
one handle (create, map, grant access, and the allocator's bookkeeping) costs 51-58 us through this
allocator whether it holds 2 MiB or 64 MiB, of which 37 us (2 MiB) to 42 us (64 MiB)
are the driver calls (benchmarks/results/h200-2026-11-30/grow_shrink_cuda.jsonl and
vmm_ops_cuda.jsonl; docs/allocator.md). The per-layer layout needs one handle per
segment for every growth step, so a 36-layer model (72 segments) growing 1.125 GiB in
2 MiB pages pays for 576 handles, 29-31 ms in that file, often on the engine's
critical path. So capacity grows in *extents*: a run of
consecutive page ids backed, in each segment, by one physical page of
`npages * page_bytes`, mapped with one `map_many` per layer reservation. In 32 MiB
extents that model grows 2.25 GiB for 72 handles, ~4.4 ms; in 64 MiB extents 4.5 GiB
for the same price. Blocks stay fine-grained (a block is still block_size tokens of one
layer); only the unit of growth and release is large. The extent size is
`KVCACHED_EXTENT_SIZE` per segment (32 MiB by default), rounded to whole page ids.
Near a limit, or when the budget or the device refuses a full extent, an extent is
halved until it fits (down to one page id), so an instance can use its whole allowance.

Note [Release per extent]. A handle cannot be released in part, and a mapping can only
be unmapped whole. Giving back memory finer than an extent would mean re-mapping its
live pages onto smaller handles and copying their bytes while kernels may be reading
them, which needs the engine's cooperation. Instead an extent is released once every
page id in it is empty, and allocation is arranged so that extents do empty: partly used
pages are filled first (the one with the fewest free blocks), and a fresh page is opened
at the lowest page id, so live blocks pack into the low extents while the high ones
drain (Note [Filling pages] in page_book.py); empty extents are released highest first.
Shrinking is therefore per extent, and a smaller extent size trades growth cost for
release granularity.

The pool. Fully free page ids of mapped extents are the pool. A background thread keeps
it between two watermarks (`KVCACHED_POOL_LOW` / `KVCACHED_POOL_HIGH`, in bytes,
converted to page ids): under the low one it maps another extent; over the high one,
once it has stayed there for `KVCACHED_POOL_RELEASE_DELAY` seconds, it releases empty
extents, but never one that would take the pool back under the low watermark. Both the
hysteresis and the delay keep a bursty load from growing and releasing the same extent
in turns; extents that an `alloc` waiting in the slow path has just grown are never
given back under it. The thread sleeps on an event that the fast path sets only when a
page changes state in a way that matters (a fresh page opened with the pool under the
low watermark, or an extent became empty), and it polls the account every
`poll_interval` so that a limit changed by another process (kvctl) is followed. A
refusal the account explains with an error of its own (a damaged ledger) is logged
once, without a traceback, and retried like a refill that failed. The threads stop at
interpreter exit before the accounts they charge are closed
(`_stop_pool_threads_at_exit`).

Fast path. Which blocks are free, which page is filled next and which extents are
empty is the `PageBook` (kvcached/page_book.py, Note [Filling pages] and Note [Page
book invariants]): a data structure with no driver, no lock and no thread, which this
allocator calls under its lock. A single-block alloc or free is one call into it under
one lock (explicit acquire/release: cheaper than `with`), a handful of Python
operations. When the pool is warm, alloc makes no driver call.

Note [Allocator locking]. One lock guards the allocator's state and is never held across
a driver call or an account call. Growth claims a range of page ids and the bytes it
will charge (`inflight`) under the lock, then charges the account, creates and maps
outside it, then commits under the lock. Release claims an empty extent under the lock
(its pages leave every free structure, so no block can be handed out of it); outside it,
it waits for the device (`Backend.synchronize`: a kernel in flight may still touch a
block the engine has just freed, and an unmap does not wait for it), then unmaps,
releases and refunds. Several threads may grow at once into different ranges; a thread
that needs blocks which an in-flight growth will bring waits for it on a condition
instead of growing twice.

Accounting and limits. Bytes are charged to the account before pages are created and
refunded if creating or mapping fails (an `OutOfMemory` from the backend becomes
"exhausted", never an exception) and when an extent is released, so the account's
charge always equals what the allocator holds. The limit is the smallest of the
allocator's own (`set_limit`), the account's (`BudgetAccount.limit`, which may change
at any time) and the virtual range. Growth stays under it. When it drops under what is
held, empty extents are released at once and the emptiest busy ones are *drained*: no
block is handed out of them any more, and each is released when its last block is
freed. A page in use is never unmapped, so a shrink waits for the engine to free its
blocks (`set_limit(..., wait=True)`). `alloc` answers None when the limit, the account
or the device cannot supply the blocks, so the engine can preempt and retry.

Note [An in-flight page is counted once]. `obtainable_blocks` adds the free blocks of
mapped pages to what the budget's headroom still allows to map, and reads the headroom
(an account call) outside the lock. A page claimed for growth is charged to the account
outside the lock too, a moment after its claim. Counted among the free blocks from its
claim on, a page whose charge lands between the headroom's read and the lock would be
counted twice: in the headroom read before the charge, and as free blocks (under a load
that interleaved the pool thread so, an SGLang instance's free count promised one page
id more than its budget held, 2026-12-05). So an in-flight page counts as free blocks
only once its charge has landed (until then its bytes are in the headroom), and a count
reads the headroom again when a charge landed or was refunded while it read it
(`_charge_changes`); one that keeps racing leaves the in-flight pages out.
"""

from __future__ import annotations

import atexit
import logging
import operator
import threading
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvcached import forksafe
from kvcached.accounting import BudgetAccount
from kvcached.backend import Page, Reservation
from kvcached.config import check_extent_bytes, check_release_delay
from kvcached.errors import InvalidArgument, KVCachedError, OutOfMemory
from kvcached.layout import KVGroup
from kvcached.lifetime import Closeable
from kvcached.page_book import Extent, PageBook

log = logging.getLogger("kvcached.allocator")

#: How many times `obtainable_blocks` reads the headroom while charges keep landing
#: (Note [An in-flight page is counted once]).
COUNT_TRIES = 3

#: After the pool could not be refilled (limit, budget or device full), the background
#: thread waits this long before it tries again (an alloc that needs memory still tries).
REFILL_RETRY_S = 0.5


def _check_bytes(what: str, nbytes: object, *, optional: bool = False) -> int | None:
    if nbytes is None and optional:
        return None
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
        raise InvalidArgument(f"{what} must be a non-negative int of bytes, got {nbytes!r}")
    return nbytes


def _bytes(what: str, nbytes: object) -> int:
    checked = _check_bytes(what, nbytes)
    if checked is None:
        raise InvalidArgument(f"{what} must be a non-negative int of bytes, got None")
    return checked


def _pool_settings() -> tuple[int, int, int, float]:
    """(extent size, pool low, pool high, release delay) from KVCACHED_* settings."""
    from kvcached.config import parse_size, settings

    config = settings()

    def size(value: str, what: str) -> int:
        return 0 if value.strip() == "0" else parse_size(value, what=what)

    return (
        size(config.extent_size, "KVCACHED_EXTENT_SIZE"),
        size(config.pool_low, "KVCACHED_POOL_LOW"),
        size(config.pool_high, "KVCACHED_POOL_HIGH"),
        float(config.pool_release_delay),
    )


#: Every allocator alive in this process, so that a forked child can disown them.
_live_allocators: weakref.WeakSet[PageAllocator] = weakref.WeakSet()


def _disown_allocators_in_child(parent: int) -> None:
    for allocator in list(_live_allocators):
        allocator._disown_after_fork(parent)


# after the ledger's and the backends' hooks (Note [fork hook order] in forksafe.py)
forksafe.register(
    "kvcached.allocator", forksafe.Stage.ALLOCATORS, after_in_child=_disown_allocators_in_child
)

#: How long interpreter exit waits for a pool thread in the middle of a round.
EXIT_JOIN_S = 5.0


def _stop_pool_threads_at_exit() -> None:
    """At interpreter exit: stop every pool thread before the accounts it charges go.

    The ledger's own exit hook removes this process's rows, so that a cache never
    closed leaves nothing behind; a pool thread still running then read a closed
    account and printed a traceback. atexit runs the hook registered last first, and
    each pool thread's start moves this one to the end of the list, so it runs before
    every hook registered earlier: the ledger's among them, since an account exists
    before the allocator that charges it."""
    for allocator in list(_live_allocators):
        allocator._stop_pool_thread(EXIT_JOIN_S)


# --------------------------------------------------------------------------- accounts
class LocalBudget:
    """An in-process device budget that several `LocalAccount`s draw from.

    The single-process stand-in for the shared ledger: every account charges against
    `total` (None: unbounded) under one lock.
    """

    def __init__(self, total: int | None = None) -> None:
        self.total = _check_bytes("budget total", total, optional=True)
        self._lock = threading.Lock()
        self._charged = 0
        self._accounts = 0  # accounts made on it (an in-process stand-in never closes one)

    @property
    def charged(self) -> int:
        return self._charged

    def account(self, limit: int | None = None) -> LocalAccount:
        return LocalAccount(limit, budget=self)


class LocalAccount:
    """A `BudgetAccount` kept in this process: a counter, an optional limit, and
    optionally a `LocalBudget` shared with other accounts. Thread safe."""

    def __init__(self, limit: int | None = None, *, budget: LocalBudget | None = None) -> None:
        self._limit = _check_bytes("limit", limit, optional=True)
        self._budget = budget if budget is not None else LocalBudget()
        with self._budget._lock:
            self._budget._accounts += 1
        self._charged = 0
        self._used = 0
        self.refused = 0  # charges turned down, for tests and metrics

    def try_charge(self, nbytes: int) -> bool:
        budget = self._budget
        with budget._lock:
            if self._limit is not None and self._charged + nbytes > self._limit:
                self.refused += 1
                return False
            if budget.total is not None and budget._charged + nbytes > budget.total:
                self.refused += 1
                return False
            self._charged += nbytes
            budget._charged += nbytes
            return True

    def refund(self, nbytes: int) -> None:
        budget = self._budget
        with budget._lock:
            if nbytes > self._charged:
                raise InvalidArgument(f"refund of {nbytes} bytes; only {self._charged} charged")
            self._charged -= nbytes
            budget._charged -= nbytes

    def set_used(self, nbytes: int) -> None:
        self._used = nbytes

    def headroom(self) -> int | None:
        budget = self._budget
        return None if budget.total is None else max(0, budget.total - budget._charged)

    def has_neighbours(self) -> bool:
        return self._budget._accounts > 1

    @property
    def limit(self) -> int | None:
        return self._limit

    @limit.setter
    def limit(self, nbytes: int | None) -> None:
        self._limit = _check_bytes("limit", nbytes, optional=True)

    @property
    def charged(self) -> int:
        """Bytes charged and not refunded: what the instance holds."""
        return self._charged

    @property
    def used(self) -> int:
        """The last value reported through `set_used`."""
        return self._used


# --------------------------------------------------------------------------- allocator
@dataclass(frozen=True)
class AllocatorStats:
    """A consistent snapshot of one allocator (taken under its lock)."""

    capacity_blocks: int  # blocks in mapped page ids (including draining extents)
    used_blocks: int  # blocks handed out and not freed
    free_blocks: int  # counted in the free lists; always capacity_blocks - used_blocks
    available_blocks: int  # free blocks that alloc can hand out (not in draining extents)
    empty_pages: int  # fully free page ids ready for use: the pool
    extents: int
    mapped_pages: int  # page ids in those extents
    draining_extents: int
    reserved_bytes: int  # physical bytes held (charged to the account)
    draining_bytes: int  # part of reserved_bytes waiting for blocks to be freed
    releasing_bytes: int  # part of reserved_bytes being unmapped and refunded right now
    inflight_bytes: int  # growth being charged / created / mapped right now
    used_bytes: int  # used_blocks in bytes, over all segments
    limit: int | None  # the allocator's own limit (the account's may be lower)
    floor: int  # bytes `resize` asked to keep mapped


def _as_block_id(block: Any) -> int:
    """`block` as a plain int (numpy integers welcome); TypeError for anything else."""
    if isinstance(block, bool):
        raise TypeError("a bool is not a block id")
    return operator.index(block)


class PageAllocator(Closeable):
    """Block allocator over one `KVGroup`: page-aware, elastic, thread safe.

    Arguments:
        group: the page-id space to allocate in (`KVLayout.groups[i]`).
        account: charged before memory is created, refunded when it is released
            (default: an unlimited `LocalAccount`).
        limit: the allocator's own cap in bytes (None: only the account's and the
            virtual range's). Change it with `set_limit`.
        extent_bytes: physical page size per segment that capacity grows by
            (default KVCACHED_EXTENT_SIZE), rounded down to whole page ids.
        pool_low, pool_high: bytes of fully free mapped page ids to keep ready, and
            above which empty extents are given back (default KVCACHED_POOL_LOW/HIGH).
        release_delay: seconds the pool must stay above `pool_high` before empty
            extents are given back (default KVCACHED_POOL_RELEASE_DELAY); 0 gives them
            back at once, at the price of grow/release cycles under bursty load.
        background: run the pool thread. Without it nothing is mapped ahead of
            demand, and `maintain()` does the upkeep when called.
        poll_interval: seconds between the thread's looks at the account's limit.

    Invariants: a block id is handed out at most once until freed; used + free =
    capacity (in blocks of mapped page ids); the account holds exactly the bytes of
    the extents the allocator holds (plus growth in flight); growth never passes the
    limit; no page holding a used block is ever unmapped (until `close`).
    """

    def __init__(
        self,
        group: KVGroup,
        *,
        account: BudgetAccount | None = None,
        limit: int | None = None,
        extent_bytes: int | None = None,
        pool_low: int | None = None,
        pool_high: int | None = None,
        release_delay: float | None = None,
        background: bool = True,
        poll_interval: float = 0.05,
    ) -> None:
        if not isinstance(group, KVGroup):
            raise InvalidArgument(f"expected a KVGroup, got {type(group).__name__}")
        if account is not None and not isinstance(account, BudgetAccount):
            raise InvalidArgument(f"{type(account).__name__} does not implement BudgetAccount")
        if not isinstance(poll_interval, (int, float)) or poll_interval <= 0:
            raise InvalidArgument(f"poll_interval must be positive seconds, got {poll_interval!r}")
        # each value is named as the caller gave it: an argument, or its KVCACHED_* variable
        names = {
            "extent": "extent_bytes" if extent_bytes is not None else "KVCACHED_EXTENT_SIZE",
            "low": "pool_low" if pool_low is not None else "KVCACHED_POOL_LOW",
            "high": "pool_high" if pool_high is not None else "KVCACHED_POOL_HIGH",
            "delay": "release_delay"
            if release_delay is not None
            else "KVCACHED_POOL_RELEASE_DELAY",
        }
        if None in (extent_bytes, pool_low, pool_high, release_delay):
            d_extent, d_low, d_high, d_delay = _pool_settings()
            extent_bytes = d_extent if extent_bytes is None else extent_bytes
            pool_low = d_low if pool_low is None else pool_low
            pool_high = d_high if pool_high is None else pool_high
            release_delay = d_delay if release_delay is None else release_delay
        # below one page it is one page; 0, 1 byte or 1 EiB are mistakes, not sizes
        extent = check_extent_bytes(_bytes(names["extent"], extent_bytes), what=names["extent"])
        low, high = _bytes(names["low"], pool_low), _bytes(names["high"], pool_high)
        if high < low:
            raise InvalidArgument(
                f"{names['high']} ({high} bytes) is below {names['low']} ({low} bytes); "
                "accepted: a high watermark at or above the low one"
            )
        release_delay = check_release_delay(release_delay, what=names["delay"])

        self.group = group
        self.backend = group.segments[0].reservation.backend
        self.account: BudgetAccount = account if account is not None else LocalAccount()
        self._limit = _check_bytes("limit", limit, optional=True)
        self._bpp = group.blocks_per_page
        self._page_bytes = group.page_bytes
        self._page_id_bytes = group.page_id_bytes
        self._block_id_bytes = group.block_id_bytes
        self._max_bytes = group.num_pages * group.page_id_bytes
        self._extent_pages = max(1, extent // group.page_bytes)
        self._low_pages = -(-low // self._page_id_bytes)
        self._high_pages = max(self._low_pages, high // self._page_id_bytes)

        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._wake = threading.Event()
        # which blocks are free or used, page by page and extent by extent (under _lock)
        self._book = PageBook(
            group.num_pages,
            self._bpp,
            low_pages=self._low_pages,
            high_pages=self._high_pages,
            signal=self._wake.set,
        )
        self._reserved = 0  # bytes charged for committed extents (and ones being released)
        self._releasing = 0  # part of _reserved being unmapped and refunded
        self._inflight = 0  # bytes claimed by growth not yet committed
        self._inflight_pages = 0
        # Note [An in-flight page is counted once]: of the in-flight pages, those whose
        # charge has landed in the account, and how many times that number changed
        self._charged_inflight_pages = 0
        self._charge_changes = 0
        self._floor = 0
        self._demand = 0  # blocks asked for by allocs that are growing the pool
        self._refill_failed_at = -float("inf")
        self._growth_paused = False  # `pause_growth`: maintain() maps nothing ahead
        self._reported_used = -1
        self._closed = False
        self._forked_from: int | None = None  # the parent's pid, in a forked child
        self.last_error: BaseException | None = None  # last failure of the background thread

        self._poll_interval = float(poll_interval)
        self._release_delay = float(release_delay)
        self._over_high_since: float | None = None  # when the pool went above pool_high
        self._thread: threading.Thread | None = None
        self._thread_stopped = False  # set at interpreter exit: no upkeep from then on
        self._upkeep_warned = ""  # the last refusal the pool thread logged
        _live_allocators.add(self)
        if background:
            atexit.unregister(_stop_pool_threads_at_exit)
            atexit.register(_stop_pool_threads_at_exit)
            self._thread = threading.Thread(
                target=self._run, name=f"kvcached-pool-{group.name}", daemon=True
            )
            self._thread.start()
            self._wake.set()

    def _disown_after_fork(self, parent: int) -> None:
        """In a forked child: refuse every use from now on, and give nothing back.

        The child's copy still points at the parent's pages (the host's are shared
        memory) and its blocks; handing any of them out, or releasing them, would
        corrupt the parent's cache. Its locks may have been held by a thread that does
        not exist in the child, so they are replaced before anything can wait on them."""
        self._forked_from = parent
        self._closed = True
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._wake = threading.Event()
        self._thread = None
        self._book.signal = self._wake.set
        self._book.disown()  # so that every free takes the path that raises

    # =================================================================== fast path
    def alloc_one(self) -> int | None:
        """One block id, or None when no block can be had (limit, budget or device)."""
        lock = self._lock
        lock.acquire()
        try:
            block = self._book.take_one()
        finally:
            lock.release()
        if block is not None:
            return block
        found = self._alloc_slow(1)
        return None if found is None else found[0]

    def alloc(self, n: int) -> list[int] | None:
        """`n` block ids, or None (nothing taken) when they cannot all be had.

        Takes from partly used pages first (fewest free blocks first), then from fresh
        pages at the lowest page ids. If the mapped pages are short, maps more (in the
        caller's thread, without holding the lock) as far as the limit, the account and
        the device allow; None means exhausted: free blocks, or wait, and retry."""
        if type(n) is not int or n < 0:
            raise InvalidArgument(f"alloc needs a non-negative int count, got {n!r}")
        if n == 1:
            block = self.alloc_one()
            return None if block is None else [block]
        book = self._book
        lock = self._lock
        lock.acquire()
        try:
            if n <= book.available:
                return book.take(n)
        finally:
            lock.release()
        return self._alloc_slow(n)

    def free_one(self, block: int) -> None:
        """Give back one block id handed out by this allocator."""
        if type(block) is not int:
            try:
                block = _as_block_id(block)
            except TypeError:
                raise InvalidArgument(f"a block id is an int, got {block!r}") from None
        lock = self._lock
        lock.acquire()
        try:
            if self._book.give_one(block):
                return
            if self._forked_from is not None:
                raise InvalidArgument(self._closed_message())
            if self._closed:
                return
            raise InvalidArgument(f"block {block} is not allocated (double free?)")
        finally:
            lock.release()

    def free(self, blocks: Iterable[int]) -> None:
        """Give back block ids handed out by this allocator, all or none: an id that is
        not allocated, or one given twice, is an InvalidArgument and nothing is freed."""
        if type(blocks) is list and len(blocks) == 1:
            self.free_one(blocks[0])
            return
        try:
            ordered = sorted(blocks)
            if type(sum(ordered)) is not int:  # a float or a numpy integer among them
                ordered = sorted(map(_as_block_id, ordered))
        except TypeError:
            raise InvalidArgument("free needs an iterable of int block ids") from None
        if not ordered:
            return
        lock = self._lock
        lock.acquire()
        try:
            if not self._book.give(ordered):
                self._undo_bad_free(ordered)  # raises, unless closed: then a no-op
        finally:
            lock.release()

    def _undo_bad_free(self, ordered: list[int]) -> None:
        """Under the lock: `free` was given an id that is not allocated, or one twice.
        Put back in the used set those of `ordered` that were allocated, then raise.
        After `close` it does nothing."""
        if self._forked_from is not None:
            raise InvalidArgument(self._closed_message())
        if self._closed:
            return
        unknown = self._book.undo_bad_give(ordered)
        if unknown:
            raise InvalidArgument(f"blocks {unknown[:8]} are not allocated (double free?)")
        raise InvalidArgument("free was given the same block id twice")

    # ================================================================== slow path
    def _alloc_slow(self, n: int) -> list[int] | None:
        """Map more page ids until `n` blocks are available, then take them."""
        with self._lock:
            self._demand += n  # the pool must not give back what this call grows
        try:
            return self._grow_for(n)
        finally:
            with self._lock:
                self._demand -= n

    def _grow_for(self, n: int) -> list[int] | None:
        bpp, book = self._bpp, self._book
        while True:
            limit = self._limit_now()
            with self._lock:
                while True:
                    if self._closed:
                        raise InvalidArgument(self._closed_message())
                    if n <= book.available:
                        blocks = book.take(n)
                        if len(book.empty) < self._low_pages:
                            self._wake.set()
                        return blocks
                    deficit = n - book.available - self._inflight_pages * bpp
                    if deficit > 0:
                        break
                    self._cond.wait()  # growth in flight will bring enough blocks
                room = (limit - self._reserved - self._inflight) // self._page_id_bytes
                unmapped = book.unmapped_pages()
                if deficit > max(0, min(room, unmapped)) * bpp:
                    return None  # more than the limit or the virtual range can ever hold
                # a whole extent even if fewer page ids would do: growth costs per handle
                claim = self._claim(self._extent_pages, limit)
                if claim is None:
                    if self._inflight_pages:
                        self._cond.wait()
                        continue
                    return None
            if self._build_claimed(*claim) == 0:
                return None

    # ===================================================================== growth
    def _limit_now(self) -> int:
        """The effective limit in bytes; reads the account, so call it without the lock."""
        limit = self._max_bytes
        own, theirs = self._limit, self.account.limit
        if own is not None and own < limit:
            limit = own
        if theirs is not None and theirs < limit:
            limit = theirs
        return limit

    def _claim(self, want: int, limit: int) -> tuple[int, int] | None:
        """Under the lock: claim up to `want` unmapped page ids (first fit, else the
        largest hole) and the bytes they will charge, if the limit has room for one."""
        room = (limit - self._reserved - self._inflight) // self._page_id_bytes
        npages = min(want, room)
        if npages <= 0 or self._book.any_draining():
            return None
        claim = self._book.claim_range(npages)
        if claim is None:
            return None
        npages = claim[1]
        self._inflight += npages * self._page_id_bytes
        self._inflight_pages += npages
        return claim

    def _unclaim(self, start: int, npages: int) -> None:
        """Under the lock: give back page ids claimed for growth that did not happen."""
        self._inflight -= npages * self._page_id_bytes
        self._inflight_pages -= npages
        self._book.return_range(start, npages)
        self._cond.notify_all()

    def _grow(self, want: int, limit: int, *, ahead: bool = False) -> int:
        """Map up to `want` page ids as one extent; the page ids mapped (0: refused).
        `ahead`: growth no caller waits for, which `pause_growth` stops (checked under
        the lock that the claim takes, so no such growth starts after the pause)."""
        with self._lock:
            if self._closed or (ahead and self._growth_paused):
                return 0
            claim = self._claim(want, limit)
        if claim is None:
            return 0
        return self._build_claimed(*claim)

    def _build_claimed(self, start: int, npages: int) -> int:
        """Charge, create and map claimed page ids, halving the extent each time the
        account or the device refuses; commit it. Returns the page ids mapped."""
        while True:
            try:
                pages = self._build(start, npages)
            except BaseException:
                with self._lock:
                    self._unclaim(start, npages)
                raise
            if pages is not None:
                with self._lock:
                    committed = self._commit(start, npages, pages)
                if committed:
                    return npages
                extent = Extent(start, npages, pages)  # closed meanwhile: undo
                self._destroy(extent)
                self._charged(-npages)
                try:
                    self.account.refund(self._extent_bytes(extent))
                finally:
                    with self._lock:
                        self._unclaim(start, npages)
                return 0
            half = npages // 2
            with self._lock:
                self._unclaim(start + half, npages - half)
            if half == 0:
                return 0
            npages = half

    def _build(self, start: int, npages: int) -> list[Page] | None:
        """Outside the lock: charge, create one page per segment and map them at page
        id `start`. None (everything undone) when the account or the device refuses."""
        nbytes = npages * self._page_id_bytes
        if not self.account.try_charge(nbytes):
            return None
        self._charged(npages)
        size = npages * self._page_bytes
        at = start * self._page_bytes
        backend = self.backend
        pages: list[Page] = []
        mapped: list[tuple[Reservation, list[tuple[int, int]]]] = []
        try:
            pages = backend.create_many(size, len(self.group.segments))
            i = 0
            for reservation, offsets in self.group.reservations:
                items = [(offset + at, pages[i + j]) for j, offset in enumerate(offsets)]
                backend.map_many(reservation, items)
                mapped.append((reservation, [(offset + at, size) for offset in offsets]))
                i += len(offsets)
        except BaseException as exc:
            try:
                for reservation, ranges in mapped:
                    backend.unmap_many(reservation, ranges)
                backend.release_many(pages)
            finally:
                self._charged(-npages)  # first: a refund that raises leaves no page counted
                self.account.refund(nbytes)
            if isinstance(exc, OutOfMemory):
                return None
            raise
        return pages

    def _charged(self, npages: int) -> None:
        """The account charged (or, negative, refunded) `npages` in-flight page ids."""
        with self._lock:
            self._charged_inflight_pages += npages
            self._charge_changes += 1

    def _commit(self, start: int, npages: int, pages: list[Page]) -> bool:
        """Under the lock: turn claimed, mapped page ids into a usable extent (False,
        changing nothing, if the allocator was closed meanwhile)."""
        if self._closed:
            return False
        nbytes = npages * self._page_id_bytes
        self._inflight -= nbytes
        self._inflight_pages -= npages
        self._charged_inflight_pages -= npages  # now in the book, as free blocks
        self._reserved += nbytes
        self._cond.notify_all()
        self._book.add_extent(Extent(start, npages, pages))
        return True

    # ==================================================================== release
    def _extent_bytes(self, extent: Extent) -> int:
        return extent.npages * self._page_id_bytes

    def _claim_release(self, extents: list[Extent]) -> None:
        """Under the lock: take empty extents out of service, to be destroyed."""
        self._book.remove_extents(extents)
        for extent in extents:
            self._releasing += self._extent_bytes(extent)

    def _destroy(self, extent: Extent) -> None:
        """Outside the lock: unmap an extent from every reservation and release it."""
        size = extent.npages * self._page_bytes
        at = extent.start * self._page_bytes
        for reservation, offsets in self.group.reservations:
            self.backend.unmap_many(reservation, [(offset + at, size) for offset in offsets])
        self.backend.release_many(extent.pages)

    def _release_claimed(self, extents: list[Extent]) -> int:
        """Outside the lock: destroy claimed extents and settle the books."""
        if not extents:
            return 0
        # A block the engine freed may still be touched by a kernel in flight, and an
        # unmap does not wait for the device (a fault in that kernel if it ran on).
        self.backend.synchronize()
        released = 0
        refund_error: Exception | None = None
        for extent in extents:
            self._destroy(extent)
            nbytes = self._extent_bytes(extent)
            try:
                self.account.refund(nbytes)
            except Exception as exc:
                # The memory is gone even so: settle the books and release the other
                # claimed extents, or close() would wait forever for them.
                refund_error = refund_error or exc
            with self._lock:
                self._releasing -= nbytes
                self._reserved -= nbytes
                self._book.return_range(extent.start, extent.npages)
                self._cond.notify_all()
            released += nbytes
        if refund_error is not None:
            raise refund_error
        return released

    def _plan_limit(self, limit: int) -> list[Extent]:
        """Under the lock: drain or undrain extents so that what is held can come within
        `limit`; claim and return the extents that can be released now."""
        book = self._book
        book.retire_current()
        held = self._reserved + self._inflight - self._releasing
        draining = [e for e in book.extents.values() if e.draining]
        pending = sum(self._extent_bytes(e) for e in draining)
        if held - pending <= limit:
            # the limit rose: put back the extents no longer needed, fullest first
            for extent in sorted(draining, key=lambda e: -e.nonempty):
                nbytes = self._extent_bytes(extent)
                if held - pending + nbytes <= limit:
                    book.undrain(extent)
                    pending -= nbytes
        else:
            # emptiest first; among equals the highest, so live blocks pack low
            candidates = sorted(
                (e for e in book.extents.values() if not e.draining),
                key=lambda e: (e.nonempty, -e.start),
            )
            for extent in candidates:
                if held - pending <= limit:
                    break
                book.drain(extent)
                pending += self._extent_bytes(extent)
        empty = [e for e in book.extents.values() if e.draining and e.nonempty == 0]
        self._claim_release(empty)
        return empty

    def _plan_pool_release(self, keep_pages: int, floor: int) -> list[Extent]:
        """Under the lock: claim empty extents, highest first, while the pool keeps
        `keep_pages` fully free page ids and what is held stays at or above `floor`."""
        book = self._book
        book.retire_current()
        keep_pages += -(-self._demand // self._bpp)  # growth that a waiting alloc made
        empty_pages = len(book.empty)
        held = self._reserved - self._releasing
        chosen: list[Extent] = []
        for extent in sorted(book.extents.values(), key=lambda e: -e.start):
            if extent.nonempty or extent.draining:
                continue
            nbytes = self._extent_bytes(extent)
            if empty_pages - extent.npages < keep_pages or held - nbytes < floor:
                continue
            chosen.append(extent)
            empty_pages -= extent.npages
            held -= nbytes
        self._claim_release(chosen)
        return chosen

    # ================================================================ maintenance
    def maintain(self) -> int:
        """One round of upkeep, what the background thread runs: follow the limit
        (release, drain), keep the pool between its watermarks, keep `resize`'s floor,
        and report used bytes to the account. Returns page ids mapped minus released."""
        delta, book = 0, self._book
        while True:
            limit = self._limit_now()
            grow = 0
            with self._lock:
                if self._closed:
                    return delta
                release = self._plan_limit(limit)
                if not release and not book.any_draining():
                    held = self._reserved + self._inflight - self._releasing
                    pool = len(book.empty) + self._inflight_pages
                    paused = self._growth_paused
                    if held < self._floor and not paused:
                        grow = -(-(self._floor - held) // self._page_id_bytes)
                    elif (
                        pool < self._low_pages
                        and not paused
                        and time.monotonic() - self._refill_failed_at > REFILL_RETRY_S
                    ):
                        grow = self._extent_pages
                    elif len(book.empty) > self._high_pages:
                        now = time.monotonic()
                        if self._over_high_since is None:
                            self._over_high_since = now
                        if now - self._over_high_since >= self._release_delay:
                            release = self._plan_pool_release(self._low_pages, self._floor)
                    else:
                        self._over_high_since = None
            if release:
                self._release_claimed(release)
                delta -= sum(e.npages for e in release)
            elif grow:
                got = self._grow(min(grow, self._extent_pages), limit, ahead=True)
                if not got:
                    self._refill_failed_at = time.monotonic()
                    break
                delta += got
            else:
                break
        self._report()
        return delta

    def _report(self) -> None:
        used = len(self._book.used) * self._block_id_bytes
        if used != self._reported_used:
            self._reported_used = used
            self.account.set_used(used)

    def _run(self) -> None:
        while not self._closed and not self._thread_stopped:
            self._wake.wait(self._poll_interval)
            self._wake.clear()
            if self._closed or self._thread_stopped:
                return
            try:
                self.maintain()
            except Exception as exc:  # keep serving; the next round retries
                self.last_error = exc
                if isinstance(exc, InvalidArgument) or not isinstance(exc, KVCachedError):
                    log.exception("kvcached pool upkeep failed")  # a bug: show where
                    continue
                # refused, and the error says why (a damaged ledger): once, and later
                self._refill_failed_at = time.monotonic()
                if str(exc) != self._upkeep_warned:
                    self._upkeep_warned = str(exc)
                    log.warning("kvcached pool upkeep failed: %s", exc)

    def _stop_pool_thread(self, timeout: float) -> None:
        """Stop the pool thread (at interpreter exit); waits up to `timeout` seconds
        for a round in progress. The allocator itself stays usable."""
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return
        self._thread_stopped = True
        self._wake.set()
        thread.join(timeout)

    # ================================================================ public knobs
    @property
    def limit(self) -> int | None:
        """The allocator's own limit in bytes (the account's may be lower)."""
        return self._limit

    @property
    def effective_limit(self) -> int:
        """The smallest of the allocator's limit, the account's and the virtual range."""
        return self._limit_now()

    def set_limit(
        self, nbytes: int | None, *, wait: bool = False, timeout: float | None = None
    ) -> bool:
        """Change the allocator's own limit. Lowering it releases empty extents now and
        drains busy ones (released as their blocks are freed; a page in use is never
        unmapped). With `wait`, block until what is held fits (or `timeout` seconds
        pass). Returns whether it fits now."""
        self._limit = _check_bytes("limit", nbytes, optional=True)
        self.maintain()
        self._wake.set()
        if wait:
            return self.wait_within_limit(timeout)
        return self._within_limit(self._limit_now())

    def pause_growth(self) -> None:
        """Map nothing ahead of demand (no pool refill, no growth toward `resize`'s
        floor) until `resume_growth`, and wait for every growth in flight, the pool
        thread's included, to land or be undone. Releases go on as before; `alloc`
        still grows when it needs blocks. Idempotent."""
        with self._lock:
            self._growth_paused = True
            while self._inflight_pages and not self._closed:
                self._cond.wait()

    def wait_released(self) -> None:
        """Wait until every release in flight, the pool thread's included, is unmapped
        and refunded, so that `reserved` then says what is held. A release the pool
        thread began on its own (a limit lowered a moment before) is not this caller's
        to finish, so a trim alone can return before it lands."""
        with self._lock:
            while self._releasing and not self._closed:
                self._cond.wait()

    def resume_growth(self) -> None:
        """Undo `pause_growth`: the pool thread keeps the pool filled again."""
        self._growth_paused = False
        self._refill_failed_at = -float("inf")  # the pause was no refusal
        self._wake.set()

    @property
    def growth_paused(self) -> bool:
        return self._growth_paused

    def _within_limit(self, limit: int) -> bool:
        with self._lock:
            return self._reserved + self._inflight <= limit

    def wait_within_limit(self, timeout: float | None = None) -> bool:
        """Block until what is held fits the effective limit; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.maintain()
            limit = self._limit_now()
            with self._lock:
                if self._reserved + self._inflight <= limit or self._closed:
                    return True
                remaining = self._poll_interval
                if deadline is not None:
                    remaining = min(remaining, deadline - time.monotonic())
                    if remaining <= 0:
                        return False
                self._cond.wait(remaining)

    def resize(self, nbytes: int) -> int:
        """Keep at least `nbytes` mapped (a floor the pool never releases below), and
        map or release toward it now: grow to the smallest size >= `nbytes` the limit
        allows; release empty extents, highest first, while what stays is >= `nbytes`.
        Returns the bytes held afterwards."""
        _check_bytes("resize target", nbytes)
        with self._lock:
            self._check_open()
            self._floor = nbytes
        while True:
            limit = self._limit_now()
            with self._lock:
                # The pool thread may be growing toward the new floor, or releasing,
                # right now: let that land, so the bytes returned are the bytes held
                # and growth that fails is made up for here.
                while self._inflight or self._releasing:
                    self._cond.wait()
                held = self._reserved
            if held >= nbytes:
                break
            need = -(-(nbytes - held) // self._page_id_bytes)
            if not self._grow(min(need, self._extent_pages), limit):
                break
        with self._lock:
            release = self._plan_pool_release(0, nbytes)
        self._release_claimed(release)
        return self.reserved_bytes

    def trim(self, keep: int | None = None) -> int:
        """Give back empty extents now, keeping `keep` bytes of fully free page ids
        mapped (default: the pool's low watermark) and `resize`'s floor. Returns the
        bytes released."""
        if keep is None:
            keep_pages = self._low_pages
        else:
            keep_pages = -(-(_check_bytes("keep", keep) or 0) // self._page_id_bytes)
        with self._lock:
            if self._closed:
                return 0
            release = self._plan_pool_release(keep_pages, self._floor)
        released = self._release_claimed(release)
        self._report()
        return released

    # ===================================================================== queries
    @property
    def reserved_bytes(self) -> int:
        """Physical bytes held (what the account is charged), growth in flight excluded."""
        return self._reserved

    def mapped_free_blocks(self) -> int:
        """Blocks `alloc` could hand out with no new charge: the free blocks of mapped
        pages and of growth in flight (`obtainable_blocks` before the limit's room).
        With `committed_bytes`, what an engine that draws on several allocators of one
        instance needs to split the instance's room between them."""
        with self._lock:
            return 0 if self._closed else self._mapped_free()

    @property
    def committed_bytes(self) -> int:
        """Bytes held or being mapped, less those being released: what this allocator
        counts against the limit when it plans growth."""
        with self._lock:
            return self._committed()

    def _mapped_free(self) -> int:
        """Under the lock: `mapped_free_blocks`."""
        return self._book.available + self._inflight_pages * self._bpp

    def _committed(self) -> int:
        """Under the lock: `committed_bytes`."""
        return self._reserved + self._inflight - self._releasing

    @property
    def used_blocks(self) -> int:
        return len(self._book.used)

    @property
    def capacity_blocks(self) -> int:
        return self._book.capacity

    def is_allocated(self, block: int) -> bool:
        return block in self._book.used

    def release_order(self, candidates: Iterable[int]) -> list[int]:
        """`candidates` (allocated blocks the engine could free, e.g. cached prefixes no
        request uses) ordered so that freeing them in order empties pages soonest:
        first the pages with the fewest other allocated blocks, among equals the
        highest page ids (live blocks pack low, so high extents drain)."""
        bpp = self._bpp
        by_page: dict[int, list[int]] = {}
        for block in candidates:
            by_page.setdefault(block // bpp, []).append(block)
        with self._lock:
            others = {
                page: bpp - self._book.free_count(page) - len(blocks)
                for page, blocks in by_page.items()
            }
        order: list[int] = []
        for page in sorted(by_page, key=lambda p: (others[p], -p)):
            order += sorted(by_page[page])
        return order

    def obtainable_blocks(self) -> int:
        """Blocks `alloc` could hand out right now: the free blocks of mapped pages and
        of growth in flight (once charged: Note [An in-flight page is counted once]),
        and what the limit, the device budget (the account's `headroom`) and the
        virtual range still allow to be mapped. An
        engine's free-block count follows this, so that running short of memory
        becomes the engine's own preemption instead of a failed allocation. It is a
        snapshot: another instance may take the budget's headroom a moment later."""
        limit = self._limit_now()
        for attempt in range(COUNT_TRIES):
            with self._lock:
                changes = self._charge_changes
            budget_room = self.account.headroom()
            with self._lock:
                if self._closed:
                    return 0
                if self._charge_changes == changes:
                    mapped = self._book.available + self._charged_inflight_pages * self._bpp
                elif attempt + 1 < COUNT_TRIES:
                    continue  # a charge landed while the headroom was read: read again
                else:
                    mapped = self._book.available  # still racing: leave in-flight pages out
                return self._obtainable(limit, budget_room, mapped)
        raise AssertionError("unreachable: the last attempt returns")

    def _obtainable(self, limit: int, budget_room: int | None, mapped: int) -> int:
        """Under the lock: `obtainable_blocks`, given the free blocks it may count."""
        room = limit - self._committed()
        if room < 0:
            # over a limit lowered under what is mapped (pages the pool thread mapped
            # ahead, say): the excess goes back, so its blocks are not promised
            excess_pages = -(room // self._page_id_bytes)  # rounded up
            return max(0, mapped - excess_pages * self._bpp)
        if budget_room is not None:
            room = min(room, budget_room)
        unmapped = self._book.unmapped_pages()
        growable = max(0, min(room // self._page_id_bytes, unmapped))
        return mapped + growable * self._bpp

    def stats(self) -> AllocatorStats:
        with self._lock:
            book = self._book
            book.retire_current()
            used = len(book.used)
            draining = [e for e in book.extents.values() if e.draining]
            return AllocatorStats(
                capacity_blocks=book.capacity,
                used_blocks=used,
                free_blocks=book.free_blocks(),
                available_blocks=book.available,
                empty_pages=len(book.empty),
                extents=len(book.extents),
                mapped_pages=sum(e.npages for e in book.extents.values()),
                draining_extents=len(draining),
                reserved_bytes=self._reserved,
                draining_bytes=sum(self._extent_bytes(e) for e in draining),
                releasing_bytes=self._releasing,
                inflight_bytes=self._inflight,
                used_bytes=used * self._block_id_bytes,
                limit=self._limit,
                floor=self._floor,
            )

    def extents(self) -> list[tuple[int, int]]:
        """(first page id, page ids) of every mapped extent, in page-id order."""
        with self._lock:
            return sorted((e.start, e.npages) for e in self._book.extents.values())

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgument(self._closed_message())

    def _closed_message(self) -> str:
        if self._forked_from is not None:
            return (
                f"this allocator belongs to process {self._forked_from}; a forked child "
                "cannot use it (its blocks and pages are the parent's): create a new "
                "KVCache or PageAllocator in the child"
            )
        return "this allocator was closed"

    # ==================================================================== lifetime
    def close(self) -> None:
        """Stop the pool thread, unmap and release every extent (blocks still in use
        included: the engine is done with them) and refund the account. Idempotent;
        `free` after close is a no-op, `alloc` an InvalidArgument."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._lock:
            # growth and release running in other threads finish (or undo) themselves
            while self._inflight or self._releasing:
                self._cond.wait()
            extents = self._book.clear()
            for extent in extents:
                self._releasing += self._extent_bytes(extent)
        self._release_claimed(extents)
        self._report()

    def __repr__(self) -> str:
        book = self._book
        state = "closed" if self._closed else f"{len(book.used)}/{book.capacity} blocks used"
        return (
            f"PageAllocator({self.group.name}, {self._bpp} blocks/page, "
            f"{self._extent_pages} pages/extent, {state}, {self._reserved} bytes held)"
        )
