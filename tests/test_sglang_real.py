"""The adapter's hooks against SGLang 0.5.16's real pool, allocators and radix cache, on
the GPU (pytest -m gpu, with SGLang importable: PYTHONPATH=/tmp/site-sglang on the
device). Each case runs in a fresh process: the hooks patch SGLang's classes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

_PROGRAM = textwrap.dedent(
    """
    import sys
    from array import array

    import torch
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.mem_cache.allocator import (
        PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator)
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    from kvcached.engines.sglang import eviction, instance, register
    from kvcached.engines.sglang.allocator import elastic_allocator

    register()
    HookRegistry.apply_hooks()
    page_size, device, size = int(sys.argv[1]), sys.argv[2], 1 << 16
    pool = MHATokenToKVPool(size, page_size=page_size, dtype=torch.bfloat16, head_num=8,
                            head_dim=128, layer_num=4, device=device,
                            enable_memory_saver=False)
    found = instance.current()
    assert found is not None, "the MHA buffers were not served by kvcached"
    assert pool.k_buffer[0].shape == (size + page_size, 8, 128)
    if page_size == 1:
        build = lambda _c: TokenToKVPoolAllocator(
            size, dtype=torch.bfloat16, device=device, kvcache=pool, need_sort=False)
    else:
        build = lambda _c: PagedTokenToKVPoolAllocator(
            size, page_size=page_size, dtype=torch.bfloat16, device=device, kvcache=pool,
            need_sort=False)
    alloc = elastic_allocator(build, None)
    assert alloc.available_size() > 0 and alloc.stock_pages() == 0
    slots = alloc.alloc(64 * page_size)
    pool.k_buffer[3][slots] = 1.5  # writes land in mapped memory and read back
    assert float(pool.k_buffer[3][slots].float().mean()) == 1.5
    assert alloc.alloc(size + 2 * page_size) is None  # more than the pool: None, no raise
    cap = alloc.kv_capacity
    assert cap.held_by_engine(alloc.stock_pages()) == 64 * page_size
    tree = RadixCache(CacheInitParams(disable=False, req_to_token_pool=None,
                                      token_to_kv_pool_allocator=alloc, page_size=page_size))
    tokens = array("q", range(1000, 1000 + 64 * page_size))
    tree.insert(InsertParams(key=RadixKey(tokens), value=slots))
    evicted, returned = eviction.give_back(tree, alloc, tokens=None)
    assert evicted == 64 * page_size and found.allocator.used_blocks == 1, (evicted, found)
    instance.close()
    print("REAL-SGLANG-OK")
    """
)


@pytest.mark.parametrize("page_size", [1, 16])
def test_the_hooks_serve_sglangs_own_pool_allocator_and_radix_cache(
    page_size: int, tmp_path: Path
) -> None:
    pytest.importorskip("sglang", reason="needs SGLang 0.5.16 (PYTHONPATH=/tmp/site-sglang)")
    env = dict(os.environ, ENABLE_KVCACHED="1", KVCACHED_LEDGER_DIR=str(tmp_path),
               KVCACHED_BUDGET="4GiB")  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-c", _PROGRAM, str(page_size), "cuda"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert "REAL-SGLANG-OK" in done.stdout, done.stdout[-2000:] + done.stderr[-4000:]
