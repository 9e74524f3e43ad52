"""The host backend: true reserve / map / unmap semantics in CPU RAM (Linux).

How the driver primitives map onto Linux:

* A **reservation** is an anonymous `PROT_NONE`, `MAP_NORESERVE` mapping: address
  space only, no memory, no commit charge. It is over-reserved by one granule and
  trimmed so that its start is granularity-aligned, like a GPU's VA reservation.
* **Physical memory** is one memfd per backend instance (the "arena"), sized 16 TiB but
  sparse. A page is a granule-aligned range of that file, allocated with
  `fallocate`, so the memory is committed (and counted) when the page is created, not
  when it is first touched: an out-of-memory shows up as `OutOfMemory` from `create`,
  never as the OOM killer later. Releasing a page punches a hole, which returns the
  memory to the kernel at once; its file range is reused by later pages of the same size.
  One file instead of one memfd per page keeps the descriptor count at one however
  many pages exist.
* **map** is `mmap(MAP_SHARED | MAP_FIXED)` of the page's file range over the reserved
  address; **unmap** puts the `PROT_NONE` reservation back with another `MAP_FIXED`
  mmap, so the range stays reserved (no one else can take the addresses in between).
  Mapping one page in two places aliases it, as on a GPU.
* **free** does not give the addresses back to the kernel either: the range, already
  `PROT_NONE` once unmapped, stays reserved (quarantined), so that a tensor view kept
  past `free` or `Backend.close()` faults (SIGSEGV) on its next access instead of
  writing into whatever the kernel would place at those addresses next. Quarantined
  address space costs no memory; only past `QUARANTINE_BYTES` of it (64 TiB, half of
  x86-64's user address space) are the oldest ranges returned. See
  docs/backends/stale-views.md.

Memory accounting. With a budget (KVCACHED_HOST_BUDGET, or `budget=`) the instance
has memory of its own: `total` is the budget and `free` what is left of it; sharing
with other processes is the ledger's job. Without one, the "device" is the machine:
`total` is MemTotal and `free` is MemTotal minus the shared memory (Shmem) in use by
every process, which is exactly what host arenas, ours and other processes', hold.
MemAvailable is not used for `free`: on VMs with ballooned or hot-plugged memory it
drifts by tens of MiB while nothing is allocated, and it trails shmem commits. It is
still the guard in `create`: a page that would not fit in MemAvailable is refused
with OutOfMemory, because committing shmem past it would not fail cleanly (with no
swap the OOM killer ends a process). That guard holds with a budget too: a budget
above what the machine has is still refused page by page once RAM runs out.
Everything is returned when the process exits: the kernel drops the mappings and the
memfd with it.
"""

from __future__ import annotations

import errno
import mmap
import os
import sys
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

from kvcached.backend import Backend, Page
from kvcached.backends.host import libc
from kvcached.config import parse_size, settings
from kvcached.errors import DriverError, InvalidArgument, OutOfMemory
from kvcached.views import host_tensor

ARENA_FILE_SIZE = 1 << 44  # 16 TiB of sparse file offsets; only created pages use memory
QUARANTINE_BYTES = 1 << 46  # freed address space kept reserved, per process (see above)

# Freed reservations, oldest first, shared by every host backend of the process (the
# address space is the process's); a forked child inherits them, which is harmless.
_quarantine: deque[tuple[int, int]] = deque()
_quarantined_bytes = 0
_quarantine_lock = threading.Lock()


def _quarantine_range(address: int, nbytes: int) -> None:
    """Keep [address, address + nbytes) reserved and inaccessible; if that makes the
    quarantine pass QUARANTINE_BYTES, give the oldest ranges back to the kernel."""
    global _quarantined_bytes
    expired: list[tuple[int, int]] = []
    with _quarantine_lock:
        _quarantine.append((address, nbytes))
        _quarantined_bytes += nbytes
        while _quarantined_bytes > QUARANTINE_BYTES and len(_quarantine) > 1:
            oldest = _quarantine.popleft()
            _quarantined_bytes -= oldest[1]
            expired.append(oldest)
    for start, size in expired:
        libc.munmap(start, size)


def _release_quarantine() -> bool:
    """Give every quarantined range back (the address space ran out); False if none."""
    global _quarantined_bytes
    with _quarantine_lock:
        expired = list(_quarantine)
        _quarantine.clear()
        _quarantined_bytes = 0
    for start, size in expired:
        libc.munmap(start, size)
    return bool(expired)


def _meminfo(field: bytes) -> int:
    with open("/proc/meminfo", "rb") as meminfo:
        for line in meminfo:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise DriverError("/proc/meminfo", 0, f"{field.decode()} missing")


def mem_available() -> int:
    """The kernel's estimate of RAM available for new allocations (MemAvailable)."""
    return _meminfo(b"MemAvailable:")


class HostBackend(Backend):
    """Reserve/map/unmap in CPU RAM through memfd + mmap; views are CPU torch tensors."""

    name = "host"

    def __init__(
        self,
        *,
        memory_limit: int | None = None,
        budget: int | str | None = None,
        granularity: int | str | None = None,
    ) -> None:
        super().__init__(memory_limit=memory_limit)
        reason = self.unavailable_reason()
        if reason is not None:
            from kvcached.errors import BackendUnavailable

            raise BackendUnavailable(f"host backend: {reason}")
        config = settings()
        granularity_name = "granularity" if granularity is not None else "KVCACHED_HOST_GRANULARITY"
        self._granularity = parse_size(
            granularity if granularity is not None else config.host_granularity,
            what=granularity_name,
        )
        g = self._granularity
        if g % mmap.PAGESIZE or g & (g - 1):
            raise InvalidArgument(
                f"{granularity_name} {g} is not accepted: the host granularity must be a "
                f"power of two and a multiple of the OS page size ({mmap.PAGESIZE} bytes), "
                "e.g. 64KiB or 2MiB"
            )
        requested = budget if budget is not None else config.host_budget
        self._budget: int | None = (
            None
            if requested is None
            else parse_size(
                requested,
                total=mem_available(),
                what="budget" if budget is not None else "KVCACHED_HOST_BUDGET",
            )
        )
        self._fd = os.memfd_create("kvcached-host-arena", os.MFD_CLOEXEC)
        os.ftruncate(self._fd, ARENA_FILE_SIZE)
        self._arena_lock = threading.Lock()
        self._arena_end = 0  # file offsets below this were handed out at least once
        self._holes: dict[int, list[int]] = {}  # size -> reusable file offsets
        self._used = 0

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if not sys.platform.startswith("linux"):
            return f"needs Linux (memfd_create + mmap); this is {sys.platform}"
        if not hasattr(os, "memfd_create"):
            return "os.memfd_create is missing (Linux < 3.17 or an old Python)"
        return None

    @property
    def granularity(self) -> int:
        return self._granularity

    @property
    def device(self) -> str:
        return "cpu"

    @property
    def budget(self) -> int | None:
        """The fixed budget in bytes, or None when it follows MemAvailable."""
        return self._budget

    def mem_info(self) -> tuple[int, int]:
        if self._budget is None:
            total = _meminfo(b"MemTotal:")
            return max(0, total - _meminfo(b"Shmem:")), total
        return self._budget - self._used, self._budget

    def describe(self) -> dict[str, Any]:
        info = super().describe()
        info["device_name"] = f"host RAM ({os.uname().machine})"
        info["versions"] = {"linux": os.uname().release}
        return info

    # ------------------------------------------------------------ primitives
    def held_bytes(self) -> int | None:
        """Bytes the kernel has allocated to this instance's arena file (0 once closed)."""
        if self._fd < 0:
            return 0
        return os.fstat(self._fd).st_blocks * 512

    def _reserve(self, nbytes: int) -> int:
        g = self._granularity
        try:
            try:
                raw = libc.mmap_anonymous_reserve(0, nbytes + g, fixed=False)
            except OSError as exc:
                if exc.errno != errno.ENOMEM or not _release_quarantine():
                    raise
                raw = libc.mmap_anonymous_reserve(0, nbytes + g, fixed=False)
        except OSError as exc:
            if exc.errno == errno.ENOMEM:
                raise OutOfMemory(
                    f"cannot reserve {nbytes} bytes: the process's address space has no "
                    "free range that large"
                ) from None
            if exc.errno in (errno.EOVERFLOW, errno.EINVAL):
                raise InvalidArgument(
                    f"cannot reserve {nbytes} bytes: larger than any address space"
                ) from None
            raise
        aligned = (raw + g - 1) & ~(g - 1)
        if aligned > raw:
            libc.munmap(raw, aligned - raw)
        tail = raw + nbytes + g - (aligned + nbytes)
        if tail:
            libc.munmap(aligned + nbytes, tail)
        return aligned

    def _free(self, address: int, nbytes: int) -> None:
        # Unmapping already put PROT_NONE back over every page; keep the range reserved.
        _quarantine_range(address, nbytes)

    def _create(self, nbytes: int) -> Any:
        with self._arena_lock:
            available = mem_available()  # the guard, with or without a budget
            if nbytes > available:
                raise OutOfMemory(
                    f"host memory exhausted: {nbytes} bytes asked, {available} available"
                )
            if self._budget is not None and self._used + nbytes > self._budget:
                raise OutOfMemory(
                    f"host budget exhausted: {self._used} of {self._budget} bytes in use, "
                    f"{nbytes} more asked"
                )
            holes = self._holes.get(nbytes)
            if holes:
                offset = holes.pop()
            else:
                offset = self._arena_end
                self._arena_end += nbytes
            self._used += nbytes
        try:
            libc.fallocate(self._fd, 0, offset, nbytes)
        except OSError as exc:
            self._return_range(offset, nbytes)
            if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                raise OutOfMemory(
                    f"the kernel could not commit {nbytes} bytes of host memory"
                ) from None
            code = exc.errno or 0
            raise DriverError("fallocate", code, errno.errorcode.get(code, "?")) from exc
        return offset

    def _release(self, handle: Any, nbytes: int) -> None:
        punch = libc.FALLOC_FL_PUNCH_HOLE | libc.FALLOC_FL_KEEP_SIZE
        libc.fallocate(self._fd, punch, handle, nbytes)
        self._return_range(handle, nbytes)

    def _return_range(self, offset: int, nbytes: int) -> None:
        with self._arena_lock:
            self._holes.setdefault(nbytes, []).append(offset)
            self._used -= nbytes

    def _map_one(self, address: int, page: Page) -> None:
        libc.mmap_file_fixed(address, page.nbytes, self._fd, page.handle)

    def _unmap_one(self, address: int, nbytes: int) -> None:
        libc.mmap_anonymous_reserve(address, nbytes, fixed=True)

    def _map_batch(self, items: Sequence[tuple[int, Page]]) -> None:
        done: list[tuple[int, int]] = []
        try:
            for address, page in items:
                self._map_one(address, page)
                done.append((address, page.nbytes))
        except BaseException:
            self._unmap_batch(done)
            raise

    def _unmap_batch(self, ranges: Sequence[tuple[int, int]]) -> None:
        for address, nbytes in ranges:
            self._unmap_one(address, nbytes)

    def _view(self, address: int, nbytes: int, shape: tuple[int, ...], dtype: Any) -> Any:
        return host_tensor(address, nbytes, shape, dtype)

    def _close_device(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
