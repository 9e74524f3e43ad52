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
    row 0 .. row N-1    (192 bytes each) pid, uid, process start time, pid
                        namespace, limit, reserved, peak reserved, used, refused
                        charges, registration time, name, engine

`reserved` is what the instance holds in physical memory (every page it created,
including pages mapped but still empty); it is the number the budget bounds:
``sum(reserved) <= budget`` and ``reserved <= limit`` for every row. `used` is the part
holding live blocks; it is reported for people (kvctl, kvtop, metrics) and bounds
nothing. A row whose pid is 0 is free and all its counters are zero, so a plain sum over
the reserved column of every row is the device total. There is no cached total in the
header: a total and a row updated by two separate stores could disagree if a process
were killed between them, while a single 8-byte store into one row cannot be torn by a
kill. The row is the single source of truth; totals are always recomputed from rows.

The file is ``kvcached-<uid>-<key>.ledger`` (``kvcached-shared-<key>.ledger`` when
shared, see Note [Shared ledgers]) in KVCACHED_LEDGER_DIR when it is set, else
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

A charge is: take both locks, check that the file still has its size (one `lseek`;
see "A ledger that shrank"), unpack this instance's row and the budget, sum the
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
Files are owner-only (a shared ledger's are its group's: see Note [Shared ledgers]):
created with mode 0600 set by fchmod (whatever the umask) in a private temporary file
that is fully written before it is linked into place, so no one ever sees a
half-written ledger, and ``link()`` fails if another process published one first
(the O_CREAT|O_EXCL race, resolved by the loser opening the winner's file). An existing
file is opened with O_NOFOLLOW and refused, with an error naming the problem, when it
is not a regular file, is owned by another user, is readable or writable by
anyone else, is shorter or longer than its header says, carries a foreign magic or an
unknown layout version. Nothing is ever overwritten: a bad file is left for a person
to inspect, until that person runs `kvctl repair` (see "A ledger that shrank").

Note [Shared ledgers]
~~~~~~~~~~~~~~~~~~~~~
By default ledgers are per user (the uid is in the file name), so two users on one GPU
get a budget each and together can overcommit it. KVCACHED_LEDGER_GROUP=<group> opts
in to one ledger per device for every member of that Unix group: the file is
``kvcached-shared-<key>.ledger`` in KVCACHED_LEDGER_DIR, which must then be set (no
default folder can be shared safely). The rules are the per-user ones, widened from
one user to one group and no further:

* The process must be in the group (root may use any). The folder is a real directory
  (never a link) of the group, owned by root or a member, with mode 2770 or 3770:
  nobody outside the group can create, remove or rename names in it, and set-group-id
  gives new files the group. It is checked whenever a ledger is opened, before its
  file, since the folder's rights are what make the file's trustworthy.
* The file is a regular file (opened with O_NOFOLLOW) of the group, owned by root or a
  member, with mode exactly 0660. A new one is given the group (fchown) and the mode
  (fchmod) in its private temporary file before it is linked into place.
* Anything else is refused with an error naming what is wrong and what is accepted;
  nothing is changed. The group's name, not just "shared on", is the setting so that
  the check knows which group to expect: a boolean would trust whatever group the
  folder has, and a folder moved to a wider group would silently widen who can write
  this user's budget.

Every member can read and write the whole file: limits, the budget, `kvctl forget`.
A group is a circle of users trusted as one user is. Every row carries the uid of its
process (layout version 2), so `kvctl list` can say whose instances hold the budget.
Liveness of another user's process is read from /proc as for one's own, but /proc
mounted with hidepid hides it; so when another user's row has a /proc/<pid>/stat that
cannot be read, it is judged by kill(pid, 0), alive unless there is no such process
(a reused pid then keeps the row until that process exits: a stale row, never a
budget charged twice). Without the group, other users' per-user ledgers of the same
device are still visible where their names can be listed (/dev/shm; every runtime
directory, for root): `separate_ledgers` finds them and `kvctl list` says that their
budgets are separate.

Failure modes and trade-offs
----------------------------
* A process stopped (SIGSTOP, a debugger) while it holds the lock stalls every other
  instance's next charge until it runs again. The lock is held for microseconds, so
  this needs a stop at exactly that moment; kvctl and kvtop give up after a timeout
  instead of hanging.
* Removing the file while instances run splits the device: new instances create a new
  ledger and no longer see the old one's charges. Don't delete live ledgers.
* Truncating the file under a running process would make its next access to the map
  fault (SIGBUS); see "A ledger that shrank" for how that is kept from killing it.
* The budget is a promise kvcached instances make to each other, not an enforcement on
  other programs: memory used outside kvcached is invisible here (the allocator still
  checks the device's free memory before creating pages).
* Liveness without /proc (macOS) falls back to ``kill(pid, 0)`` with no start time, so
  a reused pid would keep a dead row alive until the new process exits.
* A row is 192 bytes and a ledger has 64 of them (12 KiB), so at most 64 instances can
  share one device; registering the 65th is a clear error that says how to free a row.

A ledger that shrank
--------------------
kvcached never truncates a ledger, but anything running as this user can (`truncate`,
a shell's `> file`), and touching a mapped page past the end of its file kills the
process with SIGBUS, which no Python code can catch. So every access to the map first
checks, under the flock, that the file still has the mapped size (one `lseek`, a
fraction of a microsecond). A ledger found shorter is *damaged* in this process for
good, and its map is never touched again: every charge raises `LedgerDamaged` (so
`alloc` raises it when it would grow, and the pool thread logs it once), refunds and
`used` are kept in this process only, `limit` answers the last value read and
`headroom` 0. The instance keeps serving from what it holds, and closing it still
gives everything back. The check cannot stop a truncation that lands in the
microseconds between it and the access (a truncation takes no lock); `kvctl repair`
does take it.

Every error about a bad file names `kvctl repair` (`repair_file`), which puts a damaged
file right under the flock. A file whose header still names a budget (one cut short,
or with a corrupted size field) gets its full size and a fresh header back, keeping
whatever rows survived; one whose header is gone (zeroed, or shorter than the budget
field) is removed, and the next instance creates a new ledger with its own budget.
Instances that were running on the damaged file hold memory that the repaired ledger
no longer counts: restart them. A file of another layout version, another owner or
the wrong mode is not damaged; its error says what to do instead.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import errno
import fcntl
import grp
import logging
import math
import mmap
import os
import pwd
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
    "FileRepair",
    "InstanceRow",
    "Ledger",
    "LedgerAccount",
    "LedgerDamaged",
    "LedgerError",
    "LimitChange",
    "Repair",
    "SeparateLedger",
    "Totals",
    "check_usable",
    "default_key",
    "existing_keys",
    "ledger_dir",
    "ledger_key",
    "ledger_path",
    "repair_file",
    "separate_ledgers",
    "user_name",
    "user_runtime_dir",
]


class LedgerError(KVCachedError):
    """The ledger file cannot be used: missing, corrupted, foreign, of an incompatible
    layout, owned by someone else, full, or busy. The message names the file and why."""


class LedgerDamaged(LedgerError):
    """The ledger file shrank while this process used it (something other than kvcached
    truncated it), so this process no longer touches it: its instances keep what they
    hold and take no more. The message names `kvctl repair` (see "A ledger that
    shrank")."""


# ---------------------------------------------------------------------------- layout
MAGIC = b"KVCLEDGR"
LAYOUT_VERSION = 2  # 2: rows carry the uid of their process (see Note [Shared ledgers])
DEFAULT_CAPACITY = 64
NO_LIMIT = (1 << 64) - 1  # the limit field's value for "no limit of its own"

# magic, version, header size, row size, row count, budget, boot id, created (unix time)
_HEADER = struct.Struct("<8sIIIIQ16sd")
HEADER_SIZE = 128
_BUDGET = struct.Struct("<Q")
_BUDGET_OFFSET = 24
_BOOT_ID_OFFSET = 32
_BOOT_ID = struct.Struct("<16s")

# pid, uid, start time, pid namespace, limit, reserved, peak, used, refused charges,
# registered (unix time), name, engine; then spare bytes kept zero for later versions.
# The uid sits where version 1 had 4 bytes of padding, so every other offset is as it was.
_ROW = struct.Struct("<IIQQQQQQQd64s24s")
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
_UID_OFFSET = 4
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
    sharing = _sharing()
    if sharing is not None:
        raise LedgerError(
            f"KVCACHED_LEDGER_GROUP={sharing.group} shares ledgers with that group, so it "
            "needs KVCACHED_LEDGER_DIR: the folder of the group's ledgers, which an "
            f"administrator creates once ('install -d -m 2770 -g {sharing.group} "
            "/srv/kvcached', say). No default folder can be shared safely: your runtime "
            "directory is private, and in /dev/shm anyone can take a ledger's name"
        )
    runtime = user_runtime_dir()
    if runtime is not None:
        return runtime
    shm = Path("/dev/shm")
    if shm.is_dir():
        return shm
    import tempfile

    return Path(tempfile.gettempdir())


# ------------------------------------------------------------------ shared ledgers
@dataclasses.dataclass(frozen=True)
class _Sharing:
    """KVCACHED_LEDGER_GROUP, resolved: the group whose members share every ledger of
    the ledger folder (see Note [Shared ledgers])."""

    group: str
    gid: int


def _sharing() -> _Sharing | None:
    from kvcached.config import ledger_group

    resolved = ledger_group()
    return None if resolved is None else _Sharing(*resolved)


SHARED_FOLDER_MODES = (0o2770, 0o3770)  # the modes a shared ledger folder may have
SHARED_FILE_MODE = 0o660


def _in_group(uid: int, gid: int) -> bool:
    """Whether user `uid` is root or a member of group `gid` (primary or supplementary),
    as the user database says."""
    if uid == 0:
        return True
    try:
        user = pwd.getpwuid(uid)
    except KeyError:
        return False
    return gid == user.pw_gid or gid in os.getgrouplist(user.pw_name, user.pw_gid)


def _group_name(gid: int) -> str:
    try:
        return f"{grp.getgrgid(gid).gr_name} (gid {gid})"
    except KeyError:
        return f"gid {gid}"


def _shared_folder_problem(folder: Path, sharing: _Sharing) -> LedgerError | None:
    """Why the ledgers of group `sharing` cannot be kept in `folder`; None when they can.
    This process must be in the group, and the folder a real directory of the group,
    owned by root or a member, with mode 2770 or 3770 (see Note [Shared ledgers])."""
    group = sharing.group
    if os.geteuid() != 0 and sharing.gid != os.getegid() and sharing.gid not in os.getgroups():
        return LedgerError(
            f"this process ({user_name(os.geteuid())}) is not in group {group}, which "
            f"KVCACHED_LEDGER_GROUP names, so it cannot use the shared ledgers in {folder}. "
            f"Ask an administrator to add you ('usermod -aG {group} USER', then log in "
            "again), or unset KVCACHED_LEDGER_GROUP for a ledger of your own"
        )
    what = f"shared ledger folder {folder} (KVCACHED_LEDGER_DIR)"
    try:
        info = os.lstat(folder)
    except FileNotFoundError:
        return LedgerError(
            f"{what} does not exist. An administrator creates it once: 'install -d -m 2770 "
            f"-g {group} {folder}' (owned by root or a member of {group})"
        )
    except OSError as exc:
        return LedgerError(f"{what} is not usable: {exc.strerror}")
    if stat.S_ISLNK(info.st_mode):
        try:
            target = f" to {os.readlink(folder)}"
        except OSError:
            target = ""
        return LedgerError(
            f"{what} is a symbolic link{target}; accepted: the real folder (links are "
            "not followed, so that no one can redirect the group's ledgers)"
        )
    if not stat.S_ISDIR(info.st_mode):
        return LedgerError(f"{what} is not a directory; accepted: a folder of group {group}")
    if info.st_gid != sharing.gid:
        return LedgerError(
            f"{what} belongs to group {_group_name(info.st_gid)}, not to {group}; accepted: "
            f"a folder of group {group} ('chgrp {group} {folder}')"
        )
    mode = stat.S_IMODE(info.st_mode)
    if mode not in SHARED_FOLDER_MODES:
        return LedgerError(
            f"{what} has mode {mode:04o}; accepted: 2770 (read, write and enter for its "
            f"owner and group {group}, set-group-id so that new files get the group, "
            "nothing for anyone else) or 3770 (the same with the sticky bit, so that only "
            f"a file's owner can remove it): 'chmod 2770 {folder}'"
        )
    if not _in_group(info.st_uid, sharing.gid):
        return LedgerError(
            f"{what} is owned by {user_name(info.st_uid)}, who is neither root nor a member "
            f"of {group}, and could replace the group's ledgers; accepted: a folder owned "
            f"by root or a member ('chown root {folder}')"
        )
    return None


def _shared_entry_problem(path: Path, info: os.stat_result, sharing: _Sharing) -> str | None:
    """What makes the entry `info` at `path` unfit to be the shared ledger; None if fit."""
    group = sharing.group
    if not stat.S_ISREG(info.st_mode):
        return "is not a regular file"
    if info.st_gid != sharing.gid:
        return (
            f"belongs to group {_group_name(info.st_gid)}, not to {group}; accepted: a "
            f"file of group {group} with mode 0660 ('chgrp {group} {path}')"
        )
    mode = stat.S_IMODE(info.st_mode)
    if mode != SHARED_FILE_MODE:
        return (
            f"has mode {mode:04o}; a shared ledger must have mode 0660 (read and write for "
            f"its owner and group {group}, nothing for anyone else): 'chmod 660 {path}'"
        )
    if not _in_group(info.st_uid, sharing.gid):
        return (
            f"is owned by {user_name(info.st_uid)}, who is neither root nor a member of "
            f"{group}; accepted: a file owned by root or a member of {group} ('chown "
            f"MEMBER {path}', or remove it)"
        )
    return None


def _check_shared_folder(folder: Path, sharing: _Sharing | None) -> None:
    if sharing is not None:
        problem = _shared_folder_problem(folder, sharing)
        if problem is not None:
            raise problem


def _check_key(key: str) -> str:
    if not isinstance(key, str) or not _KEY.match(key):
        raise InvalidArgument(
            f"ledger key {key!r} is not valid: use lowercase letters, digits, '.', '_' "
            "and '-' (at most 64), e.g. 'cuda-0' or 'host-cpu'"
        )
    return key


def ledger_path(key: str, directory: str | os.PathLike[str] | None = None) -> Path:
    """The file of ledger `key`: the current user's, ``kvcached-<uid>-<key>.ledger``, or
    with KVCACHED_LEDGER_GROUP set the group's, ``kvcached-shared-<key>.ledger``."""
    return ledger_dir(directory) / f"{_file_prefix(_sharing())}{_check_key(key)}.ledger"


def _file_prefix(sharing: _Sharing | None) -> str:
    return "kvcached-shared-" if sharing is not None else f"kvcached-{os.geteuid()}-"


def existing_keys(directory: str | os.PathLike[str] | None = None) -> list[str]:
    """Keys of the ledgers in the ledger folder that this process would use (this user's,
    or the group's when shared), sorted."""
    prefix, suffix = _file_prefix(_sharing()), ".ledger"
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


# ------------------------------------------------------------- other users' ledgers
@dataclasses.dataclass(frozen=True)
class SeparateLedger:
    """A per-user ledger of the same device whose budget is not the one in use: another
    user's, or with a shared ledger anyone's (see Note [Shared ledgers]). `instances`
    and `reserved` count its live rows; both are None when this user cannot read it."""

    path: Path
    uid: int
    instances: int | None = None
    reserved: int | None = None


def _public_ledger_folders() -> list[Path]:
    """Where the per-user ledgers of other users may be seen: /dev/shm (anyone can list
    it), and each user's runtime directory (only root can list those)."""
    folders = [Path("/dev/shm")]
    with contextlib.suppress(OSError):
        folders += sorted(entry for entry in _RUN_USER.iterdir() if entry.name.isdigit())
    return folders


def separate_ledgers(
    key: str, directory: str | os.PathLike[str] | None = None
) -> list[SeparateLedger]:
    """The per-user ledgers of device `key` that this process can see besides the one it
    uses, whose budgets are separate from it: other users' (and, when ledgers are shared
    with KVCACHED_LEDGER_GROUP, this user's own too), in the ledger folder, this user's
    runtime directory and `_public_ledger_folders`. An entry counts only when it is a
    regular file owned by the uid its name carries. The files are read, never locked
    or changed."""
    sharing = _sharing()
    own = ledger_path(key, directory)
    folders = [own.parent, *_public_ledger_folders()]
    runtime = user_runtime_dir()
    if runtime is not None:
        folders.append(runtime)
    pattern = re.compile(rf"^kvcached-(\d+)-{re.escape(key)}\.ledger$")
    found = []
    for folder in dict.fromkeys(folders):
        try:
            names = sorted(os.listdir(folder))
        except OSError:
            continue
        for name in names:
            match = pattern.match(name)
            if match is None:
                continue
            uid, path = int(match.group(1)), folder / name
            if path == own or (sharing is None and uid == os.geteuid()):
                continue
            try:
                info = os.lstat(path)
            except OSError:
                continue
            if stat.S_ISREG(info.st_mode) and info.st_uid == uid:
                found.append(_peek(path, uid))
    return found


def _peek(path: Path, uid: int) -> SeparateLedger:
    """The live instances of another ledger file and what they hold, read without a lock;
    counts of None when it cannot be read or is not a ledger this kvcached understands."""
    unknown = SeparateLedger(path, uid)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return unknown
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > HEADER_SIZE + 4096 * ROW_SIZE:
            return unknown
        data = os.pread(fd, info.st_size, 0)
    except OSError:
        return unknown
    finally:
        os.close(fd)
    try:
        if _damage(path, len(data), data[: _HEADER.size]) is not None:
            return unknown
    except LedgerError:  # another layout version
        return unknown
    namespace = _identity().pid_namespace
    instances = reserved = 0
    for index in range(_HEADER.unpack_from(data)[4]):
        pid, row_uid, start, row_namespace, _, held = _ROW.unpack_from(
            data, HEADER_SIZE + index * ROW_SIZE
        )[:6]
        if pid and (row_namespace != namespace or _row_alive(pid, start, row_uid)):
            instances += 1
            reserved += held
    return SeparateLedger(path, uid, instances, reserved)


# --------------------------------------------------------------------- what it reports
@dataclasses.dataclass(frozen=True)
class InstanceRow:
    """One registered instance, as read from the ledger."""

    index: int
    pid: int
    uid: int  # the effective uid of the process that registered it
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
        return _row_alive(self.pid, self.start_time, self.uid)

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
        self._size = HEADER_SIZE + capacity * ROW_SIZE  # the bytes mapped
        self._damaged: str | None = None  # why, once the file shrank (never cleared)
        self._ino = os.fstat(fd).st_ino
        self._reserved_column = _reserved_column(capacity)
        self._tlock = threading.Lock()
        self._accounts: weakref.WeakSet[LedgerAccount] = weakref.WeakSet()
        self._closed = False
        self._warned_unowned = False
        self.created = False  # whether `Ledger.open` created the file
        self.group: str | None = None  # the group it is shared with (KVCACHED_LEDGER_GROUP)
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
        LedgerDamaged when the file shrank (see "A ledger that shrank")."""
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
        mapped byte. Once it did not, never again (see "A ledger that shrank")."""
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
            (i, pid, start) for i, pid, start, uid in candidates if not _row_alive(pid, start, uid)
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
                        f"if you know its process is gone, 'kvctl forget {name} --force' "
                        "(force=True from Python) removes it"
                    )
                if _row_alive(row.pid, row.start_time, row.uid):
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
        _open_ledgers.discard(self)
        with contextlib.suppress(BufferError):
            self._mm.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __repr__(self) -> str:
        return f"Ledger({self.key!r}, path={str(self.path)!r}, closed={self._closed})"


def user_name(uid: int) -> str:
    """A uid as people read it: ``uid 1001 (alice)``, or ``uid 1001`` when unknown."""
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (KeyError, OSError):
        return f"uid {uid}"


def _owned_by_another(uid: int) -> str:
    return f"is owned by {user_name(uid)}, not by this user ({user_name(os.geteuid())})"


def _squatted(path: Path, what: str, sharing: _Sharing | None = None) -> LedgerError:
    """The error for an entry at a ledger's path that kvcached must not use."""
    if sharing is not None:
        return LedgerError(
            f"{path} {what}, so it cannot be the shared ledger of group {sharing.group}; "
            f"nothing was changed. Only members of {sharing.group} can create names in "
            "its folder: remove it if it is yours, else ask its owner or an administrator"
        )
    return LedgerError(
        f"{path} {what}, so it cannot be this user's ledger; nothing was changed. If you "
        "did not make it, another user may have (anyone can create names in a shared "
        "folder such as /dev/shm), which keeps you from using kvcached there. Remove it if "
        "it is yours, or set KVCACHED_LEDGER_DIR to a folder only you can write (the "
        "default is your runtime directory, $XDG_RUNTIME_DIR, when you have one)"
    )


def _open_error(path: Path, exc: OSError, sharing: _Sharing | None = None) -> LedgerError:
    """A clear error for a failed open of an existing ledger path."""
    if exc.errno == errno.ELOOP:
        try:
            target = f" to {os.readlink(path)}"
        except OSError:
            target = ""
        return _squatted(path, f"is a symbolic link{target} (never followed here)", sharing)
    if exc.errno == errno.EISDIR:
        return _squatted(path, "is a directory", sharing)
    if exc.errno == errno.ENOTDIR:
        folder = _folder_problem(path.parent, sharing)
        if folder is not None:
            return folder
    if exc.errno in (errno.EACCES, errno.EPERM, errno.ENXIO, errno.EOPNOTSUPP):
        with contextlib.suppress(OSError):
            info = os.lstat(path)
            if sharing is not None:
                problem = _shared_entry_problem(path, info, sharing)
                if problem is not None:
                    return _shared_entry_error(path, problem, sharing)
            elif info.st_uid != os.geteuid():
                return _squatted(path, _owned_by_another(info.st_uid))
            elif not stat.S_ISREG(info.st_mode):
                return _squatted(path, "is not a regular file")
    return LedgerError(f"cannot open ledger {path}: {exc.strerror}")


def _shared_entry_error(path: Path, problem: str, sharing: _Sharing) -> LedgerError:
    if problem == "is not a regular file":
        return _squatted(path, problem, sharing)
    return LedgerError(f"shared ledger {path} {problem}")


def _missing(key: str, path: Path) -> LedgerError:
    return LedgerError(
        f"no kvcached ledger for {key!r} at {path}: no kvcached instance has used this "
        "device yet (or it used another KVCACHED_LEDGER_DIR)"
    )


def _alive(pid: int, start_time: int) -> bool:
    now = process_start_time(pid)
    return now is not None and (now == start_time or not _HAVE_PROC)


def _row_alive(pid: int, start_time: int, uid: int) -> bool:
    """Whether the process of a row of user `uid` still runs. /proc mounted with hidepid
    hides the processes of other users (their /proc/<pid>/stat cannot be read), so a row
    of another user's whose stat cannot be read is judged by kill(pid, 0): dead only
    when the kernel says there is no such process (see Note [Shared ledgers])."""
    if _alive(pid, start_time):
        return True
    if uid == os.geteuid() or not _HAVE_PROC or _stat_readable(pid):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, and belongs to someone else
        return True
    return True


def _stat_readable(pid: int) -> bool:
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    os.close(fd)
    return True


def _gib(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB ({nbytes} bytes)"


def _flock(fd: int, path: Path, timeout: float | None) -> None:
    """flock(LOCK_EX) on `fd`; LedgerError after `timeout` seconds (None: wait)."""
    if timeout is None:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return
    deadline = time.monotonic() + timeout
    delay = 0.0005
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise LedgerError(
                    f"ledger {path} stayed locked for {timeout:g} s: a process holding it "
                    "is stopped or hung"
                ) from None
            time.sleep(delay)
            delay = min(delay * 2, 0.05)


# ------------------------------------------------------------- checking a ledger file
def _check_entry(path: Path, fd: int, sharing: _Sharing | None = None) -> os.stat_result:
    """The checks of an open ledger path that no repair overrides: a regular file of this
    user that no one else can read or write; when shared, a regular file of the group
    with mode 0660, owned by root or a member (see Note [Shared ledgers])."""
    info = os.fstat(fd)
    if sharing is not None:
        problem = _shared_entry_problem(path, info, sharing)
        if problem is not None:
            raise _shared_entry_error(path, problem, sharing)
        return info
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
    return info


def _damage(path: Path, size: int, head: bytes) -> str | None:
    """What makes a ledger file of `size` bytes that starts with `head` unusable, in
    words that follow its path; None when it is sound. A file of another layout version
    is not damaged (the kvcached that wrote it reads it): LedgerError saying so."""
    if len(head) < _HEADER.size:
        return f"is {size} bytes, too short for a kvcached ledger (truncated, or not a ledger)"
    magic, version, header_size, row_size, capacity, budget, _, _ = _HEADER.unpack(head)
    if magic != MAGIC:
        return f"is not a kvcached ledger (magic {magic!r}, expected {MAGIC!r})"
    if version != LAYOUT_VERSION:
        raise LedgerError(
            f"ledger {path} has layout version {version}, this kvcached understands "
            f"version {LAYOUT_VERSION}: instances of another kvcached version are using "
            "this device. Use the same kvcached version everywhere, or give this one "
            "its own KVCACHED_LEDGER_DIR; if no instance of that version runs any more (a "
            f"ledger left from before an upgrade), remove the file: 'rm {path}'"
        )
    if (
        header_size != HEADER_SIZE
        or row_size != ROW_SIZE
        or not 0 < capacity <= 4096
        or size != header_size + row_size * capacity
        or budget == 0
    ):
        return (
            f"is corrupted (header: {header_size}-byte header, {row_size}-byte rows, "
            f"{capacity} rows, budget {budget}; file {size} bytes)"
        )
    return None


def _repair_command(key: str, path: Path) -> str:
    """The kvctl command line that repairs ledger `key` at `path`."""
    command = f"kvctl repair --key {key}"
    try:
        default = ledger_dir()
    except KVCachedError:  # a malformed environment: name the folder anyway
        default = None
    if path.parent != default:
        command += f" --ledger-dir {path.parent}"
    return command


def _validate(key: str, path: Path, fd: int, sharing: _Sharing | None = None) -> tuple[int, int]:
    """Every check of an open ledger file; (its size, its row count), else LedgerError
    naming the problem and the way out."""
    info = _check_entry(path, fd, sharing)
    head = os.pread(fd, _HEADER.size, 0)
    problem = _damage(path, info.st_size, head)
    if problem is not None:
        raise LedgerError(
            f"{path} {problem}; nothing was changed. If it is a damaged ledger (cut short "
            f"or zeroed, say), '{_repair_command(key, path)}' repairs it: it keeps the "
            "budget when the header still has one, else it removes the file for the next "
            "instance to create anew"
        )
    capacity: int = _HEADER.unpack(head)[4]
    return info.st_size, capacity


def check_usable(key: str, directory: str | os.PathLike[str] | None = None) -> Path:
    """Raise the LedgerError that an instance starting now would meet at ledger `key`,
    changing nothing: the checks of the file when it exists, else those of the folder
    it would be created in (`kvcached info` runs this). Returns the ledger's path."""
    sharing = _sharing()
    path = ledger_path(key, directory)
    _check_shared_folder(path.parent, sharing)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        _check_folder(path.parent, sharing)
        return path
    except OSError as exc:
        raise _open_error(path, exc, sharing) from None
    try:
        _validate(key, path, fd, sharing)
    finally:
        os.close(fd)
    return path


# ------------------------------------------------------------ repairing a ledger file
@dataclasses.dataclass(frozen=True)
class FileRepair:
    """What `repair_file` did to a damaged ledger file: rewritten with its `budget` (and
    the `rows` of instances that survived), or removed (`budget` None)."""

    path: Path
    problem: str
    budget: int | None
    rows: int = 0


def repair_file(key: str, directory: str | os.PathLike[str] | None = None) -> FileRepair | None:
    """Put the damaged file of ledger `key` right, under its flock (see "A ledger that
    shrank"); None when the file is sound, or was repaired meanwhile by another process.
    Raises LedgerError when there is no ledger, when the path is not this user's
    owner-only regular file (the group's 0660 one, when shared), or when the file is of
    another layout version."""
    sharing = _sharing()
    path = ledger_path(key, directory)
    _check_shared_folder(path.parent, sharing)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise _missing(key, path) from None
    except OSError as exc:
        raise _open_error(path, exc, sharing) from None
    try:
        _check_entry(path, fd, sharing)
        _flock(fd, path, _ADMIN_LOCK_TIMEOUT)  # every instance checks the size under it
        info = os.fstat(fd)
        try:
            if os.lstat(path).st_ino != info.st_ino:
                return None  # another repair replaced it while this one waited
        except FileNotFoundError:
            return None  # another repair removed it
        head = os.pread(fd, HEADER_SIZE, 0)
        problem = _damage(path, info.st_size, head[: _HEADER.size])
        if problem is None:
            return None
        budget = _surviving_budget(head)
        if budget is None:
            try:
                os.unlink(path)
            except OSError as exc:
                raise LedgerError(
                    f"cannot remove the damaged ledger {path}: {exc.strerror} (in a folder "
                    f"with the sticky bit only its owner, {user_name(info.st_uid)}, or root "
                    "may remove it)"
                ) from None
            return FileRepair(path, problem, None)
        rows = _rewrite_header(fd, path, info.st_size, head, budget)
        return FileRepair(path, problem, budget, rows)
    finally:
        os.close(fd)  # and with it the flock


def _surviving_budget(head: bytes) -> int | None:
    """The budget a damaged file's header still names, if its magic and version survive."""
    if len(head) < _BUDGET_OFFSET + _BUDGET.size or head[: len(MAGIC)] != MAGIC:
        return None
    if _U32.unpack_from(head, len(MAGIC))[0] != LAYOUT_VERSION:
        return None
    budget: int = _BUDGET.unpack_from(head, _BUDGET_OFFSET)[0]
    return budget if 0 < budget < NO_LIMIT else None


def _rewrite_header(fd: int, path: Path, size: int, head: bytes, budget: int) -> int:
    """Give a damaged file its full size (new bytes written, so that a full tmpfs fails
    here rather than under a mapping) and a fresh header naming `budget`, keeping its
    boot id when that survived. Returns the rows of instances that survived."""
    boot_end = _BOOT_ID_OFFSET + _BOOT_ID.size
    boot = head[_BOOT_ID_OFFSET:boot_end] if len(head) >= boot_end else _boot_id()
    full = HEADER_SIZE + DEFAULT_CAPACITY * ROW_SIZE
    header = bytearray(HEADER_SIZE)
    _HEADER.pack_into(
        header, 0, MAGIC, LAYOUT_VERSION, HEADER_SIZE, ROW_SIZE, DEFAULT_CAPACITY, budget,
        boot, time.time(),
    )  # fmt: skip
    try:
        os.ftruncate(fd, min(size, full))
        if size < full:
            _write_all(fd, bytes(full - size), size)
        _write_all(fd, header, 0)
        data = os.pread(fd, full, 0)
    except OSError as exc:
        raise _write_error(path.parent, exc) from None
    offsets = range(HEADER_SIZE, full, ROW_SIZE)
    return sum(1 for offset in offsets if _U32.unpack_from(data, offset)[0])


def _write_all(fd: int, data: bytes | bytearray, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


# ------------------------------------------------------------ creating a ledger file
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def _folder_problem(folder: Path, sharing: _Sharing | None = None) -> LedgerError | None:
    """Why a ledger cannot be created in `folder` (missing, not a folder, writable by
    everyone without the sticky bit; when shared, see `_shared_folder_problem`); None
    when it can be tried."""
    if sharing is not None:
        return _shared_folder_problem(folder, sharing)
    try:
        info = os.stat(folder)
    except FileNotFoundError:
        return LedgerError(
            f"ledger folder {folder} is not usable: it does not exist. Create it "
            f"('mkdir -m 700 {folder}') or set KVCACHED_LEDGER_DIR to a folder that does"
        )
    except OSError as exc:
        return LedgerError(f"ledger folder {folder} is not usable: {exc.strerror}")
    if not stat.S_ISDIR(info.st_mode):
        return LedgerError(
            f"ledger folder {folder} is not a directory; set KVCACHED_LEDGER_DIR to a "
            "folder only you can write"
        )
    if info.st_mode & stat.S_IWOTH and not info.st_mode & stat.S_ISVTX:
        return LedgerError(
            f"ledger folder {folder} is writable by everyone without the sticky bit: "
            "anyone could replace a ledger there; use another KVCACHED_LEDGER_DIR"
        )
    return None


def _check_folder(folder: Path, sharing: _Sharing | None = None) -> None:
    problem = _folder_problem(folder, sharing)
    if problem is not None:
        raise problem


def _write_error(folder: Path, exc: OSError) -> LedgerError:
    """A clear error for a ledger that could not be written in `folder`."""
    if exc.errno in _NO_SPACE:
        why = "its file system is full" if exc.errno == errno.ENOSPC else "the quota is used up"
        return LedgerError(
            f"cannot create a ledger in {folder}: {why} ({exc.strerror}). Free some space "
            "there (a tmpfs such as /dev/shm or /run/user holds its files in memory), or "
            "set KVCACHED_LEDGER_DIR to another folder"
        )
    return LedgerError(f"cannot create a ledger in {folder}: {exc.strerror}")


def _publish_new_file(
    path: Path, budget: int, capacity: int, sharing: _Sharing | None = None
) -> bool:
    """Write a complete ledger to a private temporary file and link it into place; if
    another process published one first, keep theirs. Returns whether ours was linked.
    A shared ledger is given its group and mode 0660 before it is linked."""
    folder = path.parent
    _check_folder(folder, sharing)
    tmp = folder / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(tmp, flags, 0o600)
    except OSError as exc:
        raise _write_error(folder, exc) from None
    try:
        data = bytearray(HEADER_SIZE + capacity * ROW_SIZE)
        _HEADER.pack_into(
            data, 0, MAGIC, LAYOUT_VERSION, HEADER_SIZE, ROW_SIZE, capacity, budget,
            _boot_id(), time.time(),
        )  # fmt: skip
        try:
            if sharing is not None:
                os.fchown(fd, -1, sharing.gid)  # a member may give its file the group
            # The umask may have removed bits, never added: be explicit.
            os.fchmod(fd, SHARED_FILE_MODE if sharing is not None else 0o600)
            _write_all(fd, data, 0)  # every page written: a full tmpfs fails here
        except OSError as exc:
            raise _write_error(folder, exc) from None
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False  # a concurrent creator won (or a squatter); the caller opens it
        except OSError as exc:
            if exc.errno in _NO_SPACE:
                raise _write_error(folder, exc) from None
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
    If the file shrinks under it, every charge raises `LedgerDamaged` instead, and the
    rest is kept in this process the same way (see "A ledger that shrank").
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
        ledger: Ledger,
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
        self._epoch = _fork_epoch
        self._closed = False
        self._lost = False
        self._held = 0  # reserved bytes, as last seen in the row (all there is once lost)
        self._used = 0
        self._limit = limit  # as last read from the row (what `limit` answers once damaged)

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
        ledger = self._check()
        if ledger._damaged is not None:
            return 0
        lock = ledger._tlock
        lock.acquire()
        try:
            fcntl.flock(ledger._fd, fcntl.LOCK_EX)
            try:
                if not ledger._intact():
                    return 0
                mm = ledger._mm
                budget = int(_BUDGET.unpack_from(mm, _BUDGET_OFFSET)[0])
                reserved = int(sum(ledger._reserved_column.unpack_from(mm, 0)))
            finally:
                fcntl.flock(ledger._fd, fcntl.LOCK_UN)
        finally:
            lock.release()
        return max(0, budget - reserved)

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
        _open_accounts.discard(self)
        ledger = self._ledger
        if self._lost or self._epoch != _fork_epoch or ledger.closed or ledger._fd < 0:
            return
        with contextlib.suppress(LedgerDamaged), ledger._locked(timeout=None) as mm:
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
