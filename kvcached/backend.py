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
* Lifetime. `Reservation` and `Page` are objects with `close()` (idempotent) and context
  managers. A page that is still mapped cannot be released, a reservation that still
  has mappings cannot be freed (drivers differ here: CUDA defers such a release, ROCm
  leaks it), and `Backend.close()` unmaps, releases and frees everything still alive.
  What a view taken before `free` or `close` sees afterwards differs per backend; see
  docs/backends/stale-views.md.
* fork(). A forked child inherits the parent's backend objects but not the right to
  use them: on the host both processes would share one memory file (a page the child
  releases is a hole punched into the parent's KV cache), and a CUDA context does not
  survive a fork at all. In the child every backend that existed before the fork is
  marked closed, with its reservations and pages, so that any use is an
  `InvalidArgument` saying so and `close()` touches nothing the parent owns.
* Batching. `map_many` / `unmap_many` validate the whole batch first, then hand it to
  the backend in one call so a driver can amortize work (one set-access over a
  contiguous run, for example). A batch that fails part-way is rolled back.

Locking: each reservation has its own lock, held across the driver call for that
reservation, so threads mapping into different reservations run in parallel while two
threads can never race on the same address range. Page mapping counts sit under one
short backend-wide lock that is never held across a driver call.
"""

from __future__ import annotations

import itertools
import operator
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from kvcached import forksafe
from kvcached.errors import InvalidArgument, OutOfMemory
from kvcached.lifetime import Closeable

#: No size or offset handed to a driver is larger (every 64-bit API takes it).
MAX_BYTES = (1 << 63) - 1

MappingRequest = tuple[int, "Page"]
UnmapRequest = tuple[int, int]


@dataclass(frozen=True)
class Capabilities:
    """What a backend offers beyond the seam's minimum, declared rather than discovered.

    A VMM backend (cuda, rocm, host) has every one. A backend without a VMM (mlx)
    declares what it lacks, and whoever depends on a capability asks here first: the
    conformance suite reports the checks that need a missing capability as not
    applicable, naming it, instead of running them or skipping them unannounced.
    """

    #: A view may cover several mappings, and bytes not mapped yet (a VMM's virtual range).
    views_span_mappings: bool = True
    #: Writes through a view reach the mapped page (views alias the memory, writably).
    writable_views: bool = True
    #: `mem_info` sees memory that other processes hold, not only this process's.
    device_wide_mem_info: bool = True

    def missing(self) -> list[str]:
        """Names of the capabilities this backend lacks."""
        return [f.name for f in fields(self) if getattr(self, f.name) is False]


class Reservation(Closeable):
    """A reserved virtual address range of `nbytes`; holds no physical memory by itself.

    Bookkeeping is per granule: `_occupied[i]` is 1 while granule i is mapped, so an
    overlap check is one `bytearray.find` whatever the number of mappings, and
    `_mappings` maps each mapping's start offset to its page."""

    __slots__ = ("_closed", "_lock", "_mappings", "_occupied", "address", "backend", "nbytes")

    def __init__(self, backend: Backend, address: int, nbytes: int) -> None:
        self.backend = backend
        self.address = address
        self.nbytes = nbytes
        self._mappings: dict[int, Page] = {}  # start offset -> page mapped there
        self._occupied = bytearray(nbytes // backend._g)
        self._lock = threading.Lock()
        self._closed = False

    @property
    def mapped_bytes(self) -> int:
        return sum(page.nbytes for page in self._mappings.values())

    def mappings(self) -> list[tuple[int, Page]]:
        """(offset, page) for every current mapping, in address order."""
        with self._lock:
            return sorted(self._mappings.items(), key=lambda item: item[0])

    def is_mapped(self, offset: int, nbytes: int) -> bool:
        """True when every byte of [offset, offset + nbytes) is backed by a mapping."""
        g = self.backend._g
        first, last = offset // g, (offset + nbytes + g - 1) // g
        if offset < 0 or nbytes <= 0 or last > len(self._occupied):
            return False
        with self._lock:
            return self._occupied.find(0, first, last) == -1

    def close(self) -> None:
        """Free the reservation (see `Backend.free`). Idempotent."""
        if not self._closed:
            self.backend.free(self)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._mappings)} mappings"
        return (
            f"Reservation({self.backend.name}, address={self.address:#x}, "
            f"nbytes={self.nbytes}, {state})"
        )


class Page(Closeable):
    """A physical allocation of `nbytes` that can be mapped into reservations.

    `_mapped_in` lists the reservations it is mapped into (once per mapping). Appending
    to and removing from a list are atomic, so the map and unmap paths need no lock of
    their own for it; `release` closes the page first and then checks the list, and
    `map` appends first and then checks `_closed`, so the two can never both succeed."""

    __slots__ = ("_closed", "_granules", "_mapped_in", "backend", "handle", "nbytes")

    def __init__(self, backend: Backend, handle: Any, nbytes: int) -> None:
        self.backend = backend
        self.handle = handle
        self.nbytes = nbytes
        self._granules = nbytes // backend._g
        self._mapped_in: list[Reservation] = []
        self._closed = False

    @property
    def mapped_count(self) -> int:
        return len(self._mapped_in)

    def close(self) -> None:
        """Release the page (see `Backend.release`). Idempotent."""
        if not self._closed:
            self.backend.release(self)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"mapped {len(self._mapped_in)}x"
        return f"Page({self.backend.name}, nbytes={self.nbytes}, {state})"


class Backend(Closeable, ABC):
    """One accelerator (or the host) seen as reserve / create / map / unmap / release."""

    #: Registry name, as used by KVCACHED_BACKEND and the `kvcached.backends` entry points.
    name: ClassVar[str]
    #: What this backend can do beyond the minimum (see `Capabilities`).
    capabilities: ClassVar[Capabilities] = Capabilities()

    def __init__(self, *, memory_limit: int | None = None) -> None:
        """`memory_limit` caps the physical bytes this instance may hold at once (on top
        of what the device has); creating past it raises OutOfMemory."""
        if memory_limit is not None and (not isinstance(memory_limit, int) or memory_limit <= 0):
            raise InvalidArgument(f"memory_limit must be a positive int, got {memory_limit!r}")
        self.memory_limit = memory_limit
        self._created_bytes = 0
        self._state_lock = threading.Lock()
        self._reservations: set[Reservation] = set()
        self._pages: set[Page] = set()
        self._closed = False
        self._forked_from: int | None = None  # the parent's pid, in a forked child
        _live_backends.add(self)

    def _disown_after_fork(self, parent: int) -> None:
        """In a forked child: nothing of this instance is the child's to use or give back."""
        self._forked_from = parent
        self._closed = True
        self._state_lock = threading.Lock()  # another thread may have held it at the fork
        for reservation in self._reservations:
            reservation._closed = True
            reservation._lock = threading.Lock()
        for page in self._pages:
            page._closed = True

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

    def _map_one(self, address: int, page: Page) -> None:
        """`_map_batch` of one page; backends override it when one call is cheaper."""
        self._map_batch(((address, page),))

    def _unmap_one(self, address: int, nbytes: int) -> None:
        """`_unmap_batch` of one mapping; backends override it when one call is cheaper."""
        self._unmap_batch(((address, nbytes),))

    def _close_device(self) -> None:
        """Drop device handles (contexts, file descriptors) once everything is returned."""

    # ------------------------------------------------------------- public API
    def __getattr__(self, name: str) -> Any:
        # `_g` is the granularity as a plain instance attribute, set on first read: the
        # map path reads it on every call, and a property would cost a function call.
        if name == "_g":
            g = int(self.granularity)
            self.__dict__["_g"] = g
            return g
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def synchronize(self) -> None:
        """Wait for device work that may still touch mapped memory. `unmap` does not
        wait (a driver unmap under a running kernel is the caller's bug, as with
        cuMemUnmap), so whoever unmaps memory that kernels used calls this first."""

    def reserve(self, nbytes: int) -> Reservation:
        """Reserve a virtual range of `nbytes` (a multiple of granularity). A size the
        address space (or the bookkeeping of its granules) cannot hold is OutOfMemory."""
        self._check_open()
        self._check_size("reservation size", nbytes)
        try:
            address = self._reserve(nbytes)
        except MemoryError:
            raise OutOfMemory(f"cannot reserve {nbytes} bytes of address space") from None
        try:
            reservation = Reservation(self, address, nbytes)
        except MemoryError:
            self._free(address, nbytes)
            raise OutOfMemory(
                f"a reservation of {nbytes} bytes needs {nbytes // self._g} granules of "
                "bookkeeping, more than this process can allocate"
            ) from None
        with self._state_lock:
            self._reservations.add(reservation)
        return reservation

    def free(self, reservation: Reservation) -> None:
        """Give a reservation back. It must have no mappings left."""
        self._check_reservation(reservation)
        with reservation._lock:
            if reservation._mappings:
                raise InvalidArgument(
                    f"cannot free {reservation!r}: {len(reservation._mappings)} mappings are "
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
        self._count_created(nbytes, f"creating {nbytes} bytes")
        try:
            page = Page(self, self._create(nbytes), nbytes)
        except BaseException:
            with self._state_lock:
                self._created_bytes -= nbytes
            raise
        with self._state_lock:
            self._pages.add(page)
        return page

    def _count_created(self, nbytes: int, what: str) -> None:
        """Count `nbytes` more as created, before the driver is asked (so threads cannot
        overshoot the memory limit together), or raise OutOfMemory naming `what`."""
        with self._state_lock:
            limit = self.memory_limit
            if limit is not None and self._created_bytes + nbytes > limit:
                raise OutOfMemory(
                    f"{what} would pass this {self.name} backend's memory_limit "
                    f"({self._created_bytes} of {limit} bytes in use)"
                )
            self._created_bytes += nbytes

    def create_many(self, nbytes: int, count: int) -> list[Page]:
        """`count` pages of `nbytes` each, all or nothing: a growth step creates one page
        per layer buffer, and one call checks, charges the memory limit and records them
        once rather than per page; the driver calls are the same (with `release_many`,
        a growth step's Python is 29 % less with the driver stubbed:
        benchmarks/results/cpu-2026-12-05c/grow_bookkeeping_trees.jsonl). If one cannot
        be created, those made are released and the error (OutOfMemory for a full device
        or limit) is raised."""
        self._check_open()
        self._check_size("page size", nbytes)
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise InvalidArgument(f"page count must be a non-negative int, got {count!r}")
        total = nbytes * count
        self._count_created(total, f"creating {count} pages of {nbytes} bytes")
        made: list[Page] = []
        create = self._create
        try:
            for _ in range(count):
                made.append(Page(self, create(nbytes), nbytes))
        except BaseException:
            try:
                for page in made:
                    self._release(page.handle, nbytes)
            finally:
                with self._state_lock:
                    self._created_bytes -= total
            raise
        with self._state_lock:
            self._pages.update(made)
        return made

    def release_many(self, pages: Sequence[Page]) -> None:
        """Release several pages; none is released if one is mapped, released already or
        not this backend's. A driver error part way leaves the rest unreleased (and
        usable), the ones before it released, and is raised."""
        pages = list(pages)
        for page in pages:
            self._check_page(page)
        if len(set(pages)) != len(pages):
            raise InvalidArgument("release_many was given the same page twice")
        with self._state_lock:
            for page in pages:
                if page._closed:  # released by another thread since the check
                    self._check_page(page)
            for page in pages:
                page._closed = True  # first: see `release`
            busy = [page for page in pages if page._mapped_in]
            if busy:
                for page in pages:
                    page._closed = False
                raise InvalidArgument(
                    f"cannot release {busy[0]!r}: it is still mapped "
                    f"{len(busy[0]._mapped_in)} time(s); unmap it first (nothing released)"
                )
            self._pages.difference_update(pages)
        released = 0
        try:
            for page in pages:
                self._release(page.handle, page.nbytes)
                released += 1
        finally:
            with self._state_lock:
                for page in pages[released:]:
                    page._closed = False
                    self._pages.add(page)
                self._created_bytes -= sum(page.nbytes for page in pages[:released])

    @property
    def created_bytes(self) -> int:
        """Physical bytes this instance holds in pages that are not released."""
        return self._created_bytes

    def release(self, page: Page) -> None:
        """Release a page. It must not be mapped anywhere."""
        self._check_page(page)
        with self._state_lock:
            page._closed = True  # first: a map that starts from here on sees it closed
            if page._mapped_in:
                page._closed = False
                raise InvalidArgument(
                    f"cannot release {page!r}: it is still mapped {len(page._mapped_in)} "
                    "time(s); unmap it first"
                )
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
        """Map `page` at `offset` in `reservation`, readable and writable.

        The per-page path of a growing cache, kept lean: a driver map costs tens of
        microseconds, and what kvcached adds must stay within a few percent of that.
        Anything unusual falls through to `map_many`, which raises the precise error."""
        g = self._g
        try:  # AttributeError: not a Reservation / Page (only they have these slots)
            if (
                reservation.backend is not self
                or page.backend is not self
                or offset.__class__ is not int
                or offset < 0
                or offset % g
            ):
                raise AttributeError
            first = offset // g
            last = first + page._granules
            occupied = reservation._occupied
            mapped_in = page._mapped_in
        except AttributeError:
            self.map_many(reservation, ((offset, page),))
            return
        # acquire/release rather than `with`: on CPython 3.11 the context manager's
        # calls cost about twice the lock itself, on a path run once per page
        lock = reservation._lock
        lock.acquire()
        try:
            if (
                reservation._closed
                or last > len(occupied)
                or (occupied[first] if last - first == 1 else occupied.find(1, first, last) >= 0)
            ):
                raise self._map_error(reservation, offset, page)
            mapped_in.append(reservation)
            if page._closed:
                mapped_in.remove(reservation)
                raise InvalidArgument(f"{page!r} was released; it cannot be mapped")
            try:
                self._map_one(reservation.address + offset, page)
            except BaseException:
                mapped_in.remove(reservation)
                raise
            if last - first == 1:
                occupied[first] = 1
            else:
                occupied[first:last] = b"\x01" * (last - first)
            reservation._mappings[offset] = page
        finally:
            lock.release()

    def map_many(self, reservation: Reservation, items: Iterable[MappingRequest]) -> None:
        """Map several (offset, page) pairs into one reservation; all or nothing."""
        self._check_reservation(reservation)
        requests = list(items)
        with reservation._lock:
            planned = self._plan_maps(reservation, requests)
            added: list[Page] = []
            try:
                for _, page in requests:
                    page._mapped_in.append(reservation)
                    added.append(page)
                    if page._closed:
                        raise InvalidArgument(f"{page!r} was released; it cannot be mapped")
                self._map_batch(planned)
            except BaseException:
                for page in added:
                    page._mapped_in.remove(reservation)
                raise
            g = self._g
            for offset, page in requests:
                reservation._occupied[offset // g : offset // g + page._granules] = (
                    b"\x01" * page._granules
                )
                reservation._mappings[offset] = page

    def unmap(self, reservation: Reservation, offset: int, nbytes: int) -> None:
        """Unmap [offset, offset + nbytes): it must cover whole mappings, with no gaps.

        Device work still using the range must be finished (see `synchronize`)."""
        try:
            if reservation.backend is self:
                mappings = reservation._mappings
                lock = reservation._lock
                lock.acquire()  # not `with`: see `map`
                try:
                    page = mappings.pop(offset, None)
                    if page is not None:
                        if page.nbytes != nbytes or reservation._closed:
                            mappings[offset] = page  # not one whole mapping: slow path
                        else:
                            try:
                                self._unmap_one(reservation.address + offset, nbytes)
                            except BaseException:
                                mappings[offset] = page
                                raise
                            first = offset // self._g
                            granules = page._granules
                            if granules == 1:
                                reservation._occupied[first] = 0
                            else:
                                reservation._occupied[first : first + granules] = bytes(granules)
                            page._mapped_in.remove(reservation)
                            return
                finally:
                    lock.release()
        except AttributeError:
            pass  # not a Reservation: unmap_many says so
        self.unmap_many(reservation, ((offset, nbytes),))

    def unmap_many(self, reservation: Reservation, ranges: Iterable[UnmapRequest]) -> None:
        """Unmap several (offset, nbytes) ranges of one reservation."""
        self._check_reservation(reservation)
        with reservation._lock:
            covered: list[int] = []
            mapped_at = reservation._mappings.get
            for offset, nbytes in ranges:
                # one whole mapping (what the allocator unmaps) is found by its start;
                # anything else is tiled, or refused, by `_mappings_covering`
                page = mapped_at(offset) if offset.__class__ is int else None
                if page is not None and nbytes.__class__ is int and page.nbytes == nbytes:
                    covered.append(offset)
                else:
                    covered.extend(self._mappings_covering(reservation, offset, nbytes))
            if len(set(covered)) != len(covered):
                raise InvalidArgument("unmap ranges overlap each other")
            mappings, base, g = reservation._mappings, reservation.address, self._g
            self._unmap_batch([(base + start, mappings[start].nbytes) for start in covered])
            for start in covered:
                page = mappings.pop(start)
                reservation._occupied[start // g : start // g + page._granules] = bytes(
                    page._granules
                )
                page._mapped_in.remove(reservation)

    def view(self, reservation: Reservation, offset: int, shape: Sequence[int], dtype: Any) -> Any:
        """A zero-copy array of `shape` and `dtype` at `offset` in `reservation`.

        The range may include bytes that are not mapped yet: engines view a whole
        reservation once and map pages under it as blocks are used. Touching unmapped
        bytes is the caller's bug (a device fault on GPUs, SIGSEGV on host)."""
        self._check_reservation(reservation)
        dims = _int_tuple("view shape", shape)
        if any(d < 0 for d in dims):
            raise InvalidArgument(f"view shape {dims} has a negative dimension")
        (offset,) = _int_tuple("view offset", (offset,))
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
        self.synchronize()
        with self._state_lock:
            reservations = list(self._reservations)
        for reservation in reservations:
            if reservation._closed:
                continue
            live = reservation.mappings()
            if live:
                self.unmap_many(reservation, [(offset, page.nbytes) for offset, page in live])
            self.free(reservation)
        with self._state_lock:
            pages = list(self._pages)
        for page in pages:
            if not page._closed:
                self.release(page)
        self._closed = True
        self._close_device()

    def held_bytes(self) -> int | None:
        """Physical bytes this instance holds as the driver or kernel counts them (not
        as kvcached's own bookkeeping does), or None when the backend cannot tell; the
        conformance suite then measures device-wide free memory instead."""
        return None

    @property
    def live_counts(self) -> tuple[int, int]:
        """(reservations, pages) not yet closed; what `close()` would clean up."""
        with self._state_lock:
            return len(self._reservations), len(self._pages)

    # ------------------------------------------------------------- checks
    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgument(self._closed_message())

    def _closed_message(self) -> str:
        if self._forked_from is not None:
            return (
                f"this {self.name} backend belongs to process {self._forked_from}; a forked "
                "child cannot use it (create a new backend, or kvcached.get_backend(), "
                "in the child)"
            )
        return f"the {self.name} backend was closed"

    def _check_size(self, what: str, nbytes: int) -> None:
        if not isinstance(nbytes, int) or isinstance(nbytes, bool):
            raise InvalidArgument(f"{what} must be an int, got {type(nbytes).__name__}")
        g = self._g
        if nbytes <= 0 or nbytes % g:
            raise InvalidArgument(
                f"{what} {nbytes} is not a positive multiple of the {self.name} "
                f"granularity ({g} bytes)"
            )
        if nbytes > MAX_BYTES:  # before a driver binding truncates or overflows it
            raise InvalidArgument(
                f"{what} {nbytes} is larger than any address space (at most 2**63 bytes)"
            )

    def _check_reservation(self, reservation: Reservation) -> None:
        if not isinstance(reservation, Reservation) or reservation.backend is not self:
            raise InvalidArgument(f"expected a Reservation of this {self.name} backend")
        if reservation._closed:
            if self._forked_from is not None:
                raise InvalidArgument(self._closed_message())
            raise InvalidArgument(f"{reservation!r} was freed")

    def _check_page(self, page: Page) -> None:
        if not isinstance(page, Page) or page.backend is not self:
            raise InvalidArgument(f"expected a Page of this {self.name} backend")
        if page._closed:
            if self._forked_from is not None:
                raise InvalidArgument(self._closed_message())
            raise InvalidArgument(f"{page!r} was already released")

    def _map_error(self, reservation: Reservation, offset: int, page: Page) -> InvalidArgument:
        """The precise error for a single map that failed the fast path's checks."""
        try:
            self._check_reservation(reservation)
            self._plan_maps(reservation, [(offset, page)])
        except InvalidArgument as exc:
            return exc
        return InvalidArgument(f"cannot map {page!r} at {offset} in {reservation!r}")

    def _plan_maps(
        self, reservation: Reservation, requests: list[MappingRequest]
    ) -> list[tuple[int, Page]]:
        """Validate a batch against the reservation and itself; return (address, page)."""
        g = self._g
        occupied = reservation._occupied
        claimed: list[tuple[int, int]] = []  # granule ranges this batch maps
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
            first, last = offset // g, end // g
            if occupied.find(1, first, last) >= 0:
                raise InvalidArgument(
                    f"[{offset}, {end}) of {reservation!r} is already mapped; unmap it first"
                )
            claimed.append((first, last))
            planned.append((reservation.address + offset, page))
        claimed.sort()
        for (_, end_before), (start, _) in itertools.pairwise(claimed):
            if start < end_before:
                raise InvalidArgument(f"batch maps granule {start} of {reservation!r} twice")
        return planned

    def _mappings_covering(self, reservation: Reservation, offset: int, nbytes: int) -> list[int]:
        """Start offsets of the mappings that exactly tile [offset, offset + nbytes)."""
        if not isinstance(offset, int) or not isinstance(nbytes, int) or nbytes <= 0:
            raise InvalidArgument(f"unmap range ({offset!r}, {nbytes!r}) is not a positive range")
        mappings = reservation._mappings
        end = offset + nbytes
        covered: list[int] = []
        cursor = offset
        while cursor < end:
            page = mappings.get(cursor)
            if page is None:
                raise InvalidArgument(
                    f"unmap [{offset}, {end}) of {reservation!r}: no mapping starts at "
                    f"offset {cursor} (unmap whole mappings, and only mapped ranges)"
                )
            covered.append(cursor)
            cursor += page.nbytes
        if cursor != end:
            raise InvalidArgument(
                f"unmap [{offset}, {end}) of {reservation!r} ends inside a mapping "
                f"that runs to {cursor} (unmap whole mappings)"
            )
        return covered


class ArrayBackend(Backend):
    """A backend whose pages can each be one typed framework array (mlx).

    Without a VMM there is no range to view K and V through, so an engine's cache keeps
    each run of K or V in one page made to its shape, and writes it in place. An engine
    adapter asks for this class (`isinstance`), never for a backend by its module, so it
    reaches the backend through the registry like every other layer above the seam.
    """

    @abstractmethod
    def array_page_bytes(self, shape: Sequence[int], dtype: Any) -> int:
        """Bytes of the page `create_array(shape, dtype)` would create (the rounding to
        the granularity included), known before it exists so the ledger is charged
        first."""

    @abstractmethod
    def create_array(self, shape: Sequence[int], dtype: Any) -> Page:
        """A page holding one zeroed array of `shape` and `dtype`
        (`array_page_bytes(shape, dtype)` bytes)."""


def _int_tuple(what: str, values: Iterable[Any]) -> tuple[int, ...]:
    """`values` as ints; a float such as 2.5 (or 2.0) is refused, never truncated."""
    out: list[int] = []
    for value in values:
        if isinstance(value, bool):
            raise InvalidArgument(f"{what} must be made of ints, got {value!r}")
        try:
            out.append(operator.index(value))
        except TypeError:
            raise InvalidArgument(
                f"{what} must be made of ints (numpy integers welcome), got {value!r}"
            ) from None
    return tuple(out)


#: Every backend instance alive in this process, so a forked child can disown them.
_live_backends: weakref.WeakSet[Backend] = weakref.WeakSet()


def _disown_backends_in_child(parent: int) -> None:
    for backend in list(_live_backends):
        backend._disown_after_fork(parent)


# after the ledger's hook, before the allocators' (Note [fork hook order] in forksafe.py)
forksafe.register(
    "kvcached.backend", forksafe.Stage.BACKENDS, after_in_child=_disown_backends_in_child
)


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
