"""Scheduler side: vLLM's block pool with a free queue that follows kvcached.

vLLM's `BlockPool` hands out `KVCacheBlock`s from a free queue and counts free blocks
by its length; when too few are free the scheduler preempts. The elastic pool keeps
all of vLLM's logic (prefix-cache lookups, hashing, events, ref counts) and replaces
only the free queue, whose contract is small (popleft_n, remove, append_n, prepend_n,
num_free_blocks). The queue draws from kvcached's `ElasticSupply` and only translates
between vLLM's blocks and its block ids:

* A free block with no prefix-cache hash holds nothing worth keeping: it goes back to
  the supply at once (`prepend_n`), and its page can be released.
* A free block that still holds a cached prefix (or that a KV reader pinned) is
  *retained*: allocated in kvcached, kept in LRU order, reusable by a prefix hit
  (`remove`) or evicted when its memory is needed.
* `num_free_blocks` is the retained blocks plus what the supply can hand out now
  (`ElasticSupply.obtainable`: free blocks of mapped pages and what the instance's
  limit and the device ledger's free budget still allow). When memory runs out, that
  count falls and vLLM's own preemption and queueing run; nothing crashes.
* `popleft_n` takes fresh blocks from the supply first, so cached prefixes survive
  while memory allows, then the least recently used retained blocks; a take the count
  promised but another instance raced it for waits a little (`ElasticSupply.take`).

When retained blocks go back is kvcached's Note [One reclaim policy], the same as the
SGLang adapter's: over the limit, under budget pressure, or idle for
KVCACHED_CACHE_IDLE_EVICT seconds (`ElasticSupply.upkeep`). Evictions run on the
scheduler's own thread (vLLM's pool is not thread safe): limit and pressure checks ride
on the scheduler's calls, the idle one on the engine loop's idle upkeep
(`lifecycle.py`). They follow the allocator's `release_order`, so the blocks freed
first are those that empty whole pages. With tensor parallelism the empty extents are
released on a helper thread, since their refund waits for the workers to unmap, which
this thread's next step tells them to do.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from kvcached.engines.vllm import instance
from kvcached.engines.vllm.instance import NULL_BLOCK
from kvcached.supply import ElasticSupply, Reclaim

log = logging.getLogger("vllm.kvcached")  # shown by vLLM's own log handler


class ElasticFreeQueue:
    """Stands in for vLLM's `FreeKVCacheBlockQueue` (see the module docstring)."""

    def __init__(self, pool: Any, vllm_instance: instance.VllmInstance) -> None:
        self._pool = pool
        self._blocks = pool.blocks
        self._allocator = vllm_instance.allocator
        self.supply = ElasticSupply(vllm_instance.allocator)
        # with workers replaying the ops, a release's refund waits for their next step
        self._release_here = getattr(vllm_instance, "recording", None) is None
        self._retained: OrderedDict[int, Any] = OrderedDict()
        self.evicted = 0  # blocks given back by eviction, for tests and logs

    # ------------------------------------------------------------- vLLM's contract
    @property
    def num_free_blocks(self) -> int:
        if self._retained and self.supply.check_due():
            self.upkeep(idle=False)
        return len(self._retained) + self.supply.obtainable()

    def popleft(self) -> Any:
        return self.popleft_n(1)[0]

    def popleft_n(self, n: int) -> list[Any]:
        if n <= 0:
            return []
        self.supply.busy()
        ids = self.supply.take(n, wait=0)
        if ids is None:
            ids = self._take_short(n)
        return [self._blocks[i] for i in ids]

    def remove(self, block: Any) -> None:
        del self._retained[block.block_id]
        self.supply.busy()

    def append(self, block: Any) -> None:
        self.append_n([block])

    def append_n(self, blocks: list[Any]) -> None:
        for block in blocks:
            self._retained[block.block_id] = block
        self._note_idle()

    def prepend_n(self, blocks: list[Any]) -> None:
        self.supply.give([block.block_id for block in blocks])
        self._note_idle()

    def get_all_free_blocks(self) -> list[Any]:
        return list(self._retained.values())

    # ------------------------------------------------------------ translation
    def _take_short(self, n: int) -> list[int]:
        """The supply could not give all `n` fresh: take the rest from the retained
        blocks (least recently used first). vLLM counted them free, so a shortfall
        here is a race for the budget, which the supply's take waits out a little."""
        reuse = min(n, len(self._retained))
        fresh = self.supply.take(n - reuse) if n > reuse else []
        if fresh is None:
            raise RuntimeError(
                f"kvcached: {n} KV blocks counted free a moment ago are gone: another "
                "instance took the device budget in between"
            )
        taken = [self._retained.popitem(last=False)[0] for _ in range(reuse)]
        return fresh + taken

    def _note_idle(self) -> None:
        if self._allocator.used_blocks <= 1 + len(self._retained):  # only the null block
            self.supply.idle()

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
            self.supply.give(freed)
            self.evicted += len(freed)
        return len(freed)

    def _give_back(self, reclaim: Reclaim) -> None:
        """What `reclaim` asks of the retained blocks: all of them, or those that empty
        pages first until the pages they free cover its bytes."""
        if reclaim.nbytes is None:
            chosen = list(self._retained)
        else:
            group = self._allocator.group
            need_pages = -(-reclaim.nbytes // group.page_id_bytes)
            chosen = self.supply.release_order(self._retained)[: need_pages * group.blocks_per_page]
        evicted = self.evict(chosen)
        if evicted:
            log.info("kvcached: %s: evicted %d prefix-cache blocks", reclaim.reason, evicted)

    def upkeep(self, *, idle: bool, idle_after: float | None = None) -> int:
        """Note [One reclaim policy] over the retained blocks, now; returns the blocks
        evicted. `idle`: no request runs (the idle rule may apply)."""
        before = self.evicted
        self.supply.upkeep(
            self._give_back, idle=idle, wait=self._release_here, idle_after=idle_after
        )
        return self.evicted - before

    def upkeep_due(self, idle_after: float | None = None) -> bool:
        """Whether an idle engine's `upkeep` would give anything back now (changes
        nothing; asked from the lifecycle's timer thread)."""
        if not self._retained:
            return False
        return self.supply.due(idle=True, idle_after=idle_after) is not None

    def idle_upkeep(self, idle_for: float) -> int:
        """On the engine's thread while no request runs: `upkeep`, idle after
        `idle_for` seconds, so an idle instance returns its memory."""
        return self.upkeep(idle=True, idle_after=idle_for)


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
