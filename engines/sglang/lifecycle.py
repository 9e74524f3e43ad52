"""Lifecycle: upkeep on the scheduler's thread, and the cache closing at exit.

SGLang's scheduler, allocator and radix cache are single-threaded, so everything that
changes them runs on the scheduler's own thread, between batches:

* `upkeep_between_batches` wraps `Scheduler.get_next_batch_to_run`, the step every
  loop (normal and overlap) takes. At most every `kvcached.supply.CHECK_S` it follows
  kvcached's Note [One reclaim policy] (`ElasticSupply.upkeep`): over the limit
  (`kvctl limit`, KVCACHED_INSTANCE_LIMIT), the stock goes back to kvcached and then
  cached prefixes page-first until it fits; under budget pressure (the budget is full
  and another instance draws on it, or, for a sliding-window pair, the two pools cannot
  grow together), the stock and an eighth of what it holds in cached prefixes.
* `upkeep_idle` wraps `Scheduler.on_idle` (no batch ran, the scheduler is fully idle;
  SGLang calls it at least every second then): it starts the supply's idle clock and
  runs the same upkeep, which after KVCACHED_CACHE_IDLE_EVICT seconds of idleness gives
  every cached prefix and the stock back, so an idle instance returns its memory.

What is given back and when is the core's; this module only says it in SGLang's terms
(the stock, radix-cache tokens: `evict_for`).

With tensor parallelism every rank must give back the same pages at the same moment,
so rank 0 alone judges (`decide`, on its supply's clock and ledgers) and the judgement
travels to every rank with the requests (`tensor_parallel.carries_decisions`), where
each rank carries it out (`carry_out`) at the same point of the same iteration. The
hooks above then only keep the idle clock.

Exit: an `atexit` hook closes the instance (pages unmapped, ledger row removed). A
scheduler process that SGLang kills closes nothing: the ledger reclaims its row once
the process is gone.
"""

from __future__ import annotations

import atexit
import logging
from typing import Any

from kvcached.engines.sglang import eviction, instance
from kvcached.supply import ElasticSupply, Reclaim

log = logging.getLogger("sglang.kvcached")

atexit.register(instance.close)


def _served(scheduler: Any) -> tuple[Any, Any] | None:
    """(SGLang's elastic allocator, radix cache) of this scheduler, if kvcached serves it."""
    found = instance.current()
    allocator = getattr(found, "pool_allocator", None)
    if allocator is None or getattr(scheduler, "token_to_kv_pool_allocator", None) is not allocator:
        return None
    tree_cache = getattr(scheduler, "tree_cache", None)
    found.tree_cache = tree_cache  # type: ignore[union-attr]  # for carry_out
    return allocator, tree_cache


def _shared(served: tuple[Any, Any]) -> bool:
    """Whether tensor-parallel ranks decide together (then rank 0 decides)."""
    return bool(getattr(served[0].kv_capacity, "shared", False))


def _deciding(capacity: Any) -> ElasticSupply | None:
    """The supply whose clock and ledgers decide: this process's own, or with tensor
    parallelism rank 0's (None on the other ranks)."""
    if getattr(capacity, "shared", False):
        local: ElasticSupply | None = capacity.local
        return local
    supply: ElasticSupply = capacity
    return supply


def _tokens(capacity: Any, nbytes: int | None) -> int | None:
    """Cached tokens that hold `nbytes` (None: every one)."""
    return None if nbytes is None else -(-nbytes // capacity.bytes_per_token)


def evict_for(allocator: Any, tree_cache: Any, reclaim: Reclaim) -> tuple[int, int]:
    """One process's pool gives back what `reclaim` asks, in SGLang's terms: the stock
    (unused pages) first, then cached prefixes page-first. Returns (tokens evicted,
    pages returned)."""
    capacity = allocator.kv_capacity
    if reclaim.reason != "limit":
        evicted, returned = eviction.give_back(
            tree_cache, allocator, tokens=_tokens(capacity, reclaim.nbytes)
        )
        return evicted, returned
    returned = allocator.give_back_stock()
    capacity.follow_limit()  # what emptied is released (both pools of a pair)
    excess = capacity.over_limit()
    if excess <= 0 or tree_cache is None:
        return 0, returned
    evicted, more = eviction.give_back(tree_cache, allocator, tokens=_tokens(capacity, excess))
    return evicted, returned + more


def _logged(reclaim: Reclaim, evicted: int, returned: int) -> None:
    if evicted or returned:
        level = logging.DEBUG if reclaim.reason == "pressure" else logging.INFO  # often
        log.log(
            level,
            "kvcached: %s: %d cached tokens evicted, %d pages returned",
            reclaim.reason,
            evicted,
            returned,
        )


def upkeep(allocator: Any, tree_cache: Any, *, idle: bool) -> Reclaim | None:
    """Note [One reclaim policy] for one process's pool, now (the hooks call it at most
    every CHECK_S). Returns what was given back, if anything."""
    capacity: ElasticSupply = allocator.kv_capacity

    def evict(reclaim: Reclaim) -> None:
        _logged(reclaim, *evict_for(allocator, tree_cache, reclaim))

    return capacity.upkeep(evict, idle=idle)


def _checked(served: tuple[Any, Any], *, idle: bool) -> None:
    """`upkeep`, at most every CHECK_S."""
    if not served[0].kv_capacity.check_due():
        return
    try:
        upkeep(*served, idle=idle)
    except Exception:  # upkeep must never take the scheduler down
        log.exception("kvcached: upkeep failed")


def upkeep_between_batches(original: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND `Scheduler.get_next_batch_to_run`."""
    served = _served(scheduler)
    if served is not None and not _shared(served):
        _checked(served, idle=False)
    plan = original(scheduler, *args, **kwargs)
    if served is not None and getattr(plan, "batch_to_run", None) is not None:
        supply = _deciding(served[0].kv_capacity)
        if supply is not None:
            supply.busy()
    return plan


def upkeep_idle(original: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND `Scheduler.on_idle`."""
    served = _served(scheduler)
    if served is not None and scheduler.is_fully_idle():
        supply = _deciding(served[0].kv_capacity)
        if supply is not None:
            supply.idle()  # with tensor parallelism, rank 0's `decide` reads it
        if not _shared(served):
            _checked(served, idle=True)  # a limit lowered while idle is followed too
    return original(scheduler, *args, **kwargs)


# ------------------------------------------------------------ tensor parallelism
Upkeep = tuple[str, int | None]  # ("limit" | "pressure" | "idle", tokens to evict or all)


def decide(found: Any, capacity: Any) -> Upkeep | None:
    """Rank 0, at every scheduler iteration: the memory every rank must give back now,
    if any (Note [One reclaim policy] on rank 0's supply, at most every CHECK_S, none
    while a release is still waiting for the ranks)."""
    local: ElasticSupply | None = capacity.local
    if found.pool_allocator is None or local is None or capacity.releasing():
        return None
    if not local.check_due():
        return None
    reclaim = local.decide(idle=True)  # the clock runs only while the scheduler is idle
    if reclaim is None:
        return None
    return (reclaim.reason, _tokens(capacity, reclaim.nbytes))


def carry_out(found: Any, capacity: Any, upkeep: Upkeep) -> None:
    """Every rank, the same `upkeep` at the same point: cached prefixes page-first and
    the stock go back (the same pages on every rank), then rank 0 releases what emptied."""
    kind, tokens = upkeep
    allocator = found.pool_allocator
    if allocator is None:
        return
    evicted, returned = eviction.give_back(found.tree_cache, allocator, tokens=tokens)
    capacity.release_empty()
    if evicted or returned:
        log.info(
            "kvcached: %s: %d cached tokens evicted, %d pages returned", kind, evicted, returned
        )
