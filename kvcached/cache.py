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
Prometheus endpoint (`kvcached.metrics.start_process_server`, which keeps it to one
per process: Note [one endpoint per process]); it serves every ledger of this user
until the process exits, and a process that finds the port taken leaves it to
whoever holds it.

`check_ready` runs the constructor's checks of the device (its ledger file or folder,
its granularity) without building anything; `kvcached info` reports with it.

Note [what a cache holds]. The constructor takes its resources one after another, each
pushed on one `contextlib.ExitStack`: the layout (given, or built from `layers`), the
device ledger and the instance's row in it, each other device's ledger and row
(tensor-parallel copies), then one allocator per group. A step that fails unwinds the
stack, so everything taken before it is given back, newest first: allocators (their
pool threads stop, their extents are unmapped and refunded) before the rows they
charge, rows before their ledgers, and the reservations last. On success the stack is
kept, and `close()` unwinds the very same stack. A layout handed in (`layout=`) is the
cache's from the call on: it is closed on every failure, also one before the ledger.

A forked child cannot use the parent's caches: every method but `close` raises, and
`close` gives nothing back (the pages and the ledger row are the parent's).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, overload

from kvcached import metrics
from kvcached.allocator import PageAllocator
from kvcached.backend import Backend
from kvcached.backing import BackingBuffer, BackingSet
from kvcached.config import parse_size, settings
from kvcached.errors import InvalidArgument
from kvcached.layout import KVLayout, LayerSpec, Part, check_granularity
from kvcached.ledger import Ledger, LedgerAccount, check_usable, ledger_key
from kvcached.lifetime import Closeable

#: Where a `KVCache`'s blocks live: a `KVLayout` (kvcached places every layer's blocks;
#: the cache builds it from `layers`), a `BackingBuffer` (the engine placed them; it
#: is handed in as `layout=`) or a `BackingSet` (several such buffers, a group each).
#: All give the allocators their page-id `groups`, and `close()` frees their
#: reservations.
CacheLayout = KVLayout | BackingBuffer | BackingSet


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


def _charge_rows(rows: Sequence[tuple[LedgerAccount, int]], nbytes: int) -> bool:
    """Charge each (row, copies) `nbytes` per copy: every row or, refunding what was
    charged, none (also when a damaged ledger raises)."""
    charged: list[tuple[LedgerAccount, int]] = []
    try:
        for row, copies in rows:
            if not row.try_charge(nbytes * copies):
                break
            charged.append((row, copies))
        else:
            return True
    except BaseException:
        _refund_rows(charged, nbytes)
        raise
    _refund_rows(charged, nbytes)
    return False


def _refund_rows(rows: Sequence[tuple[LedgerAccount, int]], nbytes: int) -> None:
    for row, copies in rows:
        row.refund(nbytes * copies)


class _GroupAccount:
    """One group's view of the instance's ledger rows: charges go straight through,
    `set_used` reports the sum over the groups, and the row's limit is seen less what
    the other groups hold (each group's allocator plans its growth against `limit`, so
    two groups under one limit must not each count all of it).

    `rows`: (ledger row, copies) pairs, usually one row with one copy. An allocator
    whose decisions several processes carry out (replay.py), one copy each, charges
    each device's row for the copies that device holds: all rows or none.
    `before_refund`: called before bytes go back to the rows (to wait until those
    processes have unmapped them). `fixed`: bytes one copy of the instance holds outside
    its groups (`KVCache.charge_fixed`), charged to every row for its copies, which each
    row's limit leaves out."""

    def __init__(
        self,
        rows: Sequence[tuple[LedgerAccount, int]],
        used: list[int],
        index: int,
        lock: threading.Lock,
        before_refund: Callable[[], object] | None = None,
        fixed: list[int] | None = None,
        held: list[int] | None = None,
    ):
        self._rows, self._used, self._index, self._lock = list(rows), used, index, lock
        self._before_refund = before_refund
        self._fixed = [0] if fixed is None else fixed
        #: bytes (one copy's) each group has charged and not refunded, shared
        self._held = [0] * len(used) if held is None else held

    def try_charge(self, nbytes: int) -> bool:
        if not _charge_rows(self._rows, nbytes):
            return False
        with self._lock:
            self._held[self._index] += nbytes
        return True

    def refund(self, nbytes: int) -> None:
        if self._before_refund is not None:
            self._before_refund()
        _refund_rows(self._rows, nbytes)
        with self._lock:
            self._held[self._index] -= nbytes

    def set_used(self, nbytes: int) -> None:
        with self._lock:
            self._used[self._index] = nbytes
            total = sum(self._used)
        for row, copies in self._rows:
            row.set_used(total * copies)

    def headroom(self) -> int:
        return min(row.headroom() // copies for row, copies in self._rows)

    def has_neighbours(self) -> bool:
        # the instance's other groups draw on the same rows: they are neighbours too
        return len(self._used) > 1 or any(row.has_neighbours() for row, _ in self._rows)

    @property
    def limit(self) -> int | None:
        # kvctl may change a row's limit between any two reads: read each one once
        smallest: int | None = None
        fixed = self._fixed[0]  # what the instance holds outside its groups is not theirs
        for row, copies in self._rows:
            limit = row.limit
            if limit is not None:
                share = max(0, limit - fixed * copies) // copies
                smallest = share if smallest is None else min(smallest, share)
        if smallest is None:
            return None
        with self._lock:
            others = sum(self._held) - self._held[self._index]
        return max(0, smallest - others)


class KVCache(Closeable):
    """The KV cache of one model instance.

    Built either from `layers` (kvcached lays the blocks out) or over a `layout=` the
    engine placed its blocks in itself (a `BackingBuffer`); the two overloads below.

    Arguments:
        layers: one `LayerSpec` per attention layer.
        block_size: tokens per block (default 1); with `layers` only.
        name: this instance's name in the ledger (unique among live instances of the
            device; `kvctl limit NAME ...` uses it).
        engine: what runs it ("vllm", "sglang", "mlx-lm", ...), shown by kvctl/kvtop.
        limit: this instance's cap in bytes (None: only the device budget bounds it).
        budget: the device budget if this call creates the ledger.
        backend: a backend instance, or a name; default: the layout's backend when a
            `layout` is given, else the process's backend. A `layout` must have been
            built over this same backend.
        max_tokens: virtual capacity per group (default: what the device could hold);
            with `layers` only.
        layout: instead of `layers`, a `KVLayout` or `BackingBuffer` built already over
            this backend; the cache owns it from here on and closes it, also when the
            constructor fails (Note [what a cache holds]).
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

    layout: CacheLayout
    ledger: Ledger
    account: LedgerAccount

    @overload
    def __init__(
        self,
        layers: Sequence[LayerSpec],
        *,
        block_size: int | None = None,
        name: str,
        engine: str = "custom",
        limit: int | None = None,
        budget: int | str | None = None,
        backend: Backend | str | None = None,
        max_tokens: int | None = None,
        copies: Mapping[str | int, int] | None = None,
        before_refund: Callable[[], object] | None = None,
        **allocator_options: Any,
    ) -> None: ...

    @overload
    def __init__(
        self,
        *,
        layout: CacheLayout,
        name: str,
        engine: str = "custom",
        limit: int | None = None,
        budget: int | str | None = None,
        backend: Backend | str | None = None,
        copies: Mapping[str | int, int] | None = None,
        before_refund: Callable[[], object] | None = None,
        **allocator_options: Any,
    ) -> None: ...

    def __init__(
        self,
        layers: Sequence[LayerSpec] | None = None,
        *,
        block_size: int | None = None,
        name: str,
        engine: str = "custom",
        limit: int | None = None,
        budget: int | str | None = None,
        backend: Backend | str | None = None,
        max_tokens: int | None = None,
        layout: CacheLayout | None = None,
        copies: Mapping[str | int, int] | None = None,
        before_refund: Callable[[], object] | None = None,
        **allocator_options: Any,
    ) -> None:
        self._pid = os.getpid()
        self._closed = False
        self._fixed = [0]  # bytes charged outside the groups (charge_fixed), shared
        self.allocators: list[PageAllocator] = []
        #: the rows in other devices' ledgers (tensor-parallel copies), with theirs
        self.other_rows: list[tuple[Ledger, LedgerAccount]] = []
        if layout is not None and not isinstance(layout, CacheLayout):
            raise InvalidArgument(
                f"KVCache(layout=...) takes a KVLayout, a BackingBuffer or a BackingSet, got "
                f"{type(layout).__name__}"
            )
        # Note [what a cache holds]: every step below pushes what it took on `held`
        with contextlib.ExitStack() as held:
            if layout is not None:
                held.enter_context(layout)  # the cache's from here on, whatever fails
            self.backend = self._resolve_backend(backend, layout)
            self._check_layout_arguments(layers, layout, block_size, max_tokens)
            charged = self._check_copies(copies)
            if layout is None:
                assert layers is not None  # _check_layout_arguments says so
                layout = held.enter_context(
                    KVLayout(
                        self.backend,
                        layers,
                        block_size=1 if block_size is None else block_size,
                        max_tokens=max_tokens,
                    )
                )
            self.layout = layout
            self.ledger = held.enter_context(
                open_device_ledger(self.backend, budget, key=charged[0][0])
            )
            self.account = held.enter_context(self.ledger.register(name, engine, limit))
            rows = [(self.account, charged[0][1])]  # (row, copies it is charged for)
            self._rows = rows  # charge_fixed's too
            for key, copies_there in charged[1:]:
                ledger = held.enter_context(open_device_ledger(self.backend, budget, key=key))
                row = held.enter_context(ledger.register(name, engine, limit))
                self.other_rows.append((ledger, row))
                rows.append((row, copies_there))
            used = [0] * len(self.layout.groups)
            charges = [0] * len(self.layout.groups)
            lock = threading.Lock()
            for i, group in enumerate(self.layout.groups):
                account = _GroupAccount(rows, used, i, lock, before_refund, self._fixed, charges)
                allocator = PageAllocator(group, account=account, **allocator_options)
                self.allocators.append(held.enter_context(allocator))
            self._held = held.pop_all()  # close() gives it all back, in the same order
        metrics.start_process_server()  # Note [one endpoint per process] in metrics.py

    def _resolve_backend(
        self, backend: Backend | str | None, layout: CacheLayout | None
    ) -> Backend:
        """The backend asked for, else the layout's, else the process's; a layout must
        be over the cache's backend (its ledger row is the one that is charged)."""
        from kvcached.registry import get_backend

        if isinstance(backend, Backend):
            resolved = backend
        elif backend is None and layout is not None:
            resolved = layout.backend
        else:
            resolved = get_backend(backend)
        if layout is not None and layout.backend is not resolved:
            raise InvalidArgument(
                f"KVCache(layout=...) was built over {layout.backend!r}, but the cache's "
                f"backend is {resolved!r}: build the layout over the same backend instance "
                "(or leave `backend` out: the layout's is used)"
            )
        return resolved

    @staticmethod
    def _check_layout_arguments(
        layers: Sequence[LayerSpec] | None,
        layout: CacheLayout | None,
        block_size: int | None,
        max_tokens: int | None,
    ) -> None:
        if layout is None:
            if layers is None:
                raise InvalidArgument("KVCache needs `layers` (or a prebuilt `layout`)")
            return
        given = [
            what
            for what, value in (
                ("layers", layers),
                ("block_size", block_size),
                ("max_tokens", max_tokens),
            )
            if value is not None
        ]
        if given:
            raise InvalidArgument(
                f"KVCache takes `layers` (with block_size, max_tokens) or a prebuilt "
                f"`layout`, not both: {', '.join(given)} given with layout={layout!r}"
            )

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
        if not isinstance(self.layout, KVLayout):
            raise InvalidArgument(
                f"KVCache {self.account.name!r} is over an engine-placed {self.layout!r}, "
                "which has no per-layer views: view it whole with `cache.layout.raw()`"
            )
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

    def charge_fixed(self, nbytes: int) -> bool:
        """Charge `nbytes` the instance holds outside its KV groups (memory the engine
        allocated itself, e.g. SGLang's Mamba state pool) to its ledger row, until the
        cache closes; False, charging nothing, when the limit or the budget has no room.
        The row's limit then bounds both: the allocators' share of it leaves them out,
        so their free counts never promise what the ledger would refuse. Memory the
        engine holds already comes before pages mapped ahead of demand: a charge that
        fails is tried once more after the pool threads' empty extents are given back.
        With copies (tensor-parallel ranks) `nbytes` is one copy's: each device's row is
        charged for the copies it holds, all rows or none."""
        self._check_own_process()
        if nbytes < 0:
            raise InvalidArgument(f"charge_fixed takes a byte count >= 0, got {nbytes}")
        if not _charge_rows(self._rows, nbytes):
            for allocator in self.allocators:
                allocator.pause_growth()
            try:
                for allocator in self.allocators:
                    allocator.trim(keep=0)
                    allocator.wait_released()
                if not _charge_rows(self._rows, nbytes):
                    return False
            finally:
                for allocator in self.allocators:
                    allocator.resume_growth()
        self._fixed[0] += nbytes
        return True

    @property
    def fixed_bytes(self) -> int:
        """What `charge_fixed` charged."""
        return self._fixed[0]

    # --------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Give every page back, remove the ledger row. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if os.getpid() != self._pid:
            return  # a forked child: the pages and the ledger row are the parent's
        try:
            if self._fixed[0]:
                _refund_rows(self._rows, self._fixed[0])
                self._fixed[0] = 0
        finally:
            self._held.close()  # newest first (Note [what a cache holds])


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
