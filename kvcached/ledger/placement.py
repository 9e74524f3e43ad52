"""Where ledgers live: the folder, the file names, the keys, and sharing by group.

Note [Where ledgers live]
~~~~~~~~~~~~~~~~~~~~~~~~~
The file is ``kvcached-<uid>-<key>.ledger`` (``kvcached-shared-<key>.ledger`` when
shared, see Note [Shared ledgers]) in KVCACHED_LEDGER_DIR when it is set, else
in this user's runtime directory ($XDG_RUNTIME_DIR, else /run/user/<uid>, when it is a
directory the user owns that no one else can enter), else in /dev/shm. Both are tmpfs:
memory, never disk, emptied by a reboot. The runtime directory is preferred because no
other user can create files in it: in /dev/shm anyone can pre-create the file name of
another user's ledger (a file, a link or a directory) and so deny that user kvcached;
such an entry is never touched, and the error says what is there and points to
KVCACHED_LEDGER_DIR (files.py). The key names the device: ``host-cpu``, ``cuda-0``,
``rocm-1``.

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
budget charged twice; `liveness._row_alive`). Without the group, other users' per-user
ledgers of the same device are still visible where their names can be listed
(/dev/shm; every runtime directory, for root): `separate_ledgers` finds them and
`kvctl list` says that their budgets are separate.

This module decides names and judges folders and entries; opening, creating and
repairing the file itself is files.py's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import grp
import os
import pwd
import re
import stat
from pathlib import Path

from kvcached.ledger import liveness
from kvcached.ledger.errors import LedgerError
from kvcached.ledger.format import _HEADER, _KEY, _ROW, HEADER_SIZE, ROW_SIZE, _check_key, _damage
from kvcached.ledger.liveness import _identity

__all__ = [
    "SeparateLedger",
    "default_key",
    "existing_keys",
    "ledger_dir",
    "ledger_key",
    "ledger_path",
    "separate_ledgers",
    "user_name",
    "user_runtime_dir",
]


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


# ------------------------------------------------------------------- names and keys
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
        if pid and (row_namespace != namespace or liveness._row_alive(pid, start, row_uid)):
            instances += 1
            reserved += held
    return SeparateLedger(path, uid, instances, reserved)


# ---------------------------------------------------------------------- people
def user_name(uid: int) -> str:
    """A uid as people read it: ``uid 1001 (alice)``, or ``uid 1001`` when unknown."""
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (KeyError, OSError):
        return f"uid {uid}"
