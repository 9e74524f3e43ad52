"""Whether the process of a ledger row still runs, read from /proc.

Note [Dead instances]
~~~~~~~~~~~~~~~~~~~~~
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
files, before it becomes a zombie.

Rows written from another pid namespace (a container sharing /dev/shm but not its pid
space) cannot be judged, so every row also records the namespace of its process
(`_pid_namespace`), and only rows of this process's own namespace are ever judged.
Another user's process may be hidden by /proc mounted with hidepid: `_row_alive` then
asks kill(pid, 0) (see Note [Shared ledgers] in placement.py). Liveness without /proc
(macOS) falls back to ``kill(pid, 0)`` with no start time, so a reused pid would keep a
dead row alive until the new process exits.

The boot id (/proc/sys/kernel/random/boot_id) is kept in the header: a ledger whose
boot id differs from this boot's was kept across a reboot and holds only stale rows.

When rows judged dead are cleared, and under which lock: Note [Reclaiming dead rows]
in book.py. This module only reads /proc; it takes no lock and writes nothing.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

__all__ = ["process_start_time"]


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


_me: _Identity | None = None  # this process's identity, read once (None after a fork)


def _identity() -> _Identity:
    global _me
    if _me is None:
        _me = _Identity.current()
    return _me


def _forget_identity() -> None:
    """In a forked child: the pid changed, so the identity is read again when needed."""
    global _me
    _me = None


def _alive(pid: int, start_time: int) -> bool:
    now = process_start_time(pid)
    return now is not None and (now == start_time or not _HAVE_PROC)


def _row_alive(pid: int, start_time: int, uid: int) -> bool:
    """Whether the process of a row of user `uid` still runs. /proc mounted with hidepid
    hides the processes of other users (their /proc/<pid>/stat cannot be read), so a row
    of another user's whose stat cannot be read is judged by kill(pid, 0): dead only
    when the kernel says there is no such process (Note [Shared ledgers] in
    placement.py)."""
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
