"""The few libc calls the host backend needs, through ctypes (no compiler needed).

Each wrapper raises OSError with errno on failure, like the `os` module does.
"""

from __future__ import annotations

import ctypes
import mmap
import os

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
MAP_NORESERVE = 0x4000
MAP_FIXED = 0x10
PROT_NONE = 0x0
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long
]  # fmt: skip
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.fallocate.restype = ctypes.c_int
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def _fail(call: str) -> OSError:
    code = ctypes.get_errno()
    return OSError(code, f"{call}: {os.strerror(code)}")


def mmap_anonymous_reserve(address: int, nbytes: int, *, fixed: bool) -> int:
    """Inaccessible address space with no memory behind it (at `address` when fixed)."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE | (MAP_FIXED if fixed else 0)
    result = _libc.mmap(address or None, nbytes, PROT_NONE, flags, -1, 0)
    if result == _MAP_FAILED or result is None:
        raise _fail("PROT_NONE reserve)")
    return int(result)


def mmap_file_fixed(address: int, nbytes: int, fd: int, offset: int) -> None:
    """Map [offset, offset + nbytes) of `fd` read/write and shared, exactly at `address`."""
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    result = _libc.mmap(address, nbytes, prot, mmap.MAP_SHARED | MAP_FIXED, fd, offset)
    if result == _MAP_FAILED or result != address:
        raise _fail("mmap(MAP_SHARED|MAP_FIXED)")


def munmap(address: int, nbytes: int) -> None:
    if _libc.munmap(address, nbytes) != 0:
        raise _fail("munmap")


def fallocate(fd: int, mode: int, offset: int, nbytes: int) -> None:
    if _libc.fallocate(fd, mode, offset, nbytes) != 0:
        raise _fail("fallocate")
