"""The bookkeeping between SGLang's free list and kvcached's allocator (no torch, no SGLang).

SGLang's allocators keep their free pages in a device tensor that Triton kernels read.
With kvcached that tensor holds only pages the kvcached allocator has handed out (so
their memory is mapped): the *stock*. `ElasticCapacity` is everything around it that
needs no tensor: kvcached's `ElasticSupply` (the cached obtainable count, take with its
race retry, give, the reclaim signals and Note [One reclaim policy]) seen in SGLang's
units, so it is tested against the real `PageAllocator`:

* `take(n)` brings `n` pages into the stock from kvcached, from its pool of mapped
  memory when it is warm (no driver call on the engine's thread: the pool thread maps
  ahead), or None when the limit, the budget or the device cannot supply them. A page
  past SGLang's last page id (the reservation is rounded up to whole page ids) is kept
  aside, never handed to SGLang.
* `give(ids)` returns pages from the stock to kvcached (their memory can then go); the
  padding page is never given.
* `available(stock)` is SGLang's free count in tokens: the stock plus what kvcached can
  still supply, so running short of memory makes SGLang queue, evict its radix cache
  and retract, as it does when its static pool is full.
* `held_by_engine(stock)` is what SGLang's requests and radix cache hold according to
  kvcached: the idle invariant check compares SGLang's own count against it.
* `bytes_per_token` and `page_id_tokens` turn the supply's byte counts into tokens.

A tensor-parallel engine's ranks use `tensor_parallel.SharedCapacity` instead, which
has the same methods and keeps every rank's answers identical.
"""

from __future__ import annotations

from kvcached.allocator import PageAllocator
from kvcached.engines.sglang.geometry import PADDING_PAGE
from kvcached.supply import RACE_RETRY_S, ElasticSupply


class ElasticCapacity(ElasticSupply):
    """Pages between kvcached's `allocator` and an engine's free list (see module doc).

    Arguments:
        allocator: the instance's `PageAllocator` (block `b` is SGLang's page `b`).
        last_page: SGLang's highest page id.
        page_size: tokens per page.
    """

    #: one process decides alone (a SharedCapacity's ranks decide together)
    shared = False

    def __init__(self, allocator: PageAllocator, *, last_page: int, page_size: int) -> None:
        super().__init__(allocator)
        self.last_page = last_page
        self.page_size = page_size
        self.kept_aside: list[int] = []

    # ----------------------------------------------------------------- counting
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
    def take_once(self, n: int) -> list[int] | None:
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
        if n > self.unused_pages():
            return None  # more than SGLang's pool has left (and no page kept aside for it)
        return super().take(n, wait=wait)

    def give(self, ids: list[int]) -> None:
        """Return stock pages to kvcached (never the padding page)."""
        super().give([i for i in ids if i != PADDING_PAGE])

    def held_pages(self) -> list[int]:
        """SGLang pages kvcached has handed out (not the padding page, not the rounding)."""
        allocator, aside = self.allocator, set(self.kept_aside)
        return [
            page
            for page in range(PADDING_PAGE + 1, self.last_page + 1)
            if allocator.is_allocated(page) and page not in aside
        ]

    # -------------------------------------------------------------- giving back
    @property
    def bytes_per_token(self) -> int:
        group = self.allocator.group
        return max(1, group.page_id_bytes // (group.blocks_per_page * self.page_size))

    @property
    def page_id_tokens(self) -> int:
        """Tokens in one kvcached page id (the unit memory is given back in)."""
        return self.allocator.group.blocks_per_page * self.page_size
