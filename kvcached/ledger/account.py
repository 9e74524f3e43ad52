"""`LedgerAccount`: one instance's row, as the page allocator's `BudgetAccount`.

Note [The hot path]
~~~~~~~~~~~~~~~~~~~
A charge is: take both locks (Note [Locking] in book.py), check that the file still
has its size (one `lseek`; see Note [A ledger that shrank] in book.py), unpack this
instance's row and the budget, sum the reserved column (one precompiled `struct` call
that skips over the other fields of every row: format.py), write back reserved and
peak, release: about 5.6 µs, and a refund about 3.6 µs, on the 2-core CPU machine
(benchmarks/ledger.py; benchmarks/results/cpu-2026-12-02/ledger.jsonl); small next to
creating and mapping a 2 MiB page (37 µs on the H200). Only a charge that would fail
does more: it looks for dead instances (Note [Reclaiming dead rows] in book.py) and
retries once, 45 µs in all. Nothing else in the hot path
allocates, logs or touches /proc. For that the locks are taken inline here, with
explicit acquire and release, rather than through the ledger's `_locked` helper.

Note [Lost rows]
~~~~~~~~~~~~~~~~
A row removed by hand while its process runs (`kvctl forget --force`) leaves that
instance without a row: its account notices at the next call, refuses every further
charge (the allocator answers "exhausted" and stops growing), keeps its own count of
what it still holds so that refunds, `set_used` and `limit` keep working without
touching the ledger, and logs one warning. The instance stays usable within what it
has, and closing it still returns everything. A row is owned by (pid, start time,
registration time), so a forgotten account can never charge or refund a row that its
own process registered again later (forks.py keeps registration times distinct).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import struct
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Protocol, TypeVar

from kvcached.errors import InvalidArgument
from kvcached.ledger import forks
from kvcached.ledger.errors import LedgerDamaged, LedgerError
from kvcached.ledger.format import (
    _BUDGET,
    _BUDGET_OFFSET,
    _DENIED_OFFSET,
    _LIMIT_OFFSET,
    _OWNED_HOT,
    _OWNER,
    _RESERVED_OFFSET,
    _RESERVED_PEAK,
    _U64,
    _USED_OFFSET,
    HEADER_SIZE,
    NO_LIMIT,
    ROW_SIZE,
)
from kvcached.ledger.liveness import _Identity
from kvcached.ledger.records import InstanceRow
from kvcached.lifetime import Closeable

log = logging.getLogger("kvcached.ledger")

T = TypeVar("T")

__all__ = ["AccountLedger", "LedgerAccount"]


class AccountLedger(Protocol):
    """What an account needs of the `Ledger` that registered it: its map, its two locks
    and their checks (Note [Locking] in book.py). `Ledger` is the one implementation;
    naming the surface here keeps account.py below book.py, which creates accounts."""

    key: str
    _fd: int  # the ledger file, flocked around every access (-1 once unusable)
    _mm: mmap.mmap  # the mapped file; touched only while `_intact()` holds
    _tlock: threading.Lock  # taken before the flock
    _damaged: str | None  # why the file is damaged in this process, once it shrank
    _reserved_column: struct.Struct  # unpacks the reserved field of every row
    _pid_column: struct.Struct  # unpacks the pid of every row (0: free)

    @property
    def closed(self) -> bool: ...

    def _check_open(self) -> None: ...

    def _intact(self) -> bool: ...

    def _locked(self, timeout: float | None = ...) -> AbstractContextManager[mmap.mmap]: ...

    def _reclaim_dead(self, timeout: float | None) -> int: ...

    def _read_row(self, mm: mmap.mmap, index: int) -> InstanceRow | None: ...

    def _clear_row(self, mm: mmap.mmap, index: int) -> None: ...


class LedgerAccount(Closeable):
    """One instance's row, as the page allocator's `BudgetAccount`.

    `try_charge` before creating physical memory, `refund` when it is released or its
    creation failed, `set_used` to report live bytes. Closing removes the row, so close
    only when the instance holds no memory any more (rows of processes that exit
    without closing are cleared as dead). Belongs to the process that registered it:
    a forked child must register its own.

    If the row is removed while the instance runs (`kvctl forget --force`), the account
    becomes `lost`: every charge is refused, refunds and `set_used` are kept in this
    process only, and `limit` answers what the instance still holds, so its allocator
    stops growing, keeps serving from what it has, and can still release everything.
    If the file shrinks under it, every charge raises `LedgerDamaged` instead, and the
    rest is kept in this process the same way (see Note [A ledger that shrank] in book.py).
    """

    __slots__ = (
        "__weakref__",
        "_closed",
        "_epoch",
        "_held",
        "_ledger",
        "_limit",
        "_lost",
        "_offset",
        "_owner",
        "_pid",
        "_start",
        "_used",
        "engine",
        "index",
        "name",
    )

    def __init__(
        self,
        ledger: AccountLedger,
        index: int,
        name: str,
        engine: str,
        me: _Identity,
        registered: float,
        limit: int | None = None,
    ) -> None:
        self._ledger = ledger
        self.index = index
        self.name = name
        self.engine = engine
        self._offset = HEADER_SIZE + index * ROW_SIZE
        self._pid = me.pid
        self._start = me.start_time
        self._owner = (me.pid, me.start_time, registered)
        self._epoch = forks.fork_epoch
        self._closed = False
        self._lost = False
        self._held = 0  # reserved bytes, as last seen in the row (all there is once lost)
        self._used = 0
        self._limit = limit  # as last read from the row (what `limit` answers once damaged)

    @property
    def ledger(self) -> AccountLedger:
        return self._ledger

    @property
    def lost(self) -> bool:
        """Whether this instance's row was removed from under it (kvctl forget --force)."""
        return self._lost

    # ------------------------------------------------------------ the hot path
    def try_charge(self, nbytes: int) -> bool:
        """Charge `nbytes` if this instance's limit and the device budget allow it.
        Returns False, charging nothing, when they do not (after clearing the rows of
        dead instances and trying once more), and always once the row was lost.
        LedgerDamaged, charging nothing, once the file shrank."""
        if type(nbytes) is not int or nbytes < 0:
            raise InvalidArgument(f"charge must be a non-negative int, got {nbytes!r}")
        if self._charge(nbytes, count_refusal=False):
            return True
        if self._lost:
            return False
        self._ledger._reclaim_dead(timeout=None)  # blocks like the charge itself
        return self._charge(nbytes, count_refusal=True)

    def _charge(self, nbytes: int, *, count_refusal: bool) -> bool:
        ledger = self._check()
        if self._lost:
            return False
        if ledger._damaged is not None:
            raise LedgerDamaged(ledger._damaged)
        lock = ledger._tlock
        lock.acquire()
        try:
            fcntl.flock(ledger._fd, fcntl.LOCK_EX)
            try:
                if not ledger._intact():
                    raise LedgerDamaged(ledger._damaged)
                mm = ledger._mm
                offset = self._offset
                pid, start, _ns, limit, reserved, peak, registered = _OWNED_HOT.unpack_from(
                    mm, offset
                )
                if (pid, start, registered) != self._owner:
                    lost = True
                else:
                    lost = False
                    total = sum(ledger._reserved_column.unpack_from(mm, 0))
                    new = reserved + nbytes
                    budget = _BUDGET.unpack_from(mm, _BUDGET_OFFSET)[0]
                    if new > limit or total + nbytes > budget:
                        if count_refusal:
                            denied_at = offset + _DENIED_OFFSET
                            _U64.pack_into(mm, denied_at, _U64.unpack_from(mm, denied_at)[0] + 1)
                        self._held = reserved
                        return False
                    _RESERVED_PEAK.pack_into(mm, offset + _RESERVED_OFFSET, new, max(new, peak))
                    self._held = new
                    return True
            finally:
                fcntl.flock(ledger._fd, fcntl.LOCK_UN)
        finally:
            lock.release()
        if lost:
            self._become_lost()
        return False

    def refund(self, nbytes: int) -> None:
        """Give back `nbytes` charged earlier. Refunding more than is reserved is the
        caller's bug: InvalidArgument, and nothing changes."""
        if type(nbytes) is not int or nbytes < 0:
            raise InvalidArgument(f"refund must be a non-negative int, got {nbytes!r}")
        ledger = self._check()
        if not self._lost and ledger._damaged is None:
            lost = False
            lock = ledger._tlock
            lock.acquire()
            try:
                fcntl.flock(ledger._fd, fcntl.LOCK_EX)
                try:
                    if ledger._intact():
                        mm = ledger._mm
                        offset = self._offset
                        owned = _OWNED_HOT.unpack_from(mm, offset)
                        if (owned[0], owned[1], owned[6]) == self._owner:
                            reserved = owned[4]
                            if nbytes > reserved:
                                raise self._over_refund(nbytes, reserved)
                            _U64.pack_into(mm, offset + _RESERVED_OFFSET, reserved - nbytes)
                            self._held = reserved - nbytes
                            return
                        lost = True
                finally:
                    fcntl.flock(ledger._fd, fcntl.LOCK_UN)
            finally:
                lock.release()
            if lost:
                self._become_lost()
        # Lost, or in a file this process no longer touches (damaged): the bytes are in
        # no ledger any more; keep this process's count right.
        with ledger._tlock:
            if nbytes > self._held:
                raise self._over_refund(nbytes, self._held)
            self._held -= nbytes

    def _over_refund(self, nbytes: int, reserved: int) -> InvalidArgument:
        return InvalidArgument(
            f"refund of {nbytes} bytes is more than the {reserved} bytes "
            f"instance {self.name!r} has reserved"
        )

    def set_used(self, nbytes: int) -> None:
        """Report the bytes that hold live blocks now (shown by kvctl, kvtop, metrics)."""
        if type(nbytes) is not int or nbytes < 0:
            raise InvalidArgument(f"used bytes must be a non-negative int, got {nbytes!r}")
        self._used = nbytes
        self._field(_USED_OFFSET, nbytes)

    # ---------------------------------------------------------------- reading
    @property
    def limit(self) -> int | None:
        """This instance's limit now (kvctl may change it at any time), or None. Once
        the row is lost: what the instance still holds, so that it grows no more; once
        the file is damaged: the limit last read (its charges raise anyway)."""
        value = self._field(_LIMIT_OFFSET)
        if value is None:
            return self._held if self._lost else self._limit
        limit = None if value == NO_LIMIT else value
        self._limit = limit
        return limit

    def headroom(self) -> int:
        """Bytes the device budget could still charge to any instance now (0 once the
        file is damaged): a snapshot for planning (a free-block count), never a promise."""
        column = self._ledger._reserved_column

        def room(mm: mmap.mmap) -> int:
            budget = int(_BUDGET.unpack_from(mm, _BUDGET_OFFSET)[0])
            return max(0, budget - int(sum(column.unpack_from(mm, 0))))

        return self._read_ledger(room, damaged=0)

    def has_neighbours(self) -> bool:
        """Whether another instance has a row in this ledger now, holding memory or not
        (a row is registered before its instance charges anything). False once the file
        is damaged: this process no longer reads it."""
        column, mine = self._ledger._pid_column, self.index

        def others(mm: mmap.mmap) -> bool:
            return any(pid for index, pid in enumerate(column.unpack_from(mm, 0)) if index != mine)

        return self._read_ledger(others, damaged=False)

    def _read_ledger(self, read: Callable[[mmap.mmap], T], *, damaged: T) -> T:
        """`read(map)` of the whole ledger under its two locks (Note [Locking] in
        book.py); `damaged` once the file is damaged."""
        ledger = self._check()
        if ledger._damaged is not None:
            return damaged
        lock = ledger._tlock
        lock.acquire()
        try:
            fcntl.flock(ledger._fd, fcntl.LOCK_EX)
            try:
                if not ledger._intact():
                    return damaged
                return read(ledger._mm)
            finally:
                fcntl.flock(ledger._fd, fcntl.LOCK_UN)
        finally:
            lock.release()

    @property
    def reserved(self) -> int:
        value = self._field(_RESERVED_OFFSET)
        return self._held if value is None else value

    @property
    def used(self) -> int:
        value = self._field(_USED_OFFSET)
        return self._used if value is None else value

    def _field(self, field: int, value: int | None = None) -> int | None:
        """Read one u64 field of this row, or write `value` into it, under the locks;
        None once the row is lost or the file damaged."""
        ledger = self._check()
        if self._lost or ledger._damaged is not None:
            return None
        lock = ledger._tlock
        lock.acquire()
        try:
            fcntl.flock(ledger._fd, fcntl.LOCK_EX)
            try:
                if not ledger._intact():
                    return None
                mm = ledger._mm
                offset = self._offset
                pid, start, registered = _OWNER.unpack_from(mm, offset)
                if (pid, start, registered) == self._owner:
                    if value is not None:
                        _U64.pack_into(mm, offset + field, value)
                        return value
                    current: int = _U64.unpack_from(mm, offset + field)[0]
                    return current
            finally:
                fcntl.flock(ledger._fd, fcntl.LOCK_UN)
        finally:
            lock.release()
        self._become_lost()
        return None

    def row(self) -> InstanceRow:
        """This instance's whole row; LedgerError once it was lost."""
        with self._row() as (mm, _):
            row = self._ledger._read_row(mm, self.index)
        assert row is not None
        return row

    # ---------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Remove this instance's row. Idempotent; a no-op in a forked child."""
        if self._closed:
            return
        self._closed = True
        forks._open_accounts.discard(self)
        ledger = self._ledger
        if self._lost or self._epoch != forks.fork_epoch or ledger.closed or ledger._fd < 0:
            return
        with contextlib.suppress(LedgerDamaged), ledger._locked(timeout=None) as mm:
            if _OWNER.unpack_from(mm, self._offset) == self._owner:
                ledger._clear_row(mm, self.index)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "lost" if self._lost else f"row {self.index}"
        return f"LedgerAccount({self.name!r}, ledger={self._ledger.key!r}, {state})"

    # ---------------------------------------------------------------- checks
    def _check(self) -> AccountLedger:
        if self._closed:
            raise LedgerError(f"the ledger account of {self.name!r} was closed")
        if self._epoch != forks.fork_epoch:
            raise LedgerError(
                f"the ledger account of {self.name!r} belongs to pid {self._pid}; a forked "
                "child must register its own instance"
            )
        ledger = self._ledger
        ledger._check_open()
        return ledger

    @contextlib.contextmanager
    def _row(self) -> Iterator[tuple[mmap.mmap, int]]:
        ledger = self._check()
        if self._lost:
            raise self._lost_error()
        with ledger._locked(timeout=None) as mm:
            if _OWNER.unpack_from(mm, self._offset) != self._owner:
                raise self._lost_error()
            yield mm, self._offset

    def _become_lost(self) -> None:
        if self._lost:
            return
        self._lost = True
        log.warning(
            "the ledger row of instance %r on %s was removed while it runs (kvctl forget "
            "--force?): it takes no more memory from now on and serves from the %d bytes "
            "it holds, which the device budget no longer counts; restart the instance to "
            "give it a row again",
            self.name, self._ledger.key, self._held,
        )  # fmt: skip

    def _lost_error(self) -> LedgerError:
        return LedgerError(
            f"row {self.index} of ledger {self._ledger.key} no longer belongs to instance "
            f"{self.name!r} (it was removed with 'kvctl forget --force'?)"
        )
