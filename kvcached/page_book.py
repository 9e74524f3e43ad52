"""The page book: which blocks of which page ids are free, which page is filled next, and
which extents are empty. The page allocator's bookkeeping, kept apart from everything
that costs time or can fail (driver calls, the budget, locks, threads), so that it can
be read, and property-tested, alone.

Note [Filling pages]
~~~~~~~~~~~~~~~~~~~~
Memory goes back to the device a whole extent at a time (Note [Release per extent] in
allocator.py), so the book hands out blocks in the order that lets extents empty:
partly used pages are filled first, the one with the fewest free blocks first, and a
fresh page is opened at the lowest free page id. Live blocks then pack into the low
extents while the high ones drain.

Per page id there is a list of its free block ids, kept in descending order when the
page is fresh so that `pop()` hands out the lowest. Single-block takes pop from the
*current* page until it is full; the next current page is the partly used one with the
fewest free blocks (partly used pages sit in `buckets` by free-block count, with a
bitmask `mask` of non-empty buckets, so that is the lowest set bit), else the lowest
fresh page id (`empty`, a min-heap). A single take or give is a handful of Python
operations; a batch works page by page (a 1,000-block give arrives sorted and is split
by page with bisect), so its cost grows with the pages touched more than with the
blocks. The ids handed out are kept in a set (`used`), so that giving back a block that
is not out changes nothing and is reported to the caller.

Note [Page book invariants]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
Between calls, for a book whose caller never gives back what it was not handed:

* every block id of a mapped page id is either in `used` or in its page's free list,
  never both, never twice; `capacity` is the number of blocks of mapped page ids, so
  ``len(used) + free blocks == capacity``;
* a page of an extent in service (not draining) is in exactly one place: it is the
  current page, or fully free and in `empty`, or partly used and in `buckets` under its
  free-block count, or full (in none of them); `mask` has bit k set iff bucket k is
  non-empty; `available` counts the free blocks of such pages;
* a page of a draining extent is in no free structure: nothing is handed out of it,
  and `available` does not count its blocks;
* `extent.nonempty` counts the page ids of the extent holding at least one used block,
  the current page counted as holding one; an extent in service with `nonempty == 0`
  has all its pages in `empty`;
* `holes` are the unmapped page ids not claimed for growth, as sorted, disjoint,
  non-adjacent [start, length] ranges; together with the extents and the ranges
  claimed and not yet added or returned, they tile [0, num_pages).

tests/test_page_book.py checks these after every step of random sequences.

The book takes no lock: its one user, `PageAllocator`, calls it under its own lock
(Note [Allocator locking] in allocator.py). It never blocks and never calls out, but
for `signal`, which it calls when the pool may need attention (a fresh page opened
with fewer than `low_pages` fully free pages left, or an extent emptied with more than
`high_pages` left); the allocator passes its pool thread's wake-up there.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvcached.backend import Page

__all__ = ["NO_EXTENT", "UNMAPPED", "Extent", "PageBook"]

#: The free list of every unmapped page id. Never mutated: the book only touches pages
#: of mapped extents (a block id is only accepted back if it is in the used set).
UNMAPPED: list[int] = []


class Extent:
    """Page ids [start, start + npages), backed by one physical page per segment."""

    __slots__ = ("draining", "nonempty", "npages", "pages", "start")

    def __init__(self, start: int, npages: int, pages: list[Page]) -> None:
        self.start = start
        self.npages = npages
        self.pages = pages  # the allocator's handles (in the order of its reservations)
        self.nonempty = 0  # page ids holding at least one used block (the current: one)
        self.draining = False  # over the limit: hand nothing out, release once empty


NO_EXTENT = Extent(-1, 0, [])  # the extent of every unmapped page id (never mutated)


def _no_signal() -> None:
    return None


class PageBook:
    """The free and used blocks of one page-id space of `num_pages` page ids holding
    `blocks_per_page` blocks each (block `b` lives in page id ``b // blocks_per_page``).

    Every method assumes the caller serializes calls (the allocator's lock); none blocks,
    allocates memory of a device or raises for a state the caller can reach through
    this API, except where it says so. See Note [Page book invariants] for what holds
    between calls.
    """

    __slots__ = (
        "available",
        "bpp",
        "buckets",
        "capacity",
        "current",
        "current_list",
        "empty",
        "extents",
        "free_lists",
        "high_pages",
        "holes",
        "low_pages",
        "mask",
        "num_pages",
        "page_ext",
        "signal",
        "used",
    )

    def __init__(
        self,
        num_pages: int,
        blocks_per_page: int,
        *,
        low_pages: int = 0,
        high_pages: int = 0,
        signal: Callable[[], None] = _no_signal,
    ) -> None:
        self.num_pages = num_pages
        self.bpp = blocks_per_page
        self.low_pages = low_pages  # below this many fully free pages, opening one signals
        self.high_pages = high_pages  # above it, an extent that empties signals
        self.signal = signal
        # per page id: its free block ids (UNMAPPED when unmapped), and its extent
        self.free_lists: list[list[int]] = [UNMAPPED] * num_pages
        self.page_ext: list[Extent] = [NO_EXTENT] * num_pages
        # partly used pages of extents in service, by free-block count; bit k of `mask`
        # is set iff buckets[k] is non-empty (bucket 0 stays empty: full pages are in none)
        self.buckets: list[dict[int, None]] = [{} for _ in range(blocks_per_page)]
        self.mask = 0
        self.empty: list[int] = []  # min-heap of fully free pages of extents in service
        # The page single takes pop from, in no bucket and not in the heap, and counted
        # as non-empty in its extent while current; -1 and UNMAPPED when there is none.
        self.current = -1
        self.current_list: list[int] = UNMAPPED
        self.used: set[int] = set()  # block ids handed out and not given back
        self.available = 0  # free blocks in extents in service (what can be handed out)
        self.capacity = 0  # blocks in mapped page ids (draining extents included)
        self.extents: dict[int, Extent] = {}  # mapped extents by first page id
        self.holes: list[list[int]] = [[0, num_pages]]  # unmapped [start, length], sorted

    # ============================================================== handing out
    def take_one(self) -> int | None:
        """One free block (the current page's, else see Note [Filling pages]), or None
        when no block is available."""
        free_list = self.current_list
        if free_list:
            block = free_list.pop()
        elif self.available:
            block = self._next_current().pop()
        else:
            return None
        self.available -= 1
        self.used.add(block)
        return block

    def take(self, n: int) -> list[int]:
        """`n` blocks, ascending within each page, fullest pages first; the caller
        ensures ``n <= available``."""
        self.retire_current()
        out: list[int] = []
        need = n
        buckets, free_lists = self.buckets, self.free_lists
        mask = self.mask
        opened = False
        while need:
            if mask:
                have = (mask & -mask).bit_length() - 1
                bucket = buckets[have]
                page = bucket.popitem()[0]
                if not bucket:
                    mask ^= 1 << have
            else:
                page = heapq.heappop(self.empty)
                self.page_ext[page].nonempty += 1
                have = self.bpp
                opened = True
            free_list = free_lists[page]
            if need >= have:
                out += free_list[::-1]  # lists are kept descending: hand out ascending
                free_list.clear()
                need -= have
            else:
                out += free_list[: -need - 1 : -1]
                del free_list[-need:]
                rest = have - need
                buckets[rest][page] = None
                mask |= 1 << rest
                need = 0
        self.mask = mask
        self.available -= n
        self.used.update(out)
        if opened and len(self.empty) < self.low_pages:
            self.signal()
        return out

    def _next_current(self) -> list[int]:
        """With a free block available outside the current page: make the page with the
        fewest free blocks (else the lowest fresh page) current; its free list."""
        self.retire_current()
        mask = self.mask
        if mask:
            k = (mask & -mask).bit_length() - 1
            bucket = self.buckets[k]
            page = bucket.popitem()[0]
            if not bucket:
                self.mask = mask ^ (1 << k)
        else:
            page = heapq.heappop(self.empty)
            self.page_ext[page].nonempty += 1
            if len(self.empty) < self.low_pages:
                self.signal()
        self.current = page
        self.current_list = self.free_lists[page]
        return self.current_list

    def retire_current(self) -> None:
        """File the current page by its free count again, so that every page is in the
        structure its state says (done before any planning over pages or extents)."""
        page = self.current
        if page < 0:
            return
        self.current = -1
        self.current_list = UNMAPPED
        k = len(self.free_lists[page])
        if k == self.bpp:
            heapq.heappush(self.empty, page)
            self.page_ext[page].nonempty -= 1
        elif k:
            self.buckets[k][page] = None
            self.mask |= 1 << k

    # ============================================================= giving back
    def give_one(self, block: int) -> bool:
        """Take back one block handed out; False, changing nothing, if it is not out."""
        try:
            self.used.remove(block)
        except KeyError:
            return False
        page = block // self.bpp
        if page == self.current:
            self.current_list.append(block)
            self.available += 1
            return True
        self._return_blocks(page, [block])
        return True

    def give(self, ordered: list[int]) -> bool:
        """Take back the sorted block ids `ordered`, all or none. False when one of them
        is not out, or one is given twice: they have then left `used` but no free list,
        and the caller must call `undo_bad_give` (or drop the book)."""
        used = self.used
        before = len(used)
        used.difference_update(ordered)
        if before - len(used) != len(ordered):
            return False
        bpp, current = self.bpp, self.current
        i, count = 0, len(ordered)
        while i < count:
            page = ordered[i] // bpp
            j = bisect_left(ordered, (page + 1) * bpp, i)
            if page == current:
                self.current_list += ordered[i:j]
                self.available += j - i
            else:
                self._return_blocks(page, ordered[i:j])
            i = j
        return True

    def undo_bad_give(self, ordered: list[int]) -> list[int]:
        """After `give` answered False for `ordered`: put back in `used` those that were
        out (their free lists are untouched so far); returns the ids that were not out
        (none: one was given twice)."""
        bpp, num_pages = self.bpp, self.num_pages
        unknown: list[int] = []
        for block in sorted(set(ordered)):
            page = block // bpp
            mapped = 0 <= page < num_pages and self.free_lists[page] is not UNMAPPED
            if mapped and block not in self.free_lists[page]:
                self.used.add(block)  # it was out: undo its removal
            else:
                unknown.append(block)
        return unknown

    def _return_blocks(self, page: int, blocks: list[int]) -> None:
        """Put freed `blocks` of `page` (not the current page) back."""
        free_list = self.free_lists[page]
        k0 = len(free_list)
        free_list += blocks
        k = len(free_list)
        extent = self.page_ext[page]
        if extent.draining:
            if k == self.bpp:
                extent.nonempty -= 1
                if extent.nonempty == 0:
                    self.signal()  # the extent can go
            return
        self.available += k - k0
        mask = self.mask
        if k0:
            bucket = self.buckets[k0]
            del bucket[page]
            if not bucket:
                mask ^= 1 << k0
        if k < self.bpp:
            self.buckets[k][page] = None
            self.mask = mask | (1 << k)
            return
        self.mask = mask
        heapq.heappush(self.empty, page)
        extent.nonempty -= 1
        if extent.nonempty == 0 and len(self.empty) > self.high_pages:
            self.signal()  # a whole extent is free and the pool is above its high mark

    # ========================================================= page-id ranges
    def claim_range(self, npages: int) -> tuple[int, int] | None:
        """Take up to `npages` (> 0) unmapped page ids out of `holes` for growth: the
        first hole that holds them all, else the largest; (start, page ids), or None
        when every page id is mapped or claimed. They are in no structure until
        `add_extent` (or `return_range`, when the growth did not happen)."""
        holes = self.holes
        best = -1
        for i, (_, length) in enumerate(holes):
            if length >= npages:
                best = i
                break
            if best < 0 or length > holes[best][1]:
                best = i
        if best < 0:
            return None
        start, length = holes[best]
        npages = min(npages, length)
        if npages == length:
            del holes[best]
        else:
            holes[best] = [start + npages, length - npages]
        return start, npages

    def return_range(self, start: int, npages: int) -> None:
        """Give page ids [start, start + npages) back to `holes` (claimed and not built,
        or of an extent removed), merging it with its neighbours."""
        holes = self.holes
        i = bisect_left(holes, [start, 0])
        holes.insert(i, [start, npages])
        if i + 1 < len(holes) and start + npages == holes[i + 1][0]:
            holes[i][1] += holes[i + 1][1]
            del holes[i + 1]
        if i > 0 and holes[i - 1][0] + holes[i - 1][1] == start:
            holes[i - 1][1] += holes[i][1]
            del holes[i]

    def unmapped_pages(self) -> int:
        """Page ids in `holes`: neither mapped nor claimed."""
        return sum(length for _, length in self.holes)

    # ================================================================ extents
    def add_extent(self, extent: Extent) -> None:
        """Put the claimed, now mapped page ids of `extent` in service, every block free."""
        self.extents[extent.start] = extent
        bpp = self.bpp
        for page in range(extent.start, extent.start + extent.npages):
            first = page * bpp
            self.free_lists[page] = list(range(first + bpp - 1, first - 1, -1))
            self.page_ext[page] = extent
            heapq.heappush(self.empty, page)
        self.capacity += extent.npages * bpp
        self.available += extent.npages * bpp

    def remove_extents(self, extents: Iterable[Extent]) -> None:
        """Take extents out of the book, to be unmapped (the caller returns their range
        with `return_range` once they are). Their blocks leave every structure; blocks
        still out (at `close`) are forgotten by the caller."""
        bpp = self.bpp
        dropped: set[int] = set()
        for extent in extents:
            del self.extents[extent.start]
            pages = range(extent.start, extent.start + extent.npages)
            if not extent.draining:
                self.available -= extent.npages * bpp
                dropped.update(pages)
            self.capacity -= extent.npages * bpp
            for page in pages:
                self.free_lists[page] = UNMAPPED
                self.page_ext[page] = NO_EXTENT
        if dropped:
            self.empty = [page for page in self.empty if page not in dropped]
            heapq.heapify(self.empty)

    def drain(self, extent: Extent) -> None:
        """Stop handing out blocks of `extent`; call `retire_current` first."""
        extent.draining = True
        bpp, dropped = self.bpp, False
        for page in range(extent.start, extent.start + extent.npages):
            k = len(self.free_lists[page])
            if k == bpp:
                dropped = True
            elif k:
                bucket = self.buckets[k]
                del bucket[page]
                if not bucket:
                    self.mask &= ~(1 << k)
            self.available -= k
        if dropped:
            end = extent.start + extent.npages
            self.empty = [p for p in self.empty if not extent.start <= p < end]
            heapq.heapify(self.empty)

    def undrain(self, extent: Extent) -> None:
        """Put a draining extent back in service."""
        extent.draining = False
        bpp = self.bpp
        for page in range(extent.start, extent.start + extent.npages):
            k = len(self.free_lists[page])
            if k == bpp:
                heapq.heappush(self.empty, page)
            elif k:
                self.buckets[k][page] = None
                self.mask |= 1 << k
            self.available += k

    def any_draining(self) -> bool:
        return any(e.draining for e in self.extents.values())

    # ================================================================ queries
    def free_count(self, page: int) -> int:
        """Free blocks of page id `page` (0 for an unmapped one)."""
        return len(self.free_lists[page])

    def free_blocks(self) -> int:
        """Free blocks of every mapped page id, draining extents included."""
        return sum(
            len(self.free_lists[page])
            for e in self.extents.values()
            for page in range(e.start, e.start + e.npages)
        )

    # =============================================================== lifetime
    def clear(self) -> list[Extent]:
        """Take every extent out, used blocks included (the allocator is closing);
        returns them, to be unmapped."""
        self.retire_current()
        extents = list(self.extents.values())
        for extent in extents:
            extent.nonempty = 0
        self.remove_extents(extents)
        self.used.clear()
        self.buckets = [{} for _ in range(self.bpp)]
        self.mask = 0
        self.available = 0
        return extents

    def disown(self) -> None:
        """In a forked child: hand nothing out and take nothing back from now on (the
        blocks are the parent's); every give answers False."""
        self.current = -1
        self.current_list = UNMAPPED
        self.available = 0
        self.used = set()
