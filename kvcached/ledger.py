"""The cross-process ledger: one device budget shared by every kvcached instance on it.

Why a ledger
------------
Several engine processes (a vLLM server, an SGLang server, a notebook running mlx-lm)
can share one accelerator. Each maps physical pages into its KV cache as its load grows
and returns them as it shrinks. Without coordination two instances growing at once can
each see enough free memory, both create pages, and one of them gets a driver
out-of-memory in the middle of a forward pass. The ledger prevents that race: before an
instance creates physical memory it *charges* the bytes here, under a lock that every
instance on the device takes, and it creates the memory only when the charge succeeded.
If creation fails anyway, or when pages are released, it refunds them. No charge can
take the sum past the device budget, whatever the interleaving (an operator may still
lower the budget, or a limit, below what is held: charges then fail until enough is
released).

What is in it
-------------
One small file per device, mapped into every process that uses the device::

    header (128 bytes)  magic "KVCLEDGR", layout version, header size, row size,
                        row count, device budget, boot id, creation time
    row 0 .. row N-1    (192 bytes each) pid, process start time, pid namespace,
                        limit, reserved, peak reserved, used, refused charges,
                        registration time, name, engine

`reserved` is what the instance holds in physical memory (every page it created,
including pages mapped but still empty); it is the number the budget bounds:
``sum(reserved) <= budget`` and ``reserved <= limit`` for every row. `used` is the part
holding live blocks; it is reported for people (kvctl, kvtop, metrics) and bounds
nothing. A row whose pid is 0 is free and all its counters are zero, so a plain sum over
the reserved column of every row is the device total. There is no cached total in the
header: a total and a row updated by two separate stores could disagree if a process
were killed between them, while a single 8-byte store into one row cannot be torn by a
kill. The row is the single source of truth; totals are always recomputed from rows.

The file is ``kvcached-<uid>-<key>.ledger`` in KVCACHED_LEDGER_DIR when it is set, else
in this user's runtime directory ($XDG_RUNTIME_DIR, else /run/user/<uid>, when it is a
directory the user owns that no one else can enter), else in /dev/shm. Both are tmpfs:
memory, never disk, emptied by a reboot. The runtime directory is preferred because no
other user can create files in it: in /dev/shm anyone can pre-create the file name of
another user's ledger (a file, a link or a directory) and so deny that user kvcached;
such an entry is never touched, and the error says what is there and points to
KVCACHED_LEDGER_DIR. The key
names the device: ``host-cpu``, ``cuda-0``, ``rocm-1``. The fields are packed with
`struct` in little-endian order at fixed offsets, so the layout is the same in every
process and every Python version, and the version field lets a newer kvcached refuse a
segment it does not understand with an error instead of misreading it.

Locking and the hot path
------------------------
Every read-modify-write happens under ``flock(LOCK_EX)`` on the ledger file. flock was
chosen over a lock word in shared memory (a futex, a POSIX robust mutex) because the
kernel drops it when its holder dies for any reason, SIGKILL and the OOM killer
included: no process can leave the ledger locked forever, and no recovery protocol is
needed. Its cost is two system calls, about a microsecond. flock belongs to an *open
file description*, not to a thread, so two threads of one process would both "hold" it;
each `Ledger` object therefore also takes a `threading.Lock` first. After `fork()` the
child would share the parent's open file description (and so its flock), so a fork
hook reopens the file in the child.

A charge is: take both locks, unpack this instance's row and the budget, sum the
reserved column (one precompiled `struct` call that skips over the other fields of every
row), write back reserved and peak, release: about 3 µs, and a refund about 1.4 µs, on
a 2-core CI machine; small next to creating and mapping a 2 MiB page (tens of µs on a
GPU). Only a charge that would fail does more: it looks for dead instances (below) and
retries once, which costs tens of µs more. Nothing else in the hot path allocates,
logs or touches /proc.

Dead instances
--------------
A process can die without refunding (SIGKILL, the OOM killer, a segfault in a kernel);
its memory is returned by the driver, but its row still claims it. Each row records the
pid *and* the process start time (field 22 of /proc/<pid>/stat, in clock ticks since
boot), so a pid the kernel has reused for a new process is not mistaken for the old
one. A process counts as dead only once none of its threads is left: after SIGKILL the
main thread of a multi-threaded process (every `KVCache` has a pool thread) shows as a
zombie within a few milliseconds, while the other threads, which release the process's
memory, exit tens of milliseconds later; reclaiming at the first sight of the zombie
would let the budget be charged twice over for that while. So a zombie main thread is
dead only when every entry of /proc/<pid>/task is a zombie too (or gone). This holds
on every backend: device memory is returned when the last thread closes the driver's
files, before it becomes a zombie. Rows of dead processes are cleared when a charge
would fail, when a ledger is opened, and when rows are listed (kvctl, kvtop, metrics).
The /proc reads happen outside the lock: death is permanent, so a row seen dead is
cleared later only if it still holds the same pid and start time.
Rows written from another pid namespace (a container sharing /dev/shm but not its pid
space) cannot be judged and are left alone; `forget()` removes one by hand.

A row removed by hand while its process runs (`kvctl forget --force`) leaves that
instance without a row: its account notices at the next call, refuses every further
charge (the allocator answers "exhausted" and stops growing), keeps its own count of
what it still holds so that refunds, `set_used` and `limit` keep working without
touching the ledger, and logs one warning. The instance stays usable within what it
has, and closing it still returns everything. A row is owned by (pid, start time,
registration time), so a forgotten account can never charge or refund a row that its
own process registered again later. A row is cleared counters first and pid last, so a
process killed halfway leaves a row with a pid (reclaimed like any dead one), never a
free row still holding bytes. If a free row does hold bytes anyway (a corrupted file),
`snapshot` counts them as `Totals.unowned` and in `Totals.reserved`, so listings agree
with what charges see, and `repair()` (``kvctl repair``) clears them. A header
whose boot id differs from this boot's (a ledger kept on a persistent disk across a
reboot) has only stale rows, and they are all cleared on open.

Security
--------
Files are owner-only: created with mode 0600 set by fchmod (whatever the umask) in a
private temporary file that is fully written before it is linked into place, so no one
ever sees a half-written ledger, and ``link()`` fails if another process published one
first (the O_CREAT|O_EXCL race, resolved by the loser opening the winner's file). An
existing file is opened with O_NOFOLLOW and refused, with an error naming the problem,
when it is not a regular file, is owned by another user, is readable or writable by
anyone else, is shorter or longer than its header says, carries a foreign magic or an
unknown layout version. Nothing is ever overwritten: a bad file is left for a person
to inspect. Ledgers are per user (the uid is in the file name), so two users on one GPU
do not share a budget; sharing one across users would need a group-writable file, which
this design refuses on purpose.

Failure modes and trade-offs
----------------------------
* A process stopped (SIGSTOP, a debugger) while it holds the lock stalls every other
  instance's next charge until it runs again. The lock is held for microseconds, so
  this needs a stop at exactly that moment; kvctl and kvtop give up after a timeout
  instead of hanging.
* Removing the file while instances run splits the device: new instances create a new
  ledger and no longer see the old one's charges. Don't delete live ledgers.
* Truncating the file under a running process would make its next access fault
  (SIGBUS); only the owner can do that, and kvcached never does.
* The budget is a promise kvcached instances make to each other, not an enforcement on
  other programs: memory used outside kvcached is invisible here (the allocator still
  checks the device's free memory before creating pages).
* Liveness without /proc (macOS) falls back to ``kill(pid, 0)`` with no start time, so
  a reused pid would keep a dead row alive until the new process exits.
* A row is 192 bytes and a ledger has 64 of them (12 KiB), so at most 64 instances can
  share one device; registering the 65th is a clear error.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import errno
import fcntl
import logging
import math
import mmap
import os
import re
import secrets
import stat
import struct
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

from kvcached.errors import InvalidArgument, KVCachedError
from kvcached.lifetime import Closeable

log = logging.getLogger("kvcached.ledger")

__all__ = [
    "DEFAULT_CAPACITY",
    "LAYOUT_VERSION",
    "MAGIC",
    "BudgetChange",
    "InstanceRow",
    "Ledger",
    "LedgerAccount",
    "LedgerError",
    "LimitChange",
    "Repair",
    "Totals",
    "default_key",
    "existing_keys",
    "ledger_dir",
    "ledger_key",
    "ledger_path",
    "user_runtime_dir",
]


class LedgerError(KVCachedError):
    """The ledger file cannot be used: missing, corrupted, foreign, of an incompatible
    layout, owned by someone else, full, or busy. The message names the file and why."""


# ---------------------------------------------------------------------------- layout
MAGIC = b"KVCLEDGR"
LAYOUT_VERSION = 1
DEFAULT_CAPACITY = 64
NO_LIMIT = (1 << 64) - 1  # the limit field's value for "no limit of its own"

# magic, version, header size, row size, row count, budget, boot id, created (unix time)
_HEADER = struct.Struct("<8sIIIIQ16sd")
HEADER_SIZE = 128
_BUDGET = struct.Struct("<Q")
_BUDGET_OFFSET = 24
_BOOT_ID_OFFSET = 32
_BOOT_ID = struct.Struct("<16s")

# pid, (pad), start time, pid namespace, limit, reserved, peak, used, refused charges,
# registered (unix time), name, engine; then spare bytes kept zero for later versions.
_ROW = struct.Struct("<I4xQQQQQQQd64s24s")
ROW_SIZE = 192
NAME_BYTES = 64
ENGINE_BYTES = 24
# The hot path reads only the row's prefix: pid, start time, pid namespace, limit,
# reserved, peak; and writes back reserved and peak in one store.
_HOT = struct.Struct("<I4xQQQQQ")
_RESERVED_OFFSET = 32
_RESERVED_PEAK = struct.Struct("<QQ")
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_IDENTITY = struct.Struct("<I4xQ")
# What an account reads to know its row is still its own: (pid, start time, registration
# time); the hot path reads it with the prefix, in one call.
_REGISTERED_OFFSET = 64
_OWNED_HOT = struct.Struct("<I4xQQQQQ16xd")
_OWNER = struct.Struct("<I4xQ48xd")
_USED_OFFSET = 48
_DENIED_OFFSET = 56
_LIMIT_OFFSET = 24

assert _HEADER.size <= HEADER_SIZE
assert _ROW.size <= ROW_SIZE
assert _HOT.size == _RESERVED_OFFSET + 16
assert _OWNED_HOT.size == _OWNER.size == _REGISTERED_OFFSET + 8

_KEY = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+/=-]*$")
_ENGINE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")
_ADMIN_LOCK_TIMEOUT = 5.0  # seconds kvctl/kvtop/register wait for a stalled lock holder


def _reserved_column(capacity: int) -> struct.Struct:
    """One struct that unpacks the reserved field of every row, skipping the rest."""
    first = HEADER_SIZE + _RESERVED_OFFSET
    between = ROW_SIZE - 8
    return struct.Struct("<" + f"{first}xQ" + f"{between}xQ" * (capacity - 1))


# ---------------------------------------------------------------------- processes
_PROC = Path("/proc")
_HAVE_PROC = Path("/proc/self/stat").exists()


def process_start_time(pid: int) -> int | None:
    """The start time of a live process in clock ticks since boot (/proc/<pid>/stat
    field 22), or None when it is gone or none of its threads is left (all zombies).
    A zombie main thread with other threads still running is alive: those threads
    still hold the process's memory. 0 where /proc does not exist and the process is
    alive (the start time is then unknown)."""
    if not _HAVE_PROC:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return 0
        return 0
    data = _read_stat(f"/proc/{pid}/stat")
    if data is None:
        return None
    # The command name (field 2) is in parentheses and may itself contain ") ", so the
    # fields are counted from the last ')'. After it come field 3 (state) onwards.
    fields = data[data.rfind(b")") + 2 :].split()
    if len(fields) < 20:
        return None
    if fields[0] in _EXITED and not _has_running_thread(pid):
        return None
    return int(fields[19])


_EXITED = (b"Z", b"X", b"x")  # /proc states of a task that has finished exiting


def _read_stat(path: str) -> bytes | None:
    """The first 4 KiB of a /proc stat file, or None when the task is gone."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)


def _task_state(path: str) -> bytes | None:
    data = _read_stat(path)
    if data is None:
        return None
    rest = data[data.rfind(b")") + 2 :]
    return rest[:1] or None


def _has_running_thread(pid: int) -> bool:
    """Whether any thread of `pid` has not finished exiting. A thread that vanishes
    while it is looked at has finished; the directory gone means the process has."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for tid in tids:
        state = _task_state(f"/proc/{pid}/task/{tid}/stat")
        if state is not None and state not in _EXITED:
            return True
    return False


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _boot_id() -> bytes:
    try:
        text = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return bytes.fromhex(text.replace("-", ""))[:16].ljust(16, b"\0")
    except (OSError, ValueError):
        return bytes(16)


@dataclasses.dataclass(frozen=True)
class _Identity:
    pid: int
    start_time: int
    pid_namespace: int

    @classmethod
    def current(cls) -> _Identity:
        pid = os.getpid()
        start = process_start_time(pid)
        return cls(pid, start or 0, _pid_namespace())


_me: _Identity | None = None
_fork_epoch = 0  # bumped in every forked child; accounts of an older epoch are refused
_open_ledgers: weakref.WeakSet[Ledger] = weakref.WeakSet()
_open_accounts: weakref.WeakSet[LedgerAccount] = weakref.WeakSet()


def _identity() -> _Identity:
    global _me
    if _me is None:
        _me = _Identity.current()
    return _me


_last_registration = 0.0
_registration_lock = threading.Lock()


def _registration_time() -> float:
    """time.time(), but strictly later than this process's previous registration, so
    two rows registered by one process never share an owner (see LedgerAccount)."""
    global _last_registration
    with _registration_lock:
        now = max(time.time(), math.nextafter(_last_registration, math.inf))
        _last_registration = now
        return now


def _after_fork_in_child() -> None:
    global _me, _fork_epoch, _registration_lock
    _registration_lock = threading.Lock()
    _me = None
    _fork_epoch += 1
    for ledger in list(_open_ledgers):
        ledger._reopen_after_fork()


def _close_accounts_at_exit() -> None:
    for account in list(_open_accounts):
        with contextlib.suppress(Exception):
            account.close()


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_close_accounts_at_exit)


# ------------------------------------------------------------------- where ledgers are
_RUN_USER = Path("/run/user")  # where systemd-logind makes each user's runtime directory


def user_runtime_dir() -> Path | None:
    """This user's runtime directory: $XDG_RUNTIME_DIR, else /run/user/<uid>, if it is a
    real directory owned by this user that no one else can enter; else None."""
    candidates = [os.environ.get("XDG_RUNTIME_DIR", ""), str(_RUN_USER / str(os.geteuid()))]
    for candidate in candidates:
        if not candidate.startswith("/"):
            continue
        try:
            info = os.lstat(candidate)
        except OSError:
            continue
        if (
            stat.S_ISDIR(info.st_mode)
            and info.st_uid == os.geteuid()
            and not stat.S_IMODE(info.st_mode) & 0o077
        ):
            return Path(candidate)
    return None


def ledger_dir(directory: str | os.PathLike[str] | None = None) -> Path:
    """The folder ledgers live in, as an absolute path: `directory` (a relative one is
    taken from the current directory), else KVCACHED_LEDGER_DIR, else this user's
    runtime directory (`user_runtime_dir`), else /dev/shm, else the system's temporary
    folder (macOS has neither)."""
    if directory is None:
        from kvcached.config import settings

        directory = settings().ledger_dir
    if directory is not None:
        return Path(directory).absolute()
    runtime = user_runtime_dir()
    if runtime is not None:
        return runtime
    shm = Path("/dev/shm")
    if shm.is_dir():
        return shm
    import tempfile

    return Path(tempfile.gettempdir())


def _check_key(key: str) -> str:
    if not isinstance(key, str) or not _KEY.match(key):
        raise InvalidArgument(
            f"ledger key {key!r} is not valid: use lowercase letters, digits, '.', '_' "
            "and '-' (at most 64), e.g. 'cuda-0' or 'host-cpu'"
        )
    return key


def ledger_path(key: str, directory: str | os.PathLike[str] | None = None) -> Path:
    """The file of ledger `key` for the current user."""
    return ledger_dir(directory) / f"kvcached-{os.geteuid()}-{_check_key(key)}.ledger"


def existing_keys(directory: str | os.PathLike[str] | None = None) -> list[str]:
    """Keys of this user's ledgers in the ledger folder, sorted."""
    prefix, suffix = f"kvcached-{os.geteuid()}-", ".ledger"
    try:
        names = os.listdir(ledger_dir(directory))
    except OSError:
        return []
    keys = (n[len(prefix) : -len(suffix)] for n in names if n.startswith(prefix))
    return sorted(k for k in keys if _KEY.match(k) and f"{prefix}{k}{suffix}" in names)


def ledger_key(backend: str, device: str | int) -> str:
    """The ledger key of a device: ``ledger_key("cuda", 0) == "cuda-0"``; a framework
    device string works too (``"cuda:1"`` gives ordinal 1; the host's ``"cpu"`` gives
    ``"host-cpu"``)."""
    text = str(device).strip().lower()
    ordinal = text.rsplit(":", 1)[-1]
    return _check_key(f"{backend.strip().lower()}-{ordinal}")


def default_key(backend: str | None = None, device: str | int | None = None) -> str:
    """The key of the ledger that an instance started here with the current settings
    would use: the resolved backend (KVCACHED_BACKEND or auto-detection; no device
    context is created) and KVCACHED_DEVICE, or ``cpu`` for the host backend."""
    from kvcached.config import settings
    from kvcached.registry import resolve_name

    name = resolve_name(backend)
    if device is None:
        device = "cpu" if name == "host" else settings().device
    return ledger_key(name, device)


# --------------------------------------------------------------------- what it reports
@dataclasses.dataclass(frozen=True)
class InstanceRow:
    """One registered instance, as read from the ledger."""

    index: int
    pid: int
    start_time: int
    pid_namespace: int
    name: str
    engine: str
    limit: int | None
    reserved: int
    used: int
    peak: int
    denied: int
    registered_at: float

    def process_alive(self) -> bool | None:
        """Whether the row's process still runs, as far as this process can tell; None
        for a row registered from another pid namespace (it cannot be judged here)."""
        if self.pid_namespace != _identity().pid_namespace:
            return None
        return _alive(self.pid, self.start_time)

    @property
    def over_limit(self) -> int:
        """Bytes reserved above the limit (after `set_limit` lowered it), else 0."""
        return 0 if self.limit is None else max(0, self.reserved - self.limit)

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Totals:
    """Device-wide sums; `free` is what the budget still allows to be charged.

    `reserved` is the sum that charges are checked against: every instance's, plus
    `unowned`, bytes that free rows of a corrupted ledger still hold (normally 0;
    `Ledger.repair` clears them)."""

    budget: int
    reserved: int
    used: int
    instances: int
    unowned: int = 0

    @property
    def free(self) -> int:
        return max(0, self.budget - self.reserved)

    def as_dict(self) -> dict[str, int]:
        return {**dataclasses.asdict(self), "free": self.free}


@dataclasses.dataclass(frozen=True)
class LimitChange:
    """The outcome of `Ledger.set_limit`. When `over_by` > 0 the instance holds more
    than its new limit: it stops growing and releases free pages towards the limit,
    but pages holding live blocks stay until their blocks are freed."""

    name: str
    pid: int
    limit: int | None
    previous: int | None
    reserved: int

    @property
    def over_by(self) -> int:
        return 0 if self.limit is None else max(0, self.reserved - self.limit)


@dataclasses.dataclass(frozen=True)
class Repair:
    """The outcome of `Ledger.repair`: free rows that held leftovers, and their bytes."""

    rows: list[int]
    unowned: int


@dataclasses.dataclass(frozen=True)
class BudgetChange:
    """The outcome of `Ledger.set_budget`; `over_by` > 0 means instances already hold
    more than the new budget: no charge succeeds until they release that much."""

    budget: int
    previous: int
    reserved: int

    @property
    def over_by(self) -> int:
        return max(0, self.reserved - self.budget)


def _check_bytes(what: str, nbytes: object, *, allow_zero: bool = True) -> int:
    if type(nbytes) is not int or nbytes < 0 or (nbytes == 0 and not allow_zero):
        kind = "non-negative" if allow_zero else "positive"
        raise InvalidArgument(f"{what} must be a {kind} int of bytes, got {nbytes!r}")
    if nbytes >= NO_LIMIT:
        raise InvalidArgument(f"{what} {nbytes} is too large")
    return nbytes


def _check_limit(limit: object) -> int | None:
    if limit is None:
        return None
    return _check_bytes("limit", limit)


def _encode(what: str, value: str, pattern: re.Pattern[str], size: int) -> bytes:
    if not isinstance(value, str) or not pattern.match(value):
        raise InvalidArgument(
            f"instance {what} {value!r} is not valid: use letters, digits and . _ - "
            f"(starting with a letter or digit)"
        )
    data = value.encode()
    if len(data) > size:
        raise InvalidArgument(f"instance {what} {value!r} is longer than {size} bytes")
    return data


def _decode(raw: bytes) -> str:
    """A name or engine field as text that is safe to print: kvcached writes only
    validated names, but the file can be written by anything running as this user, so
    control characters (terminal escapes, bidi overrides) come back as escapes."""
    text = raw.rstrip(b"\0").decode(errors="replace")
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)


# -------------------------------------------------------------------------- the ledger
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
        self._ino = os.fstat(fd).st_ino
        self._reserved_column = _reserved_column(capacity)
        self._tlock = threading.Lock()
        self._accounts: weakref.WeakSet[LedgerAccount] = weakref.WeakSet()
        self._closed = False
        self._warned_unowned = False
        self.created = False  # whether `Ledger.open` created the file
        _open_ledgers.add(self)

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
        foreign, of an incompatible layout version or not owned by this user;
        InvalidArgument for a malformed key or budget."""
        _check_key(key)
        if budget is not None:
            _check_bytes("budget", budget, allow_zero=False)
        path = ledger_path(key, directory)
        created = False
        for _ in range(8):
            try:
                fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:
                if not create:
                    raise LedgerError(
                        f"no kvcached ledger for {key!r} at {path}: no kvcached instance "
                        "has used this device yet (or it used another KVCACHED_LEDGER_DIR)"
                    ) from None
                if budget is None:
                    raise InvalidArgument(
                        f"creating the ledger for {key!r} needs a budget in bytes"
                    ) from None
                created = _publish_new_file(path, budget, DEFAULT_CAPACITY)
                continue  # open what is there now: ours, or a concurrent creator's
            except OSError as exc:
                raise _open_error(path, exc) from None
            try:
                ledger = cls._from_fd(key, path, fd)
            except BaseException:
                os.close(fd)
                raise
            ledger.created = created
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
    def _from_fd(cls, key: str, path: Path, fd: int) -> Ledger:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _squatted(path, "is not a regular file")
        if info.st_uid != os.geteuid():
            raise _squatted(path, _owned_by_another(info.st_uid))
        mode = stat.S_IMODE(info.st_mode)
        if mode & 0o077:
            raise LedgerError(
                f"ledger {path} has mode {mode:04o}; ledgers must be owner-only (0600). "
                f"Fix it with 'chmod 600 {path}' if the file is yours, or remove it"
            )
        head = os.pread(fd, _HEADER.size, 0)
        if len(head) < _HEADER.size:
            raise LedgerError(
                f"{path} is {info.st_size} bytes, too short for a kvcached ledger "
                "(corrupted or not a ledger); remove it once no instance uses it"
            )
        magic, version, header_size, row_size, capacity, budget, _, _ = _HEADER.unpack(head)
        if magic != MAGIC:
            raise LedgerError(
                f"{path} is not a kvcached ledger (magic {magic!r}, expected {MAGIC!r}); "
                "refusing to touch it"
            )
        if version != LAYOUT_VERSION:
            raise LedgerError(
                f"ledger {path} has layout version {version}, this kvcached understands "
                f"version {LAYOUT_VERSION}: instances of another kvcached version are using "
                "this device. Use the same kvcached version everywhere, or give this one "
                "its own KVCACHED_LEDGER_DIR"
            )
        expected = header_size + row_size * capacity
        if (
            header_size != HEADER_SIZE
            or row_size != ROW_SIZE
            or not 0 < capacity <= 4096
            or info.st_size != expected
            or budget == 0
        ):
            raise LedgerError(
                f"ledger {path} is corrupted (header: {header_size}-byte header, "
                f"{row_size}-byte rows, {capacity} rows, budget {budget}; file "
                f"{info.st_size} bytes); remove it once no instance uses it"
            )
        try:
            mm = mmap.mmap(fd, info.st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
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
        """Both locks for an administrative operation; LedgerError after `timeout`."""
        self._check_open()
        if not self._tlock.acquire(timeout=-1 if timeout is None else timeout):
            raise LedgerError(f"ledger {self.path} is busy in this process")
        try:
            self._flock(timeout)
            try:
                yield self._mm
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._tlock.release()

    def _flock(self, timeout: float | None) -> None:
        if timeout is None:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            return
        deadline = time.monotonic() + timeout
        delay = 0.0005
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise LedgerError(
                        f"ledger {self.path} stayed locked for {timeout:g} s: a process "
                        "holding it is stopped or hung"
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, 0.05)

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
        (pid, start, namespace, limit, reserved, peak, used, denied, registered, name, engine) = (
            _ROW.unpack_from(mm, self._row_offset(index))
        )
        if pid == 0:
            return None
        return InstanceRow(
            index=index,
            pid=pid,
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
                    candidates.append((index, pid, start))
        if unowned and not self._warned_unowned:
            self._warned_unowned = True
            log.warning(
                "ledger %s is corrupted: free rows hold %d bytes that count against the "
                "budget though no instance holds them; 'kvctl repair --key %s' clears them",
                self.path, unowned, self.key,
            )  # fmt: skip
        dead = [(i, pid, start) for i, pid, start in candidates if not _alive(pid, start)]
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
        registered = _registration_time()
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
                    f"ledger {self.key} is full: {self.capacity} instances are registered"
                )
            _ROW.pack_into(
                mm,
                self._row_offset(free),
                me.pid,
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
        account = LedgerAccount(self, free, name, engine, me, registered)
        self._accounts.add(account)
        _open_accounts.add(account)
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
        memory, and the bytes it holds are no longer counted (see LedgerAccount)."""
        with self._locked() as mm:
            row = self._find(mm, name)
            if row is None:
                raise InvalidArgument(self._unknown(mm, name))
            if not force:
                if row.pid_namespace != _identity().pid_namespace:
                    raise InvalidArgument(
                        f"instance {name!r} was registered from another pid namespace (a "
                        "container?), so whether it is alive cannot be checked from here; "
                        "pass force if you know its process is gone"
                    )
                if _alive(row.pid, row.start_time):
                    raise InvalidArgument(
                        f"instance {name!r} (pid {row.pid}) is alive; pass force to remove it"
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
        _open_ledgers.discard(self)
        with contextlib.suppress(BufferError):
            self._mm.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __repr__(self) -> str:
        return f"Ledger({self.key!r}, path={str(self.path)!r}, closed={self._closed})"


def _user_name(uid: int) -> str:
    import pwd

    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (KeyError, OSError):
        return f"uid {uid}"


def _owned_by_another(uid: int) -> str:
    return f"is owned by {_user_name(uid)}, not by this user ({_user_name(os.geteuid())})"


def _squatted(path: Path, what: str) -> LedgerError:
    """The error for an entry at a ledger's path that kvcached must not use."""
    return LedgerError(
        f"{path} {what}, so it cannot be this user's ledger; nothing was changed. If you "
        "did not make it, another user may have (anyone can create names in a shared "
        "folder such as /dev/shm), which keeps you from using kvcached there. Remove it if "
        "it is yours, or set KVCACHED_LEDGER_DIR to a folder only you can write (the "
        "default is your runtime directory, $XDG_RUNTIME_DIR, when you have one)"
    )


def _open_error(path: Path, exc: OSError) -> LedgerError:
    """A clear error for a failed open of an existing ledger path."""
    if exc.errno == errno.ELOOP:
        try:
            target = f" to {os.readlink(path)}"
        except OSError:
            target = ""
        return _squatted(path, f"is a symbolic link{target} (never followed here)")
    if exc.errno == errno.EISDIR:
        return _squatted(path, "is a directory")
    if exc.errno in (errno.EACCES, errno.EPERM, errno.ENXIO, errno.EOPNOTSUPP):
        with contextlib.suppress(OSError):
            info = os.lstat(path)
            if info.st_uid != os.geteuid():
                return _squatted(path, _owned_by_another(info.st_uid))
            if not stat.S_ISREG(info.st_mode):
                return _squatted(path, "is not a regular file")
    return LedgerError(f"cannot open ledger {path}: {exc.strerror}")


def _alive(pid: int, start_time: int) -> bool:
    now = process_start_time(pid)
    return now is not None and (now == start_time or not _HAVE_PROC)


def _gib(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB ({nbytes} bytes)"


def _publish_new_file(path: Path, budget: int, capacity: int) -> bool:
    """Write a complete ledger to a private temporary file and link it into place; if
    another process published one first, keep theirs. Returns whether ours was linked."""
    folder = path.parent
    try:
        info = os.stat(folder)
    except OSError as exc:
        raise LedgerError(f"ledger folder {folder} is not usable: {exc.strerror}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise LedgerError(f"ledger folder {folder} is not a directory")
    if info.st_mode & stat.S_IWOTH and not info.st_mode & stat.S_ISVTX:
        raise LedgerError(
            f"ledger folder {folder} is writable by everyone without the sticky bit: "
            "anyone could replace a ledger there; use another KVCACHED_LEDGER_DIR"
        )
    tmp = folder / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(tmp, flags, 0o600)
    except OSError as exc:
        raise LedgerError(f"cannot create a ledger in {folder}: {exc.strerror}") from None
    try:
        os.fchmod(fd, 0o600)  # the umask may have removed bits, never added: be explicit
        data = bytearray(HEADER_SIZE + capacity * ROW_SIZE)
        _HEADER.pack_into(
            data, 0, MAGIC, LAYOUT_VERSION, HEADER_SIZE, ROW_SIZE, capacity, budget,
            _boot_id(), time.time(),
        )  # fmt: skip
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False  # a concurrent creator won (or a squatter); the caller opens it
        except OSError as exc:
            raise LedgerError(
                f"cannot create ledger {path}: {exc.strerror} (the folder must support "
                "hard links, as tmpfs and local file systems do)"
            ) from None
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return True


# ------------------------------------------------------------------------ accounts
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
    """

    __slots__ = (
        "__weakref__",
        "_closed",
        "_epoch",
        "_held",
        "_ledger",
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
        ledger: Ledger,
        index: int,
        name: str,
        engine: str,
        me: _Identity,
        registered: float,
    ) -> None:
        self._ledger = ledger
        self.index = index
        self.name = name
        self.engine = engine
        self._offset = HEADER_SIZE + index * ROW_SIZE
        self._pid = me.pid
        self._start = me.start_time
        self._owner = (me.pid, me.start_time, registered)
        self._epoch = _fork_epoch
        self._closed = False
        self._lost = False
        self._held = 0  # reserved bytes, as last seen in the row (all there is once lost)
        self._used = 0

    @property
    def ledger(self) -> Ledger:
        return self._ledger

    @property
    def lost(self) -> bool:
        """Whether this instance's row was removed from under it (kvctl forget --force)."""
        return self._lost

    # ------------------------------------------------------------ the hot path
    def try_charge(self, nbytes: int) -> bool:
        """Charge `nbytes` if this instance's limit and the device budget allow it.
        Returns False, charging nothing, when they do not (after clearing the rows of
        dead instances and trying once more), and always once the row was lost."""
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
        lock = ledger._tlock
        lock.acquire()
        try:
            fcntl.flock(ledger._fd, fcntl.LOCK_EX)
            try:
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
        if not self._lost:
            lock = ledger._tlock
            lock.acquire()
            try:
                fcntl.flock(ledger._fd, fcntl.LOCK_EX)
                try:
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
                finally:
                    fcntl.flock(ledger._fd, fcntl.LOCK_UN)
            finally:
                lock.release()
            self._become_lost()
        # Lost: the bytes are in no ledger any more; keep this process's count right.
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
        the row is lost: what the instance still holds, so that it grows no more."""
        value = self._field(_LIMIT_OFFSET)
        if value is None:
            return self._held
        return None if value == NO_LIMIT else value

    def headroom(self) -> int:
        """Bytes the device budget could still charge to any instance now. Read without
        the lock: a snapshot for planning (a free-block count), never a promise."""
        ledger = self._check()
        mm = ledger._mm
        budget = int(_BUDGET.unpack_from(mm, _BUDGET_OFFSET)[0])
        return max(0, budget - int(sum(ledger._reserved_column.unpack_from(mm, 0))))

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
        None once the row is lost."""
        ledger = self._check()
        if self._lost:
            return None
        lock = ledger._tlock
        lock.acquire()
        try:
            fcntl.flock(ledger._fd, fcntl.LOCK_EX)
            try:
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
        _open_accounts.discard(self)
        ledger = self._ledger
        if self._lost or self._epoch != _fork_epoch or ledger.closed or ledger._fd < 0:
            return
        with ledger._locked(timeout=None) as mm:
            if _OWNER.unpack_from(mm, self._offset) == self._owner:
                ledger._clear_row(mm, self.index)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "lost" if self._lost else f"row {self.index}"
        return f"LedgerAccount({self.name!r}, ledger={self._ledger.key!r}, {state})"

    # ---------------------------------------------------------------- checks
    def _check(self) -> Ledger:
        if self._closed:
            raise LedgerError(f"the ledger account of {self.name!r} was closed")
        if self._epoch != _fork_epoch:
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
