"""Model Runner V2's warm-up runs on blocks kvcached has mapped.

Before serving, V2 (`vllm.v1.worker.gpu.warmup.warmup_kernels`, vLLM 0.26) runs a
prefill and a decode step to compile its kernels, with scheduler outputs it builds
itself: it numbers their KV blocks 1, 2, 3, ... up to a few thousand, without asking
the block pool. Those blocks are real KV writes and reads, and under kvcached a block
nobody allocated has no physical page: on the H200 that was an illegal memory access
(benchmarks/results/h200-2026-12-01). V1 warms up on block 0 only, which is pinned.

So the worker's `execute_model` that V2's warm-up calls is wrapped: each step's block
ids are swapped, one for one, for blocks taken from this process's allocator, and once
the warm-up has synchronized they are freed again. vLLM's own warm-up code runs
unchanged; it only sees other numbers. In a tensor-parallel engine the workers do not
own the allocator (they replay the scheduler's decisions), so V2 is refused there at
allocation time (`allocation.py`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

from kvcached.engines.vllm import instance
from kvcached.engines.vllm.refusals import Refused


class WarmupBlocks:
    """Lends allocator blocks to the warm-up's made-up block ids, one for one."""

    def __init__(self, allocator: Any) -> None:
        self._allocator = allocator
        self.lent: dict[int, int] = {instance.NULL_BLOCK: instance.NULL_BLOCK}

    def _lend(self, made_up: Iterable[int]) -> None:
        needed = sorted({b for b in made_up if b not in self.lent})
        if not needed:
            return
        blocks = self._allocator.alloc(len(needed))
        if blocks is None:
            raise Refused(
                f"vLLM's Model Runner V2 warms up on {len(self.lent) - 1 + len(needed)} KV "
                f"blocks and kvcached could supply only {self._allocator.obtainable_blocks()} "
                "more under the instance's limit and the device budget; raise "
                "KVCACHED_INSTANCE_LIMIT or the budget, lower max_num_seqs, or set "
                "VLLM_USE_V2_MODEL_RUNNER=0"
            )
        self.lent.update(zip(needed, blocks, strict=True))

    def _swap(self, groups: Any) -> Any:
        if groups is None:
            return None
        return tuple([self.lent[b] for b in group] for group in groups)

    def translate(self, scheduler_output: Any) -> Any:
        """Give `scheduler_output`'s made-up block ids real, mapped blocks (in place)."""
        new_requests = list(scheduler_output.scheduled_new_reqs)
        cached = scheduler_output.scheduled_cached_reqs
        cached_groups = list(cached.new_block_ids)
        self._lend(b for r in new_requests for group in r.block_ids for b in group)
        self._lend(b for groups in cached_groups if groups for group in groups for b in group)
        for request in new_requests:
            request.block_ids = self._swap(request.block_ids)
        cached.new_block_ids = [self._swap(groups) for groups in cached_groups]
        return scheduler_output

    def give_back(self) -> None:
        blocks = [b for made_up, b in self.lent.items() if made_up != instance.NULL_BLOCK]
        self.lent = {instance.NULL_BLOCK: instance.NULL_BLOCK}
        if blocks:
            self._allocator.free(blocks)


def on_kvcached_blocks(original: Callable[..., Any]) -> Callable[..., Any]:
    """`warmup_kernels(model_runner, worker_execute_model, worker_sample_tokens)`."""

    @functools.wraps(original)
    def warmup_kernels(model_runner: Any, execute_model: Any, *args: Any, **kwargs: Any) -> Any:
        served = instance.current()
        if served is None or served.closed:  # vLLM's own KV buffer: nothing to do
            return original(model_runner, execute_model, *args, **kwargs)
        blocks = WarmupBlocks(served.allocator)

        def execute_on_kvcached_blocks(scheduler_output: Any, *rest: Any, **kw: Any) -> Any:
            return execute_model(blocks.translate(scheduler_output), *rest, **kw)

        try:
            # vLLM's warm-up ends with a device synchronize, so no kernel still uses
            # the lent blocks when they go back
            return original(model_runner, execute_on_kvcached_blocks, *args, **kwargs)
        finally:
            blocks.give_back()

    return warmup_kernels
