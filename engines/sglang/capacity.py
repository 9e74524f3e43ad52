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

import itertools
import math
from collections.abc import Sequence

from kvcached.allocator import PageAllocator
from kvcached.engines.sglang.geometry import PADDING_PAGE
from kvcached.supply import PRESSURE_SHARE, RACE_RETRY_S, ElasticSupply


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

    def follow_limit(self) -> None:
        """The allocator follows the limit now: releases the extents that emptied, so
        that `over_limit` counts only what SGLang still holds."""
        self.allocator.maintain()


# ---------------------------------------------------- two pools, one instance
def joint_level(room: int, costs: list[tuple[int, int]], free: Sequence[int]) -> int:
    """The most free pages every one of several pools can count at once, when a new
    token takes a slot in every pool (SGLang's hybrid sliding-window allocator hands out
    a full-attention slot and a window slot together) and their growth draws on `room`
    bytes of one instance's limit and budget. `costs`: per pool (bytes of one kvcached
    page id, SGLang pages in it); `free`: per pool, pages it has already (its stock and
    the free pages of its mapped page ids, which cost no room).

    Each pool counts the larger of its own free pages and this level, so the pools
    together promise growth of max(0, level - free) pages each, whose cost fits the
    room once, less one page id per pool (growth comes in whole page ids). The pools
    short of pages grow first: a pool with pages to spare (window slots SGLang gave
    back as tokens left the window) needs none of the room, which then goes to the
    others. (Giving every pool the same growth, as the counts did until 2026-12-05,
    promised the pool with pages to spare growth that no take of the moment could
    use, and the short one less than the room allows.)"""
    spare = room - sum(page_id_bytes for page_id_bytes, _ in costs)
    level = min(free)
    if spare <= 0:
        return level
    # in integers (exact): costs per page scaled by a multiple of every pool's pages
    scale = math.lcm(*(pages for _, pages in costs))
    spare *= scale
    per_page = [page_id_bytes * (scale // pages) for page_id_bytes, pages in costs]
    pools = sorted(zip(free, per_page, strict=True))
    rate = 0  # what a page more costs, over the pools short of the level
    for (_, cost), (next_free, _) in itertools.pairwise(pools):
        rate += cost
        step = (next_free - level) * rate  # raising the level to the next pool's pages
        if step > spare:
            return level + spare // rate
        spare -= step
        level = next_free
    return level + spare // (rate + pools[-1][1])  # every pool grows from here


class HybridCapacity(ElasticCapacity):
    """The full-attention pool's capacity of a hybrid sliding-window instance, which
    also speaks for the window pool (`window`) wherever the reclaim policy (Note [One
    reclaim policy]) looks at the instance as a whole: what goes back under pressure
    is a share of both pools' bytes (one ledger row), a cached token given back frees a
    slot in each, and empty extents go back from both. Over the limit needs nothing of
    its own: the limit each pool's allocator sees is the row's less what the other pool
    holds (`kvcached.cache`), so the full pool's excess is the instance's."""

    def __init__(
        self,
        allocator: PageAllocator,
        window: ElasticCapacity,
        *,
        last_page: int,
        page_size: int,
    ) -> None:
        super().__init__(allocator, last_page=last_page, page_size=page_size)
        self.window = window

    def _held(self) -> int:
        return self.allocator.reserved_bytes + self.window.allocator.reserved_bytes

    def pressure_bytes(self) -> int:
        unit = self.page_id_bytes
        share = int(self._held() * PRESSURE_SHARE) // unit * unit
        return max(unit, share)

    def release_empty(self, *, wait: bool = True) -> None:
        super().release_empty(wait=wait)
        self.window.release_empty(wait=wait)

    def follow_limit(self) -> None:
        # the window pool first: what it releases is room the full pool's limit sees
        self.window.follow_limit()
        super().follow_limit()

    def _costs(self) -> list[tuple[int, int]]:
        """Per pool: (bytes of one kvcached page id, SGLang pages in it)."""
        return [
            (self.page_id_bytes, self.allocator.group.blocks_per_page),
            (self.window.page_id_bytes, self.window.allocator.group.blocks_per_page),
        ]

    def under_pressure(self) -> bool:
        """The device budget cannot grow this instance by a page in both pools at once
        (`joint_level` from none), the only way it grows: room for one full-pool page id
        alone would leave it stuck with no instance asked to give memory back."""
        headroom = self.allocator.account.headroom()
        return headroom is not None and joint_level(headroom, self._costs(), (0, 0)) == 0

    @property
    def bytes_per_token(self) -> int:
        return super().bytes_per_token + self.window.bytes_per_token

    def make_room(self) -> None:
        """Give both pools' empty extents (pages mapped ahead of demand) back now, so
        that the room the free counts split is free for either pool."""
        allocators = (self.allocator, self.window.allocator)
        for allocator in allocators:
            allocator.pause_growth()
        try:
            for allocator in allocators:
                allocator.trim(keep=0)
                allocator.wait_released()
        finally:
            for allocator in allocators:
                allocator.resume_growth()
        self.recount()
        self.window.recount()

    def room(self) -> int:
        """Bytes the instance may still map, both pools together: the smaller of the
        device budget's headroom and what its limit leaves."""
        full = self.allocator
        headroom = full.account.headroom()
        room = (1 << 62) if headroom is None else headroom  # None: no budget
        limit = full.account.limit  # the row's, less what the window pool holds
        if limit is not None:
            room = min(room, limit - full.committed_bytes)
        return max(0, room)

    def free_pages(self, full_stock: int, window_stock: int) -> tuple[int, int]:
        """SGLang's free counts of the two pools, in pages: each pool's stock and its
        mapped free pages, raised to the level `joint_level` allows both pools at once
        (never by more than the pool's own obtainable count or its unused page ids)."""
        pools = ((self, full_stock), (self.window, window_stock))
        mapped = [capacity.allocator.mapped_free_blocks() for capacity, _ in pools]
        free = [stock + more for (_, stock), more in zip(pools, mapped, strict=True)]
        level = joint_level(self.room(), self._costs(), free)
        full, window = (
            stock + min(capacity.obtainable(), max(has, level) - stock, capacity.unused_pages())
            for (capacity, stock), has in zip(pools, free, strict=True)
        )
        return full, window
