"""The few libc calls the host backend needs, through ctypes (no compiler needed).

Each wrapper raises OSError with errno on failure, like the `os` module does. ctypes
converts a Python int to `size_t` or `long` by dropping the high bits, so a size of
2**64 + 4096 would reach the kernel as 4096: every size and offset is checked against
its C type first, and one that does not fit is OSError(EOVERFLOW), never truncated.
"""

from __future__ import annotations

import ctypes
import errno
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


_SIZE_MAX = (1 << (8 * ctypes.sizeof(ctypes.c_size_t))) - 1
_LONG_MAX = (1 << (8 * ctypes.sizeof(ctypes.c_long) - 1)) - 1


def _fits(call: str, what: str, value: int, largest: int) -> int:
    if not isinstance(value, int) or not 0 <= value <= largest:
        raise OSError(errno.EOVERFLOW, f"{call}: {what} {value!r} is not an int in [0, {largest}]")
    return value


def _fail(call: str) -> OSError:
    code = ctypes.get_errno()
    return OSError(code, f"{call}: {os.strerror(code)}")


def mmap_anonymous_reserve(address: int, nbytes: int, *, fixed: bool) -> int:
    """Inaccessible address space with no memory behind it (at `address` when fixed)."""
    _fits("mmap", "address", address, _SIZE_MAX)
    _fits("mmap", "size", nbytes, _SIZE_MAX)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE | (MAP_FIXED if fixed else 0)
    result = _libc.mmap(address or None, nbytes, PROT_NONE, flags, -1, 0)
    if result == _MAP_FAILED or result is None:
        raise _fail("mmap(PROT_NONE) reserve")
    return int(result)


def mmap_file_fixed(address: int, nbytes: int, fd: int, offset: int) -> None:
    """Map [offset, offset + nbytes) of `fd` read/write and shared, exactly at `address`."""
    _fits("mmap", "address", address, _SIZE_MAX)
    _fits("mmap", "size", nbytes, _SIZE_MAX)
    _fits("mmap", "file offset", offset, _LONG_MAX)
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    result = _libc.mmap(address, nbytes, prot, mmap.MAP_SHARED | MAP_FIXED, fd, offset)
    if result == _MAP_FAILED or result != address:
        raise _fail("mmap(MAP_SHARED|MAP_FIXED)")


def munmap(address: int, nbytes: int) -> None:
    _fits("munmap", "address", address, _SIZE_MAX)
    _fits("munmap", "size", nbytes, _SIZE_MAX)
    if _libc.munmap(address, nbytes) != 0:
        raise _fail("munmap")


def fallocate(fd: int, mode: int, offset: int, nbytes: int) -> None:
    _fits("fallocate", "offset", offset, _LONG_MAX)
    _fits("fallocate", "length", nbytes, _LONG_MAX)
    if _libc.fallocate(fd, mode, offset, nbytes) != 0:
        raise _fail("fallocate")
