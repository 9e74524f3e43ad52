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

Memory accounting. With a budget (KVCACHED_HOST_BUDGET, or `budget=`) the instance
has memory of its own: `total` is the budget and `free` what is left of it; sharing
with other processes is the ledger's job. Without one, the "device" is the machine:
`total` is MemTotal and `free` is MemTotal minus the shared memory (Shmem) in use by
every process, which is exactly what host arenas, ours and other processes', hold.
MemAvailable is not used for `free`: on VMs with ballooned or hot-plugged memory it
drifts by tens of MiB while nothing is allocated, and it trails shmem commits. It is
still the guard in `create`: a page that would not fit in MemAvailable is refused
with OutOfMemory, because committing shmem past it would not fail cleanly (with no
swap the OOM killer ends a process).
Everything is returned when the process exits: the kernel drops the mappings and the
memfd with it.
"""

from __future__ import annotations

import errno
import mmap
import os
import sys
import threading
from collections.abc import Sequence
from typing import Any

from kvcached.backend import Backend, Page
from kvcached.backends.host import libc
from kvcached.config import parse_size, settings
from kvcached.errors import DriverError, InvalidArgument, OutOfMemory
from kvcached.views import host_tensor

ARENA_FILE_SIZE = 1 << 44  # 16 TiB of sparse file offsets; only created pages use memory


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
        self._granularity = parse_size(
            granularity if granularity is not None else config.host_granularity,
            what="host granularity",
        )
        g = self._granularity
        if g % mmap.PAGESIZE or g & (g - 1):
            raise InvalidArgument(
                f"host granularity {g} must be a power of two and a multiple of the OS "
                f"page size ({mmap.PAGESIZE})"
            )
        requested = budget if budget is not None else config.host_budget
        self._budget: int | None = (
            None
            if requested is None
            else parse_size(requested, total=mem_available(), what="KVCACHED_HOST_BUDGET")
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
    def _reserve(self, nbytes: int) -> int:
        g = self._granularity
        raw = libc.mmap_anonymous_reserve(0, nbytes + g, fixed=False)
        aligned = (raw + g - 1) & ~(g - 1)
        if aligned > raw:
            libc.munmap(raw, aligned - raw)
        tail = raw + nbytes + g - (aligned + nbytes)
        if tail:
            libc.munmap(aligned + nbytes, tail)
        return aligned

    def _free(self, address: int, nbytes: int) -> None:
        libc.munmap(address, nbytes)

    def _create(self, nbytes: int) -> Any:
        with self._arena_lock:
            if self._budget is None:
                available = mem_available()
                if nbytes > available:
                    raise OutOfMemory(
                        f"host memory exhausted: {nbytes} bytes asked, {available} available"
                    )
            elif self._used + nbytes > self._budget:
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
