"""Scheduler side: vLLM's block pool with a free queue that follows kvcached.

vLLM's `BlockPool` hands out `KVCacheBlock`s from a free queue and counts free blocks
by its length; when too few are free the scheduler preempts. The elastic pool keeps
all of vLLM's logic (prefix-cache lookups, hashing, events, ref counts) and replaces
only the free queue, whose contract is small (popleft_n, remove, append_n, prepend_n,
num_free_blocks):

* A free block with no prefix-cache hash holds nothing worth keeping: it goes back to
  the kvcached allocator at once (`prepend_n`), and its page can be released.
* A free block that still holds a cached prefix (or that a KV reader pinned) is
  *retained*: allocated in kvcached, kept in LRU order, reusable by a prefix hit
  (`remove`) or evicted when its memory is needed.
* `num_free_blocks` is the retained blocks plus what the allocator can supply now:
  free blocks of mapped pages and what the instance's limit and the device ledger's
  free budget still allow to be mapped. When memory runs out, that count falls and
  vLLM's own preemption and queueing run; nothing crashes.
* `popleft_n` takes fresh blocks from the allocator first, so cached prefixes survive
  while memory allows, then the least recently used retained blocks.

Retained blocks must be given back when the instance has to shrink: when what it
holds is over its limit (`kvctl limit`), or when it has been idle for
KVCACHED_CACHE_IDLE_EVICT seconds. Both evict on the scheduler's own thread (vLLM's
pool is not thread safe): over-limit checks ride on the scheduler's calls, idle ones on
the engine loop's idle upkeep (`lifecycle.py`). Evictions follow the allocator's
`release_order`, so the blocks freed first are those that empty whole pages.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from kvcached.engines.vllm import instance
from kvcached.engines.vllm.instance import NULL_BLOCK

#: how often (seconds) the scheduler's calls look at the limit
LIMIT_CHECK_S = 0.05
#: how long (seconds) a computed free count is reused. vLLM asks for it once per request
#: per step (1,024 times a step with 1,024 running requests), and the exact figure reads
#: the ledger under its file lock (~10 us). Within the window the count follows this
#: queue's own allocations and frees exactly; only another instance's use of the budget
#: is seen up to this late (then an allocation retries briefly, see `_alloc_short`).
COUNT_REFRESH_S = 0.005
#: an allocation that lost a race for the budget retries for this long before failing
RACE_RETRY_S = 2.0


class ElasticFreeQueue:
    """Stands in for vLLM's `FreeKVCacheBlockQueue` (see the module docstring)."""

    def __init__(self, pool: Any, vllm_instance: instance.VllmInstance) -> None:
        self._pool = pool
        self._blocks = pool.blocks
        self._allocator = vllm_instance.allocator
        self._retained: OrderedDict[int, Any] = OrderedDict()
        self._idle_since: float | None = None
        self._limit_checked = 0.0
        self._counted_at = -1.0
        self._obtainable = 0
        self.evicted = 0  # blocks given back by eviction, for tests and logs

    # ------------------------------------------------------------- vLLM's contract
    @property
    def num_free_blocks(self) -> int:
        now = time.monotonic()
        if now - self._limit_checked > LIMIT_CHECK_S:
            self._limit_checked = now
            self.give_back_over_limit()
        if now - self._counted_at > COUNT_REFRESH_S:
            self._counted_at = now
            self._obtainable = self._allocator.obtainable_blocks()
        return len(self._retained) + self._obtainable

    def _counted(self, delta: int) -> None:
        """This queue took (negative) or gave back blocks: keep the cached count exact."""
        self._obtainable = max(0, self._obtainable + delta)

    def popleft(self) -> Any:
        return self.popleft_n(1)[0]

    def popleft_n(self, n: int) -> list[Any]:
        if n <= 0:
            return []
        self._idle_since = None
        ids = self._allocator.alloc(n)
        if ids is None:
            self._counted_at = -1.0  # the count was stale: recompute it next time
            ids = self._alloc_short(n)
        else:
            self._counted(-n)
        return [self._blocks[i] for i in ids]

    def remove(self, block: Any) -> None:
        del self._retained[block.block_id]
        self._idle_since = None

    def append(self, block: Any) -> None:
        self.append_n([block])

    def append_n(self, blocks: list[Any]) -> None:
        for block in blocks:
            self._retained[block.block_id] = block
        self._note_idle()

    def prepend_n(self, blocks: list[Any]) -> None:
        ids = [block.block_id for block in blocks]
        if ids:
            self._allocator.free(ids)
            self._counted(len(ids))
        self._note_idle()

    def get_all_free_blocks(self) -> list[Any]:
        return list(self._retained.values())

    # ------------------------------------------------------------------- policy
    def _alloc_short(self, n: int) -> list[int]:
        """The allocator could not give all `n`: take the rest from the retained blocks
        (least recently used first); if the budget was taken by another instance
        between vLLM's free count and this call, wait for it a little."""
        deadline = time.monotonic() + RACE_RETRY_S
        while True:
            reuse = min(n, len(self._retained))
            fresh = self._allocator.alloc(n - reuse) if n > reuse else []
            if fresh is not None:
                taken = [self._retained.popitem(last=False)[0] for _ in range(reuse)]
                return fresh + taken
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"kvcached: {n} KV blocks counted free a moment ago are gone: another "
                    "instance took the device budget in between"
                )
            time.sleep(0.01)

    def _note_idle(self) -> None:
        if self._idle_since is None and self._allocator.used_blocks <= 1 + len(self._retained):
            self._idle_since = time.monotonic()

    def evict(self, block_ids: Iterable[int]) -> int:
        """Evict retained blocks from the prefix cache and free them in kvcached."""
        pool, freed = self._pool, []
        for block_id in block_ids:
            block = self._retained.pop(block_id, None)
            if block is None:
                continue
            pool._maybe_evict_cached_block(block)
            notify = getattr(pool, "_notify_reuse", None)
            if notify is not None:
                notify([block])
            freed.append(block_id)
        if freed:
            self._allocator.free(freed)
            self._counted(len(freed))
            self.evicted += len(freed)
        return len(freed)

    def give_back_over_limit(self) -> int:
        """Over the limit: evict retained blocks, those that empty pages first, until
        the pages they free cover the excess (the allocator then releases them)."""
        allocator = self._allocator
        excess = allocator.reserved_bytes - allocator.effective_limit
        if excess <= 0 or not self._retained:
            return 0
        order = allocator.release_order(self._retained)
        per_page = allocator.group.blocks_per_page
        need_pages = -(-excess // allocator.group.page_id_bytes)
        chosen = order[: need_pages * per_page] if need_pages * per_page < len(order) else order
        return self.evict(chosen)

    def idle_upkeep(self, idle_for: float) -> int:
        """On the engine's thread while no request runs: after `idle_for` seconds of
        idleness evict every retained block, so an idle instance returns its memory."""
        evicted = self.give_back_over_limit()
        since = self._idle_since
        if self._retained and since is not None and time.monotonic() - since >= idle_for:
            evicted += self.evict(list(self._retained))
        return evicted


def elastic_block_pool(block_pool_class: type) -> type:
    """vLLM's `BlockPool` class, with the elastic free queue (see the module docstring)."""

    class ElasticBlockPool(block_pool_class):  # type: ignore[misc]
        __doc__ = f"vLLM's BlockPool whose free queue follows kvcached. {__doc__}"

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            found = instance.require()
            if self.null_block.block_id != NULL_BLOCK:
                raise RuntimeError(f"vLLM's null block is {self.null_block.block_id}, not 0")
            self.free_block_queue = ElasticFreeQueue(self, found)
            found.pool = self

        def get_usage(self) -> float:
            allocator = self.free_block_queue._allocator
            used = allocator.used_blocks - 1 - len(self.free_block_queue._retained)
            total = used + self.get_num_free_blocks()
            return 0.0 if total <= 0 else used / total

        def reset_prefix_cache(self) -> bool:
            queue = self.free_block_queue
            busy = queue._allocator.used_blocks - 1 - len(queue._retained)
            if busy > 0:
                return False
            queue.evict(list(queue._retained))
            return self.reset_prefix_cache_after_evict()

        def reset_prefix_cache_after_evict(self) -> bool:
            # vLLM's check counts free blocks against the whole virtual pool; with every
            # block back in kvcached, the hash tables are what is left to clear
            for block in self.blocks:
                if block.block_hash is not None:
                    block.reset_hash()
            table: Any = getattr(self, "cached_block_hash_to_block")  # noqa: B009
            setattr(self, "cached_block_hash_to_block", type(table)())  # noqa: B010
            hashes = getattr(self, "cached_block_hashes_by_block", None)
            if hashes is not None:
                hashes.clear()
            return True

    ElasticBlockPool.__qualname__ = ElasticBlockPool.__name__
    return ElasticBlockPool
