"""Engine core: the block pool's size comes from kvcached, not from a memory profile.

vLLM turns "bytes available for KV" into a block count once, at start-up, and
allocates exactly that. With kvcached the count is *virtual*: as many blocks as the
device ledger's whole budget could hold (so an instance can grow into all of it when
the others are idle), while physical memory follows use. The wrapper replaces the
profiled figure with that capacity (`num_gpu_blocks_override`, which vLLM honours in
both 0.26 and 0.32), so no `gpu_memory_utilization` or `kv_cache_memory_bytes` guess is
needed; what the profile measured is ignored. The instance's own limit
(KVCACHED_INSTANCE_LIMIT, `kvctl limit`) is enforced by the allocator at run time.

Before sizing, it refuses what the adapter does not support (`refusals.py`).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from typing import Any

from kvcached import config
from kvcached.engines.vllm import instance, refusals
from kvcached.engines.vllm.groups import largest_page

log = logging.getLogger("vllm.kvcached")  # shown by vLLM's own log handler

#: vLLM keeps a Python object per block; past this many the pool costs more than it helps.
MAX_BLOCKS = 1 << 18


def plan_blocks(page_bytes: int, num_layers: int, granularity: int, budget: int) -> int:
    """Blocks of `num_layers` pages of `page_bytes` that `budget` bytes hold, as a
    multiple of what makes every layer's run of blocks whole page ids."""
    multiple = math.lcm(granularity, page_bytes) // page_bytes
    count = min(budget // (page_bytes * num_layers), MAX_BLOCKS)
    return max(multiple, count // multiple * multiple)


def _worker_devices() -> dict[str | int, int]:
    """{device: ranks on it} of a tensor-parallel engine's workers."""
    from collections import Counter

    from kvcached.engines.vllm.replay import device_of_worker

    executor = instance.executor
    if executor is None:
        raise refusals.Refused("the engine core's executor is out of the adapter's reach")
    return dict(Counter[str | int](executor.collective_rpc(device_of_worker)))


def _start_scheduler_instance(
    backend: Any, kv_cache_config: Any, devices: dict[str | int, int]
) -> None:
    """Tensor parallel: the scheduler's instance records its decisions; the workers,
    told the plan and the null block's first ops, replay them (replay.py). Each
    worker's copy is charged to its own device's ledger (two GPUs: two ledgers)."""
    from kvcached.engines.vllm.allocation import geometry_of
    from kvcached.engines.vllm.replay import plan_on_worker
    from kvcached.replay import RecordingBackend

    executor = instance.executor
    assert executor is not None  # _worker_devices() reached it
    recording = RecordingBackend.standing_in_for(backend)
    geometry = geometry_of(kv_cache_config, recording.granularity)
    backing = geometry.backing(recording)
    instance.start(backing, model=instance.slot.planned_model, copies=devices)
    first, ops = recording.take()
    executor.collective_rpc(plan_on_worker, args=(instance.planned_blocks, first, ops))


def remembers_executor(original: Callable[..., Any]) -> Callable[..., Any]:
    """`EngineCore._initialize_kv_caches`: sizing may need to reach the workers."""

    @functools.wraps(original)
    def initialize_kv_caches(self: Any, *args: Any, **kwargs: Any) -> Any:
        instance.executor = self.model_executor
        try:
            return original(self, *args, **kwargs)
        finally:
            instance.executor = None

    return initialize_kv_caches


def sized_by_kvcached(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def get_kv_cache_configs(
        vllm_config: Any, kv_cache_specs: list[dict[str, Any]], available_memory: list[int]
    ) -> Any:
        from kvcached.cache import open_device_ledger
        from kvcached.registry import get_backend

        specs = refusals.check(vllm_config, kv_cache_specs)
        backend = get_backend()
        with open_device_ledger(backend) as ledger:
            budget = ledger.budget
        page = largest_page(specs)  # every KV cache group's page is unified to it
        layers = len(kv_cache_specs[0])
        granularity = backend.granularity
        one_page_id = math.lcm(granularity, page) * layers
        limit = config.instance_limit(budget)
        if limit is not None and limit < one_page_id:
            raise refusals.Refused(
                f"KVCACHED_INSTANCE_LIMIT is {limit} bytes, below the {one_page_id} bytes of "
                f"one page id of this model ({layers} layers x "
                f"{math.lcm(granularity, page)} bytes), which vLLM's null block needs; "
                "give at least that"
            )
        # one copy of the KV slice per rank; ranks sharing a device share its budget
        devices = _worker_devices() if len(kv_cache_specs) > 1 else {}
        blocks = plan_blocks(page, layers, granularity, budget // max(devices.values(), default=1))
        vllm_config.cache_config.num_gpu_blocks_override = blocks
        memory = [blocks * page * len(worker) for worker in kv_cache_specs]
        configs = original(vllm_config, kv_cache_specs, memory)
        instance.planned_blocks = int(configs[0].num_blocks)
        instance.slot.planned_model = getattr(vllm_config.model_config, "model", None)
        if devices:
            _start_scheduler_instance(backend, configs[0], devices)
        log.info(
            "kvcached: %d virtual KV blocks (%d bytes each) over a %d-byte device budget",
            instance.planned_blocks,
            page * layers,
            budget,
        )
        return configs

    return get_kv_cache_configs
