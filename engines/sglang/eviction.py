"""Giving memory back: the radix cache evicts the prefixes that empty whole pages first.

SGLang's `RadixCache.evict` frees leaves in its eviction policy's order (LRU by
default) until enough tokens are free. That is right when SGLang needs slots; when
kvcached must give *memory* back (the instance's limit was lowered, the device budget
has no room left, the instance has been idle), a freed slot on a page that other live
slots still use returns nothing. So `evict_emptying_pages` runs SGLang's own `evict`
with a different priority: the allocator's `release_order` of the leaves' pages
(pages with the fewest other live slots first, then the highest, so high extents
drain). `MambaRadixCache` (hybrid Mamba models, `mamba.py`) and `UnifiedRadixCache`
(hybrid sliding-window models, `swa.py`; asked for the window tokens too) evict in
their own order: the unified cache does rank its `evictable_device_leaves` by its
eviction strategy, but its nodes keep their slots per component, not in the `value`
the page-first order reads, so the order is left as SGLang has it (only a cost: more
prefixes may go before a page empties). The tree stays consistent (SGLang deletes the
leaves, records its events and metrics); only the order changes. The freed pages
land in the allocator's stock and `give_back` returns the stock to kvcached, whose
allocator releases extents once empty (after waiting for the device: `PageAllocator`
synchronises before it unmaps, so GPU work the overlap scheduler launched one batch
ahead finishes reading first).
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("sglang.kvcached")

_LAST = 1 << 62  # the rank of a page the order does not know (evicted last)


class _PageFirst:
    """An eviction strategy (SGLang's `EvictionStrategy` protocol): a node's priority is
    the best release rank of its pages."""

    def __init__(self, rank: dict[int, int], page_size: int) -> None:
        self._rank = rank
        self._page_size = page_size

    def get_priority(self, node: Any) -> int:
        value = getattr(node, "value", None)
        if value is None or len(value) == 0:
            return _LAST
        pages = (value // self._page_size).tolist()
        return min((self._rank.get(page, _LAST) for page in pages), default=_LAST)


def evict_emptying_pages(tree_cache: Any, allocator: Any, num_tokens: int) -> int:
    """Evict up to `num_tokens` cached tokens, those that empty pages first; returns the
    tokens evicted. `allocator` is SGLang's (elastic) allocator. A cache without
    `evictable_leaves` (`MambaRadixCache`, `UnifiedRadixCache`) evicts in its own
    order (the module's docstring says why)."""
    if num_tokens <= 0:
        return 0
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    if not hasattr(tree_cache, "evictable_leaves"):
        window = 0
        if tree_cache.supports_swa():  # a full token given back frees its window slot
            window = min(num_tokens, int(tree_cache.swa_evictable_size()))
        result = tree_cache.evict(EvictParams(num_tokens=num_tokens, swa_num_tokens=window))
        return int(getattr(result, "num_tokens_evicted", 0))
    leaves = list(tree_cache.evictable_leaves)
    if not leaves:
        return 0
    import torch

    page_size = allocator.page_size
    slots = torch.cat([leaf.value for leaf in leaves if leaf.value is not None])
    pages = sorted(set((slots // page_size).tolist()))
    order = allocator.kv_capacity.release_order(pages)
    rank = {page: i for i, page in enumerate(order)}
    usual = tree_cache.eviction_strategy
    tree_cache.eviction_strategy = _PageFirst(rank, page_size)
    try:
        result = tree_cache.evict(EvictParams(num_tokens=num_tokens))
    finally:
        tree_cache.eviction_strategy = usual
    return int(getattr(result, "num_tokens_evicted", 0))


def evictable_tokens(tree_cache: Any) -> int:
    """The KV tokens `tree_cache` could evict. `MambaRadixCache.evictable_size()` raises
    (it counts tokens and state slots apart): its `full_evictable_size()` is the tokens'.
    Every other cache answers `evictable_size()`; its `full_evictable_size()` is the base
    class's 0."""
    if tree_cache.supports_mamba():
        return int(tree_cache.full_evictable_size())
    return int(tree_cache.evictable_size())


def give_back(tree_cache: Any, allocator: Any, *, tokens: int | None) -> tuple[int, int]:
    """Evict `tokens` cached tokens (None: every evictable one) page-first, then return
    the stock to kvcached. Returns (tokens evicted, pages returned)."""
    evicted = 0
    if tree_cache is not None:
        want = tokens
        if want is None:
            want = evictable_tokens(tree_cache)
        evicted = evict_emptying_pages(tree_cache, allocator, want)
    returned = allocator.give_back_stock()
    return evicted, returned
