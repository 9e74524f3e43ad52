"""Lifecycle: upkeep on the scheduler's thread, and the cache closing at exit.

SGLang's scheduler, allocator and radix cache are single-threaded, so everything that
changes them runs on the scheduler's own thread, between batches:

* `upkeep_between_batches` wraps `Scheduler.get_next_batch_to_run`, the step every
  loop (normal and overlap) takes. At most every `BUSY_CHECK_S` it looks whether the
  instance is over its limit (`kvctl limit`, KVCACHED_INSTANCE_LIMIT) or the device
  budget is full (another instance wants to grow): then the stock goes back to
  kvcached and, over the limit, cached prefixes page-first until it fits; under budget
  pressure one extent's worth of cached prefixes at a time.
* `upkeep_idle` wraps `Scheduler.on_idle` (no batch ran, the scheduler is fully idle;
  SGLang calls it at least every second then): the same checks, and after
  KVCACHED_CACHE_IDLE_EVICT seconds of idleness every cached prefix and the
  stock go back, so an idle instance returns its memory.

With tensor parallelism every rank must give back the same pages at the same moment,
so rank 0 alone judges (`decide`, on its clock and its ledgers) and the judgement
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
import time
from typing import Any

from kvcached.engines.sglang import debug, eviction, instance

log = logging.getLogger("sglang.kvcached")

#: how often (seconds) a busy scheduler looks at its limit and the budget
BUSY_CHECK_S = 0.05
#: under budget pressure, at most this often (seconds) are the stock and a slice of the
#: cache given back
PRESSURE_EVICT_S = 0.5

atexit.register(instance.close)


class _Upkeep:
    def __init__(self) -> None:
        self.checked_at = 0.0
        self.pressure_checked_at = 0.0
        self.idle_since: float | None = None
        self.idle_done = False


_state = _Upkeep()


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


def busy_upkeep(allocator: Any, tree_cache: Any) -> None:
    capacity = allocator.kv_capacity
    excess = capacity.over_limit()
    if excess > 0:
        returned = allocator.give_back_stock()
        capacity.allocator.maintain()
        excess = capacity.over_limit()
        evicted = 0
        if excess > 0 and tree_cache is not None:
            tokens = -(-excess // capacity.bytes_per_token)
            evicted, more = eviction.give_back(tree_cache, allocator, tokens=tokens)
            returned += more
        if returned or evicted:
            log.info(
                "kvcached: over the limit: %d pages returned, %d cached tokens evicted",
                returned,
                evicted,
            )
        return
    now = time.monotonic()
    if now - _state.pressure_checked_at >= PRESSURE_EVICT_S and capacity.under_pressure():
        # at most every PRESSURE_EVICT_S: giving back reads the stock's ids (a GPU wait)
        # and what goes back may be needed again soon by this instance
        _state.pressure_checked_at = now
        group = capacity.allocator.group
        tokens = group.blocks_per_page * capacity.page_size  # one page id's worth
        eviction.give_back(tree_cache, allocator, tokens=tokens)
        capacity.allocator.trim(0)


def _checked(served: tuple[Any, Any]) -> None:
    """`busy_upkeep`, at most every BUSY_CHECK_S."""
    now = time.monotonic()
    if now - _state.checked_at >= BUSY_CHECK_S:
        _state.checked_at = now
        try:
            busy_upkeep(*served)
        except Exception:  # upkeep must never take the scheduler down
            log.exception("kvcached: upkeep failed")


def upkeep_between_batches(original: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND `Scheduler.get_next_batch_to_run`."""
    served = _served(scheduler)
    if served is not None and not _shared(served):
        _checked(served)
    plan = original(scheduler, *args, **kwargs)
    if getattr(plan, "batch_to_run", None) is not None:
        _state.idle_since = None
        _state.idle_done = False
    return plan


def upkeep_idle(original: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND `Scheduler.on_idle`."""
    served = _served(scheduler)
    if served is not None and _shared(served) and scheduler.is_fully_idle():
        if _state.idle_since is None:
            _state.idle_since = time.monotonic()  # rank 0's `decide` reads it
    elif served is not None and scheduler.is_fully_idle():
        allocator, tree_cache = served
        _checked(served)  # a limit lowered while idle is followed too
        try:
            debug.maybe_corrupt(allocator)
            now = time.monotonic()
            if _state.idle_since is None:
                _state.idle_since = now
            from kvcached.config import settings

            idle_for = float(settings().cache_idle_evict)
            if not _state.idle_done and now - _state.idle_since >= idle_for:
                _state.idle_done = True
                evicted, returned = eviction.give_back(tree_cache, allocator, tokens=None)
                allocator.kv_capacity.allocator.trim(0)
                log.info(
                    "kvcached: idle: %d cached tokens evicted, %d pages returned", evicted, returned
                )
        except Exception:
            log.exception("kvcached: idle upkeep failed")
    return original(scheduler, *args, **kwargs)


# ------------------------------------------------------------ tensor parallelism
Upkeep = tuple[str, int | None]  # ("limit" | "pressure" | "idle", tokens to evict or all)


def decide(found: Any, capacity: Any) -> Upkeep | None:
    """Rank 0, at every scheduler iteration: the memory every rank must give back now,
    if any (the same checks as `busy_upkeep` and `upkeep_idle`, at most every
    BUSY_CHECK_S, none while a release is still waiting for the ranks)."""
    now = time.monotonic()
    if found.pool_allocator is None or now - _state.checked_at < BUSY_CHECK_S:
        return None
    if capacity.releasing():
        return None
    _state.checked_at = now
    excess = capacity.over_limit()
    if excess > 0:
        return ("limit", -(-excess // capacity.bytes_per_token))
    if now - _state.pressure_checked_at >= PRESSURE_EVICT_S and capacity.under_pressure():
        _state.pressure_checked_at = now
        return ("pressure", capacity.page_id_tokens)
    from kvcached.config import settings

    idle_since = _state.idle_since
    idle_for = float(settings().cache_idle_evict)
    if idle_since is not None and not _state.idle_done and now - idle_since >= idle_for:
        return ("idle", None)
    return None


def carry_out(found: Any, capacity: Any, upkeep: Upkeep) -> None:
    """Every rank, the same `upkeep` at the same point: cached prefixes page-first and
    the stock go back (the same pages on every rank), then rank 0 releases what emptied."""
    kind, tokens = upkeep
    allocator = found.pool_allocator
    if allocator is None:
        return
    if kind == "idle":
        _state.idle_done = True
    evicted, returned = eviction.give_back(found.tree_cache, allocator, tokens=tokens)
    capacity.release_empty()
    if evicted or returned:
        log.info(
            "kvcached: %s: %d cached tokens evicted, %d pages returned", kind, evicted, returned
        )
