"""kvcached's SGLang hooks on a hybrid Mamba model's real pools (SGLang 0.5.16): the
attention layers' pool inside `HybridLinearKVPool` served by kvcached beside SGLang's
own `MambaPool`, the elastic allocator under `MambaRadixCache`, SGLang's idle invariant
check (whose total for these models is the allocator's size, the H200 run's failure of
2026-12-04) passing with every slot accounted for and failing with five lost, and the
cache giving its tokens back. Run in a fresh process (the hooks patch SGLang's classes):

    python mamba_hybrid.py DEVICE

with KVCACHED_BUDGET below the pool's virtual size (the device's case: available less
than SGLang's size), on the GPU by tests/test_sglang_real.py, on CPU by
scripts/sglang-real-cpu.sh.
"""

import sys
from array import array
from types import SimpleNamespace

import one_rank  # noqa: F401  (SGLang's parallel state for one process, first)
import torch
from sglang.srt.configs.qwen3_next import Qwen3NextConfig
from sglang.srt.managers.scheduler_components.invariant_checker import SchedulerInvariantChecker
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import InsertParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
from sglang.srt.mem_cache.mamba_radix_cache import MambaRadixCache
from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang.srt.runtime_context import get_context

from kvcached.engines.sglang import eviction, instance, mamba, register
from kvcached.engines.sglang.allocator import elastic_allocator

register()
HookRegistry.apply_hooks()


def sized(budget: int, limit: int | None, **options: object) -> tuple[int, int, object]:
    """kvcached's sizing of the state pool through SGLang's own rules (its configurator's
    `_handle_max_mamba_cache` and `_calculate_mamba_ratio`, on the options given)."""
    args = SimpleNamespace(max_mamba_cache_size=None, max_running_requests=None,
                           disable_radix_cache=False, mamba_full_memory_ratio=0.9,
                           disable_overlap_schedule=False, speculative_num_draft_tokens=None,
                           enable_mamba_extra_buffer=lambda: False)  # fmt: skip
    vars(args).update(options)
    args.override = lambda _source, **fields: vars(args).update(fields)
    found = SimpleNamespace(
        server_args=args, mambaish_config=SimpleNamespace(mamba2_cache_params=params),
        spec_algorithm=SimpleNamespace(is_none=lambda: True), ps=SimpleNamespace(attn_dp_size=1),
    )  # fmt: skip
    found._handle_max_mamba_cache = lambda rest: KVCacheConfigurator._handle_max_mamba_cache(
        found, rest
    )
    found._calculate_mamba_ratio = lambda: KVCacheConfigurator._calculate_mamba_ratio(found)
    state, rest = mamba.state_bytes_and_rest(found, budget, limit)
    return state, rest, args.max_mamba_cache_size


device, size = sys.argv[1], 1 << 14
config = Qwen3NextConfig(
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    full_attention_interval=4,
)
params = config.mamba2_cache_params
print("mamba layers", params.layers, "full", config.full_attention_layer_ids)
per_req = params.mamba_cache_per_req
GIB = 1 << 30
state, rest, slots = sized(40 * GIB, None, max_running_requests=16)
assert slots == 16 * 3 and state == 48 * per_req and rest == 40 * GIB - state, (state, slots)
state, rest, slots = sized(40 * GIB, 4 * GIB)  # no count: SGLang's share of the limit
assert abs(state - 4 * GIB * 0.9 / 1.9) <= per_req + 1, (state, slots)
print("sizing:", per_req, "bytes a request's state;", slots, "slots under a 4 GiB limit")
reqs = HybridReqToTokenPool(
    size=8,
    mamba_size=24,
    mamba_spec_state_size=8,
    max_context_len=512,
    device=device,
    enable_memory_saver=False,
    cache_params=params,
    mamba_layer_ids=params.layers,
    enable_mamba_extra_buffer=False,
)
pool = HybridLinearKVPool(
    size=size,
    dtype=torch.bfloat16,
    page_size=1,
    head_num=2,
    head_dim=64,
    full_attention_layer_ids=config.full_attention_layer_ids,
    device=device,
    mamba_pool=reqs.mamba_pool,
)
found = instance.current()
assert found is not None, "the attention layers' buffers were not served by kvcached"
assert pool.full_kv_pool.k_buffer[0].shape == (size + 1, 2, 64)
alloc = elastic_allocator(
    lambda _c: TokenToKVPoolAllocator(
        size, dtype=torch.bfloat16, device=device, kvcache=pool, need_sort=False
    ),
    None,
)
print("elastic", type(alloc).__name__, alloc.available_size(), "of", alloc.size)


get_context().set_server_args(SimpleNamespace(mamba_cache_chunk_size=64))
tree = MambaRadixCache(
    CacheInitParams(
        disable=False, req_to_token_pool=reqs, token_to_kv_pool_allocator=alloc, page_size=1
    )
)
slots = alloc.alloc(300)
assert slots is not None
pool.full_kv_pool.k_buffer[0][slots] = 1.5  # writes land in mapped memory and read back
assert bool((pool.full_kv_pool.k_buffer[0][slots] == 1.5).all())
state = reqs.mamba_allocator.alloc(1)
assert state is not None
tree.insert(
    InsertParams(key=RadixKey(array("q", range(1000, 1300))), value=slots, mamba_value=state)
)
print("cached", tree.full_evictable_size(), "tokens", tree.mamba_evictable_size(), "states")
assert eviction.evictable_tokens(tree) == 300

# SGLang's idle check: available + evictable + protected == the allocator's size for a
# hybrid Mamba model; kvcached's hook makes that size the elastic total meanwhile
checker = SimpleNamespace(
    is_hybrid_swa=False,
    is_hybrid_ssm=True,
    tree_cache=tree,
    token_to_kv_pool_allocator=alloc,
    max_total_num_tokens=size,
    server_args=SimpleNamespace(dcp_size=1),
    pool_stats_observer=SimpleNamespace(session_held_tokens=lambda: 0),
    _check_pool_invariant=SchedulerInvariantChecker._check_pool_invariant,
)


def stats():
    return SimpleNamespace(
        full_available_size=alloc.available_size(), full_evictable_size=tree.full_evictable_size()
    )


leak, message = SchedulerInvariantChecker._check_full_pool(checker, stats())
print("idle check:", leak, message)
assert not leak, message
assert alloc.size == size  # put back
lost = alloc.alloc(5)  # five slots SGLang lost track of: the check must see them
leak, message = SchedulerInvariantChecker._check_full_pool(checker, stats())
print("idle check, 5 slots lost:", leak, message)
assert leak, message
alloc.free(lost)

evicted, returned = eviction.give_back(tree, alloc, tokens=None)
print("give back:", evicted, returned, found)
assert evicted == 300 and found.allocator.used_blocks == 1, (evicted, found)
instance.close()
print("MAMBA-REAL-SGLANG-OK")
