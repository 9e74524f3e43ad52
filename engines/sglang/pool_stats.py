"""SGLang's pool statistics (token usage, used tokens) measured against what an elastic
pool can hold now, not against its static size.

SGLang 0.5.16's `SchedulerPoolStatsObserver.get_pool_stats` counts a pool's used tokens
as its size less its free and evictable tokens, the size being `max_total_num_tokens`
(a plain pool), the allocator's `size` (a hybrid Mamba model's KV pool) or
`full_tokens_per_layer` / `swa_tokens_per_layer` (a hybrid sliding-window pair), and
the usage as used over size. With kvcached those sizes are virtual (`sizing.py`: what
the whole device budget could hold), while the free count is what the instance can
really have: its stock plus what its limit and the budget still allow. Against the
static size, the used count then includes memory other instances hold and the part
of the budget over this instance's limit (an idle instance under a limit of a quarter
of the budget read 75 % used), and the two pools of a sliding-window pair, whose free
counts share one room, read 24,577 and 8,193 tokens used while holding only 300 cached
ones (`tests/sglang_real/swa_hybrid.py`); and as the room goes to the pool short of
pages, a pool's free count can pass its static size less what it holds, a usage below
zero, which SGLang asserts against (`PoolStats.get_max_pool_usage`, on its metrics and
prefill-delayer paths).

The hook lets SGLang compute its statistics, then sets each elastic pool's used
tokens to what kvcached sees SGLang hold (`held_by_engine`: pages handed out and not
in the stock, as SGLang's own count includes a partly filled page) less the
evictable tokens, and its usage to used over used + evictable + free: the share of
what this instance could hold now that its requests hold. These are the figures of
the decode log line, `sglang:token_usage`, `sglang:num_used_tokens`, the load SGLang
reports to a router, and the prefill delayer's input. Free and evictable counts are
SGLang's own, unchanged; a Mamba state pool's figures are SGLang's (it is SGLang's
own pool, `mamba.py`).
"""

from __future__ import annotations

from typing import Any

from kvcached.engines.sglang import swa
from kvcached.engines.sglang.allocator import is_elastic


def usage_of_what_it_can_hold(original: Any, observer: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND `SchedulerPoolStatsObserver.get_pool_stats` (see the module docstring)."""
    stats = original(observer, *args, **kwargs)
    allocator = observer.token_to_kv_pool_allocator
    if swa.is_elastic_swa(allocator):
        stats.full_num_used, stats.full_token_usage = _used(
            allocator.full_attn_allocator, stats.full_available_size, stats.full_evictable_size
        )
        stats.swa_num_used, stats.swa_token_usage = _used(
            allocator.swa_attn_allocator, stats.swa_available_size, stats.swa_evictable_size
        )
    elif is_elastic(allocator):
        stats.full_num_used, stats.full_token_usage = _used(
            allocator, stats.full_available_size, stats.full_evictable_size
        )
    return stats


def _used(allocator: Any, available: int, evictable: int) -> tuple[int, float]:
    """Tokens an elastic pool's requests hold, and their share of what it can hold now
    (held by SGLang's requests and radix cache, and free)."""
    held = allocator.tokens_held()
    used = max(0, held - evictable)
    total = used + evictable + available
    return used, (used / total if total > 0 else 0.0)
