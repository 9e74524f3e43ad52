"""The mlx backend: ledger-charged MLX arrays as physical pages, on a seam built for VMM.

MLX has no virtual memory API, and on Linux it always copies external memory
(`mx.asarray(x, copy=False)` raises), so nothing here can put two pages side by side
in one address range. The seam is kept all the same, so the shared allocator, the
ledger, kvctl and kvtop work unchanged:

* A **reservation** is bookkeeping: a range of made-up addresses (never dereferenced)
  that the base class checks mappings against, exactly as on a VMM backend.
* A **page** is one evaluated MLX array (`MlxBuffer.array`), created at its full size
  by `create` (so the memory exists, and is counted, from then on) and dropped by
  `release`, which then calls `mx.clear_cache()`: MLX keeps freed buffers in its own
  cache, and without the clear the memory would still be held while the ledger said
  it was returned.
* **map** records which page lies at which address; **view** returns an MLX array over
  bytes inside *one* mapping. What a VMM backend has and this one has not is declared
  in `capabilities`: a view cannot span mappings or cover unmapped bytes, and a view is
  a value (MLX arrays are immutable to their users), so writes go through `write` /
  `fill`, or through the buffer itself (`MlxBuffer.array[...] = x`).

In place, or a copy. A slice update `buffer.array[..., a:b, :] = x` on an evaluated
array writes in place only while no other array references that buffer; otherwise MLX
copies the whole array first (seconds for hundreds of MiB). So a page keeps exactly one
owner: `MlxBuffer.retype` replaces the flat bytes by a typed array instead of keeping
both, and a view handed out by `view` must be dropped before the next write.

Memory accounting. `mem_info` uses MLX's own counters (active plus cached bytes of this
process) against the machine's memory, or against a budget of this instance
(KVCACHED_MLX_BUDGET, or `budget=`). MLX has no device-wide counter, so memory that
other processes hold is not seen (`device_wide_mem_info=False`); sharing between
processes is the ledger's job.

Zero-copy mode (opt-in, KVCACHED_MLX_ZERO_COPY=1, or `zero_copy=True`). On Metal
(mlx >= 0.32.1) `mx.asarray(host_view, copy=False)` wraps 16 KiB-aligned host memory
without a copy, so pages can be kvcached's own mmap regions. Asked for where MLX must
copy (Linux), it is refused with the reason at construction. It has never run on a Mac
in this project; see docs/backends/mlx.md.
"""

from __future__ import annotations

import importlib.util
import mmap
import os
import sys
import threading
from bisect import bisect_right, insort
from collections.abc import Sequence
from typing import Any

from kvcached.backend import (
    ArrayBackend,
    Capabilities,
    Page,
    Reservation,
    dtype_itemsize,
    dtype_name,
)
from kvcached.config import parse_size, settings
from kvcached.errors import BackendUnavailable, InvalidArgument, OutOfMemory

#: Metal's page size, and the alignment `mx.asarray(copy=False)` needs on Metal.
GRANULARITY = 16 << 10
#: Where made-up reservation addresses start (any non-zero, aligned value would do).
_FIRST_ADDRESS = 1 << 40


def _mx() -> Any:
    import mlx.core as mx

    return mx


def machine_memory() -> int:
    """The memory MLX allocates from: the device's on Metal, else the machine's RAM."""
    info = _mx().device_info()
    size = info.get("memory_size") if isinstance(info, dict) else None
    if isinstance(size, int) and size > 0:
        return size
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def zero_copy_unavailable_reason() -> str | None:
    """None when MLX here wraps our own aligned memory without a copy, else why not."""
    try:
        import numpy as np

        mx = _mx()
        region = mmap.mmap(-1, GRANULARITY)
        try:
            host = np.frombuffer(region, dtype=np.uint8)
            wrapped = mx.asarray(host, copy=False)
            del wrapped, host
        finally:
            region.close()
    except Exception as exc:
        return f"MLX copies external memory on this machine ({type(exc).__name__}: {exc})"
    return None


def array_page_bytes(shape: Sequence[int], dtype: Any) -> int:
    """Bytes of the page `MlxBackend.create_array(shape, dtype)` creates."""
    dims = tuple(int(d) for d in shape)
    if not dims or any(d <= 0 for d in dims):
        raise InvalidArgument(f"array shape must be positive dimensions, got {shape!r}")
    count = 1
    for d in dims:
        count *= d
    return -(-count * dtype_itemsize(dtype) // GRANULARITY) * GRANULARITY


class MlxBuffer:
    """The physical memory of one page: an evaluated MLX array, its buffer's only owner.

    `array` starts as `nbytes` of uint8 and may be retyped once by its user (an engine
    cache stores (2, B, H, T, D) K/V in it). Zero-copy pages also keep the mmap region
    the array wraps, so it lives exactly as long as the array."""

    __slots__ = ("array", "nbytes", "region")

    def __init__(self, array: Any, nbytes: int, region: mmap.mmap | None = None) -> None:
        self.array: Any = array
        self.nbytes = nbytes
        self.region = region

    def retype(self, shape: Sequence[int], dtype: Any) -> Any:
        """Reinterpret the bytes as `shape` of `dtype` (exactly `nbytes`), keeping one owner."""
        mx = _mx()
        typed = self.array.view(getattr(mx, dtype_name(dtype))).reshape(tuple(shape))
        self.array = typed  # the flat array goes: a second owner would force copies
        mx.eval(self.array)
        return self.array

    def flat(self) -> Any:
        """The bytes as a flat uint8 array (a new reference: drop it before writing)."""
        return self.array.view(_mx().uint8).reshape(-1)


def _buffer(page: Page) -> MlxBuffer:
    handle = page.handle
    assert isinstance(handle, MlxBuffer)
    return handle


class MlxBackend(ArrayBackend):
    """Pages are MLX arrays; reservations and mappings are bookkeeping (no VMM)."""

    name = "mlx"
    capabilities = Capabilities(
        views_span_mappings=False, writable_views=False, device_wide_mem_info=False
    )

    def __init__(
        self,
        *,
        memory_limit: int | None = None,
        budget: int | str | None = None,
        zero_copy: bool | None = None,
    ) -> None:
        super().__init__(memory_limit=memory_limit)
        reason = self.unavailable_reason()
        if reason is not None:
            raise BackendUnavailable(f"mlx backend: {reason}")
        config = settings()
        self.zero_copy = config.mlx_zero_copy if zero_copy is None else bool(zero_copy)
        if self.zero_copy:
            why = zero_copy_unavailable_reason()
            if why is not None:
                raise BackendUnavailable(
                    f"mlx zero-copy mode was asked for (KVCACHED_MLX_ZERO_COPY) but {why}; "
                    "unset it to use copied pages"
                )
        self._total = machine_memory()
        requested = budget if budget is not None else config.mlx_budget
        self._budget: int | None = (
            None
            if requested is None
            else parse_size(requested, total=self._total, what="KVCACHED_MLX_BUDGET")
        )
        self._lock = threading.Lock()
        self._typed = threading.local()  # the (shape, dtype) `create_array` asks for
        self._next_address = _FIRST_ADDRESS
        self._used = 0
        self._starts: list[int] = []  # addresses where a mapping starts, sorted
        self._mapped: dict[int, Page] = {}  # start address -> page mapped there

    # ------------------------------------------------------------ detection
    @classmethod
    def unavailable_reason(cls) -> str | None:
        if importlib.util.find_spec("mlx") is None:
            return "mlx is not installed (pip install mlx; on Linux 'mlx[cpu]')"
        try:
            _mx()
        except Exception as exc:  # plain `mlx` on Linux installs but cannot be imported
            return (
                f"mlx.core cannot be imported ({type(exc).__name__}: {exc}); on Linux "
                "install mlx[cpu] (pip install 'mlx[cpu]')"
            )
        return None

    @classmethod
    def auto_selectable(cls) -> bool:
        """Only where Metal is present: on Linux MLX runs on the CPU, where the host
        backend (true VMM semantics) serves the same memory better."""
        if sys.platform != "darwin":
            return False
        try:
            return bool(_mx().metal.is_available())
        except Exception:
            return False

    # ------------------------------------------------------------ device facts
    @property
    def granularity(self) -> int:
        return GRANULARITY

    @property
    def device(self) -> str:
        return "gpu" if self.auto_selectable() else "cpu"

    @property
    def budget(self) -> int | None:
        return self._budget

    def mem_info(self) -> tuple[int, int]:
        if self._budget is not None:
            return max(0, self._budget - self._used), self._budget
        mx = _mx()
        held = int(mx.get_active_memory()) + int(mx.get_cache_memory())
        return max(0, self._total - held), self._total

    def describe(self) -> dict[str, Any]:
        info = super().describe()
        mx = _mx()
        device = mx.device_info()
        info["device_name"] = str(device.get("device_name", "unknown"))
        info["versions"] = {"mlx": str(mx.__version__)}
        info["zero_copy"] = self.zero_copy
        info["metal"] = bool(mx.metal.is_available())
        return info

    def synchronize(self) -> None:
        _mx().synchronize()

    # ------------------------------------------------------------ primitives
    def _reserve(self, nbytes: int) -> int:
        with self._lock:
            address = self._next_address
            self._next_address += nbytes + GRANULARITY  # a gap: ranges never touch
        return address

    def _free(self, address: int, nbytes: int) -> None:
        """Nothing to give back: a reservation holds no memory here."""

    def _create(self, nbytes: int) -> Any:
        with self._lock:
            if self._budget is not None:
                if self._used + nbytes > self._budget:
                    raise OutOfMemory(
                        f"mlx budget exhausted: {self._used} of {self._budget} bytes in "
                        f"use, {nbytes} more asked"
                    )
            else:
                free = self.mem_info()[0]
                if nbytes > free:
                    raise OutOfMemory(f"mlx memory exhausted: {nbytes} bytes asked, {free} free")
            self._used += nbytes
        try:
            return self._new_buffer(nbytes)
        except BaseException:
            with self._lock:
                self._used -= nbytes
            raise

    def array_page_bytes(self, shape: Sequence[int], dtype: Any) -> int:
        return array_page_bytes(shape, dtype)

    def create_array(self, shape: Sequence[int], dtype: Any) -> Page:
        """A page holding one zeroed MLX array of `shape` and `dtype`, its size rounded
        up to the granularity (the rounding is charged, and stays unused). An engine
        cache stores K or V in it directly: no flat buffer is kept beside it, so slice
        updates of `page.handle.array` stay in place."""
        dims = tuple(int(d) for d in shape)
        nbytes = array_page_bytes(dims, dtype)
        self._typed.request = (dims, dtype_name(dtype))
        try:
            return self.create(nbytes)
        finally:
            self._typed.request = None

    def _new_buffer(self, nbytes: int) -> MlxBuffer:
        mx = _mx()
        request = getattr(self._typed, "request", None)
        shape, dtype = request if request is not None else ((nbytes,), "uint8")
        if self.zero_copy:
            import numpy as np

            region = mmap.mmap(-1, nbytes)  # page-aligned: 16 KiB on Apple silicon
            flat = mx.asarray(np.frombuffer(region, dtype=np.uint8), copy=False)
            count = 1
            for d in shape:
                count *= d
            itemsize = dtype_itemsize(dtype)
            array = flat[: count * itemsize].view(getattr(mx, dtype)).reshape(shape)
            return MlxBuffer(array, nbytes, region)
        try:
            array = mx.zeros(shape, dtype=getattr(mx, dtype))
            mx.eval(array)
        except (MemoryError, RuntimeError) as exc:
            raise OutOfMemory(f"MLX could not allocate {nbytes} bytes: {exc}") from None
        return MlxBuffer(array, nbytes)

    def _release(self, handle: Any, nbytes: int) -> None:
        assert isinstance(handle, MlxBuffer)
        handle.array = None
        if handle.region is not None:
            handle.region.close()
            handle.region = None
        with self._lock:
            self._used -= nbytes
        _mx().clear_cache()  # else MLX keeps the bytes in its cache

    def _map_batch(self, items: Sequence[tuple[int, Page]]) -> None:
        with self._lock:
            for address, page in items:
                self._mapped[address] = page
                insort(self._starts, address)

    def _unmap_batch(self, ranges: Sequence[tuple[int, int]]) -> None:
        with self._lock:
            for address, _ in ranges:
                del self._mapped[address]
                self._starts.pop(bisect_right(self._starts, address) - 1)

    def _locate(self, address: int, nbytes: int) -> tuple[MlxBuffer, int]:
        """The buffer holding [address, address + nbytes), and where the range starts."""
        with self._lock:
            index = bisect_right(self._starts, address) - 1
            page = self._mapped.get(self._starts[index]) if index >= 0 else None
            start = self._starts[index] if index >= 0 else 0
        if page is None or address + nbytes > start + page.nbytes:
            raise InvalidArgument(
                f"the mlx backend has no VMM: a view or write must lie inside one mapped "
                f"page, and [{address:#x}, {address + nbytes:#x}) does not "
                "(Backend.capabilities.views_span_mappings is False)"
            )
        return _buffer(page), address - start

    def _view(self, address: int, nbytes: int, shape: tuple[int, ...], dtype: Any) -> Any:
        buffer, start = self._locate(address, nbytes)
        mx = _mx()
        data = buffer.flat()[start : start + nbytes]
        return data.view(getattr(mx, dtype_name(dtype))).reshape(shape)

    # ------------------------------------------------------------ writes
    def write(self, reservation: Reservation, offset: int, data: Any) -> None:
        """Copy the bytes of MLX array `data` to `offset` in `reservation` (one page)."""
        self._check_reservation(reservation)
        mx = _mx()
        raw = mx.contiguous(data).reshape(-1).view(mx.uint8)
        nbytes = int(raw.size)
        if offset < 0 or offset + nbytes > reservation.nbytes:
            raise InvalidArgument(
                f"write of {nbytes} bytes at offset {offset} does not fit {reservation!r}"
            )
        buffer, start = self._locate(reservation.address + offset, nbytes)
        shape, dtype = buffer.array.shape, buffer.array.dtype
        flat = buffer.flat()
        buffer.array = None  # the graph is the only owner now: the update is in place
        flat[start : start + nbytes] = raw
        buffer.array = flat.view(dtype).reshape(shape)
        mx.eval(buffer.array)

    def _pieces(self, reservation: Reservation, offset: int, nbytes: int) -> list[tuple[int, int]]:
        """[offset, offset + nbytes) cut at mapping boundaries: (offset, nbytes) pieces.
        Data access may cross mappings (each piece lies in one page); views may not."""
        self._check_reservation(reservation)
        if offset < 0 or nbytes <= 0 or offset + nbytes > reservation.nbytes:
            raise InvalidArgument(
                f"range of {nbytes} bytes at offset {offset} does not fit {reservation!r}"
            )
        pieces, cursor, end = [], offset, offset + nbytes
        while cursor < end:
            with self._lock:
                index = bisect_right(self._starts, reservation.address + cursor) - 1
                start = self._starts[index] - reservation.address if index >= 0 else -1
                page = self._mapped.get(self._starts[index]) if index >= 0 else None
            if page is None or cursor >= start + page.nbytes:
                raise InvalidArgument(f"offset {cursor} of {reservation!r} is not mapped")
            piece = min(end, start + page.nbytes) - cursor
            pieces.append((cursor, piece))
            cursor += piece
        return pieces

    def fill(self, reservation: Reservation, offset: int, nbytes: int, value: int) -> None:
        """Set every byte of [offset, offset + nbytes) of `reservation` to `value`."""
        if not isinstance(value, int) or not 0 <= value <= 255:
            raise InvalidArgument(f"fill value must be an int in 0..255, got {value!r}")
        mx = _mx()
        for at, size in self._pieces(reservation, offset, nbytes):
            self.write(reservation, at, mx.full((size,), value, dtype=mx.uint8))

    def byte_values(self, reservation: Reservation, offset: int, nbytes: int) -> set[int]:
        """The distinct byte values in [offset, offset + nbytes) of `reservation`."""
        import numpy as np

        values: set[int] = set()
        for at, size in self._pieces(reservation, offset, nbytes):
            view = self.view(reservation, at, (size,), "uint8")
            values.update(int(v) for v in np.unique(np.array(view, copy=True)))
            del view
        return values
