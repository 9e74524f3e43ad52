"""Lifecycle: the cache closes with the engine, and idle engines give memory back.

Shutdown. `EngineCore.shutdown` stops the executor (workers finish their last kernels)
and then the kvcached instance closes: pages unmapped, ledger row removed, before the
interpreter tears modules down (closing later logs `LedgerError`s from half-destroyed
objects). An `atexit` hook covers engines that are never shut down explicitly. A
SIGKILLed engine closes nothing: the ledger reclaims its row once the process is gone.

Idle upkeep. A separate engine process (the default, and `vllm serve`) blocks on its
input queue while no request runs, so nothing would evict the retained prefix-cache
blocks of an idle instance. A small timer thread watches for that and, when there is
work (an instance holding retained blocks that kvcached's Note [One reclaim policy]
says must go back: over its limit, under budget pressure, or idle long enough, see
`ElasticFreeQueue.upkeep_due`), asks the engine loop to run the upkeep on its own
thread: it queues the upkeep as an idle-state callback and wakes the loop with vLLM's
own no-op WAKEUP request. An in-process engine (`LLM` with
VLLM_ENABLE_V1_MULTIPROCESSING=0) has no loop: its limit and pressure checks ride on the
scheduler's next call, and its idle eviction waits for an upkeep call.
"""

from __future__ import annotations

import atexit
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kvcached.engines.vllm import instance

log = logging.getLogger("vllm.kvcached")  # shown by vLLM's own log handler

#: how often (seconds) the timer thread looks at an idle engine
IDLE_TICK_S = 0.25

atexit.register(instance.close)


def scheduler_and_worker_share_a_process(original: Callable[..., Any]) -> Callable[..., Any]:
    """`Executor.get_class` that picks vLLM's in-process executor for a single worker:
    the scheduler owns the allocator and the worker's KV buffer must be in its process."""

    @functools.wraps(original)
    def get_class(vllm_config: Any) -> Any:
        parallel = vllm_config.parallel_config
        if getattr(parallel, "world_size", 1) == 1:
            from vllm.v1.executor.uniproc_executor import UniProcExecutor

            return UniProcExecutor
        return original(vllm_config)

    return staticmethod(get_class)


def closes_kvcached_first(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def shutdown(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, *args, **kwargs)
        finally:
            instance.close()

    return shutdown


def _upkeep_due(idle_for: float) -> bool:
    recording = instance.recorder()
    if recording is not None and recording.pending:
        return True  # releases wait for the workers to replay them
    found = instance.current()
    queue = getattr(getattr(found, "pool", None), "free_block_queue", None)
    return queue is not None and bool(queue.upkeep_due(idle_for))


def _watch(engine: Any) -> None:
    from vllm.v1.engine import EngineCoreRequestType

    from kvcached.config import settings

    idle_for = float(settings().cache_idle_evict)
    has_work = getattr(engine, "has_work", None)

    def upkeep(_engine: Any = None) -> None:  # vLLM passes the engine to its callbacks
        from kvcached.engines.vllm.replay import flush_while_idle

        found = instance.current()
        pool = getattr(found, "pool", None)
        if pool is None:
            return
        try:
            pool.free_block_queue.idle_upkeep(idle_for)  # logs what it evicts
            flush_while_idle(engine)
        except Exception:  # upkeep must never take the engine down; it retries next tick
            log.exception("kvcached: idle upkeep failed")

    while instance.current() is not None:  # the engine closed it: nothing left to watch
        time.sleep(IDLE_TICK_S)
        busy = has_work() if callable(has_work) else False
        if not busy and _upkeep_due(idle_for):
            engine._idle_state_callbacks.append(upkeep)
            engine.input_queue.put_nowait((EngineCoreRequestType.WAKEUP, None))


def maintains_when_idle(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def process_input_queue(self: Any) -> Any:
        if not getattr(self, "_kvcached_watcher", None) and instance.current() is not None:
            self._kvcached_watcher = threading.Thread(
                target=_watch, args=(self,), name="kvcached-idle", daemon=True
            )
            self._kvcached_watcher.start()
        return original(self)

    return process_input_queue
