"""`KVCache`: one engine instance's elastic KV cache, wired to the device's ledger.

This is the piece an engine adapter creates once per model instance. It puts the
layers together: the process's backend (`kvcached.get_backend()`), the device ledger
(opened, or created with the device's budget, and one row registered for this
instance), a `KVLayout` for the model's layers and one `PageAllocator` per layout group,
all charging the one ledger row. Adapters then only translate: block ids in and out
(`alloc`, `free`) and tensors for the attention kernels (`view`).

Several groups share one ledger row, but each allocator reports the bytes its live
blocks hold on its own, so the row's `used` is kept as their sum by `_GroupAccount`.

The ledger's budget is fixed by whoever creates it: `budget=` here, else
KVCACHED_BUDGET (a size, or a percentage of the device's memory), else all of the
device's memory; `kvctl budget` changes it later. Once the ledger exists, a budget
asked for here is ignored, with a warning that names the ledger's budget.

With KVCACHED_METRICS_PORT set, the first `KVCache` of a process starts the
Prometheus endpoint (`kvcached.metrics.start_from_settings`); it serves every ledger
of this user until the process exits, and a process that finds the port taken
leaves it to whoever holds it.

A constructor that fails part-way closes what it built (allocators and their pool
threads, reservations, the ledger row), and a forked child cannot use the parent's
caches: every method but `close` raises, and `close` gives nothing back (the pages
and the ledger row are the parent's).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvcached.allocator import PageAllocator
from kvcached.backend import Backend
from kvcached.config import parse_size, settings
from kvcached.errors import InvalidArgument
from kvcached.layout import KVLayout, LayerSpec, Part
from kvcached.ledger import Ledger, LedgerAccount, ledger_key
from kvcached.lifetime import Closeable


def open_device_ledger(backend: Backend, budget: int | str | None = None) -> Ledger:
    """The ledger of `backend`'s device, created with `budget` (else KVCACHED_BUDGET,
    else all of the device's memory) if it does not exist yet."""
    total = backend.mem_info()[1]
    requested = budget if budget is not None else settings().budget
    device_budget = (
        total
        if requested is None
        else parse_size(
            requested, total=total, what="budget" if budget is not None else "KVCACHED_BUDGET"
        )
    )
    if budget is not None:
        source: str | None = f"KVCache(budget={budget!r})"
    else:
        source = None if requested is None else f"KVCACHED_BUDGET={requested}"
    return Ledger.open(
        ledger_key(backend.name, backend.device),
        budget=device_budget,
        budget_source=source,  # an existing ledger keeps its budget: say so
    )


class _GroupAccount:
    """One group's view of the instance's ledger row: charges go straight through,
    `set_used` reports the sum over the groups.

    `scale`: the row is charged this many bytes per byte the allocator maps (an
    allocator whose decisions several processes carry out, one copy each: replay.py).
    `before_refund`: called before bytes go back to the row (to wait until those
    processes have unmapped them)."""

    def __init__(
        self,
        row: LedgerAccount,
        used: list[int],
        index: int,
        lock: threading.Lock,
        scale: int = 1,
        before_refund: Callable[[], object] | None = None,
    ):
        self._row, self._used, self._index, self._lock = row, used, index, lock
        self._scale, self._before_refund = scale, before_refund

    def try_charge(self, nbytes: int) -> bool:
        return self._row.try_charge(nbytes * self._scale)

    def refund(self, nbytes: int) -> None:
        if self._before_refund is not None:
            self._before_refund()
        self._row.refund(nbytes * self._scale)

    def set_used(self, nbytes: int) -> None:
        with self._lock:
            self._used[self._index] = nbytes * self._scale
            total = sum(self._used)
        self._row.set_used(total)

    def headroom(self) -> int:
        return self._row.headroom() // self._scale

    @property
    def limit(self) -> int | None:
        limit = self._row.limit
        return None if limit is None else limit // self._scale


class KVCache(Closeable):
    """The KV cache of one model instance.

    Arguments:
        layers: one `LayerSpec` per attention layer.
        block_size: tokens per block.
        name: this instance's name in the ledger (unique among live instances of the
            device; `kvctl limit NAME ...` uses it).
        engine: what runs it ("vllm", "sglang", "mlx-lm", ...), shown by kvctl/kvtop.
        limit: this instance's cap in bytes (None: only the device budget bounds it).
        budget: the device budget if this call creates the ledger.
        backend: a backend instance, or a name; default: the process's backend.
        max_tokens: virtual capacity per group (default: what the device could hold).
        layout: instead of `layers`, a layout built already over this backend (a
            `BackingBuffer`, for an engine that places its blocks itself); the cache
            owns it from here on and closes it.
        charge_scale, before_refund: for an allocator whose decisions other processes
            carry out (`kvcached.replay`): the ledger is charged `charge_scale` bytes
            per byte mapped (one copy per process), and `before_refund` is called
            before a release is refunded (to wait until they have all unmapped).
        allocator_options: passed to every `PageAllocator` (extent_bytes, pool_low, ...).
    """

    def __init__(
        self,
        layers: Sequence[LayerSpec] | None = None,
        *,
        block_size: int = 1,
        name: str,
        engine: str = "custom",
        limit: int | None = None,
        budget: int | str | None = None,
        backend: Backend | str | None = None,
        max_tokens: int | None = None,
        layout: Any = None,
        charge_scale: int = 1,
        before_refund: Callable[[], object] | None = None,
        **allocator_options: Any,
    ) -> None:
        from kvcached.registry import get_backend

        self._pid = os.getpid()
        self._closed = False
        self.allocators: list[PageAllocator] = []
        self.backend = backend if isinstance(backend, Backend) else get_backend(backend)
        self.ledger = open_device_ledger(self.backend, budget)
        try:
            self.account = self.ledger.register(name, engine, limit)
            try:
                if layout is not None:
                    self.layout = layout
                elif layers is None:
                    raise InvalidArgument("KVCache needs `layers` (or a prebuilt `layout`)")
                else:
                    self.layout = KVLayout(
                        self.backend, layers, block_size=block_size, max_tokens=max_tokens
                    )
                try:
                    used = [0] * len(self.layout.groups)
                    lock = threading.Lock()
                    for i, group in enumerate(self.layout.groups):
                        account = _GroupAccount(
                            self.account, used, i, lock, charge_scale, before_refund
                        )
                        self.allocators.append(
                            PageAllocator(group, account=account, **allocator_options)
                        )
                except BaseException:
                    for allocator in self.allocators:  # their threads stop, extents return
                        allocator.close()
                    self.allocators.clear()
                    self.layout.close()
                    raise
            except BaseException:
                if layout is not None and not getattr(layout, "_closed", False):
                    layout.close()
                self.account.close()
                raise
        except BaseException:
            self.ledger.close()
            raise
        _start_metrics_once()

    # ------------------------------------------------------------------ blocks
    def _allocator(self, group: int) -> PageAllocator:
        if not 0 <= group < len(self.allocators):
            raise InvalidArgument(
                f"group {group} does not exist; this cache has {len(self.allocators)} "
                "group(s) (see KVCache.layout.groups)"
            )
        return self.allocators[group]

    def alloc(self, n: int, group: int = 0) -> list[int] | None:
        """`n` block ids of `group`, or None when memory is exhausted (preempt, retry)."""
        return self._allocator(group).alloc(n)

    def free(self, blocks: Iterable[int], group: int = 0) -> None:
        self._allocator(group).free(blocks)

    def view(self, layer: int, part: Part = "kv", **options: Any) -> Any:
        """The zero-copy tensor of `layer`'s K, V or both (see `KVLayout.view`)."""
        self._check_own_process()
        return self.layout.view(layer, part, **options)

    def set_limit(self, nbytes: int | None) -> None:
        """Change this instance's limit in the ledger; the allocators follow it."""
        self._check_own_process()
        self.ledger.set_limit(self.account.name, nbytes)

    def _check_own_process(self) -> None:
        if os.getpid() != self._pid:
            raise InvalidArgument(
                f"KVCache {self.account.name!r} belongs to process {self._pid}; a forked "
                "child cannot use it: create a KVCache of its own in the child"
            )

    @property
    def reserved_bytes(self) -> int:
        return sum(allocator.reserved_bytes for allocator in self.allocators)

    # --------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Give every page back, remove the ledger row. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if os.getpid() != self._pid:
            return  # a forked child: the pages and the ledger row are the parent's
        try:
            for allocator in self.allocators:
                allocator.close()
            self.layout.close()
        finally:
            self.account.close()
            self.ledger.close()


_metrics_lock = threading.Lock()
_metrics_started_in: int | None = None  # pid of the process that started (or tried) it


def _start_metrics_once() -> None:
    """Start the metrics endpoint of KVCACHED_METRICS_PORT, once per process."""
    global _metrics_started_in
    if settings().metrics_port is None:
        return
    with _metrics_lock:
        if _metrics_started_in == os.getpid():
            return
        _metrics_started_in = os.getpid()
    from kvcached import metrics

    metrics.start_process_server()


def _stop_metrics() -> None:
    """Stop this process's metrics endpoint and allow a later KVCache to start it again."""
    global _metrics_started_in
    from kvcached import metrics

    metrics.stop_process_server()
    with _metrics_lock:
        _metrics_started_in = None
