"""Hybrid sliding-window models: SGLang's two KV pools, both elastic, on one ledger row.

SGLang 0.5.16 serves GPT-OSS, Gemma 4 (and Llama 4, MiMo-V2, Step 3.5) with two pools
(`SWAKVPool`): a `MHATokenToKVPool` for the full-attention layers and one for the
sliding-window layers, of different token counts and, for Gemma 4, of different head
counts and widths. `SWATokenToKVPoolAllocator` keeps a sub-allocator per pool and a
full-to-window slot map: every token takes a slot in both, and SGLang frees the window
slot of a token that has left every window (`free_swa`) while its full slot stays.
Its radix cache (`UnifiedRadixCache`) evicts full and window tokens apart.

kvcached serves both pools, each as it serves one MHA pool (`buffers.py`):

* the buffers: while `SWAKVPool.__init__` runs (`builds_both_pools`), each sub-pool's
  buffers are views of a reservation of its own; when both exist, one `KVCache` over
  the two (`kvcached.backing.BackingSet`) gives each pool its own page ids and
  allocator, both charging the instance's one ledger row (`instance.hybrid`), and pins
  each pool's padding page.
* the allocators: each sub-allocator is elastic (`allocator.ElasticAllocator`) over its
  pool's pages. The composite (`ElasticSWAAllocator`) counts free memory *jointly*:
  both pools draw on one row's limit and the device budget, and a new token costs a
  page in each, so each pool's free count is its stock and mapped pages, raised to
  the level the shared room allows both at once, the pool short of pages growing
  first (`capacity.joint_level`: window slots SGLang gave back as tokens left the
  window cost no room, which then goes to the full pool);
  counting the whole room for each pool would promise the same bytes twice, SGLang
  would admit a batch on both counts, and the allocation would then fail as SGLang's
  `RuntimeError("Prefill out of memory")`. Before SGLang's code allocates, both
  pools' stocks are topped up, so it never takes a full slot and then finds the
  window pool short (its `alloc_decode` would not give the first back).
* SGLang's idle invariant check compares each pool's free, cached and protected
  tokens with the pool's static size: both totals stand at the elastic one during the
  check (`allocator.checks_elastic_capacity`, `checks_window_capacity`).
* giving memory back (`eviction.py`) evicts cached tokens of both pools, and the
  reclaim policy sees the instance's two pools as one holding (`HybridCapacity`).

SGLang's own sizing stays: its `HybridSWAPoolConfigurator` turns the bytes the hook of
`sizing.py` gives it (the budget) into the two pools' token counts, in its ratio
(`--swa-full-tokens-ratio`), so full and window pools together could hold the budget.
Not served: tensor parallelism (rank 0 would decide two pools for every rank), models
with no full-attention layer (`PureSWATokenToKVPoolAllocator`), and page-major or
mxfp8 window pools (refused by `buffers.py` as for one pool).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from kvcached.backing import BackingBuffer
from kvcached.engines.sglang import instance
from kvcached.engines.sglang.capacity import HybridCapacity
from kvcached.engines.sglang.elastic_classes import TopsUpFirst, subclass_with
from kvcached.engines.sglang.geometry import PoolGeometry
from kvcached.engines.sglang.refusals import Refused
from kvcached.supply import COUNT_REFRESH_S

log = logging.getLogger("sglang.kvcached")


class _Part(NamedTuple):
    """A sub-pool not yet in an instance: what `buffers._views` needs of it, and what
    `instance.hybrid` takes."""

    geometry: PoolGeometry
    backing: BackingBuffer


class _Building:
    """The sub-pools' reservations while `SWAKVPool.__init__` runs, in build order."""

    def __init__(self) -> None:
        self.parts: list[_Part] = []
        self.backend: Any = None

    def add(self, geometry: PoolGeometry, backend: Any) -> _Part:
        self.backend = backend
        part = _Part(geometry, geometry.backing(backend))
        self.parts.append(part)
        return part

    def close(self) -> None:
        for part in self.parts:
            part.backing.close()


_building: _Building | None = None


def building() -> _Building | None:
    """The hybrid pool under construction in this process, if any (`buffers.py`)."""
    return _building


def builds_both_pools(original: Any, pool: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND `SWAKVPool.__init__`: both sub-pools' buffers over kvcached reservations,
    then one instance over the two (see the module docstring)."""
    global _building  # a second model's pools are refused by buffers.py's first check
    if kwargs.get("full_attention_layer_ids") == []:
        raise Refused(
            "models whose every layer is a sliding-window layer (SGLang's "
            "PureSWATokenToKVPoolAllocator) are not supported yet"
        )
    made = _Building()
    _building = made
    try:
        original(pool, *args, **kwargs)
    except BaseException:
        made.close()
        raise
    finally:
        _building = None
    if len(made.parts) != 2:
        made.close()
        raise Refused(
            f"SGLang's SWAKVPool built {len(made.parts)} KV buffer sets through the "
            "adapter; it serves the plain full + sliding-window pair"
        )
    window, full = made.parts  # SGLang builds the window pool first
    model = instance.slot.planned_model
    found = instance.start_hybrid(full, window, made.backend, model=model)
    for sub in (pool.full_kv_pool, pool.swa_kv_pool):  # padding pages start clean
        for view in (*sub.k_buffer, *sub.v_buffer):
            view[: sub.page_size].zero_()
    log.info(
        "kvcached serves the hybrid sliding-window pools: %d full-attention layers "
        "(%d tokens), %d window layers (%d tokens), %r",
        pool.full_layer_nums,
        pool.size,
        pool.swa_layer_nums,
        pool.size_swa,
        found,
    )
    return None


class ElasticSWAAllocator(TopsUpFirst):
    """The methods of the elastic subclass of SGLang's `SWATokenToKVPoolAllocator` (made
    as `allocator.elastic_class` makes one for a plain allocator: `elastic_classes.py`):
    joint free counts, both stocks topped up before SGLang allocates (`TopsUpFirst`),
    both given back together."""

    full_attn_allocator: Any  # SGLang's sub-allocators, made elastic
    swa_attn_allocator: Any
    page_size: int
    kv_capacity: HybridCapacity
    _takes_page_count = False
    _counted: tuple[float, int, int, int, int] | None

    def attach(self, capacity: HybridCapacity, elastic_class: Callable[[type], type]) -> None:
        """Over `capacity`; each sub-allocator gets `elastic_class` of its own class
        (`allocator.elastic_class`, passed in: that module builds on this one)."""
        self.kv_capacity = capacity
        self._counted = None
        for sub, its in (
            (self.full_attn_allocator, capacity),
            (self.swa_attn_allocator, capacity.window),
        ):
            sub.__class__ = elastic_class(type(sub))
            sub.attach(its)

    # ------------------------------------------------------------- counting
    def _free_pages(self) -> tuple[int, int]:
        full, window = self.full_attn_allocator, self.swa_attn_allocator
        stocks = (full.stock_pages(), window.stock_pages())
        now = time.monotonic()
        kept = self._counted
        if kept is not None and now - kept[0] <= COUNT_REFRESH_S and kept[1:3] == stocks:
            return kept[3], kept[4]
        counts = self.kv_capacity.free_pages(*stocks)
        self._counted = (now, *stocks, *counts)
        return counts

    def full_available_size(self) -> int:
        return self._free_pages()[0] * self.page_size

    def swa_available_size(self) -> int:
        return self._free_pages()[1] * self.page_size

    def available_size(self) -> int:
        return min(self._free_pages()) * self.page_size

    def stock_pages(self) -> int:
        """The full-attention pool's stock (the pool whose allocator is the instance's)."""
        return int(self.full_attn_allocator.stock_pages())

    # -------------------------------------------------------- both stocks first
    def _ensure(self, pages: int) -> bool:
        """Both stocks hold `pages` pages, or False. The free counts promised them, but
        one pool's growth can take room the count gave the other (pages mapped ahead
        by its pool thread, or a top-up's spare pages): then the spare pages and the
        empty extents go back, and both are topped up again with no spare. The first
        pass does not wait: a take that fails there has mostly lost its room to the
        other pool, which a wait would not bring back (it held the scheduler for the
        supply's race window, 2 s, with SGLang pages of 128 tokens)."""
        self._counted = None
        full, window = self.full_attn_allocator, self.swa_attn_allocator
        if full._top_up(pages, wait=0) and window._top_up(pages, wait=0):
            return True
        for sub in (full, window):
            if sub.stock_pages() > pages:
                sub.give_back_stock()
        self.kv_capacity.make_room()
        return bool(full._top_up(pages, spare=False) and window._top_up(pages, spare=False))

    def give_back_stock(self) -> int:
        """Both stocks back to kvcached (reads the ids: waits for the GPU)."""
        self._counted = None
        full = self.full_attn_allocator.give_back_stock()
        return int(full + self.swa_attn_allocator.give_back_stock())

    def resize(self, config: Any) -> None:
        raise Refused("resizing the pool after start-up (post-capture KV sizing) is not supported")


_classes: dict[type, type] = {}


def elastic_swa_class(cls: type) -> type:
    """SGLang's `SWATokenToKVPoolAllocator` class `cls` with `ElasticSWAAllocator`'s
    methods (cached)."""
    return subclass_with(cls, ElasticSWAAllocator, _classes)


def is_elastic_swa(allocator: Any) -> bool:
    return type(allocator) in _classes.values()


def make_elastic(
    built: Any, found: instance.SglangInstance, elastic_class: Callable[[type], type]
) -> None:
    """Give SGLang's `SWATokenToKVPoolAllocator` `built` the elastic class over the
    instance's two pools, its sub-allocators `elastic_class` of theirs
    (`allocator.elastic_allocator` calls it)."""
    window = found.window
    if window is None or not isinstance(found.capacity, HybridCapacity):
        raise Refused(
            "SGLang built a sliding-window allocator over a pool kvcached serves as one "
            "pool; the adapter serves SGLang's SWAKVPool pair"
        )
    for sub, pool in ((built.full_attn_allocator, found), (built.swa_attn_allocator, window)):
        if int(sub.page_size) != pool.geometry.page_size:
            raise Refused(f"allocator page size {sub.page_size} != pool page size")
    built.__class__ = elastic_swa_class(type(built))
    built.attach(found.capacity, elastic_class)


def _against_elastic_total(
    original: Any,
    checker: Any,
    ps: Any,
    total: str,
    pool: Any,
    available: int,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """SGLang's idle check of one pool, with the checker's static `total` for that pool
    standing at the elastic one during it: SGLang's free count (`available`) plus what
    kvcached sees SGLang hold in it (`pool`, an elastic sub-allocator)."""
    static = getattr(checker, total)
    setattr(checker, total, available + pool.tokens_held())
    try:
        return original(checker, ps, *args, **kwargs)
    finally:
        setattr(checker, total, static)


def checks_full_capacity(original: Any, checker: Any, ps: Any, *args: Any, **kwargs: Any) -> Any:
    """The full pool's idle check of an elastic pair (`allocator.checks_elastic_capacity`
    hands it over): its total is `full_tokens_per_layer`."""
    allocator = checker.token_to_kv_pool_allocator
    return _against_elastic_total(
        original, checker, ps, "full_tokens_per_layer", allocator.full_attn_allocator,
        ps.full_available_size, *args, **kwargs,
    )  # fmt: skip


def checks_window_capacity(original: Any, checker: Any, ps: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND `SchedulerInvariantChecker._check_swa_pool`: the window pool's total,
    `swa_tokens_per_layer`, is its elastic one during the check."""
    allocator = checker.token_to_kv_pool_allocator
    if not is_elastic_swa(allocator):
        return original(checker, ps, *args, **kwargs)
    return _against_elastic_total(
        original, checker, ps, "swa_tokens_per_layer", allocator.swa_attn_allocator,
        ps.swa_available_size, *args, **kwargs,
    )  # fmt: skip
