"""The bookkeeping between SGLang's free list and kvcached's allocator (no torch, no SGLang).

SGLang's allocators keep their free pages in a device tensor that Triton kernels read.
With kvcached that tensor holds only pages the kvcached allocator has handed out (so
their memory is mapped): the *stock*. `ElasticCapacity` is everything around it that
needs no tensor, so it is tested against the real `PageAllocator`:

* `take(n)` brings `n` pages into the stock from kvcached, from its pool of mapped
  memory when it is warm (no driver call on the engine's thread: the pool thread maps
  ahead), or None when the limit, the budget or the device cannot supply them. A page
  past SGLang's last page id (the reservation is rounded up to whole page ids) is kept
  aside, never handed to SGLang.
* `give(ids)` returns pages from the stock to kvcached (their memory can then go).
* `available(stock)` is SGLang's free count: the stock plus what kvcached can still
  supply (`PageAllocator.obtainable_blocks`, which includes the limit and the ledger's
  headroom), so running short of memory makes SGLang queue, evict its radix cache and
  retract, as it does when its static pool is full.
* `held_by_engine(stock)` is what SGLang's requests and radix cache hold according to
  kvcached: the idle invariant check compares SGLang's own count against it.
* `over_limit()` and `under_pressure()` say when memory must go back;
  `release_order(pages)` is the order that empties pages soonest, `release_empty()`
  gives empty extents back to the device now.

A tensor-parallel engine's ranks use `tensor_parallel.SharedCapacity` instead, which
has the same methods and keeps every rank's answers identical.
"""

from __future__ import annotations

import time

from kvcached.allocator import PageAllocator
from kvcached.engines.sglang.geometry import PADDING_PAGE

#: how long (seconds) a computed obtainable count is reused. SGLang asks for the free
#: count several times per scheduling step; the exact figure reads the ledger under its
#: lock. Within the window the count follows this instance's own takes and gives.
COUNT_REFRESH_S = 0.005
#: a take that lost a race for the budget (another instance took it after SGLang
#: counted it free) retries for this long before SGLang sees the shortage
RACE_RETRY_S = 2.0


class ElasticCapacity:
    """Pages between kvcached's `allocator` and an engine's free list (see module doc).

    Arguments:
        allocator: the instance's `PageAllocator` (block `b` is SGLang's page `b`).
        last_page: SGLang's highest page id.
        page_size: tokens per page.
    """

    #: one process decides alone (a SharedCapacity's ranks decide together)
    shared = False

    def __init__(self, allocator: PageAllocator, *, last_page: int, page_size: int) -> None:
        self.allocator = allocator
        self.last_page = last_page
        self.page_size = page_size
        self.kept_aside: list[int] = []
        self._counted_at = -1.0
        self._obtainable = 0

    # ----------------------------------------------------------------- counting
    def obtainable(self) -> int:
        now = time.monotonic()
        if now - self._counted_at > COUNT_REFRESH_S:
            self._counted_at = now
            self._obtainable = self.allocator.obtainable_blocks()
        return self._obtainable

    def unused_pages(self) -> int:
        """SGLang page ids kvcached has not handed out (the rest of the virtual pool)."""
        handed_out = self.allocator.used_blocks - len(self.kept_aside)  # padding page too
        return max(0, self.last_page + 1 - handed_out)

    def available(self, stock: int) -> int:
        """Tokens SGLang may count free: its stock plus what kvcached can supply (never
        more pages than SGLang's pool has left)."""
        return (stock + min(self.obtainable(), self.unused_pages())) * self.page_size

    def held_by_engine(self, stock: int) -> int:
        """Tokens kvcached has handed out that are neither in the stock nor pinned."""
        pinned = 1 + len(self.kept_aside)  # the padding page, the rounding
        return (self.allocator.used_blocks - pinned - stock) * self.page_size

    # ------------------------------------------------------------ moving pages
    def _take_once(self, n: int) -> list[int] | None:
        ids = self.allocator.alloc(n)
        if ids is None:
            return None
        usable = [i for i in ids if i <= self.last_page]
        while len(usable) < n:  # some ids were the rounding past SGLang's last page
            self.kept_aside += [i for i in ids if i > self.last_page]
            more = self.allocator.alloc(n - len(usable))
            if more is None:
                self.allocator.free(usable)
                return None
            ids = more
            usable += [i for i in more if i <= self.last_page]
        return usable

    def take(self, n: int, *, wait: float = RACE_RETRY_S) -> list[int] | None:
        """`n` pages for the stock, or None when kvcached cannot supply them (after
        waiting up to `wait` seconds if they were counted obtainable a moment ago)."""
        if n <= 0:
            return []
        if n > self.unused_pages():
            return None  # more than SGLang's pool has left (and no page kept aside for it)
        counted = self._obtainable
        deadline = time.monotonic() + wait
        while True:
            ids = self._take_once(n)
            if ids is not None:
                self._obtainable = max(0, self._obtainable - n)
                return ids
            self._counted_at = -1.0
            if counted < n or time.monotonic() > deadline:
                return None  # not a race: kvcached never had them
            time.sleep(0.01)

    def give(self, ids: list[int]) -> None:
        """Return stock pages to kvcached."""
        ids = [i for i in ids if i != PADDING_PAGE]
        if ids:
            self.allocator.free(ids)
            self._obtainable += len(ids)

    def held_pages(self) -> list[int]:
        """SGLang pages kvcached has handed out (not the padding page, not the rounding)."""
        allocator, aside = self.allocator, set(self.kept_aside)
        return [
            page
            for page in range(PADDING_PAGE + 1, self.last_page + 1)
            if allocator.is_allocated(page) and page not in aside
        ]

    # -------------------------------------------------------------- giving back
    def release_order(self, pages: list[int]) -> list[int]:
        """`pages` in the order that empties kvcached pages soonest (`PageAllocator`)."""
        return self.allocator.release_order(pages)

    def release_empty(self) -> None:
        """Give every empty extent back to the device now (waits for the device)."""
        self.allocator.trim(0)

    def over_limit(self) -> int:
        """Bytes held over the instance's limit (0 when within it)."""
        allocator = self.allocator
        return max(0, allocator.reserved_bytes - allocator.effective_limit)

    def under_pressure(self) -> bool:
        """The device budget has no room for one more page id (another instance, or
        this one, cannot grow): idle memory should go back."""
        headroom = getattr(self.allocator.account, "headroom", None)
        if not callable(headroom):
            return False
        room: int = headroom()
        return room < self.allocator.group.page_id_bytes

    @property
    def bytes_per_token(self) -> int:
        group = self.allocator.group
        return max(1, group.page_id_bytes // (group.blocks_per_page * self.page_size))
