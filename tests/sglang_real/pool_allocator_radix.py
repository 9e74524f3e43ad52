"""kvcached's SGLang hooks on SGLang 0.5.16's real MHA pool, token and paged allocators
and radix cache: buffers served, writes landing in mapped memory, an allocation larger
than the pool answered None, held pages counted, and the radix cache giving every page
back. Run in a fresh process (the hooks patch SGLang's classes):

    python pool_allocator_radix.py PAGE_SIZE DEVICE

on the GPU by tests/test_sglang_real.py, on CPU by scripts/sglang-real-cpu.sh.
"""

import sys
from array import array

import one_rank  # noqa: F401  (SGLang's parallel state for one process, first)
import pool_stats
import torch
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import InsertParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang.srt.plugins.hook_registry import HookRegistry

from kvcached.engines.sglang import eviction, instance, register
from kvcached.engines.sglang.allocator import elastic_allocator

register()
HookRegistry.apply_hooks()
page_size, device, size = int(sys.argv[1]), sys.argv[2], 1 << 16
pool = MHATokenToKVPool(
    size,
    page_size=page_size,
    dtype=torch.bfloat16,
    head_num=8,
    head_dim=128,
    layer_num=4,
    device=device,
    enable_memory_saver=False,
)
found = instance.current()
assert found is not None, "the MHA buffers were not served by kvcached"
assert pool.k_buffer[0].shape == (size + page_size, 8, 128)


def build(_configurator: object) -> TokenToKVPoolAllocator | PagedTokenToKVPoolAllocator:
    """SGLang's own allocator for the page size, as its configurator builds it."""
    if page_size == 1:
        return TokenToKVPoolAllocator(
            size, dtype=torch.bfloat16, device=device, kvcache=pool, need_sort=False
        )
    return PagedTokenToKVPoolAllocator(
        size,
        page_size=page_size,
        dtype=torch.bfloat16,
        device=device,
        kvcache=pool,
        need_sort=False,
    )


alloc = elastic_allocator(build, None)
assert alloc.available_size() > 0 and alloc.stock_pages() == 0
slots = alloc.alloc(64 * page_size)
pool.k_buffer[3][slots] = 1.5  # writes land in mapped memory and read back
assert bool((pool.k_buffer[3][slots] == 1.5).all())
assert alloc.alloc(size + 2 * page_size) is None  # more than the pool: None, no raise
assert alloc.tokens_held() == 64 * page_size
tree = RadixCache(
    CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=page_size
    )
)
tokens = array("q", range(1000, 1000 + 64 * page_size))
tree.insert(InsertParams(key=RadixKey(tokens), value=slots))
# SGLang's pool statistics: the pool's used tokens of what it can hold now (the cached
# ones are evictable, not used), then a request's 32 pages
observer = pool_stats.observer(tree, alloc, max_total=size)
stats = observer.get_pool_stats()
assert (stats.full_num_used, stats.full_token_usage) == (0, 0.0), stats
running = alloc.alloc(32 * page_size)
stats = observer.get_pool_stats()
cached_and_free = 64 * page_size + stats.full_available_size
assert stats.full_num_used == 32 * page_size, stats
assert stats.full_token_usage == 32 * page_size / (32 * page_size + cached_and_free), stats
alloc.free(running)
evicted, returned = eviction.give_back(tree, alloc, tokens=None)
assert evicted == 64 * page_size and found.allocator.used_blocks == 1, (evicted, found)
instance.close()
print("REAL-SGLANG-OK")
