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
  while memory allows, then the least recently used retained blocks.

Note [A counted block is a taken block]. vLLM's `KVCacheManager.allocate_slots` asks its
coordinator how many blocks a request needs (`get_num_blocks_to_allocate`), compares
that with `get_num_free_blocks()` and, if they fit, takes them (`get_new_blocks` ->
`popleft_n`). Part of the count is the device budget's headroom, which another instance
can charge between the comparison and the take; it keeps what it took, so the take would
fail after vLLM had already decided, and the engine would die. So the comparison itself
takes: the coordinator's count is recorded (`_tell_the_queue`, by the shim
`counted_for_the_comparison`), and the free-block count that follows it *stages* that
many fresh blocks from the supply, as many as it can have. When it gets them all, the
count is what it always was; when it does not, the count is only what is held for sure
(the retained blocks and the staged ones), below the need, so vLLM returns None and
preempts or queues, its own answer to a shortage. `popleft_n` serves staged blocks
first; blocks staged but not taken (the need counted prefix hits, or vLLM declined for
its watermark) go back at the next comparison, or with the unused memory of an upkeep. A
need of zero (most running requests at a decode step: their next token fits their
blocks) with nothing staged is answered by the pool's `get_num_free_blocks` with the
retained count alone, no upkeep, no supply query: it is on the path vLLM walks once per
running request per step, where each Python call kvcached adds costs ~0.1 us a request.
Between a comparison and its take nothing may shrink what was promised: the upkeep that
rides on the scheduler's calls runs only at a comparison, before its staging, and never
evicts the request's own prefix hits that the need counted; counts that are not
comparisons (vLLM's own check inside `get_new_blocks`, statistics) only read, once
comparisons are seen. A `popleft_n` beyond every promise is vLLM's bug, and fails
loudly.

When retained blocks go back is kvcached's Note [One reclaim policy], the same as the
SGLang adapter's: over the limit, under budget pressure, or idle for
KVCACHED_CACHE_IDLE_EVICT seconds (`ElasticSupply.upkeep`). Evictions run on the
scheduler's own thread (vLLM's pool is not thread safe): limit and pressure checks ride
on the scheduler's calls, the idle one on the engine loop's idle upkeep
(`lifecycle.py`). They follow the allocator's `release_order`, so the blocks freed
first are those that empty whole pages. With tensor parallelism the empty extents are
released on a helper thread, since their refund waits for the workers to unmap, which
this thread's next step tells them to do.

Note [A connector may read a freed block late]. vLLM's OffloadingConnector (0.26 and
0.32) does not delay frees: `request_finished` says the blocks may go, and the store
of the request's last chunks to the CPU tier is only built at the next scheduler step
and copied asynchronously after it, from blocks vLLM has already freed. Plain vLLM's
freed blocks keep their bytes until they are handed out again (and the connector waits
for its copy before one is); kvcached's may lose their page. So once such a connector
runs (`cool_freed_blocks`), every block vLLM frees stays mapped for a few more steps:
a freed block without a prefix goes back to the supply only then, and a retained one
is not evicted before. vLLM may take either back meanwhile, as from its own queue: its
connector flushes a store pending on a block before that block's new owner writes to it
(`jobs_to_flush` in the connector's scheduler), so what must hold is only that the
block keeps its page, which it does while allocated, cooling or held. So the cooling
blocks count as free and are handed out when the supply is short, those freed longest
ago first. (Until 2026-12-04 they were held back from vLLM too, so under a tight limit
vLLM preempted rather than reuse them; a batch with the tier then preempted 143 times
against 24 without it, benchmarks/results/h200-2026-12-04, the cooling's share in that
not measured.) The steps are counted
by the connector's once-a-step `build_connector_meta` (`next_step`), and three of them
cover a copy built one step late even with asynchronous scheduling (one step in
flight); the unmap that finally releases a page waits for the device first
(`PageAllocator`), so a copy still running on another stream ends before. An idle
engine has no step left to count, and vLLM keeps stepping while the connector has
stores pending, so the idle upkeep ends the cooling.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
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
        # Note [A counted block is a taken block]: fresh block ids taken at the last
        # comparison and not yet handed out; the need the next count is compared with
        # (None: that count is no comparison) and the prefix hits the need counted
        self._staged: list[int] = []
        self._expected: int | None = None
        self._expected_hits: Sequence[Sequence[Any]] = ()
        self._protected: frozenset[int] = frozenset()  # never evicted by this upkeep
        self._comparisons_seen = False
        # Note [A connector may read a freed block late]: per step, the blocks freed in
        # it (given: no prefix, held back from the supply; retained: kept from eviction)
        self._cool_steps = 0
        self._cooling: deque[tuple[list[int], list[int]]] = deque()

    # ------------------------------------------------------------- vLLM's contract
    @property
    def num_free_blocks(self) -> int:
        need, self._expected = self._expected, None
        if need is not None:
            return self._compare(need)
        if not self._comparisons_seen and self.holds_unused() and self.supply.check_due():
            self.upkeep(idle=False)
        held = len(self._retained) + len(self._staged) + self._cooling_given()
        return held + self.supply.obtainable()

    def popleft(self) -> Any:
        return self.popleft_n(1)[0]

    def popleft_n(self, n: int) -> list[Any]:
        if n <= 0:
            return []
        self.supply.busy()
        staged = self._staged
        ids = staged[:n]
        del staged[:n]
        if len(ids) < n:
            rest = n - len(ids)
            fresh = self.supply.take(rest, wait=0)
            ids += fresh if fresh is not None else self._take_short(rest)
        return [self._blocks[i] for i in ids]

    def remove(self, block: Any) -> None:
        del self._retained[block.block_id]
        self.supply.busy()

    def append(self, block: Any) -> None:
        self.append_n([block])

    def append_n(self, blocks: list[Any]) -> None:
        for block in blocks:
            self._retained[block.block_id] = block
        if self._cool_steps:
            self._cooling[-1][1].extend(block.block_id for block in blocks)
        self._note_idle()

    def prepend_n(self, blocks: list[Any]) -> None:
        if self._cool_steps:
            self._cooling[-1][0].extend(block.block_id for block in blocks)
        else:
            self.supply.give([block.block_id for block in blocks])
        self._note_idle()

    def get_all_free_blocks(self) -> list[Any]:
        return list(self._retained.values())

    # ------------------------------------ Note [A counted block is a taken block]
    # (`_expected` and `_expected_hits` are set by `_tell_the_queue`, below)
    def _compare(self, need: int) -> int:
        """The free-block count vLLM compares `need` with: `need` fresh blocks staged
        (as many as the supply gives), and only what is held for sure when short."""
        self._comparisons_seen = True
        hits, self._expected_hits = self._expected_hits, ()
        if self.holds_unused() and self.supply.check_due():
            self._protected = frozenset(block.block_id for group in hits for block in group)
            try:
                self.upkeep(idle=False)
            finally:
                self._protected = frozenset()
        staged = self._staged
        if len(staged) > need:
            self.supply.give(staged[need:])
            del staged[need:]
        elif len(staged) < need:
            staged += self.supply.take_up_to(need - len(staged))
        # cooling blocks are the queue's own until `next_step`, which runs after this
        # step's takes: counted, not staged (staged blocks may go back to the supply)
        cooling = self._cooling_given()
        held = len(self._retained) + len(staged) + cooling
        return held + self.supply.obtainable() if len(staged) + cooling >= need else held

    def unstage(self) -> int:
        """Staged blocks back to the supply (memory no request holds); returns how many."""
        staged, self._staged = self._staged, []
        self.supply.give(staged)
        return len(staged)

    def holds_unused(self) -> bool:
        """Blocks no request holds are allocated here: retained prefixes, staged, or
        freed ones cooling."""
        return bool(self._retained or self._staged or self._cooling_given())

    @property
    def unused_blocks(self) -> int:
        """Allocated in kvcached but held by no request: retained, staged and cooling."""
        return len(self._retained) + len(self._staged) + self._cooling_given()

    # ------------------------------ Note [A connector may read a freed block late]
    def cool_freed_blocks(self, steps: int) -> None:
        """From now on every block vLLM frees stays mapped for `steps` more steps."""
        if steps > self._cool_steps:
            if not self._cooling:
                self._cooling.append(([], []))
            self._cool_steps = steps

    def next_step(self) -> None:
        """A scheduler step was built: what was freed `steps` steps ago may go."""
        if not self._cool_steps:
            return
        self._cooling.append(([], []))
        if len(self._cooling) > self._cool_steps:
            given, _ = self._cooling.popleft()
            self.supply.give(given)

    def end_cooling(self) -> None:
        """Every cooling block may go now (the engine is idle)."""
        if not self._cool_steps:
            return
        given = [i for held, _ in self._cooling for i in held]
        self._cooling = deque([([], [])])
        self.supply.give(given)

    def _cooling_given(self) -> int:
        """Freed blocks held back from the supply (0 at once while nothing cools: this
        is on the free-count path)."""
        return sum(len(held) for held, _ in self._cooling) if self._cool_steps else 0

    def _take_cooling(self, n: int) -> list[int]:
        """Up to `n` cooling blocks for vLLM to reuse, those freed longest ago first (as
        its own queue would hand them out): they stay allocated, so their pages stay."""
        taken: list[int] = []
        for held, _ in self._cooling:
            if len(taken) == n:
                break
            count = min(n - len(taken), len(held))
            taken += held[:count]
            del held[:count]
        return taken

    # ------------------------------------------------------------ translation
    def _take_short(self, n: int) -> list[int]:
        """The supply could not give all `n` fresh: take the rest from the cooling
        blocks, then the retained ones (least recently used first), which the comparison
        counted on."""
        cooled = self._take_cooling(n)  # no prefix to lose: before the retained ones
        reuse = min(n - len(cooled), len(self._retained))
        rest = n - len(cooled) - reuse
        fresh = self.supply.take(rest, wait=0) if rest else []
        if fresh is None:
            if cooled:  # as they were, for the error's sake
                self._cooling[0][0][:0] = cooled
            raise RuntimeError(
                f"kvcached: vLLM took {n} KV blocks that no free-block count promised "
                f"({len(self._retained)} retained, none staged); every take must follow "
                "the comparison that staged it (Note [A counted block is a taken block] "
                "in kvcached/engines/vllm/block_pool.py)"
            )
        taken = [self._retained.popitem(last=False)[0] for _ in range(reuse)]
        return fresh + cooled + taken

    def _note_idle(self) -> None:
        if self._allocator.used_blocks <= 1 + self.unused_blocks:  # only the null block
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
        self.unstage()  # unused memory goes first
        protected = self._protected
        if self._cool_steps:  # retained blocks freed in the last steps stay
            protected = protected | {i for _, kept in self._cooling for i in kept}
        candidates = [b for b in self._retained if b not in protected]
        if reclaim.nbytes is None:
            chosen = candidates
        else:
            group = self._allocator.group
            need_pages = -(-reclaim.nbytes // group.page_id_bytes)
            chosen = self.supply.release_order(candidates)[: need_pages * group.blocks_per_page]
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
        if not self.holds_unused():
            return False
        return self.supply.due(idle=True, idle_after=idle_after) is not None

    def idle_upkeep(self, idle_for: float) -> int:
        """On the engine's thread while no request runs: `upkeep`, idle after
        `idle_for` seconds, so an idle instance returns its memory."""
        self.end_cooling()
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

        def get_num_free_blocks(self) -> int:
            # vLLM's count reads the queue's property; a zero need (a running request
            # whose next tokens fit its blocks, most of them at every decode step) is
            # answered here, a call less on a path walked once per request per step:
            # nothing to stage, and any count passes vLLM's `0 > free`
            queue = self.free_block_queue
            if queue._expected == 0 and not queue._staged:
                queue._expected = None
                queue._comparisons_seen = True
                return len(queue._retained)
            return queue.num_free_blocks

        def get_usage(self) -> float:
            allocator = self.free_block_queue._allocator
            used = allocator.used_blocks - 1 - self.free_block_queue.unused_blocks
            total = used + self.get_num_free_blocks()
            return 0.0 if total <= 0 else used / total

        def reset_prefix_cache(self) -> bool:
            queue = self.free_block_queue
            busy = queue._allocator.used_blocks - 1 - queue.unused_blocks
            if busy > 0:
                return False
            queue.unstage()
            queue.end_cooling()
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


def counted_for_the_comparison(original: Callable[..., int]) -> Callable[..., int]:
    """vLLM's `KVCacheCoordinator.get_num_blocks_to_allocate`, whose count (and the prefix
    hits it includes) the elastic free queue is told before vLLM compares it with the
    free blocks (Note [A counted block is a taken block]).

    vLLM calls it once per running request per step, by keyword (eight arguments in
    0.32), so the wrapper takes the original's own parameter list rather than `*args,
    **kwargs`: a generic wrapper spent ~750 ns a call repacking the keywords (against
    ~135 ns for one with the parameters spelled out, on the CPU machine), ~0.2 ms a step
    at 256 requests. The list is read from the signature once and written out as the
    wrapper's own (`_forwarding`); a signature it cannot copy gets the generic wrapper."""
    wrapper = _forwarding(original, "new_computed_blocks", _tell_the_queue)
    if wrapper is None:
        # where the prefix hits come among the positional arguments (self excluded),
        # found once: binding the signature at each call cost ~30 us
        names = list(inspect.signature(original).parameters)[1:]
        at = names.index("new_computed_blocks") if "new_computed_blocks" in names else None

        def generic(self: Any, *args: Any, **kwargs: Any) -> int:
            need = original(self, *args, **kwargs)
            hits = kwargs.get("new_computed_blocks")
            if hits is None and at is not None and at < len(args):
                hits = args[at]
            _tell_the_queue(self, need, hits)
            return need

        wrapper = generic
    return functools.wraps(original)(wrapper)


def _tell_the_queue(coordinator: Any, need: int, hits: Any) -> None:
    """The coordinator counted `need` blocks for a request, `hits` (its prefix hits, per
    KV cache group) among them: the elastic free queue's next count is the comparison
    (vLLM's own queue is told nothing). Sets the queue's fields itself rather than
    calling a method of it: this runs once per running request per step."""
    queue = coordinator.block_pool.free_block_queue
    if queue.__class__ is ElasticFreeQueue:
        queue._expected = need
        # vLLM counts each prefix hit that sits in the free queue as a block to
        # allocate, so a need of zero (most requests at a decode step) spares none
        queue._expected_hits = (hits or ()) if need else ()


def _forwarding(
    original: Callable[..., int], watched: str, tell: Callable[[Any, int, Any], None]
) -> Callable[..., int] | None:
    """A function with `original`'s parameters (names, kinds, defaults) that calls it with
    them, then `tell(self, result, <the argument named watched, or None>)`; None when the
    signature has `*args` / `**kwargs` or positional-only parameters (nothing to copy), or
    a name the function's own would clash with."""
    params = list(inspect.signature(original).parameters.values())
    plain = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    if not params or any(p.kind not in plain for p in params):
        return None
    if any(p.name == "result" or p.name.startswith("_") for p in params):
        return None  # would clash with the forwarding function's own names
    header: list[str] = []
    passed: list[str] = []
    names: dict[str, Any] = {"_original": original, "_tell": tell}
    for i, p in enumerate(params):
        if p.kind is inspect.Parameter.KEYWORD_ONLY and "*" not in header:
            header.append("*")
        if p.default is inspect.Parameter.empty:
            header.append(p.name)
        else:
            names[f"_default{i}"] = p.default
            header.append(f"{p.name}=_default{i}")
        keyword = p.kind is inspect.Parameter.KEYWORD_ONLY
        passed.append(f"{p.name}={p.name}" if keyword else p.name)
    this = params[0].name
    seen = watched if any(p.name == watched for p in params) else "None"
    source = (
        f"def forwarding({', '.join(header)}):\n"
        f"    result = _original({', '.join(passed)})\n"
        f"    _tell({this}, result, {seen})\n"
        "    return result\n"
    )
    exec(source, names)  # the source holds only the signature's own names
    made: Callable[..., int] = names["forwarding"]
    return made
