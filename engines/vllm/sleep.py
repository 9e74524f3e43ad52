"""Sleep mode: vLLM's own for the weights, kvcached's for the KV.

vLLM's sleep mode (`LLM(..., enable_sleep_mode=True)`, `vllm serve
--enable-sleep-mode`) keeps the weights in its `CuMemAllocator` pool, tagged
``weights``, and its KV buffer in the same pool, tagged ``kv_cache``. `EngineCore.sleep`
pauses the scheduler (clearing the prefix cache from level 1) and then has every
worker suspend that pool: level 1 copies the weights to host memory and drops the rest,
level 2 drops everything. `EngineCore.wake_up` maps the pool back.

With kvcached the KV buffer is not in that pool: it is a kvcached reservation whose
pages kvcached maps itself (`allocation.py`), so vLLM's sleep leaves the KV memory where
it is. The two wrappers here give it back and bring it back, around vLLM's own calls:

* `sleep` (level 1 or 2; level 0 only pauses and frees nothing): before vLLM's own
  sleep, each allocator of the instance stops growing ahead of demand and waits for
  the growth its pool thread has in flight (`PageAllocator.pause_growth`): vLLM's
  workers measure the device's free memory before and after they suspend their pool
  and fail the sleep when it went down ("memory usage increased after sleeping"), which
  a pool extent landing in between would do. Once vLLM has paused the scheduler,
  cleared the prefix cache (every block is back in kvcached, see
  `ElasticBlockPool.reset_prefix_cache`) and suspended its pool, each allocator is
  capped at 0 bytes. The cap releases every empty extent at once, and with no growth
  left in flight nothing lands after it; a release the pool thread already had under
  way (a row limit lowered just before) is waited for too, so the sleep returns with
  only what stays held. When vLLM's pause is still under way (a multiprocess engine
  with requests in flight) it returns a Future, and the trim waits for it; requests
  that finish meanwhile still grow on demand.
* `wake_up`, when the wake includes the KV (no tags, or ``kv_cache`` among them): the
  null block is mapped again before vLLM's own wake can resume the scheduler, and the
  caps are lifted, back to what each allocator had, after vLLM has mapped its pool back
  (the weights come first), and the pool threads grow ahead again, so KV memory grows
  as requests need it. A sleep that fails lets them grow again at once.

Note [The null block sleeps too]. vLLM's null block (block 0) is pinned for the
instance's lifetime (`instance.py`): padded and dummy runs write to it. Its extent is
the first one mapped, a whole extent (KVCACHED_EXTENT_SIZE per layer segment, over a
GiB for a 28-layer model), and a sleep that kept it would keep that. No step runs while
the engine sleeps, so when the null block is the only block held (no request kept its
blocks through the pause), the sleep frees it too and the instance holds nothing. The
wake takes it back first, with the allocator's limit at one page id for that moment, so
the extent it lands in is a single page id (block 0 of an empty book is the lowest
block of the lowest page id: Note [Filling pages]); if the budget has no room even for
that, the wake fails with `OutOfMemory` and the engine stays asleep, since a step that
wrote to an unmapped null block would fault on the device. A ledger row whose limit is
already below one page id when the engine goes to sleep keeps its null block: whoever
set it wants no KV there until they raise it, and may do so only after the wake (the
`kvcached serve` supervisor sets 0 before ``/sleep`` and restores the limit after
``/wake_up``), so a wake that needed the page first would fail.

Note [Sleeping with the allocator's own limit]. The cap is the allocator's own limit
(`PageAllocator.set_limit`), not the ledger row's. The row's limit belongs to whoever
shares the device out (`kvctl limit`, KVCACHED_INSTANCE_LIMIT, the `kvcached serve`
supervisor, which sets it to 0 itself before it calls ``/sleep`` and back after
``/wake_up``); the allocator follows the smaller of the two. A sleep that wrote the row
would have to restore a value that may have changed while it slept, and would undo a
`kvctl limit` given in between. With its own limit, a sleep changes nothing another
process set, and a row limit lowered during the sleep still holds after the wake.

Tensor parallelism (decision 0007): the allocator lives beside the scheduler, in the
engine-core process, and its releases reach the workers through the replay path. A
release is refunded only once every worker has unmapped it, and the workers hear of it
from this thread (no step runs while the engine sleeps), so the cap is set on a helper
thread while this one sends the pending ops to the workers (`flush_while_idle`, one
`collective_rpc` per round) until the release is done.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from kvcached.engines.vllm import instance
from kvcached.engines.vllm.instance import NULL_BLOCK
from kvcached.errors import OutOfMemory

log = logging.getLogger("vllm.kvcached")  # shown by vLLM's own log handler

#: how often (seconds) the engine thread sends pending ops while a TP release runs
FLUSH_EVERY_S = 0.01


@dataclass
class _Asleep:
    """An instance asleep: each allocator's own limit before the sleep, and whether the
    null block went back too (Note [The null block sleeps too])."""

    instance: instance.VllmInstance
    limits: tuple[int | None, ...]
    null_freed: bool


_asleep: _Asleep | None = None


def asleep() -> bool:
    """Whether this process's instance is asleep (its KV given back by `kv_to_nothing`)."""
    return _asleep is not None and _asleep.instance is instance.current()


def kv_to_nothing(engine: Any) -> None:
    """Cap every allocator of this process's instance at 0 bytes, releasing what is
    empty now (Note [Sleeping with the allocator's own limit]), the null block's page
    too when nothing else is held (Note [The null block sleeps too]); idempotent.
    `engine`: the engine core, whose executor reaches a tensor-parallel engine's
    workers."""
    global _asleep
    found = instance.current()
    if found is None or asleep():
        return
    allocators, first = found.cache.allocators, found.allocator
    state = _Asleep(found, tuple(allocator.limit for allocator in allocators), False)
    _asleep = state
    queue = getattr(found.pool, "free_block_queue", None)
    unstage = getattr(queue, "unstage", None)
    if unstage is not None:
        unstage()  # blocks a comparison staged that no request took (block_pool.py)

    def release() -> None:
        for allocator in allocators:
            allocator.pause_growth()  # already paused by the wrapper; idempotent
            allocator.set_limit(0)
        if _null_block_can_sleep(first):
            first.free([NULL_BLOCK])
            state.null_freed = True
            first.maintain()  # its extent is empty and over the limit: released now

    if found.recording is None:
        release()
        # a row limit lowered just before (the serve supervisor sets 0, then sleeps) has
        # the pool thread releasing too; what the sleep reports must be what stays held.
        # (With tensor parallelism the refund waits for the workers' next step: no wait.)
        for allocator in allocators:
            allocator.wait_released()
    else:
        _while_workers_replay(release, engine)
    _recount(found)
    log.info("kvcached: %s asleep: KV trimmed to %d bytes", found.name, found.cache.reserved_bytes)


def _null_block_can_sleep(allocator: Any) -> bool:
    """Only the null block is held, and the ledger row's limit leaves room to map it
    again at the wake (Note [The null block sleeps too])."""
    if allocator.used_blocks != 1 or not allocator.is_allocated(NULL_BLOCK):
        return False
    row_limit = allocator.account.limit
    return row_limit is None or row_limit >= allocator.group.page_id_bytes


def null_block_back(engine: Any) -> None:
    """Before vLLM wakes: map vLLM's null block again, in an extent of one page id
    (Note [The null block sleeps too]). Raises `OutOfMemory` when the device budget has
    no room for it; the engine then stays asleep and the wake can be asked for again."""
    held, found = _asleep, instance.current()
    if held is None or held.instance is not found or found is None or not held.null_freed:
        return
    allocator = found.allocator
    allocator.set_limit(allocator.group.page_id_bytes)  # the smallest extent there is
    block = allocator.alloc_one()
    if block != NULL_BLOCK:
        if block is not None:
            allocator.free([block])
        allocator.set_limit(0)
        raise OutOfMemory(
            f"kvcached could not map vLLM's null block again to wake {found.name} (got "
            f"{block!r}): the instance's limit or the device budget has no room for one "
            f"page id ({allocator.group.page_id_bytes} bytes); the engine stays asleep: "
            "free memory on the device (kvctl list) and wake it again"
        )
    held.null_freed = False
    if found.recording is not None:
        from kvcached.engines.vllm.replay import flush_while_idle

        flush_while_idle(engine)  # every worker maps it before any step


def kv_on_demand() -> None:
    """Lift the caps `kv_to_nothing` set: each allocator's own limit as before the
    sleep. Does nothing when the instance is not asleep."""
    global _asleep
    held, found = _asleep, instance.current()
    if held is None or held.instance is not found or found is None or held.null_freed:
        return  # not asleep, or the null block is not back (the wake failed)
    _asleep = None
    for allocator, limit in zip(found.cache.allocators, held.limits, strict=True):
        allocator.set_limit(limit)
        allocator.resume_growth()
    _recount(found)
    log.info("kvcached: %s awake: KV grows on demand again", found.name)


def _while_workers_replay(release: Callable[[], None], engine: Any) -> None:
    """Run `release` on a helper thread while this thread sends the ops it records to
    the workers, so that its refunds (which wait for them) complete."""
    from kvcached.engines.vllm.replay import flush_while_idle

    failed: list[BaseException] = []

    def run() -> None:
        try:
            release()
        except BaseException as exc:  # reported on the engine thread below
            failed.append(exc)

    helper = threading.Thread(target=run, name="kvcached-sleep", daemon=True)
    helper.start()
    while helper.is_alive():
        flush_while_idle(engine)
        helper.join(FLUSH_EVERY_S)
    flush_while_idle(engine)
    if failed:
        raise failed[0]


def pause_growth() -> None:
    """Before vLLM's own sleep: no allocator of this process's instance maps anything
    ahead of demand, and no growth is in flight (`PageAllocator.pause_growth`)."""
    found = instance.current()
    if found is None or asleep():
        return
    for allocator in found.cache.allocators:
        allocator.pause_growth()


def resume_growth() -> None:
    """A sleep that failed: the allocators grow ahead of demand again (not asleep)."""
    found = instance.current()
    if found is None or asleep():
        return
    for allocator in found.cache.allocators:
        allocator.resume_growth()


def _recount(found: instance.VllmInstance) -> None:
    queue = getattr(found.pool, "free_block_queue", None)
    supply = getattr(queue, "supply", None)
    if supply is not None:
        supply.recount()


def _wakes_kv(tags: list[str] | None) -> bool:
    return tags is None or "kv_cache" in tags


def trims_kv_on_sleep(original: Callable[..., Any]) -> Callable[..., Any]:
    """`EngineCore.sleep`: vLLM's sleep, then (level >= 1) the KV to nothing."""

    @functools.wraps(original)
    def sleep(self: Any, level: int = 1, *args: Any, **kwargs: Any) -> Any:
        if level < 1:
            return original(self, level, *args, **kwargs)  # a pause: nothing leaves
        pause_growth()  # nothing lands while vLLM measures what its sleep freed
        try:
            result = original(self, level, *args, **kwargs)
        except BaseException:
            resume_growth()
            raise
        if isinstance(result, Future):

            def after_pause(done: Future[Any]) -> None:
                if done.exception() is None:
                    kv_to_nothing(self)
                else:
                    resume_growth()

            result.add_done_callback(after_pause)
        else:
            kv_to_nothing(self)
        return result

    return sleep


def regrows_kv_on_wake(original: Callable[..., Any]) -> Callable[..., Any]:
    """`EngineCore.wake_up`: vLLM's wake (its pool mapped back), then the KV caps lifted
    when the wake includes the KV."""

    @functools.wraps(original)
    def wake_up(self: Any, tags: list[str] | None = None, *args: Any, **kwargs: Any) -> Any:
        if _wakes_kv(tags):
            null_block_back(self)  # before vLLM's scheduler can run a step
        result = original(self, tags, *args, **kwargs)
        if _wakes_kv(tags):
            kv_on_demand()
        return result

    return wake_up
