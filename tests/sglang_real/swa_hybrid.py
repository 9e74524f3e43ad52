"""kvcached's SGLang hooks on a hybrid sliding-window model's real pools (SGLang 0.5.16):
`SWAKVPool`'s full-attention and window pools both served by kvcached in one instance
(two page-id groups, one ledger row; rows of one width as GPT-OSS's, and of two as
Gemma 4's), `SWATokenToKVPoolAllocator` made elastic with
free counts that split the budget between the pools, `UnifiedRadixCache` giving both
pools' tokens back, and SGLang's idle invariant checks of both pools passing with every
slot accounted for and failing with five lost. Run in a fresh process (the hooks patch
SGLang's classes):

    python swa_hybrid.py DEVICE

with KVCACHED_BUDGET below the two pools' virtual sizes together (each pool alone
could fill it), on the GPU by tests/test_sglang_real.py, on CPU by
scripts/sglang-real-cpu.sh.
"""

import os
import sys
from array import array
from types import SimpleNamespace

import one_rank  # noqa: F401  (SGLang's parallel state for one process, first)
import pool_stats
import torch
from sglang.srt.managers.scheduler_components.invariant_checker import SchedulerInvariantChecker
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import InsertParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
from sglang.srt.mem_cache.unified_cache_components import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.plugins.hook_registry import HookRegistry

from kvcached.engines.sglang import eviction, instance, register
from kvcached.engines.sglang.allocator import elastic_allocator

register()
HookRegistry.apply_hooks()
# no pages mapped ahead of demand, so that the room the counts split is all unmapped (a
# pool thread's mapping ahead is simulated below, where it would race an allocation)
os.environ["KVCACHED_POOL_LOW"] = "0"

device = sys.argv[1]
full_size, window_size, heads, width = 1 << 16, 1 << 15, 2, 64
pool = SWAKVPool(
    size=full_size,
    size_swa=window_size,
    page_size=1,
    dtype=torch.bfloat16,
    head_num=heads,
    head_dim=width,
    swa_attention_layer_ids=[0, 2, 4],
    full_attention_layer_ids=[1, 3, 5],
    device=device,
)
found = instance.current()
assert found is not None and found.window is not None, "kvcached did not serve both pools"
cache = found.cache
assert cache is not None and len(cache.allocators) == 2
assert [a.used_blocks for a in cache.allocators] == [1, 1]  # each pool's padding page
assert pool.full_kv_pool.k_buffer[0].shape == (full_size + 1, heads, width)
assert pool.swa_kv_pool.v_buffer[2].shape == (window_size + 1, heads, width)
assert float(pool.swa_kv_pool.k_buffer[0][0].float().abs().sum()) == 0.0  # padding zeroed

alloc = elastic_allocator(
    lambda _c: SWATokenToKVPoolAllocator(
        full_size, window_size, 1, torch.bfloat16, device, kvcache=pool, need_sort=False
    ),
    None,
)
print("elastic", type(alloc).__name__, alloc.full_available_size(), alloc.swa_available_size())
# a token costs a slot in both pools, of the same bytes here. The budget is below the
# two pools' sizes together: a count that gave each pool the whole room would promise
# the same bytes twice. Pages already mapped (the rest of each padding page id) cost
# no room; the growth beyond them must fit the room once, less whole page ids
per_token = 2 * 3 * heads * width * 2  # K and V, 3 layers, bf16, in each pool
budget = cache.ledger.budget
room = budget - cache.account.reserved
full_free, window_free = alloc.full_available_size(), alloc.swa_available_size()
mapped = [a.mapped_free_blocks() for a in cache.allocators]
print("budget", budget, "room", room, "free", full_free, window_free, "mapped", mapped)
assert full_free <= full_size and window_free <= window_size
growth = (full_free - mapped[0]) * per_token + (window_free - mapped[1]) * per_token
assert growth <= room, f"the free counts promise {growth} bytes of growth in {room}"
assert growth >= room // 2, f"the free counts promise too little: {growth} of {room}"

# what both counts promise is there: SGLang's allocation of it succeeds, even when,
# between the count and the allocation, the full pool's pool thread mapped pages ahead
# that took the room the window pool was promised (kvcached gives them back first)
promised = min(full_free, window_free)
ahead = cache.allocators[0].alloc(room // per_token)
assert ahead is not None
cache.allocators[0].free(ahead)  # mapped, empty: as a pool thread leaves them
assert cache.account.reserved >= budget - 2 * (12 << 20), "the room was not taken"
slots = alloc.alloc(promised)
assert slots is not None, "an allocation within both free counts failed"
swa_slots = alloc.full_to_swa_index_mapping[slots]
assert bool((swa_slots > 0).all()), "a full slot without its window slot"
pool.full_kv_pool.k_buffer[1][slots] = 1.5  # writes land in mapped memory and read back
pool.swa_kv_pool.k_buffer[0][swa_slots] = 2.5
assert bool((pool.full_kv_pool.k_buffer[1][slots] == 1.5).all())
assert bool((pool.swa_kv_pool.k_buffer[0][swa_slots] == 2.5).all())
more = alloc.alloc(max(alloc.full_available_size(), alloc.swa_available_size()) + 3 * 8192)
assert more is None, "an allocation past the budget succeeded"
held_before = [a.used_blocks for a in cache.allocators]
print("allocated", promised, "tokens; kvcached blocks held", held_before)

# a token that left every window gives its window slot back, the full slot stays
window_before = alloc.swa_available_size()
alloc.free_swa(slots[:500])
assert alloc.swa_available_size() >= window_before + 500
assert bool((alloc.full_to_swa_index_mapping[slots[:500]] == 0).all())
alloc.free(slots)  # the request ends: SGLang frees both (the window's once)

# SGLang's radix cache of these models keeps a finished request's 300 tokens, full and
# window KV
tree = UnifiedRadixCache(
    CacheInitParams(
        disable=False,
        req_to_token_pool=None,
        token_to_kv_pool_allocator=alloc,
        page_size=1,
        sliding_window_size=128,
        tree_components=(ComponentType.FULL, ComponentType.SWA),
    )
)
kept = alloc.alloc(300)
assert kept is not None
tree.insert(InsertParams(key=RadixKey(array("q", range(1000, 1300))), value=kept))
print("cached", tree.full_evictable_size(), "full,", tree.swa_evictable_size(), "window tokens")
assert eviction.evictable_tokens(tree) == 300

checker = SimpleNamespace(
    is_hybrid_swa=True,
    is_hybrid_ssm=False,
    tree_cache=tree,
    token_to_kv_pool_allocator=alloc,
    full_tokens_per_layer=full_size,
    swa_tokens_per_layer=window_size,
    server_args=SimpleNamespace(dcp_size=1),
    pool_stats_observer=SimpleNamespace(
        session_held_full_tokens=lambda: 0, session_held_swa_tokens=lambda: 0
    ),
    _check_pool_invariant=SchedulerInvariantChecker._check_pool_invariant,
)


def stats():
    return SimpleNamespace(
        full_available_size=alloc.full_available_size(),
        full_evictable_size=tree.full_evictable_size(),
        swa_available_size=alloc.swa_available_size(),
        swa_evictable_size=tree.swa_evictable_size(),
    )


CHECKS = (SchedulerInvariantChecker._check_full_pool, SchedulerInvariantChecker._check_swa_pool)
for check in CHECKS:
    leak, message = check(checker, stats())
    print("idle check:", leak, message)
    assert not leak, message
assert (checker.full_tokens_per_layer, checker.swa_tokens_per_layer) == (full_size, window_size)
lost = alloc.alloc(5)  # five slots SGLang lost track of, in both pools: both checks see them
for check in CHECKS:
    leak, message = check(checker, stats())
    print("idle check, 5 slots lost:", leak, message)
    assert leak, message
alloc.free(lost)

# SGLang's pool statistics (its decode log, token-usage metrics and prefill delayer)
# count each pool's used tokens of what it can hold now, not of its static size
observer = pool_stats.observer(tree, alloc, max_total=full_size, swa_sizes=(full_size, window_size))
ps = observer.get_pool_stats()
static = (
    full_size - ps.full_available_size - ps.full_evictable_size,
    window_size - ps.swa_available_size - ps.swa_evictable_size,
)
print("pool stats, only the cache:", ps, "; against the static sizes, used", static)
assert (ps.full_num_used, ps.swa_num_used, ps.get_max_pool_usage()) == (0, 0, 0.0)
running = alloc.alloc(700)
assert running is not None
ps = observer.get_pool_stats()
print("pool stats, 700 tokens running:", ps)
assert (ps.full_num_used, ps.swa_num_used) == (700, 700)
assert ps.full_token_usage == 700 / (700 + 300 + ps.full_available_size)
assert ps.swa_token_usage == 700 / (700 + 300 + ps.swa_available_size)
assert ps.get_max_pool_usage() == max(ps.full_token_usage, ps.swa_token_usage) > 0
alloc.free(running)

evicted, returned = eviction.give_back(tree, alloc, tokens=None)
print("give back:", evicted, "tokens,", returned, "pages;", found)
assert evicted == 300 and tree.full_evictable_size() == 0 and tree.swa_evictable_size() == 0
assert [a.used_blocks for a in cache.allocators] == [1, 1], "a pool kept pages"
instance.close()

# Gemma 4's case: the pools' rows differ (window layers 2 heads x 64, full layers 2
# heads x 128), as SGLang builds them from its swa_* arguments
wide = SWAKVPool(
    size=1 << 14,
    size_swa=1 << 13,
    page_size=1,
    dtype=torch.bfloat16,
    head_num=heads,
    head_dim=2 * width,
    swa_attention_layer_ids=[0, 1, 3, 4],
    full_attention_layer_ids=[2, 5],
    device=device,
    swa_head_num=heads,
    swa_head_dim=width,
    swa_v_head_dim=width,
    v_head_dim=2 * width,
)
found = instance.current()
assert found is not None and found.window is not None and found.cache is not None
assert wide.full_kv_pool.k_buffer[0].shape == ((1 << 14) + 1, heads, 2 * width)
assert wide.swa_kv_pool.v_buffer[3].shape == ((1 << 13) + 1, heads, width)
rows = [group.block_bytes for group in found.cache.layout.groups]
assert rows == [heads * 2 * width * 2, heads * width * 2], rows
alloc = elastic_allocator(
    lambda _c: SWATokenToKVPoolAllocator(
        1 << 14, 1 << 13, 1, torch.bfloat16, device, kvcache=wide, need_sort=False
    ),
    None,
)
slots = alloc.alloc(1000)
assert slots is not None
wide.full_kv_pool.v_buffer[1][slots] = 3.5
wide.swa_kv_pool.k_buffer[3][alloc.full_to_swa_index_mapping[slots]] = 4.5
# every element, not the mean: CUDA's float32 mean of these 256,000 values came out
# 3.5000002 (H100, 2026-12-05), with every one of them 3.5
assert bool((wide.full_kv_pool.v_buffer[1][slots] == 3.5).all())
alloc.free(slots)
print("two widths:", rows, "bytes a row;", found)
instance.close()


def pair(size: int, size_swa: int, page_size: int) -> tuple[SWAKVPool, object]:
    """A one-layer-each pair of SGLang pages of `page_size` tokens, made elastic."""
    kv = SWAKVPool(
        size=size,
        size_swa=size_swa,
        page_size=page_size,
        dtype=torch.bfloat16,
        head_num=heads,
        head_dim=width,
        swa_attention_layer_ids=[0],
        full_attention_layer_ids=[1],
        device=device,
    )
    made = elastic_allocator(
        lambda _c: SWATokenToKVPoolAllocator(
            size, size_swa, page_size, torch.bfloat16, device, kvcache=kv, need_sort=False
        ),
        None,
    )
    return kv, made


# pages of 128 tokens: the full pool's top-up with its spare pages (256 SGLang pages,
# several page ids) takes room the joint count gave the window pool. Both stocks still
# fill, and no take waits out the supply's race window on the scheduler's thread
import kvcached.supply as supply  # noqa: E402

_, alloc = pair(2048 * 128, 2048 * 128, 128)
found = instance.current()
assert found is not None and found.cache is not None
found.cache.set_limit(40 << 20)  # page ids of 4 MiB a pool: the spare is 4 of them
pages = min(alloc.full_available_size(), alloc.swa_available_size()) // 128
waits: list[float] = []
real_sleep = supply.time.sleep
supply.time.sleep = lambda seconds: (waits.append(seconds), real_sleep(seconds))[1]
try:
    assert alloc._ensure(pages), "the pages both counts promised could not be stocked"
finally:
    supply.time.sleep = real_sleep
stocks = (alloc.full_attn_allocator.stock_pages(), alloc.swa_attn_allocator.stock_pages())
print("pages of 128:", pages, "promised, stocks", stocks, "; waits", len(waits))
assert min(stocks) >= pages and not waits, f"{len(waits)} waits for a take on the scheduler"
instance.close()

# a window size of no whole number of pages (SGLang's configurator caps the window pool
# at --max-total-tokens): SGLang's pages are 1 to size // page_size, and kvcached hands
# out no other, nor counts more free than the size (SGLang asserts it at every free)
_, alloc = pair(256 * 16, 1000, 16)
window = alloc.swa_attn_allocator
assert window.num_pages == 1000 // 16
free_now = alloc.swa_available_size()
assert free_now <= 1000, f"the window pool counts {free_now} free of 1000"
assert alloc._ensure(free_now // 16), "the window's free pages could not be stocked"
highest = int(window.free_pages.max())  # every page the window pool was handed
assert highest <= window.num_pages, f"window page {highest} past SGLang's {window.num_pages}"
# what SGLang's SWATokenToKVPoolAllocator.free asserts of both pools at every free
for sub in (window, alloc.full_attn_allocator):
    assert sub.available_size() <= sub.size, f"{sub.available_size()} free of {sub.size}"
print("window of 1000 tokens:", free_now, "free, highest page", highest)
instance.close()

# decoding past the window: SGLang gives back the window slots of tokens that left it
# (free_swa), and those slots, free in mapped pages, cost no room. The room under the
# limit then goes to the full pool alone (capacity.joint_level): its count is the room
# in full-pool slots, about twice the even split of both pools' growth (the counts until
# 2026-12-05), and an allocation of what both counts promise succeeds
_, alloc = pair(1 << 18, 1 << 17, 1)
found = instance.current()
assert found is not None and found.cache is not None
decoded = alloc.alloc(40000)
assert decoded is not None
alloc.free_swa(decoded[:39000])  # all but the last 1,000 tokens left the window
found.cache.set_limit(found.cache.account.reserved + (12 << 20))
capacity = found.capacity
full_free, window_free = alloc.full_available_size(), alloc.swa_available_size()
costs = capacity._costs()
room = capacity.room()
mapped = [a.mapped_free_blocks() for a in found.cache.allocators]
spare = room - sum(page_id for page_id, _ in costs)
even = (
    mapped[0]
    + alloc.full_attn_allocator.stock_pages()
    + int(spare // sum(page_id / pages for page_id, pages in costs))
)
print("past the window: full", full_free, "window", window_free, "free; even split", even)
assert full_free > 1.5 * even, f"the full pool counts {full_free}, the even split {even}"
took = alloc.alloc(min(full_free, window_free))
assert took is not None, "an allocation within both free counts failed"
assert bool((alloc.full_to_swa_index_mapping[took] > 0).all())
alloc.free(took)
alloc.free(decoded)
instance.close()

print("SWA-REAL-SGLANG-OK")
