"""SGLang's pool statistics over a program's allocator and radix cache, built as its
scheduler builds the observer (no batches, sessions, Mamba pool or HiSparse here)."""

from typing import Any

from sglang.srt.managers.scheduler_components.pool_stats_observer import (
    SchedulerPoolStatsObserver,
)


def observer(
    tree: Any, allocator: Any, *, max_total: int, swa_sizes: tuple[int, int] | None = None
) -> SchedulerPoolStatsObserver:
    """`swa_sizes`: a sliding-window pair's static (full, window) token counts."""
    full, window = swa_sizes if swa_sizes is not None else (None, None)
    return SchedulerPoolStatsObserver(
        tree_cache=tree,
        token_to_kv_pool_allocator=allocator,
        req_to_token_pool=None,
        session_controller=None,
        hisparse_coordinator=None,
        is_hybrid_swa=swa_sizes is not None,
        is_hybrid_ssm=False,
        enable_hisparse=False,
        full_tokens_per_layer=full,
        swa_tokens_per_layer=window,
        max_total_num_tokens=max_total,
        get_last_batch=lambda: None,
        get_running_batch=lambda: None,
    )
