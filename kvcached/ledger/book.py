"""`Ledger`: one device's ledger file, mapped into this process, and what people do with
it (register instances, list them, change limits and the budget, forget and repair).

Note [Locking]
~~~~~~~~~~~~~~
Every read-modify-write happens under ``flock(LOCK_EX)`` on the ledger file. flock was
chosen over a lock word in shared memory (a futex, a POSIX robust mutex) because the
kernel drops it when its holder dies for any reason, SIGKILL and the OOM killer
included: no process can leave the ledger locked forever, and no recovery protocol is
needed. Its cost is two system calls, about a microsecond. flock belongs to an *open
file description*, not to a thread, so two threads of one process would both "hold" it;
each `Ledger` object therefore also takes a `threading.Lock` first (`_tlock`, always
before the flock). After `fork()` the child would share the parent's open file
description (and so its flock), so a fork hook reopens the file in the child (Note
[Ledgers across fork and exit] in forks.py). Administrative operations take both locks
through `_locked`, which gives up after a timeout (kvctl and kvtop never hang on a
stopped holder); the account's hot path takes them inline (Note [The hot path] in
account.py).

Note [Reclaiming dead rows]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
Rows of dead processes (how death is judged: Note [Dead instances] in liveness.py) are
cleared when a charge would fail, when a ledger is opened, and when rows are listed
(kvctl, kvtop, metrics). The /proc reads happen outside the lock: death is permanent,
so a row seen dead is cleared later only if it still holds the same pid and start time.
Rows written from another pid namespace cannot be judged and are left alone; `forget()`
removes one by hand (and what that does to a live instance is Note [Lost rows] in
account.py).

A row is cleared counters first and pid last (`_clear_row`), so a process killed
halfway leaves a row with a pid (reclaimed like any dead one), never a free row still
holding bytes. If a free row does hold bytes anyway (a corrupted file), `snapshot`
counts them as `Totals.unowned` and in `Totals.reserved`, so listings agree with what
charges see, and `repair()` (``kvctl repair``) clears them. A header whose boot id
differs from this boot's (a ledger kept on a persistent disk across a reboot) has only
stale rows, and they are all cleared on open (`_clear_stale_boot`).

Note [A ledger that shrank]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
kvcached never truncates a ledger, but anything running as this user can (`truncate`,
a shell's `> file`), and touching a mapped page past the end of its file kills the
process with SIGBUS, which no Python code can catch. So every access to the map first
checks, under the flock, that the file still has the mapped size (`_intact`: one
`lseek`, a fraction of a microsecond). A ledger found shorter is *damaged* in this
process for good, and its map is never touched again: every charge raises
`LedgerDamaged` (so `alloc` raises it when it would grow, and the pool thread logs it
once), refunds and `used` are kept in this process only, `limit` answers the last value
read and `headroom` 0. The instance keeps serving from what it holds, and closing it
still gives everything back. The check cannot stop a truncation that lands in the
microseconds between it and the access (a truncation takes no lock); `kvctl repair`
does take it (Note [Repairing a ledger] in files.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path

from kvcached.errors import InvalidArgument
from kvcached.ledger import forks, liveness
from kvcached.ledger.account import LedgerAccount
from kvcached.ledger.errors import LedgerDamaged, LedgerError
from kvcached.ledger.files import (
    _ADMIN_LOCK_TIMEOUT,
    _flock,
    _missing,
    _open_error,
    _publish_new_file,
    _repair_command,
    _validate,
)
from kvcached.ledger.format import (
    _BOOT_ID,
    _BOOT_ID_OFFSET,
    _BUDGET,
    _BUDGET_OFFSET,
    _ENGINE,
    _HOT,
    _LIMIT_OFFSET,
    _NAME,
    _RESERVED_OFFSET,
    _ROW,
    _U32,
    _U64,
    _UID_OFFSET,
    DEFAULT_CAPACITY,
    ENGINE_BYTES,
    HEADER_SIZE,
    NAME_BYTES,
    NO_LIMIT,
    ROW_SIZE,
    _check_bytes,
    _check_key,
    _check_limit,
    _decode,
    _encode,
    _pid_column,
    _reserved_column,
)
from kvcached.ledger.liveness import _boot_id, _identity
from kvcached.ledger.placement import _check_shared_folder, _Sharing, _sharing, ledger_path
from kvcached.ledger.records import BudgetChange, InstanceRow, LimitChange, Repair, Totals
from kvcached.lifetime import Closeable

log = logging.getLogger("kvcached.ledger")

__all__ = ["Ledger"]


class Ledger(Closeable):
    """One device's shared ledger, mapped into this process.

    Open it with `Ledger.open`; register this process's instances with `register`;
    `rows`, `totals`, `set_limit` and `set_budget` serve kvctl, kvtop and metrics.
    Thread-safe and fork-aware (a child reopens the file and must register anew).
    """

    def __init__(self, key: str, path: Path, fd: int, mm: mmap.mmap, capacity: int) -> None:
        """Use `Ledger.open`."""
        self.key = key
        self.path = path
        self.capacity = capacity
        self._fd = fd
        self._mm = mm
        self._size = HEADER_SIZE + capacity * ROW_SIZE  # the bytes mapped
        self._damaged: str | None = None  # why, once the file shrank (never cleared)
        self._ino = os.fstat(fd).st_ino
        self._reserved_column = _reserved_column(capacity)
        self._pid_column = _pid_column(capacity)
        self._tlock = threading.Lock()
        self._accounts: weakref.WeakSet[LedgerAccount] = weakref.WeakSet()
        self._closed = False
        self._warned_unowned = False
        self.created = False  # whether `Ledger.open` created the file
        self.group: str | None = None  # the group it is shared with (KVCACHED_LEDGER_GROUP)
        forks._open_ledgers.add(self)

    # ----------------------------------------------------------------- opening
    @classmethod
    def open(
        cls,
        key: str,
        budget: int | None = None,
        *,
        create: bool = True,
        directory: str | os.PathLike[str] | None = None,
        budget_source: str | None = None,
    ) -> Ledger:
        """Open the ledger of device `key`, creating it with `budget` bytes if it does
        not exist and `create` is true. The budget of an existing ledger is left as it
        is (`set_budget` changes it); when `budget_source` names where `budget` came
        from (a setting the user chose, e.g. "KVCACHED_BUDGET=20GiB") and it differs
        from the existing ledger's, a warning says it is ignored and how to change it.
        Rows of dead processes are cleared. `Ledger.created` says whether this call
        created the file.

        Raises LedgerError when the file is missing (and `create` is false), corrupted,
        foreign, of an incompatible layout version or not owned by this user (with
        KVCACHED_LEDGER_GROUP: not the group's, or in a folder unfit to share);
        InvalidArgument for a malformed key or budget."""
        _check_key(key)
        if budget is not None:
            _check_bytes("budget", budget, allow_zero=False)
        sharing = _sharing()
        path = ledger_path(key, directory)
        _check_shared_folder(path.parent, sharing)
        created = False
        for _ in range(8):
            try:
                fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:
                if not create:
                    raise _missing(key, path) from None
                if budget is None:
                    raise InvalidArgument(
                        f"creating the ledger for {key!r} needs a budget in bytes"
                    ) from None
                created = _publish_new_file(path, budget, DEFAULT_CAPACITY, sharing)
                continue  # open what is there now: ours, or a concurrent creator's
            except OSError as exc:
                raise _open_error(path, exc, sharing) from None
            try:
                ledger = cls._from_fd(key, path, fd, sharing)
            except BaseException:
                os.close(fd)
                raise
            ledger.created = created
            ledger.group = None if sharing is None else sharing.group
            try:
                ledger._clear_stale_boot()
                ledger.reclaim_dead()
                if budget is not None and budget_source is not None and not created:
                    ledger._warn_if_budget_ignored(budget, budget_source)
            except BaseException:
                ledger.close()
                raise
            return ledger
        raise LedgerError(f"ledger {path} keeps disappearing while being opened")

    @classmethod
    def _from_fd(cls, key: str, path: Path, fd: int, sharing: _Sharing | None) -> Ledger:
        size, capacity = _validate(key, path, fd, sharing)
        try:
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            raise LedgerError(f"cannot map ledger {path}: {exc.strerror}") from None
        return cls(key, path, fd, mm, capacity)

    def _warn_if_budget_ignored(self, requested: int, source: str) -> None:
        current = self.budget
        if current == requested:
            return
        log.warning(
            "%s is ignored: the ledger of %s (%s) already exists with a budget of %s "
            "(set by whoever created it, or since with kvctl budget). A ledger keeps its "
            "budget for as long as it exists (until the file is removed or the machine "
            "reboots); change it with 'kvctl budget SIZE --key %s'",
            source, self.key, self.path, _gib(current), self.key,
        )  # fmt: skip

    def _reopen_after_fork(self) -> None:
        """In a forked child: a new lock, and a new open file description so the child's
        flock excludes the parent's. The mapping is inherited and stays valid."""
        self._tlock = threading.Lock()
        self._accounts = weakref.WeakSet()
        if self._closed:
            return
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            self._mark_broken()
            return
        if os.fstat(fd).st_ino != self._ino:
            os.close(fd)
            self._mark_broken()
            return
        old, self._fd = self._fd, fd
        os.close(old)

    def _mark_broken(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)
        self._fd = -1

    # ----------------------------------------------------------------- locking
    @contextlib.contextmanager
    def _locked(self, timeout: float | None = _ADMIN_LOCK_TIMEOUT) -> Iterator[mmap.mmap]:
        """Both locks for an administrative operation; LedgerError after `timeout`,
        LedgerDamaged when the file shrank (see Note [A ledger that shrank])."""
        self._check_open()
        if self._damaged is not None:
            raise LedgerDamaged(self._damaged)
        if not self._tlock.acquire(timeout=-1 if timeout is None else timeout):
            raise LedgerError(f"ledger {self.path} is busy in this process")
        try:
            _flock(self._fd, self.path, timeout)
            try:
                if not self._intact():
                    raise LedgerDamaged(self._damaged)
                yield self._mm
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._tlock.release()

    def _intact(self) -> bool:
        """Under the flock, before the map is touched: whether the file still holds every
        mapped byte. Once it did not, never again (see Note [A ledger that shrank])."""
        if self._damaged is None:
            size = os.lseek(self._fd, 0, os.SEEK_END)
            if size >= self._size:
                return True
            self._damaged = (
                f"ledger {self.path} shrank to {size} bytes from {self._size} while this "
                "process used it (something other than kvcached truncated it), so this "
                "process no longer touches it: its instances keep serving the memory they "
                "hold but take no more. Run "
                f"'{_repair_command(self.key, self.path)}', then restart them"
            )
            log.warning("%s", self._damaged)
        return False

    def _check_open(self) -> None:
        if self._closed:
            raise LedgerError(f"ledger {self.key!r} was closed")
        if self._fd < 0:
            raise LedgerError(
                f"ledger {self.path} was removed or replaced after this process forked"
            )

    # ---------------------------------------------------------------- rows
    def _row_offset(self, index: int) -> int:
        return HEADER_SIZE + index * ROW_SIZE

    def _read_row(self, mm: mmap.mmap, index: int) -> InstanceRow | None:
        (
            pid,
            uid,
            start,
            namespace,
            limit,
            reserved,
            peak,
            used,
            denied,
            registered,
            name,
            engine,
        ) = _ROW.unpack_from(mm, self._row_offset(index))
        if pid == 0:
            return None
        return InstanceRow(
            index=index,
            pid=pid,
            uid=uid,
            start_time=start,
            pid_namespace=namespace,
            name=_decode(name),
            engine=_decode(engine),
            limit=None if limit == NO_LIMIT else limit,
            reserved=reserved,
            used=used,
            peak=peak,
            denied=denied,
            registered_at=registered,
        )

    def _clear_row(self, mm: mmap.mmap, index: int) -> None:
        # Counters first, the pid last: a process killed halfway leaves a row that still
        # has a pid (reclaimed as dead later), never a free row that still holds bytes.
        offset = self._row_offset(index)
        mm[offset + 4 : offset + ROW_SIZE] = bytes(ROW_SIZE - 4)
        mm[offset : offset + 4] = bytes(4)

    def _find(self, mm: mmap.mmap, name: str) -> InstanceRow | None:
        for index in range(self.capacity):
            row = self._read_row(mm, index)
            if row is not None and row.name == name:
                return row
        return None

    def snapshot(self, *, reclaim: bool = True) -> tuple[Totals, list[InstanceRow]]:
        """Totals and every registered instance (in row order), read under one lock so
        they agree; rows of dead processes are cleared first unless `reclaim` is false."""
        if reclaim:
            self.reclaim_dead()
        with self._locked() as mm:
            budget = _BUDGET.unpack_from(mm, _BUDGET_OFFSET)[0]
            rows = [self._read_row(mm, i) for i in range(self.capacity)]
            charged = sum(self._reserved_column.unpack_from(mm, 0))  # what charges see
        live = [row for row in rows if row is not None]
        owned = sum(row.reserved for row in live)
        totals = Totals(
            budget=budget,
            reserved=charged,
            used=sum(row.used for row in live),
            instances=len(live),
            unowned=charged - owned,
        )
        return totals, live

    def rows(self, *, reclaim: bool = True) -> list[InstanceRow]:
        """Every registered instance, in row order (see `snapshot`)."""
        return self.snapshot(reclaim=reclaim)[1]

    def totals(self, *, reclaim: bool = True) -> Totals:
        """The budget and the sums over every instance (see `snapshot`)."""
        return self.snapshot(reclaim=reclaim)[0]

    @property
    def budget(self) -> int:
        with self._locked() as mm:
            return int(_BUDGET.unpack_from(mm, _BUDGET_OFFSET)[0])

    # -------------------------------------------------------------- dead rows
    def reclaim_dead(self) -> int:
        """Clear the rows of processes that no longer exist; return how many."""
        return self._reclaim_dead(_ADMIN_LOCK_TIMEOUT)

    def _reclaim_dead(self, timeout: float | None) -> int:
        me = _identity()
        mine = (me.pid, me.start_time, me.pid_namespace)
        unowned = 0
        with self._locked(timeout) as mm:
            candidates = []
            for index in range(self.capacity):
                pid, start, namespace, _, reserved = _HOT.unpack_from(mm, self._row_offset(index))[
                    :5
                ]
                if not pid:
                    unowned += reserved
                elif namespace == me.pid_namespace and (pid, start, namespace) != mine:
                    uid = _U32.unpack_from(mm, self._row_offset(index) + _UID_OFFSET)[0]
                    candidates.append((index, pid, start, uid))
        if unowned and not self._warned_unowned:
            self._warned_unowned = True
            log.warning(
                "ledger %s is corrupted: free rows hold %d bytes that count against the "
                "budget though no instance holds them; 'kvctl repair --key %s' clears them",
                self.path, unowned, self.key,
            )  # fmt: skip
        dead = [
            (i, pid, start)
            for i, pid, start, uid in candidates
            if not liveness._row_alive(pid, start, uid)
        ]
        if not dead:
            return 0
        cleared = 0
        with self._locked(timeout) as mm:
            for index, pid, start in dead:
                now_pid, now_start = _HOT.unpack_from(mm, self._row_offset(index))[:2]
                if (now_pid, now_start) == (pid, start):
                    self._clear_row(mm, index)
                    cleared += 1
        return cleared

    def unowned_rows(self) -> dict[int, int]:
        """Free rows (pid 0) that hold bytes anyway, as {row index: reserved}: what a
        corrupted ledger charges to nobody. Normally empty."""
        with self._locked() as mm:
            return self._unowned(mm)

    def _unowned(self, mm: mmap.mmap) -> dict[int, int]:
        found = {}
        for index in range(self.capacity):
            offset = self._row_offset(index)
            if _U32.unpack_from(mm, offset)[0] == 0 and any(mm[offset : offset + ROW_SIZE]):
                found[index] = _U64.unpack_from(mm, offset + _RESERVED_OFFSET)[0]
        return found

    def repair(self) -> Repair:
        """Clear free rows that are not all zeros (a corrupted ledger: their reserved
        bytes count against the budget, though no instance holds them)."""
        with self._locked() as mm:
            found = self._unowned(mm)
            for index in found:
                self._clear_row(mm, index)
        return Repair(rows=sorted(found), unowned=sum(found.values()))

    def _clear_stale_boot(self) -> None:
        boot = _boot_id()
        with self._locked() as mm:
            if _BOOT_ID.unpack_from(mm, _BOOT_ID_OFFSET)[0] == boot:
                return
            for index in range(self.capacity):
                self._clear_row(mm, index)
            _BOOT_ID.pack_into(mm, _BOOT_ID_OFFSET, boot)

    # -------------------------------------------------------------- instances
    def register(self, name: str, engine: str, limit: int | None = None) -> LedgerAccount:
        """Add a row for an instance of this process and return its account.

        `name` identifies the instance to kvctl (unique among live instances of this
        device, at most 64 bytes); `engine` says what runs it ("vllm", "sglang", ...);
        `limit` caps its reserved bytes (None: only the budget does). Raises
        InvalidArgument for a malformed or taken name, LedgerError when the ledger is
        full."""
        name_bytes = _encode("name", name, _NAME, NAME_BYTES)
        engine_bytes = _encode("engine", engine, _ENGINE, ENGINE_BYTES)
        limit = _check_limit(limit)
        me = _identity()
        registered = forks._registration_time()
        self.reclaim_dead()
        with self._locked() as mm:
            taken = self._find(mm, name)
            if taken is not None:
                raise InvalidArgument(
                    f"an instance named {name!r} is already registered on {self.key} "
                    f"(pid {taken.pid}); choose another name"
                )
            free = next(
                (
                    i
                    for i in range(self.capacity)
                    if _HOT.unpack_from(mm, self._row_offset(i))[0] == 0
                ),
                None,
            )
            if free is None:
                raise LedgerError(
                    f"ledger {self.key} is full: {self.capacity} instances are registered, "
                    "as many as it has rows (rows of exited processes were cleared first). "
                    "Close an instance this device no longer needs (KVCache.close(), or "
                    f"stop its engine) and try again; 'kvctl list --key {self.key}' shows "
                    "them, and 'kvctl forget NAME' removes the row of one whose process is "
                    "gone but cannot be judged from here (another pid namespace)"
                )
            _ROW.pack_into(
                mm,
                self._row_offset(free),
                me.pid,
                os.geteuid(),
                me.start_time,
                me.pid_namespace,
                NO_LIMIT if limit is None else limit,
                0,
                0,
                0,
                0,
                registered,
                name_bytes,
                engine_bytes,
            )
        account = LedgerAccount(self, free, name, engine, me, registered, limit)
        self._accounts.add(account)
        forks._open_accounts.add(account)
        return account

    def set_limit(self, name: str, nbytes: int | None) -> LimitChange:
        """Set (or with None remove) the limit of instance `name`. A limit below what
        the instance holds is accepted: it stops growing and shrinks towards it as its
        pages empty; the returned change's `over_by` says by how much it is over."""
        limit = _check_limit(nbytes)
        self.reclaim_dead()
        with self._locked() as mm:
            row = self._find(mm, name)
            if row is None:
                raise InvalidArgument(self._unknown(mm, name))
            _U64.pack_into(
                mm,
                self._row_offset(row.index) + _LIMIT_OFFSET,
                NO_LIMIT if limit is None else limit,
            )
        return LimitChange(name, row.pid, limit, row.limit, row.reserved)

    def set_budget(self, nbytes: int) -> BudgetChange:
        """Set the device budget. Below what instances hold already, charges fail until
        they release enough; the returned change's `over_by` says how much."""
        budget = _check_bytes("budget", nbytes, allow_zero=False)
        self.reclaim_dead()
        with self._locked() as mm:
            previous = _BUDGET.unpack_from(mm, _BUDGET_OFFSET)[0]
            reserved = sum(self._reserved_column.unpack_from(mm, 0))
            _BUDGET.pack_into(mm, _BUDGET_OFFSET, budget)
        return BudgetChange(budget, previous, reserved)

    def forget(self, name: str, *, force: bool = False) -> InstanceRow:
        """Remove the row of instance `name` by hand, for a process this ledger cannot
        judge itself (one in another pid namespace). Without `force` it is refused for
        a live process and for one whose liveness cannot be checked from here. A live
        instance forgotten with `force` keeps running without a row: it takes no more
        memory, and the bytes it holds are no longer counted (Note [Lost rows] in account.py)."""
        with self._locked() as mm:
            row = self._find(mm, name)
            if row is None:
                raise InvalidArgument(self._unknown(mm, name))
            if not force:
                if row.pid_namespace != _identity().pid_namespace:
                    raise InvalidArgument(
                        f"instance {name!r} was registered from another pid namespace (a "
                        "container?), so whether it is alive cannot be checked from here; "
                        f"if you know its process is gone, 'kvctl forget {name} --force' "
                        "(force=True from Python) removes it"
                    )
                if liveness._row_alive(row.pid, row.start_time, row.uid):
                    raise InvalidArgument(
                        f"instance {name!r} (pid {row.pid}) is alive; 'kvctl forget {name} "
                        "--force' (force=True from Python) removes its row anyway: it then "
                        "takes no more memory, and what it holds leaves the budget"
                    )
            self._clear_row(mm, row.index)
        return row

    def _unknown(self, mm: mmap.mmap, name: str) -> str:
        names = [r.name for i in range(self.capacity) if (r := self._read_row(mm, i))]
        known = ", ".join(sorted(names)) or "none"
        return f"no instance named {name!r} on {self.key}; registered: {known}"

    # ------------------------------------------------------------------ closing
    def close(self) -> None:
        """Remove the rows this object registered and unmap the ledger. Idempotent."""
        if self._closed:
            return
        for account in list(self._accounts):
            account.close()
        self._closed = True
        forks._open_ledgers.discard(self)
        with contextlib.suppress(BufferError):
            self._mm.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __repr__(self) -> str:
        return f"Ledger({self.key!r}, path={str(self.path)!r}, closed={self._closed})"


def _gib(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB ({nbytes} bytes)"
