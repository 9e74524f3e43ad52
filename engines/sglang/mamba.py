"""Hybrid Mamba / Gated DeltaNet models: the state pool beside the KV pool.

SGLang 0.5.16 serves Qwen3-Next, Qwen3.5 and the other hybrid linear-attention models
with two pools. `HybridLinearKVPool` keeps the attention layers' K and V in a plain
`MHATokenToKVPool`, which the buffer hook serves as it serves any MHA model (one
segment per attention layer). `HybridReqToTokenPool` keeps a `MambaPool` of conv and
SSM state: a fixed number of slots, one per running request and one per prefix the
radix cache keeps, whose size does not follow tokens and which the linear-attention
kernels index by slot. kvcached leaves that pool as SGLang builds it and changes two
things about it:

* its size. SGLang sizes it inside the memory profile that `sizing.py` replaces
  (`KVCacheConfigurator._handle_max_mamba_cache`): `--max-mamba-cache-size` if given;
  else `--max-running-requests` if the radix cache is off; else
  `--mamba-full-memory-ratio` of the profiled memory. Under kvcached there is no
  profiled memory, only the device budget, and that share of a whole budget would be
  real memory the instance holds from start to exit, whatever its load. So here:
  `--max-mamba-cache-size` as given; else `--max-running-requests` times SGLang's
  slots per request (`_calculate_mamba_ratio`, which counts the radix cache's), with
  the radix cache on or off; else SGLang's share rule over what this instance may
  hold at most (its KVCACHED_INSTANCE_LIMIT, else the budget). SGLang's own
  `_handle_max_mamba_cache` then applies the size, so its checks and log lines stay.
* its charge. The state's bytes are charged to the instance's ledger row when the
  instance starts, for its whole life (`KVCache.charge_fixed`, from `instance.single`),
  so the budget and the other instances see the device's memory as it is, and the
  instance's limit bounds KV and state together: the KV allocator's free count leaves
  the state out of the limit, so SGLang is never promised pages the ledger refuses
  (an allocation SGLang was promised and does not get raises in its scheduler). A
  budget or limit without room for the state refuses at start-up.

`MambaRadixCache` evicts in its own LRU order (it has no eviction strategy to swap
and no `evictable_leaves`), and its `evictable_size()` raises; `eviction.py` uses its
`full_evictable_size()` and `evict` for the memory kvcached gives back.
With tensor parallelism every rank holds a state pool of its own (its shard of the
heads, the same size on every rank, as every rank sizes it from the same budget and
options): rank 0 charges one copy to every rank's device, all rows or none, for the
instance's life (`tensor_parallel.start_rank`), and each device's row leaves the copy
out of the KV pool's share of its limit.
"""

from __future__ import annotations

import logging
from typing import Any

from kvcached.engines.sglang.refusals import Refused

log = logging.getLogger("sglang.kvcached")

GIB = 1 << 30


def state_bytes_and_rest(configurator: Any, budget: int, limit: int | None) -> tuple[int, int]:
    """Size SGLang's state pool for a hybrid Mamba model (sets
    `server_args.max_mamba_cache_size` through SGLang's own rule); returns the state's
    bytes and the bytes left for the KV pool's virtual size (`budget` less the state)."""
    args = configurator.server_args
    if args.max_mamba_cache_size is None and args.max_running_requests is not None:
        slots = int(args.max_running_requests) * int(configurator._calculate_mamba_ratio())
        args.override("kvcached: mamba_pool.from_max_running_requests", max_mamba_cache_size=slots)
    most = budget if limit is None else min(budget, limit)
    rest_gib = configurator._handle_max_mamba_cache(most / GIB)  # SGLang's rules, in GiB
    state = max(0, most - int(rest_gib * GIB))
    if state >= most:
        raise Refused(
            f"the Mamba state pool ({args.max_mamba_cache_size} slots, {state} bytes) "
            f"leaves no room for the KV cache in this instance's {most} bytes; lower "
            "--max-mamba-cache-size or --max-running-requests, or raise "
            "KVCACHED_INSTANCE_LIMIT / the device budget"
        )
    log.info(
        "kvcached: the Mamba state pool holds %d slots, %d bytes, charged to this "
        "instance; the KV pool is sized for the other %d bytes of the budget",
        args.max_mamba_cache_size,
        state,
        budget - state,
    )
    return state, budget - state
