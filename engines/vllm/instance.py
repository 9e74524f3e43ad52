"""The one kvcached instance of a vLLM engine process, and how it is named and sized.

The worker creates it when vLLM allocates its KV buffer (`allocation.py`): a
`KVCache` over a `BackingBuffer` with exactly vLLM's geometry, one ledger row, one
allocator. The scheduler's block pool (`block_pool.py`), built later in the same
process, finds it here and draws block ids from its allocator. Block 0 is vLLM's null
block (padded and dummy runs write to it): it is taken from the allocator as soon as
the cache exists, so its page is mapped before any warm-up run and is never handed
out or released. The instance is held in a `kvcached.supply.InstanceSlot`, as the SGLang
adapter's is.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from kvcached import config
from kvcached.backing import BackingBuffer
from kvcached.cache import KVCache, start_engine_cache
from kvcached.replay import RecordingBackend
from kvcached.supply import InstanceSlot

log = logging.getLogger("vllm.kvcached")  # shown by vLLM's own log handler

NULL_BLOCK = 0

#: this process's instance, and the model the engine core serves (names the ledger row)
slot: InstanceSlot[VllmInstance] = InstanceSlot()
#: the block count the engine core sized the pool with (None: not sized by kvcached)
planned_blocks: int | None = None
#: the engine core's executor, while it sizes the pool (to reach the workers)
executor: Any = None
#: in a worker of a tensor-parallel engine: its replica, and the ops it starts with
replica: Any = None
replica_ops: tuple[int, list[Any]] | None = None


def instance_name(model: str | None) -> str:
    """KVCACHED_INSTANCE_NAME, else ``vllm-<model folder>-<pid>``."""
    return config.instance_name("vllm", model)


class VllmInstance:
    """A vLLM engine's `KVCache`: its allocator, ledger row and pinned null block."""

    def __init__(
        self, backing: BackingBuffer, *, name: str, copies: Mapping[str | int, int] | None = None
    ) -> None:
        self.backing = backing
        recording = backing.backend if isinstance(backing.backend, RecordingBackend) else None
        self.recording = recording
        self.cache = KVCache(
            layout=backing,
            name=name,
            engine="vllm",
            backend=backing.backend,
            copies=copies,
            before_refund=None if recording is None else recording.wait_applied,
        )
        self.allocator = start_engine_cache(self.cache, "vLLM's null block")
        self.closed = False
        self.pool: Any = None  # the scheduler's block pool, once built in this process

    @property
    def name(self) -> str:
        return str(self.cache.account.name)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.recording is not None:
                self.recording.abandon()  # the workers are gone or going
            self.cache.close()

    def __repr__(self) -> str:
        return f"VllmInstance({self.name}, {self.allocator!r})"


def start(
    backing: BackingBuffer, *, model: str | None, copies: Mapping[str | int, int] | None = None
) -> VllmInstance:
    """Create this process's instance over `backing` (replacing an earlier one);
    `copies`: {device: processes holding its memory there} (tensor-parallel ranks
    replaying it; see `KVCache`), default this process alone."""
    made = slot.replace(lambda: VllmInstance(backing, name=instance_name(model), copies=copies))
    log.info("kvcached: %s, %r", made.name, backing)
    return made


def current() -> VllmInstance | None:
    """This process's instance, None before it is made and once it is closed."""
    return slot.current()


def recorder() -> RecordingBackend | None:
    """The op log of this process's instance when workers replay it, else None."""
    found = slot.current()
    return None if found is None else found.recording


def close() -> None:
    """Close this process's instance: pages unmapped, ledger row removed. Idempotent."""
    global replica
    slot.close()
    if replica is not None:
        replica.close()
        replica = None


def require() -> VllmInstance:
    found = slot.current()
    if found is None:
        raise RuntimeError(
            "kvcached: vLLM built its block pool before kvcached sized it (the engine "
            "core's KV initialisation did not run through the adapter). Unset "
            "ENABLE_KVCACHED to run without kvcached."
        )
    return found
