"""Scheduler side: SGLang's own allocator, handing out only slots kvcached has mapped.

SGLang builds its allocator in `KVCacheConfigurator._build_token_to_kv_pool_allocator`:
`TokenToKVPoolAllocator` (page size 1) or `PagedTokenToKVPoolAllocator`. Both keep the
free pages in a device tensor (`free_pages`) that their Triton kernels read. The hook
lets SGLang build it, then gives the object an elastic subclass of its own class
(`__class__` is swapped; every method SGLang does not see changed stays SGLang's):

* `free_pages` starts empty and holds only pages taken from kvcached (the stock,
  `capacity.py`). Before an allocation the stock is topped up from kvcached to what
  the allocation needs, computed as SGLang computes it (`get_num_new_pages`), so the
  kernels only ever see mapped pages. Taking pages from kvcached's warm pool makes no
  driver call: growth happens on kvcached's pool thread, off the critical path.
* `available_size()` is the stock plus what kvcached can still supply. SGLang's
  admission (`PrefillAdder`), radix-cache eviction and decode retraction all read it,
  so running out of memory is SGLang's own queueing and retraction; an allocation
  fails only if another instance took the budget in the moment between (`capacity`).
* Freed pages go back to the stock (SGLang's code); the stock goes back to kvcached
  when memory must go (`eviction.py`), never on the hot path (reading the device
  tensor's ids waits for the GPU).
* `backup_state`/`restore_state` (a rolled-back allocation) keep pages topped up in
  between, and `clear()` (a cache flush) returns every page but the padding page.

The idle invariant check (`SchedulerInvariantChecker._check_full_pool`) requires
available + evictable + protected + session-held tokens to equal the pool's size. With
an elastic pool the size is what SGLang can count free plus what kvcached sees SGLang
hold, so the check still catches a page SGLang lost track of.
"""

from __future__ import annotations

import logging
from typing import Any

from kvcached.engines.sglang import instance, swa
from kvcached.engines.sglang.capacity import ElasticCapacity
from kvcached.engines.sglang.elastic_classes import TopsUpFirst, subclass_with
from kvcached.engines.sglang.refusals import Refused
from kvcached.supply import RACE_RETRY_S

log = logging.getLogger("sglang.kvcached")

#: what a top-up takes beyond the shortfall, in SGLang pages, when kvcached has it
#: (fewer, larger tensor concatenations; the pages stay in the stock for the next step)
TOP_UP_EXTRA = 256
#: with tensor parallelism a top-up is a broadcast to every rank: take more at once
SHARED_TOP_UP_EXTRA = 4 * TOP_UP_EXTRA


class ElasticAllocator(TopsUpFirst):
    """The methods of the elastic subclass of SGLang's allocator class (see the module
    docstring and `elastic_class`; how the class is made: `elastic_classes.py`). Its
    allocation calls top the stock up first (`TopsUpFirst`)."""

    free_pages: Any
    release_pages: Any
    page_size: int
    device: Any
    kv_capacity: ElasticCapacity  # or a tensor_parallel.SharedCapacity (same methods)
    _topped_since_backup: list[Any]

    def attach(self, capacity: ElasticCapacity) -> None:
        import torch

        self.kv_capacity = capacity
        self._topped_since_backup = []
        self.free_pages = torch.empty((0,), dtype=torch.int64, device=self.device)
        self.release_pages = torch.empty((0,), dtype=torch.int64, device=self.device)

    # -------------------------------------------------------------- the stock
    def stock_pages(self) -> int:
        return int(len(self.free_pages) + len(self.release_pages))

    def tokens_held(self) -> int:
        """Tokens SGLang's requests and radix cache hold in this pool (what kvcached
        handed out, less the stock and the pinned pages)."""
        return int(self.kv_capacity.held_by_engine(self.stock_pages()))

    def _top_up(self, pages: int, *, spare: bool = True, wait: float = RACE_RETRY_S) -> bool:
        """At least `pages` pages in the stock; `spare`: and `TOP_UP_EXTRA` more when
        kvcached has them at once. `wait`: how long a take the count promised may retry
        a race with the pool thread."""
        import torch

        short = pages - len(self.free_pages)
        if short <= 0:
            return True
        capacity = self.kv_capacity
        extra = SHARED_TOP_UP_EXTRA if capacity.shared else TOP_UP_EXTRA
        ids = None
        if spare and capacity.obtainable() >= short + extra:
            ids = capacity.take(short + extra, wait=0)
        if ids is None:
            ids = capacity.take(short, wait=wait)
        if ids is None:
            return False
        added = torch.tensor(ids, dtype=torch.int64, device=self.device)
        self.free_pages = torch.cat((self.free_pages, added))
        self._topped_since_backup.append(added)
        return True

    def give_back_stock(self) -> int:
        """Return every stock page to kvcached (reads the ids: waits for the GPU)."""
        import torch

        if self.stock_pages() == 0:
            return 0  # nothing to read: no wait for the GPU

        ids = torch.cat((self.free_pages, self.release_pages)).tolist()
        empty = torch.empty((0,), dtype=torch.int64, device=self.device)
        self.free_pages, self.release_pages = empty, empty.clone()
        self._topped_since_backup = []
        self.kv_capacity.give(ids)
        return len(ids)

    # ------------------------------------------------------- SGLang's contract
    def available_size(self) -> int:
        return int(self.kv_capacity.available(self.stock_pages()))

    def _ensure(self, pages: int) -> bool:
        return self._top_up(pages)

    def backup_state(self) -> Any:
        self._topped_since_backup = []
        return self._base.backup_state(self)

    def restore_state(self, state: Any) -> None:
        import torch

        self._base.restore_state(self, state)
        if self._topped_since_backup:  # pages taken in between are still ours
            self.free_pages = torch.cat((self.free_pages, *self._topped_since_backup))
            self._topped_since_backup = []

    def clear(self) -> None:
        self._base.clear(self)
        capacity = getattr(self, "kv_capacity", None)
        if capacity is None:
            return  # SGLang's own __init__ (the class is swapped afterwards)
        held = capacity.held_pages()
        self.attach(capacity)
        capacity.give(held)

    def resize(self, config: Any) -> None:
        raise Refused("resizing the pool after start-up (post-capture KV sizing) is not supported")


_SERVED = ("TokenToKVPoolAllocator", "PagedTokenToKVPoolAllocator")
_classes: dict[type, type] = {}


def elastic_class(cls: type) -> type:
    """SGLang's allocator class `cls` with `ElasticAllocator` mixed in (cached)."""
    return subclass_with(cls, ElasticAllocator, _classes)


def is_elastic(allocator: Any) -> bool:
    return type(allocator) in _classes.values()


def elastic_allocator(original: Any, configurator: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND `KVCacheConfigurator._build_token_to_kv_pool_allocator`."""
    built = original(configurator, *args, **kwargs)
    found = instance.current()
    if found is None:
        raise Refused(
            "SGLang built its token allocator for a KV pool kvcached does not serve "
            "(the pool's buffers were not created through the adapter)"
        )
    name = type(built).__name__
    if name == "SWATokenToKVPoolAllocator":  # a hybrid sliding-window model's pair
        swa.make_elastic(built, found, elastic_class)
        found.pool_allocator = built
        log.info("kvcached: %s over %r", type(built).__name__, found.capacity)
        return built
    if name not in _SERVED:
        served = ", ".join((*_SERVED, "SWATokenToKVPoolAllocator"))
        raise Refused(f"SGLang's {name} is not supported; the adapter serves {served}")
    if int(built.page_size) != found.geometry.page_size:
        raise Refused(f"allocator page size {built.page_size} != pool page size")
    built.__class__ = elastic_class(type(built))
    built.attach(found.capacity)
    found.pool_allocator = built
    log.info("kvcached: %s over %r", type(built).__name__, found.capacity)
    return built


def checks_elastic_capacity(original: Any, checker: Any, ps: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND `SchedulerInvariantChecker._check_full_pool`: the total it checks against
    is the elastic capacity: what SGLang counted free plus what kvcached sees it hold.
    SGLang reads that total from `max_total_num_tokens`, or, for hybrid Mamba models,
    from the allocator's `size`, or, for hybrid sliding-window models, from
    `full_tokens_per_layer` (their window pool: `swa.checks_window_capacity`): each
    stands at the elastic total during the check."""
    allocator = checker.token_to_kv_pool_allocator
    if swa.is_elastic_swa(allocator):  # a hybrid sliding-window pair: its full pool
        return swa.checks_full_capacity(original, checker, ps, *args, **kwargs)
    if not is_elastic(allocator):
        return original(checker, ps, *args, **kwargs)
    elastic_total = ps.full_available_size + allocator.tokens_held()
    static_total = checker.max_total_num_tokens
    # a hybrid Mamba model's check takes its total from the allocator's size instead
    hybrid = bool(getattr(checker, "is_hybrid_ssm", False))
    static_size = allocator.size if hybrid else None
    checker.max_total_num_tokens = elastic_total
    if hybrid:
        allocator.size = elastic_total
    try:
        return original(checker, ps, *args, **kwargs)
    finally:
        checker.max_total_num_tokens = static_total
        if hybrid:
            allocator.size = static_size
