"""The ledger file itself: opened safely, checked, created atomically, and repaired.

Note [Ledger file security]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
Files are owner-only (a shared ledger's are its group's: see Note [Shared ledgers] in
placement.py): created with mode 0600 set by fchmod (whatever the umask) in a private
temporary file that is fully written before it is linked into place, so no one ever
sees a half-written ledger, and ``link()`` fails if another process published one first
(the O_CREAT|O_EXCL race, resolved by the loser opening the winner's file:
`_publish_new_file`). An existing file is opened with O_NOFOLLOW and refused, with an
error naming the problem, when it is not a regular file, is owned by another user, is
readable or writable by anyone else, is shorter or longer than its header says,
carries a foreign magic or an unknown layout version (`_check_entry`, `_validate`).
Nothing is ever overwritten: a bad file is left for a person to inspect, until that
person runs `kvctl repair` (Note [Repairing a ledger]).

Note [Repairing a ledger]
~~~~~~~~~~~~~~~~~~~~~~~~~
Every error about a bad file names `kvctl repair` (`repair_file`), which puts a damaged
file right under the flock (the lock every instance checks the file's size under: Note
[A ledger that shrank] in book.py). A file whose header still names a budget (one cut
short, or with a corrupted size field) gets its full size and a fresh header back,
keeping whatever rows survived; one whose header is gone (zeroed, or shorter than the
budget field) is removed, and the next instance creates a new ledger with its own
budget. Instances that were running on the damaged file hold memory that the repaired
ledger no longer counts: restart them. A file of another layout version, another owner
or the wrong mode is not damaged; its error says what to do instead.

The flock itself, with a timeout for administrative callers, is `_flock`; why flock at
all is Note [Locking] in book.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import os
import secrets
import stat
import time
from pathlib import Path

from kvcached.errors import KVCachedError
from kvcached.ledger.errors import LedgerError
from kvcached.ledger.format import (
    _BOOT_ID,
    _BOOT_ID_OFFSET,
    _BUDGET,
    _BUDGET_OFFSET,
    _HEADER,
    _U32,
    DEFAULT_CAPACITY,
    HEADER_SIZE,
    LAYOUT_VERSION,
    MAGIC,
    NO_LIMIT,
    ROW_SIZE,
    _damage,
)
from kvcached.ledger.liveness import _boot_id
from kvcached.ledger.placement import (
    SHARED_FILE_MODE,
    _check_shared_folder,
    _shared_entry_problem,
    _shared_folder_problem,
    _Sharing,
    _sharing,
    ledger_dir,
    ledger_path,
    user_name,
)

__all__ = ["FileRepair", "check_usable", "repair_file"]

_ADMIN_LOCK_TIMEOUT = 5.0  # seconds kvctl/kvtop/register wait for a stalled lock holder


# ------------------------------------------------------------ errors about an entry
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


# ----------------------------------------------------------------------- the flock
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
    with mode 0660, owned by root or a member (Note [Shared ledgers] in placement.py)."""
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
    """Put the damaged file of ledger `key` right, under its flock (see Note [Repairing
    a ledger]); None when the file is sound, or was repaired meanwhile by another process.
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
