"""The backend seam: reserve virtual ranges, create physical pages, map them in and out.

Every accelerator (CUDA, ROCm, MLX) and the host differ only behind this class. A
backend subclass implements a handful of private driver primitives (`_reserve`,
`_free`, `_create`, `_release`, `_map_batch`, `_unmap_batch`, `_view`, `mem_info`,
`granularity`); this base class owns everything that must behave identically on every
platform, so the conformance suite can hold each backend to one contract:

* Argument checking. Sizes and offsets must be positive multiples of `granularity`, a
  mapping must lie inside its reservation and must not overlap another mapping, an
  unmap must cover whole mappings, and objects of another backend are refused. Every
  violation is an `InvalidArgument` raised *before* any driver call, so nothing is lost.
* Lifetime. `Reservation` and `Page` are objects with `close()` and context managers.
  A page that is still mapped cannot be released, a reservation that still has mappings
  cannot be freed (drivers differ here: CUDA defers such a release, ROCm leaks it), and
  `Backend.close()` unmaps, releases and frees everything still alive.
* Batching. `map_many` / `unmap_many` validate the whole batch first, then hand it to
  the backend in one call so a driver can amortize work (one set-access over a
  contiguous run, for example). A batch that fails part-way is rolled back.

Locking: each reservation has its own lock, held across the driver call for that
reservation, so threads mapping into different reservations run in parallel while two
threads can never race on the same address range. Page mapping counts sit under one
short backend-wide lock that is never held across a driver call.
"""

from __future__ import annotations

import bisect
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

from kvcached.errors import InvalidArgument, OutOfMemory

MappingRequest = tuple[int, "Page"]
UnmapRequest = tuple[int, int]


class Reservation:
    """A reserved virtual address range of `nbytes`; holds no physical memory by itself."""

    __slots__ = ("backend", "address", "nbytes", "_starts", "_mappings", "_lock", "_closed")

    def __init__(self, backend: Backend, address: int, nbytes: int) -> None:
        self.backend = backend
        self.address = address
        self.nbytes = nbytes
        self._starts: list[int] = []  # sorted offsets of the mappings
        self._mappings: dict[int, Page] = {}  # offset -> page mapped there
        self._lock = threading.Lock()
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def mapped_bytes(self) -> int:
        return sum(page.nbytes for page in self._mappings.values())

    def mappings(self) -> list[tuple[int, Page]]:
        """(offset, page) for every current mapping, in address order."""
        with self._lock:
            return [(offset, self._mappings[offset]) for offset in self._starts]

    def is_mapped(self, offset: int, nbytes: int) -> bool:
        """True when every byte of [offset, offset + nbytes) is backed by a mapping."""
        with self._lock:
            end = offset + nbytes
            i = bisect.bisect_right(self._starts, offset) - 1
            cursor = offset
            while cursor < end:
                if i < 0 or i >= len(self._starts):
                    return False
                start = self._starts[i]
                stop = start + self._mappings[start].nbytes
                if not start <= cursor < stop:
                    return False
                cursor = stop
                i += 1
            return True

    def close(self) -> None:
        self.backend.free(self)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._closed:
            self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._starts)} mappings"
        return (
            f"Reservation({self.backend.name}, address={self.address:#x}, "
            f"nbytes={self.nbytes}, {state})"
        )


class Page:
    """A physical allocation of `nbytes` that can be mapped into reservations."""

    __slots__ = ("backend", "handle", "nbytes", "_mapped_count", "_closed")

    def __init__(self, backend: Backend, handle: Any, nbytes: int) -> None:
        self.backend = backend
        self.handle = handle
        self.nbytes = nbytes
        self._mapped_count = 0
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def mapped_count(self) -> int:
        return self._mapped_count

    def close(self) -> None:
        self.backend.release(self)

    def __enter__(self) -> Page:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._closed:
            self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"mapped {self._mapped_count}x"
        return f"Page({self.backend.name}, nbytes={self.nbytes}, {state})"


class Backend(ABC):
    """One accelerator (or the host) seen as reserve / create / map / unmap / release."""

    #: Registry name, as used by KVCACHED_BACKEND and the `kvcached.backends` entry points.
    name: ClassVar[str]

    def __init__(self, *, memory_limit: int | None = None) -> None:
        """`memory_limit` caps the physical bytes this instance may hold at once (on top
        of what the device has); creating past it raises OutOfMemory."""
        if memory_limit is not None and (
            not isinstance(memory_limit, int) or memory_limit <= 0
        ):
            raise InvalidArgument(f"memory_limit must be a positive int, got {memory_limit!r}")
        self.memory_limit = memory_limit
        self._created_bytes = 0
        self._state_lock = threading.Lock()
        self._reservations: set[Reservation] = set()
        self._pages: set[Page] = set()
        self._closed = False

    # ----------------------------------------------------------------- detection
    @classmethod
    @abstractmethod
    def unavailable_reason(cls) -> str | None:
        """None when this backend can run here, else why not. Cheap, never raises, and
        never creates a device context (engines fork workers after importing us)."""

    @classmethod
    def auto_selectable(cls) -> bool:
        """Whether auto-detection may pick this backend when it is available (the MLX
        backend, for one, is only picked automatically where Metal is present)."""
        return True

    @classmethod
    def is_available(cls) -> bool:
        try:
            return cls.unavailable_reason() is None
        except Exception:  # detection must never raise
            return False

    # ------------------------------------------------------------ device facts
    @property
    @abstractmethod
    def granularity(self) -> int:
        """Bytes; every reservation, page size and offset is a multiple of it."""

    @property
    @abstractmethod
    def device(self) -> str:
        """The framework device string views live on, e.g. 'cuda:0' or 'cpu'."""

    @abstractmethod
    def mem_info(self) -> tuple[int, int]:
        """(free, total) physical bytes this backend can still create / could ever hold."""

    def describe(self) -> dict[str, Any]:
        """Facts for `kvcached info`; subclasses add device names and driver versions."""
        free, total = self.mem_info()
        return {
            "backend": self.name,
            "device": self.device,
            "granularity": self.granularity,
            "free_bytes": free,
            "total_bytes": total,
        }

    # ------------------------------------------------------ driver primitives
    @abstractmethod
    def _reserve(self, nbytes: int) -> int:
        """Reserve `nbytes` of virtual address space aligned to granularity; return it."""

    @abstractmethod
    def _free(self, address: int, nbytes: int) -> None:
        """Give back a reservation that has no mappings left."""

    @abstractmethod
    def _create(self, nbytes: int) -> Any:
        """Create `nbytes` of physical memory; return the driver's handle for it. Raises
        OutOfMemory when the device or the backend's budget cannot hold it."""

    @abstractmethod
    def _release(self, handle: Any, nbytes: int) -> None:
        """Release physical memory that is no longer mapped anywhere."""

    @abstractmethod
    def _map_batch(self, items: Sequence[tuple[int, Page]]) -> None:
        """Map each (address, page) and make it readable and writable from the device.
        All or nothing: on failure, undo what this call mapped, then raise."""

    @abstractmethod
    def _unmap_batch(self, ranges: Sequence[tuple[int, int]]) -> None:
        """Unmap each (address, nbytes); every range is exactly one earlier mapping."""

    @abstractmethod
    def _view(self, address: int, nbytes: int, shape: tuple[int, ...], dtype: Any) -> Any:
        """A zero-copy framework array over [address, address + nbytes)."""

    def _close_device(self) -> None:
        """Drop device handles (contexts, file descriptors) once everything is returned."""

    # ------------------------------------------------------------- public API
    def reserve(self, nbytes: int) -> Reservation:
        """Reserve a virtual range of `nbytes` (a multiple of granularity)."""
        self._check_open()
        self._check_size("reservation size", nbytes)
        reservation = Reservation(self, self._reserve(nbytes), nbytes)
        with self._state_lock:
            self._reservations.add(reservation)
        return reservation

    def free(self, reservation: Reservation) -> None:
        """Give a reservation back. It must have no mappings left."""
        self._check_reservation(reservation)
        with reservation._lock:
            if reservation._starts:
                raise InvalidArgument(
                    f"cannot free {reservation!r}: {len(reservation._starts)} mappings are "
                    "still in it; unmap them first"
                )
            self._free(reservation.address, reservation.nbytes)
            reservation._closed = True
        with self._state_lock:
            self._reservations.discard(reservation)

    def create(self, nbytes: int) -> Page:
        """Create a physical page of `nbytes` (a multiple of granularity)."""
        self._check_open()
        self._check_size("page size", nbytes)
        with self._state_lock:
            limit = self.memory_limit
            if limit is not None and self._created_bytes + nbytes > limit:
                raise OutOfMemory(
                    f"creating {nbytes} bytes would pass this {self.name} backend's "
                    f"memory_limit ({self._created_bytes} of {limit} bytes in use)"
                )
            self._created_bytes += nbytes  # charged first, so threads cannot overshoot
        try:
            page = Page(self, self._create(nbytes), nbytes)
        except BaseException:
            with self._state_lock:
                self._created_bytes -= nbytes
            raise
        with self._state_lock:
            self._pages.add(page)
        return page

    @property
    def created_bytes(self) -> int:
        """Physical bytes this instance holds in pages that are not released."""
        return self._created_bytes

    def release(self, page: Page) -> None:
        """Release a page. It must not be mapped anywhere."""
        self._check_page(page)
        with self._state_lock:
            if page._mapped_count:
                raise InvalidArgument(
                    f"cannot release {page!r}: it is still mapped {page._mapped_count} "
                    "time(s); unmap it first"
                )
            page._closed = True  # claimed: no map can start on it from here on
            self._pages.discard(page)
        try:
            self._release(page.handle, page.nbytes)
        except BaseException:
            with self._state_lock:
                page._closed = False
                self._pages.add(page)
            raise
        with self._state_lock:
            self._created_bytes -= page.nbytes

    def map(self, reservation: Reservation, offset: int, page: Page) -> None:
        """Map `page` at `offset` in `reservation`, readable and writable."""
        self.map_many(reservation, ((offset, page),))

    def map_many(self, reservation: Reservation, items: Iterable[MappingRequest]) -> None:
        """Map several (offset, page) pairs into one reservation; all or nothing."""
        self._check_reservation(reservation)
        requests = list(items)
        with reservation._lock:
            planned = self._plan_maps(reservation, requests)
            with self._state_lock:
                for _, page in requests:
                    if page._closed:
                        raise InvalidArgument(f"{page!r} was released; it cannot be mapped")
                for _, page in requests:
                    page._mapped_count += 1
            try:
                self._map_batch(planned)
            except BaseException:
                with self._state_lock:
                    for _, page in requests:
                        page._mapped_count -= 1
                raise
            for offset, page in requests:
                bisect.insort(reservation._starts, offset)
                reservation._mappings[offset] = page

    def unmap(self, reservation: Reservation, offset: int, nbytes: int) -> None:
        """Unmap [offset, offset + nbytes): it must cover whole mappings, with no gaps."""
        self.unmap_many(reservation, ((offset, nbytes),))

    def unmap_many(self, reservation: Reservation, ranges: Iterable[UnmapRequest]) -> None:
        """Unmap several (offset, nbytes) ranges of one reservation."""
        self._check_reservation(reservation)
        with reservation._lock:
            covered: list[int] = []
            for offset, nbytes in ranges:
                covered.extend(self._mappings_covering(reservation, offset, nbytes))
            if len(set(covered)) != len(covered):
                raise InvalidArgument("unmap ranges overlap each other")
            base = reservation.address
            self._unmap_batch(
                [(base + start, reservation._mappings[start].nbytes) for start in covered]
            )
            with self._state_lock:
                for start in covered:
                    reservation._mappings.pop(start)._mapped_count -= 1
            for start in covered:
                del reservation._starts[bisect.bisect_left(reservation._starts, start)]

    def view(self, reservation: Reservation, offset: int, shape: Sequence[int], dtype: Any) -> Any:
        """A zero-copy array of `shape` and `dtype` at `offset` in `reservation`.

        The range may include bytes that are not mapped yet: engines view a whole
        reservation once and map pages under it as blocks are used. Touching unmapped
        bytes is the caller's bug (a device fault on GPUs, SIGSEGV on host)."""
        self._check_reservation(reservation)
        dims = tuple(int(d) for d in shape)
        if any(d < 0 for d in dims):
            raise InvalidArgument(f"view shape {dims} has a negative dimension")
        itemsize = dtype_itemsize(dtype)
        count = 1
        for d in dims:
            count *= d
        nbytes = count * itemsize
        if offset < 0 or offset % itemsize or offset + nbytes > reservation.nbytes:
            raise InvalidArgument(
                f"view of {nbytes} bytes at offset {offset} does not fit {reservation!r} "
                f"(offset must be a non-negative multiple of the item size {itemsize})"
            )
        return self._view(reservation.address + offset, nbytes, dims, dtype)

    def close(self) -> None:
        """Unmap, release and free everything this backend still holds. Idempotent."""
        if self._closed:
            return
        with self._state_lock:
            reservations = list(self._reservations)
        for reservation in reservations:
            if reservation._closed:
                continue
            with reservation._lock:
                starts = list(reservation._starts)
            if starts:
                self.unmap_many(
                    reservation, [(s, reservation._mappings[s].nbytes) for s in starts]
                )
            self.free(reservation)
        with self._state_lock:
            pages = list(self._pages)
        for page in pages:
            if not page._closed:
                self.release(page)
        self._closed = True
        self._close_device()

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def live_counts(self) -> tuple[int, int]:
        """(reservations, pages) not yet closed; what `close()` would clean up."""
        with self._state_lock:
            return len(self._reservations), len(self._pages)

    # ------------------------------------------------------------- checks
    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgument(f"the {self.name} backend was closed")

    def _check_size(self, what: str, nbytes: int) -> None:
        if not isinstance(nbytes, int) or isinstance(nbytes, bool):
            raise InvalidArgument(f"{what} must be an int, got {type(nbytes).__name__}")
        g = self.granularity
        if nbytes <= 0 or nbytes % g:
            raise InvalidArgument(
                f"{what} {nbytes} is not a positive multiple of the {self.name} "
                f"granularity ({g} bytes)"
            )

    def _check_reservation(self, reservation: Reservation) -> None:
        if not isinstance(reservation, Reservation) or reservation.backend is not self:
            raise InvalidArgument(f"expected a Reservation of this {self.name} backend")
        if reservation._closed:
            raise InvalidArgument(f"{reservation!r} was freed")

    def _check_page(self, page: Page) -> None:
        if not isinstance(page, Page) or page.backend is not self:
            raise InvalidArgument(f"expected a Page of this {self.name} backend")
        if page._closed:
            raise InvalidArgument(f"{page!r} was already released")

    def _plan_maps(
        self, reservation: Reservation, requests: list[MappingRequest]
    ) -> list[tuple[int, Page]]:
        """Validate a batch against the reservation and itself; return (address, page)."""
        g = self.granularity
        starts, mappings = reservation._starts, reservation._mappings
        batch: list[tuple[int, int]] = []
        planned: list[tuple[int, Page]] = []
        for offset, page in requests:
            self._check_page(page)
            if not isinstance(offset, int) or offset < 0 or offset % g:
                raise InvalidArgument(
                    f"map offset {offset!r} is not a non-negative multiple of the "
                    f"granularity ({g} bytes)"
                )
            end = offset + page.nbytes
            if end > reservation.nbytes:
                raise InvalidArgument(
                    f"mapping [{offset}, {end}) runs past the end of {reservation!r}"
                )
            i = bisect.bisect_right(starts, offset)
            if (i > 0 and starts[i - 1] + mappings[starts[i - 1]].nbytes > offset) or (
                i < len(starts) and starts[i] < end
            ):
                raise InvalidArgument(
                    f"[{offset}, {end}) of {reservation!r} is already mapped; unmap it first"
                )
            for other_start, other_end in batch:
                if other_start < end and offset < other_end:
                    raise InvalidArgument(f"batch maps [{offset}, {end}) twice")
            batch.append((offset, end))
            planned.append((reservation.address + offset, page))
        return planned

    def _mappings_covering(self, reservation: Reservation, offset: int, nbytes: int) -> list[int]:
        """Start offsets of the mappings that exactly tile [offset, offset + nbytes)."""
        if not isinstance(offset, int) or not isinstance(nbytes, int) or nbytes <= 0:
            raise InvalidArgument(f"unmap range ({offset!r}, {nbytes!r}) is not a positive range")
        starts, mappings = reservation._starts, reservation._mappings
        end = offset + nbytes
        i = bisect.bisect_left(starts, offset)
        covered: list[int] = []
        cursor = offset
        while cursor < end:
            if i >= len(starts) or starts[i] != cursor:
                raise InvalidArgument(
                    f"unmap [{offset}, {end}) of {reservation!r}: nothing is mapped at "
                    f"offset {cursor}, or a mapping starts before it (unmap whole mappings)"
                )
            cursor += mappings[cursor].nbytes
            covered.append(starts[i])
            i += 1
        if cursor != end:
            raise InvalidArgument(
                f"unmap [{offset}, {end}) of {reservation!r} ends inside a mapping "
                f"that runs to {cursor} (unmap whole mappings)"
            )
        return covered


_ITEMSIZE = {
    "bool": 1, "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2,
    "int32": 4, "uint32": 4, "float32": 4,
    "int64": 8, "uint64": 8, "float64": 8,
}  # fmt: skip


def dtype_name(dtype: Any) -> str:
    """'bfloat16' for torch.bfloat16, mx.bfloat16, numpy dtypes or the string itself."""
    text = str(dtype)
    for prefix in ("torch.", "mlx.core."):
        text = text.removeprefix(prefix)
    if text not in _ITEMSIZE:
        raise InvalidArgument(f"unsupported dtype {dtype!r}; accepted: {', '.join(_ITEMSIZE)}")
    return text


def dtype_itemsize(dtype: Any) -> int:
    return _ITEMSIZE[dtype_name(dtype)]
