"""`KVCache`: one engine instance's elastic KV cache, wired to the device's ledger.

This is the piece an engine adapter creates once per model instance. It puts the
layers together: the process's backend (`kvcached.get_backend()`), the device ledger
(opened, or created with the device's budget, and one row registered for this
instance), a `KVLayout` for the model's layers and one `PageAllocator` per layout group,
all charging the one ledger row. Adapters then only translate: block ids in and out
(`alloc`, `free`) and tensors for the attention kernels (`view`).

Several groups share one ledger row, but each allocator reports the bytes its live
blocks hold on its own, so the row's `used` is kept as their sum by `_GroupAccount`.
Another process (kvctl) may change a row's limit between any two reads of it, so each
decision reads it once.

The ledger's budget is fixed by whoever creates it: `budget=` here, else
KVCACHED_BUDGET (a size, or a percentage of the device's memory), else all of the
device's memory; `kvctl budget` changes it later. Once the ledger exists, a budget
asked for here is ignored, with a warning that names the ledger's budget.

With KVCACHED_METRICS_PORT set, the first `KVCache` of a process starts the
Prometheus endpoint (`kvcached.metrics.start_from_settings`); it serves every ledger
of this user until the process exits, and a process that finds the port taken
leaves it to whoever holds it.

`check_ready` runs the constructor's checks of the device (its ledger file or folder,
its granularity) without building anything; `kvcached info` reports with it.

A constructor that fails part-way closes what it built (allocators and their pool
threads, reservations, the ledger row), and a forked child cannot use the parent's
caches: every method but `close` raises, and `close` gives nothing back (the pages
and the ledger row are the parent's).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvcached.allocator import PageAllocator
from kvcached.backend import Backend
from kvcached.config import parse_size, settings
from kvcached.errors import InvalidArgument
from kvcached.layout import KVLayout, LayerSpec, Part, check_granularity
from kvcached.ledger import Ledger, LedgerAccount, check_usable, ledger_key
from kvcached.lifetime import Closeable


def open_device_ledger(
    backend: Backend, budget: int | str | None = None, *, key: str | None = None
) -> Ledger:
    """The ledger of `backend`'s device, created with `budget` (else KVCACHED_BUDGET,
    else all of the device's memory) if it does not exist yet. `key` names another
    device's ledger instead, one of the same kind as `backend`'s (a tensor-parallel
    rank's GPU): a budget given as a share is taken of `backend`'s memory."""
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
        key or ledger_key(backend.name, backend.device),
        budget=device_budget,
        budget_source=source,  # an existing ledger keeps its budget: say so
    )


def check_ready(backend: Backend) -> Path:
    """Run, changing nothing, the checks a `KVCache` on `backend` would fail in its
    constructor: its layout's granularity check, and its device ledger's (the file's, or
    those of the folder it would be created in). Returns the ledger's path; raises the
    error the constructor would. `kvcached info` reports with this."""
    check_granularity(backend)
    return check_usable(ledger_key(backend.name, backend.device))


class _GroupAccount:
    """One group's view of the instance's ledger rows: charges go straight through,
    `set_used` reports the sum over the groups.

    `rows`: (ledger row, copies) pairs, usually one row with one copy. An allocator
    whose decisions several processes carry out (replay.py), one copy each, charges
    each device's row for the copies that device holds: all rows or none.
    `before_refund`: called before bytes go back to the rows (to wait until those
    processes have unmapped them)."""

    def __init__(
        self,
        rows: Sequence[tuple[LedgerAccount, int]],
        used: list[int],
        index: int,
        lock: threading.Lock,
        before_refund: Callable[[], object] | None = None,
    ):
        self._rows, self._used, self._index, self._lock = list(rows), used, index, lock
        self._before_refund = before_refund

    def try_charge(self, nbytes: int) -> bool:
        charged: list[tuple[LedgerAccount, int]] = []
        try:
            for row, copies in self._rows:
                if not row.try_charge(nbytes * copies):
                    break
                charged.append((row, copies))
            else:
                return True
        except BaseException:
            self._undo(charged, nbytes)  # a damaged ledger raises: all rows or none
            raise
        self._undo(charged, nbytes)
        return False

    @staticmethod
    def _undo(charged: list[tuple[LedgerAccount, int]], nbytes: int) -> None:
        for done, copies in charged:
            done.refund(nbytes * copies)

    def refund(self, nbytes: int) -> None:
        if self._before_refund is not None:
            self._before_refund()
        for row, copies in self._rows:
            row.refund(nbytes * copies)

    def set_used(self, nbytes: int) -> None:
        with self._lock:
            self._used[self._index] = nbytes
            total = sum(self._used)
        for row, copies in self._rows:
            row.set_used(total * copies)

    def headroom(self) -> int:
        return min(row.headroom() // copies for row, copies in self._rows)

    @property
    def limit(self) -> int | None:
        # kvctl may change a row's limit between any two reads: read each one once
        smallest: int | None = None
        for row, copies in self._rows:
            limit = row.limit
            if limit is not None:
                share = limit // copies
                smallest = share if smallest is None else min(smallest, share)
        return smallest


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
        copies, before_refund: for an allocator whose decisions other processes carry
            out (`kvcached.replay`): ``{device: processes holding a copy there}``, the
            devices as backends name them (a tensor-parallel engine's ranks, e.g.
            ``{"cuda:0": 1, "cuda:1": 1}``).
            The instance gets a row in each of those devices' ledgers, each charged
            for its copies (the first key's row is `account`); `before_refund` is
            called before a release is refunded (to wait until all have unmapped).
            Default: one copy, in this backend's ledger.
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
        copies: Mapping[str | int, int] | None = None,
        before_refund: Callable[[], object] | None = None,
        **allocator_options: Any,
    ) -> None:
        from kvcached.registry import get_backend

        self._pid = os.getpid()
        self._closed = False
        self.allocators: list[PageAllocator] = []
        self.backend = backend if isinstance(backend, Backend) else get_backend(backend)
        charged = self._check_copies(copies)
        self.ledger = open_device_ledger(self.backend, budget, key=charged[0][0])
        try:
            self.account = self.ledger.register(name, engine, limit)
            #: the rows in other devices' ledgers (tensor-parallel copies), with theirs
            self.other_rows: list[tuple[Ledger, LedgerAccount]] = []
            rows = [(self.account, charged[0][1])]  # (row, copies it is charged for)
            try:
                for key, copies_there in charged[1:]:
                    ledger = open_device_ledger(self.backend, budget, key=key)
                    try:
                        row = ledger.register(name, engine, limit)
                    except BaseException:
                        ledger.close()
                        raise
                    self.other_rows.append((ledger, row))
                    rows.append((row, copies_there))
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
                        account = _GroupAccount(rows, used, i, lock, before_refund)
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
                self._close_rows()
                raise
        except BaseException:
            self.ledger.close()
            raise
        _start_metrics_once()

    def _check_copies(self, copies: Mapping[str | int, int] | None) -> list[tuple[str, int]]:
        """(ledger key, copies) per device, this backend's device if none is named."""
        if copies is None:
            return [(ledger_key(self.backend.name, self.backend.device), 1)]
        charged = [(ledger_key(self.backend.name, device), n) for device, n in copies.items()]
        bad = [n for _, n in charged if not isinstance(n, int) or isinstance(n, bool) or n < 1]
        if not charged or bad:
            raise InvalidArgument(
                f"copies must map devices to positive counts of processes, got {copies!r}"
            )
        if len({key for key, _ in charged}) != len(charged):
            raise InvalidArgument(f"copies names one device twice: {copies!r}")
        return charged

    def _close_rows(self) -> None:
        """Remove the instance's rows (own ledger's row, then the other devices')."""
        try:
            self.account.close()
        finally:
            for ledger, account in self.other_rows:
                try:
                    account.close()
                finally:
                    ledger.close()
            self.other_rows = []

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
        for ledger, account in self.other_rows:
            ledger.set_limit(account.name, nbytes)

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
            try:
                self._close_rows()
            finally:
                self.ledger.close()


def start_engine_cache(cache: KVCache, first_block: str) -> PageAllocator:
    """An engine adapter's start: KVCACHED_INSTANCE_LIMIT applied to `cache`, and block 0
    of its first group taken, the block the engine writes padded or dummy tokens to
    (`first_block` names it in the error), so its page is mapped before any forward pass
    and never handed out. Returns that group's allocator; closes `cache` on failure."""
    from kvcached.config import instance_limit

    try:
        limit = instance_limit(cache.ledger.budget)
        if limit is not None:
            cache.set_limit(limit)
        allocator = cache.allocators[0]
        block = allocator.alloc_one()
        if block != 0:
            raise InvalidArgument(
                f"kvcached could not map {first_block} (got {block!r}): the instance's "
                "limit or the device budget has no room for one page id "
                f"({allocator.group.page_id_bytes} bytes); give at least that"
            )
    except BaseException:
        cache.close()
        raise
    return allocator


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
