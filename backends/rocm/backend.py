"""The ROCm backend: HIP's virtual memory management (VMM) API through hip-python.

HIP copies CUDA's VMM API call for call: `hipMemAddressReserve` (address space only),
`hipMemCreate` (physical memory, a generic allocation handle), `hipMemMap` followed by
`hipMemSetAccess` (nothing can touch a mapping until access is granted), and the reverse
`hipMemUnmap`, `hipMemRelease`, `hipMemAddressFree`. hip-python differs from
cuda-bindings in calling details only: structures are Python objects whose nested
members are set in place (`prop.location.id = 0`), enums are typed, and
`hipMemSetAccess` takes one `hipMemAccessDesc` (or a pointer to an array) plus a count,
not a Python list. `bindings.py` hides the differences between hip-python's package
layouts; `detect.py` answers "can ROCm run here" without initialising HIP in this process.

What is shaped by ROCm rather than by the API (docs/backends/rocm.md has the sources):

* **Access is granted per mapping.** Several ROCm releases validate the range given to
  `hipMemSetAccess` against the wrong set of mappings and reject legal calls with
  hipErrorInvalidValue: a range starting at a mapping that is not the reservation's
  first and spanning several mappings (the "grow the tail" pattern, ROCm 7.2,
  ROCm/rocm-systems#6977), and, earlier, any range whose size is not a prefix sum of the
  reservation's mappings (ROCm/rocm-systems#2516). One call per mapping, with exactly
  that mapping's size, passes the fixed check and the 7.2 one; when the older check
  rejects it (a mapping whose size is no prefix sum), the call is retried once over the
  contiguous run of mappings from the reservation's first mapping through this one,
  which that check accepts. The driver's price is per handle, not per byte, so
  per-mapping calls cost little. (With the release workaround below, each mapping is
  alone in its hip reservation, where every one of these checks accepts it.)
* **Unmapping is one call per mapping.** A `hipMemUnmap` spanning several mappings
  leaves ROCr counting the reservation as in use, and the later `hipMemAddressFree`
  fails (ROCm/ROCR-Runtime#285). We never coalesce unmaps, unlike the CUDA backend.
* **Released memory stays in use while its address range stays reserved.** On ROCm 7.2
  `hipMemMap` also maps the allocation on the CPU side (no access) at the same address,
  and `hipMemUnmap` leaves that CPU mapping in place, so after `hipMemRelease` the
  memory stays in use until something replaces those addresses, in practice the
  `hipMemAddressFree` of the range (ROCm/legacy-rocm-build#6021, fixed by
  ROCm/rocm-systems#4363; 6.4.0 had a similar report, ROCm/hip#3781). An engine never
  frees its KV reservations while it runs, and a range with live pages cannot be freed
  (ROCr refuses), so memory it gives back would never reach other instances. With the
  bug present, therefore, a reservation of ours is not one hip reservation but several
  adjacent ones that tile it (`_Pieces`): it is reserved once as a whole, which yields a
  suitably aligned range; when a page is mapped, the unmapped piece(s) it falls in are
  freed and reserved again at the same addresses as up to three pieces, the middle one
  exactly the mapping (`_carve`); when it is unmapped, its own piece is freed and
  reserved again at the same address (`_recycle`), which takes the stale CPU mapping
  away, so the `hipMemRelease` that follows returns the memory at once. Neighbouring
  mappings live in hip reservations of their own and are never touched, so nothing is
  unmapped under a running kernel. Every re-reservation asks for its address and checks
  that it got it: ROCr grants a requested range that is free and otherwise quietly
  reserves elsewhere (returning success), so a miss (something else in the process, a
  hipMalloc or any mmap, took the range in the moment it was free) is given back and
  asked for again a few times (Note [a range taken for a moment]); one that persists,
  the
  previous pieces are reserved again, and the map fails with a DriverError that says
  so; nothing is ever mapped at an address other than the one asked for, and a range
  that could not be had back is retried by the next map over it. `_va_lock` covers
  every free-and-reserve-again and every reserve of ours, so our own threads never take
  such a range; others can, and HIP offers no way to close that moment.
  Splitting is done only when the bug is present: on a healthy runtime it buys nothing
  and would cost two to four address-space calls per map, a moment per map in which a
  range of ours is unreserved, and up to 2n + 1 hip reservations for n mappings instead
  of one. Whether the runtime has the bug is measured once at start (map, release and
  free a probe allocation and watch `hipMemGetInfo`); `release_workaround` forces the
  answer. A page mapped again at the same offset with the same size finds its piece
  ready, so steady grow/shrink at the same offsets costs one free and one reserve per
  unmap and nothing extra per map.

Threads: HIP's current device is per thread. The calls that use it (`hipMemCreate`,
`hipMemGetInfo`, `hipMemGetAllocationGranularity`, `hipDeviceSynchronize`) run with
this backend's device made current and the thread's own put back afterwards, so the
backend never changes the device torch sees on a thread. The others name their device
themselves (the handle's allocation properties, the access descriptor; reservations
span all devices) and run as they are: without the release workaround the per-page map
and unmap are the driver calls themselves and nothing more. Maps and unmaps within one
reservation are serialised by the base class's reservation lock, which covers its
pieces too; `_va_lock` serialises the address-space calls of all reservations.

Views are torch tensors on `cuda:N`, the device ROCm builds of torch give AMD GPUs. An
integrated device whose memory is host memory, used where torch is not a ROCm build
(the host stand-in the tests use), gets CPU tensors over the same addresses instead.
"""

from __future__ import annotations

import bisect
import contextlib
import importlib.util
import threading
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from kvcached.backend import Backend, Page, Reservation
from kvcached.backends.rocm import bindings
from kvcached.backends.rocm.detect import rocm_unavailable_reason
from kvcached.config import settings
from kvcached.errors import (
    BackendUnavailable,
    DriverError,
    InvalidArgument,
    KVCachedError,
    OutOfMemory,
)
from kvcached.views import device_tensor, host_tensor

HIP_SUCCESS = 0
HIP_ERROR_INVALID_VALUE = 1
HIP_ERROR_OUT_OF_MEMORY = 2

#: Granules of the allocation that probes for the release bug at start (64 MiB at 2 MiB).
RELEASE_PROBE_GRANULES = 32

# Note [a range taken for a moment]: with the release workaround, a range of ours is
# unreserved for a moment while it is freed and reserved again, and anything else in the
# process that maps memory then (another thread's large malloc, a temporary array) may be
# placed there: Linux hands out the highest free gap first, and a hole just made inside a
# reservation of ours often is that gap. Such takers are mostly short-lived, so a miss is
# asked for again, backing off from 1 ms, before it counts; a range held longer than that
# is a DriverError, as before, and loses nothing. The first budget, 6 tries over about
# 30 ms, was too short on a loaded 2-core machine, where a taker in another thread waits
# for the GIL and a core before it lets go: the conformance suite's threaded test failed
# in a fresh-clone CI run (2026-12-03), and in 2 of 67 runs here beside two busy loops.
# 10 tries back off up to 256 ms, about 0.5 s in all. Only a real miss pays it, but it
# pays it holding the VA lock and the reservation's lock, so other maps wait that long.
# One taker is not short-lived: a thread started in that moment, whose 8 MiB stack was
# seen placed over a freed 4 MiB piece (the conformance suite's threaded test, host
# stand-in, 2026-12-02). That piece stays unreserved for the thread's life, and maps
# there fail with the DriverError. Takers that stay are what Note [holes below the
# frontier] keeps out: since reservations lie low, a freed piece is no longer where
# Linux puts the next mapping.
ADDRESS_ATTEMPTS = 10
ADDRESS_RETRY_S = 0.001

# Note [holes below the frontier]: Linux puts a mapping made without an address into the
# highest free gap below its mmap base that fits (top-down). A hip reservation made that
# way lands at the low end of everything mapped so far, the frontier, so a piece the
# release workaround frees inside it is a gap above the big free space below the
# frontier: the highest gap that fits, which the next small mapping of any thread takes.
# Python's object arenas (1 MiB each, alive as long as one object in them is) are the
# usual taker: on the host stand-in, a freed 4 MiB piece was found as an rw-p anonymous
# mapping in /proc/self/maps while a thread was making objects; the conformance suite's
# threaded test failed that way in a fresh-clone CI run (2026-12-04); and a thread
# making 1 MiB mappings beside maps and unmaps made 43 of 1,216 maps fail
# (benchmarks/rocm_piece_takers.py). Retrying cannot help a taker that stays. So, with the
# workaround on, reservations are asked for at low addresses instead, from
# LOW_PLACEMENT_START upwards (16 TiB; on x86-64 Linux places the executable near 85 TiB
# and maps downwards from near 128 TiB), where a freed piece lies below that free space
# and is taken only once nothing above fits. ROCr grants a free requested range
# (libhsakmt maps it with MAP_FIXED_NOREPLACE; the GPU's VM range spans the 47-bit user
# space, so the range is valid for the GPU too); a range not granted is kept wherever
# the runtime put it, correct but unprotected (one refused outright is asked for again
# without an address), and a cursor past LOW_PLACEMENT_END stops asking.
LOW_PLACEMENT_START = 1 << 44
LOW_PLACEMENT_END = 1 << 46

Span = tuple[int, int]  # (address, nbytes)


class _LowPlacement:
    """Where the next reservation under the release workaround is asked for (Note
    [holes below the frontier]); one per process, shared by every backend."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cursor = LOW_PLACEMENT_START

    def claim(self, nbytes: int, alignment: int) -> int | None:
        """The next free-looking low address for `nbytes`, or None past the low region.
        The range is claimed whether or not the runtime grants it: one that is not
        granted has something in it, which the next claim steps over."""
        with self._lock:
            start = -(-self._cursor // alignment) * alignment
            if start + nbytes > LOW_PLACEMENT_END:
                return None
            self._cursor = start + nbytes
            return start


_LOW_PLACEMENT = _LowPlacement()


class _Pieces:
    """The hip reservations behind one reservation of ours, tiling it without a gap.

    `starts` is sorted and `sizes` gives each piece's length. Without the release
    workaround there is one piece, the whole range. With it, each mapping is a piece of
    its own from the moment it is made, and unmapped ranges are pieces without mappings.
    A start in `unreserved` is a piece with no hip reservation behind it: one that could
    not be reserved again at its address, or that a failed `free` already gave back.
    The next map over it tries to reserve it again.

    Changed only by a thread holding the reservation's lock (the base class's), and
    then under the backend's registry lock too, so that `describe` reads it whole."""

    __slots__ = ("sizes", "starts", "unreserved")

    def __init__(self, start: int, nbytes: int) -> None:
        self.starts = [start]
        self.sizes = {start: nbytes}
        self.unreserved: set[int] = set()

    def overlapping(self, address: int, nbytes: int) -> list[int]:
        """Starts of the pieces that overlap [address, address + nbytes), in order."""
        first = max(bisect.bisect_right(self.starts, address) - 1, 0)
        return self.starts[first : bisect.bisect_left(self.starts, address + nbytes)]

    def spans(self, starts: Iterable[int]) -> list[Span]:
        return [(start, self.sizes[start]) for start in starts]

    def replace(self, old: Sequence[int], new: Sequence[Span], unreserved: Iterable[int]) -> None:
        """Put the pieces `new` where the consecutive pieces `old` were (same extent)."""
        index = bisect.bisect_left(self.starts, old[0])
        for start in old:
            del self.sizes[start]
            self.unreserved.discard(start)
        self.starts[index : index + len(old)] = sorted(start for start, _ in new)
        self.sizes.update(new)
        self.unreserved.update(unreserved)

    @property
    def reserved_count(self) -> int:
        return len(self.starts) - len(self.unreserved)


class RocmBackend(Backend):
    """AMD GPUs through HIP VMM (hip-python); views are `torch` tensors on `cuda:N`."""

    name = "rocm"

    def __init__(
        self,
        *,
        memory_limit: int | None = None,
        device: int | None = None,
        release_workaround: bool | None = None,
    ) -> None:
        """`device` defaults to KVCACHED_DEVICE. `release_workaround` forces the
        workaround for released memory that stays in use (one hip reservation per
        mapping, recycled at unmap) on or off; None measures whether it is needed."""
        super().__init__(memory_limit=memory_limit)
        self._ordinal = settings().device if device is None else device
        reason = rocm_unavailable_reason(self._ordinal)
        if reason is not None:
            raise BackendUnavailable(f"rocm backend: {reason}")
        self._hip = hip = bindings.load()
        self._call("hipInit", 0)
        count = int(self._call("hipGetDeviceCount"))
        if not 0 <= self._ordinal < count:
            raise InvalidArgument(
                f"HIP device {self._ordinal} does not exist; this machine has {count} "
                f"(valid: 0..{count - 1}; set KVCACHED_DEVICE)"
            )
        attribute = hip.hipDeviceAttribute_t
        if not self._call(
            "hipDeviceGetAttribute",
            attribute.hipDeviceAttributeVirtualMemoryManagementSupported,
            self._ordinal,
        ):
            raise BackendUnavailable(
                f"HIP device {self._ordinal} does not support virtual memory management"
            )
        self._integrated = bool(
            self._call(
                "hipDeviceGetAttribute", attribute.hipDeviceAttributeIntegrated, self._ordinal
            )
        )

        prop = hip.hipMemAllocationProp()
        prop.type = hip.hipMemAllocationType.hipMemAllocationTypePinned
        prop.location.type = hip.hipMemLocationType.hipMemLocationTypeDevice
        prop.location.id = self._ordinal
        if hasattr(prop, "requestedHandleTypes"):  # not exposed by 10.x; 0 there means none
            prop.requestedHandleTypes = hip.hipMemAllocationHandleType.hipMemHandleTypeNone
        self._prop = prop
        access = hip.hipMemAccessDesc()
        access.location.type = hip.hipMemLocationType.hipMemLocationTypeDevice
        access.location.id = self._ordinal
        access.flags = hip.hipMemAccessFlags.hipMemAccessFlagsProtReadWrite
        self._access = access
        with self._on_device():
            self._granularity = int(
                self._call(
                    "hipMemGetAllocationGranularity",
                    prop,
                    hip.hipMemAllocationGranularity_flags.hipMemAllocationGranularityMinimum,
                )
            )

        self._device_string: str | None = None
        # Reservations of ours by start address, for finding the one an address is in,
        # and the hip reservations behind each.
        self._registry_lock = threading.Lock()
        self._starts: list[int] = []
        self._sizes: dict[int, int] = {}
        self._pieces: dict[int, _Pieces] = {}
        # Held across every free-then-reserve-again and by every reserve of ours, so our
        # own threads never take a range in the moment it is free.
        self._va_lock = threading.Lock()
        self._release_workaround = (
            self._release_bug_present() if release_workaround is None else release_workaround
        )

    @classmethod
    def unavailable_reason(cls) -> str | None:
        try:
            ordinal = settings().device
        except Exception:  # a bad KVCACHED_* value is reported where settings are used
            ordinal = 0
        reason: str | None = rocm_unavailable_reason(ordinal)
        return reason

    # ---------------------------------------------------------------- helpers
    def _call(self, api: str, *args: Any) -> Any:
        """Call hip-python's `api`; unpack its (hipError_t, values...) or raise typed."""
        try:
            err, *values = getattr(self._hip, api)(*args)
        except RuntimeError as exc:  # hip-python could not dlopen the runtime or dlsym `api`
            raise DriverError(api, -1, "hip-python loader error", str(exc)) from exc
        if err:  # hipError_t is an IntEnum in every hip-python release; hipSuccess is 0
            self._raise(err, api)
        if not values:
            return None
        return values[0] if len(values) == 1 else tuple(values)

    def _raise(self, err: Any, api: str) -> None:
        code = int(err)
        if code == HIP_ERROR_OUT_OF_MEMORY:
            raise OutOfMemory(f"{api}: HIP device {self._ordinal} is out of memory")
        raise DriverError(api, code, getattr(err, "name", f"hipError {code}"))

    @contextlib.contextmanager
    def _on_device(self) -> Iterator[None]:
        """Run with this backend's device current, restoring the thread's own after."""
        previous = int(self._call("hipGetDevice"))
        if previous == self._ordinal:
            yield
            return
        self._call("hipSetDevice", self._ordinal)
        try:
            yield
        finally:
            self._hip.hipSetDevice(previous)

    def _register(self, start: int, nbytes: int) -> None:
        with self._registry_lock:
            bisect.insort(self._starts, start)
            self._sizes[start] = nbytes
            self._pieces[start] = _Pieces(start, nbytes)

    def _unregister(self, start: int) -> None:
        with self._registry_lock:
            index = bisect.bisect_left(self._starts, start)
            if index < len(self._starts) and self._starts[index] == start:
                del self._starts[index]
            self._sizes.pop(start, None)
            self._pieces.pop(start, None)

    def _start_of(self, address: int) -> int | None:
        """Start of the reservation holding `address`, None if none does."""
        with self._registry_lock:
            index = bisect.bisect_right(self._starts, address) - 1
            if index < 0:
                return None
            start = self._starts[index]
            return start if address < start + self._sizes[start] else None

    def _pieces_of(self, address: int) -> _Pieces | None:
        """The hip reservations behind the reservation holding `address`."""
        start = self._start_of(address)
        if start is None:
            return None
        with self._registry_lock:
            return self._pieces.get(start)

    def _reservation_at(self, start: int) -> Reservation | None:
        with self._state_lock:
            for reservation in self._reservations:
                if reservation.address == start and not reservation.closed:
                    return reservation
        return None

    # ------------------------------------------------------------ device facts
    @property
    def granularity(self) -> int:
        return self._granularity

    @property
    def device(self) -> str:
        if self._device_string is None:
            host = self._integrated and not _torch_is_rocm()
            self._device_string = "cpu" if host else f"cuda:{self._ordinal}"
        return self._device_string

    def mem_info(self) -> tuple[int, int]:
        with self._on_device():
            free, total = self._call("hipMemGetInfo")
        return int(free), int(total)

    def synchronize(self) -> None:
        with self._on_device():
            self._call("hipDeviceSynchronize")

    def describe(self) -> dict[str, Any]:
        info = super().describe()
        info["device_name"] = bindings.text(self._call("hipDeviceGetName", 256, self._ordinal))
        info["integrated"] = self._integrated
        info["release_workaround"] = self._release_workaround
        with self._registry_lock:
            info["hip_reservations"] = sum(p.reserved_count for p in self._pieces.values())
        info["versions"] = {
            "hip_runtime": _hip_version(int(self._call("hipRuntimeGetVersion"))),
            "hip_driver": _hip_version(int(self._call("hipDriverGetVersion"))),
            "hip-python": bindings.version(),
            "libamdhip64": bindings.library_path(),
        }
        return info

    # ------------------------------------------------------------ primitives
    def _reserve(self, nbytes: int) -> int:
        with self._va_lock:
            # Note [holes below the frontier]: only the workaround frees pieces inside
            hint = None
            if self._release_workaround:
                hint = _LOW_PLACEMENT.claim(nbytes, self._granularity)
            try:
                pointer = self._call("hipMemAddressReserve", nbytes, self._granularity, hint, 0)
            except KVCachedError:
                if hint is None:
                    raise
                # a runtime that refuses the address instead of placing the range
                # elsewhere: unasked, as without the workaround
                pointer = self._call("hipMemAddressReserve", nbytes, self._granularity, None, 0)
        start: int = bindings.address(pointer)
        self._register(start, nbytes)
        return start

    def _free(self, address: int, nbytes: int) -> None:
        with self._registry_lock:
            pieces = self._pieces.get(address) if self._sizes.get(address) == nbytes else None
        if pieces is None:  # not a reservation of ours: the driver says what is wrong
            self._call("hipMemAddressFree", address, nbytes)
            self._unregister(address)
            return
        for start, size in pieces.spans(list(pieces.starts)):
            if start in pieces.unreserved:
                continue
            self._call("hipMemAddressFree", start, size)
            with self._registry_lock:  # given back: a retry of a failed free skips it
                pieces.unreserved.add(start)
        self._unregister(address)

    def _create(self, nbytes: int) -> Any:
        with self._on_device():
            return self._call("hipMemCreate", nbytes, self._prop, 0)

    def _release(self, handle: Any, nbytes: int) -> None:
        self._call("hipMemRelease", handle)

    def _map_batch(self, items: Sequence[tuple[int, Page]]) -> None:
        if self._release_workaround:
            for address, page in items:
                self._carve(address, page.nbytes)
        done: list[tuple[int, Page]] = []
        try:
            for address, page in items:
                self._call("hipMemMap", address, page.nbytes, 0, page.handle, 0)
                done.append((address, page))
            for address, page in items:
                self._grant_access(address, page.nbytes, done)
        except BaseException:
            self._undo_maps(done)
            raise

    def _map_one(self, address: int, page: Page) -> None:
        """The per-page path of a growing cache: `_map_batch` of one page, without the
        batch's bookkeeping around the two driver calls."""
        if self._release_workaround:
            self._carve(address, page.nbytes)
        try:
            (err,) = self._hip.hipMemMap(address, page.nbytes, 0, page.handle, 0)
        except RuntimeError as exc:
            raise DriverError("hipMemMap", -1, "hip-python loader error", str(exc)) from exc
        if err:
            self._raise(err, "hipMemMap")
        mapped = ((address, page),)
        try:
            self._grant_access(address, page.nbytes, mapped)
        except BaseException:
            self._undo_maps(mapped)
            raise

    def _unmap_one(self, address: int, nbytes: int) -> None:
        try:
            (err,) = self._hip.hipMemUnmap(address, nbytes)
        except RuntimeError as exc:
            raise DriverError("hipMemUnmap", -1, "hip-python loader error", str(exc)) from exc
        if err:
            self._raise(err, "hipMemUnmap")
        if self._release_workaround:
            self._recycle(address, nbytes)

    def _unmap_batch(self, ranges: Sequence[tuple[int, int]]) -> None:
        self._unmap_each(ranges)
        if self._release_workaround:
            for address, nbytes in ranges:
                self._recycle(address, nbytes)

    def _unmap_each(self, ranges: Sequence[tuple[int, int]]) -> None:
        """One hipMemUnmap per mapping, never several at once (ROCR-Runtime#285); on a
        failure the ones already unmapped are mapped back, to match the bookkeeping."""
        done: list[tuple[int, int]] = []
        for address, nbytes in ranges:
            try:
                self._call("hipMemUnmap", address, nbytes)
            except BaseException:
                self._remap_quietly(done)
                raise
            done.append((address, nbytes))

    def _view(self, address: int, nbytes: int, shape: tuple[int, ...], dtype: Any) -> Any:
        if self.device == "cpu":
            return host_tensor(address, nbytes, shape, dtype)
        return device_tensor(address, nbytes, shape, dtype, self.device)

    # --------------------------------------------------------- access (bug b)
    def _grant_access(self, address: int, nbytes: int, batch: Sequence[tuple[int, Page]]) -> None:
        """Read-write access for one mapping, retried over the reservation's mapped
        prefix when the runtime's coverage check rejects the exact range."""
        err = self._set_access(address, nbytes)
        if not err:
            return
        if int(err) == HIP_ERROR_INVALID_VALUE:
            prefix = self._mapped_prefix(address, nbytes, batch)
            if prefix is not None and int(self._set_access(*prefix)) == HIP_SUCCESS:
                return
        self._raise(err, "hipMemSetAccess")

    def _set_access(self, address: int, nbytes: int) -> Any:
        """hipMemSetAccess's hipError_t, unraised (one descriptor: this device, RW)."""
        try:
            (err,) = self._hip.hipMemSetAccess(address, nbytes, self._access, 1)
        except RuntimeError as exc:
            raise DriverError("hipMemSetAccess", -1, "hip-python loader error", str(exc)) from exc
        return err

    def _mapped_prefix(
        self, address: int, nbytes: int, batch: Sequence[tuple[int, Page]]
    ) -> tuple[int, int] | None:
        """(start, length) from the reservation's lowest mapping through the one at
        `address`, when the mappings in between leave no hole and it is more than that
        one mapping; else None (nothing else worth trying). Always None when each
        mapping has a hip reservation of its own: a longer range would cross into other
        hip reservations, which HIP rejects whatever its coverage check."""
        if self._release_workaround:
            return None
        start = self._start_of(address)
        reservation = self._reservation_at(start) if start is not None else None
        if start is None or reservation is None:
            return None
        # The caller holds the reservation's lock; this batch is not in _mappings yet.
        spans = {start + offset: page.nbytes for offset, page in reservation._mappings.items()}
        spans.update((a, page.nbytes) for a, page in batch)
        ordered = sorted(spans.items())
        cursor = ordered[0][0]
        for begin, length in ordered:
            if begin != cursor:
                return None
            cursor = begin + length
            if begin == address:
                first = ordered[0][0]
                return None if first == address else (first, cursor - first)
        return None

    # ------------------------------------------------------- release (bug a)
    @property
    def release_workaround(self) -> bool:
        """Whether each mapping gets a hip reservation of its own that is freed and
        reserved again at unmap, so released memory is returned (module docstring)."""
        return self._release_workaround

    def _carve(self, address: int, nbytes: int) -> None:
        """Make [address, address + nbytes) a hip reservation of its own, so that a
        mapping there can later be freed without touching any other mapping.

        The range lies in pieces without mappings (the base class refuses overlaps); they
        are freed and reserved again at the same addresses as the range itself and what
        is left of them on either side. If the runtime does not grant an address, what
        was reserved is given back, the old pieces are reserved again, and DriverError
        is raised. The caller holds the reservation's lock."""
        pieces = self._pieces_of(address)
        if pieces is None:
            return  # not in a reservation of ours; hipMemMap reports it
        end = address + nbytes
        old = pieces.overlapping(address, nbytes)
        if not old:
            return
        first, last = old[0], old[-1]
        last_end = last + pieces.sizes[last]
        if old == [address] and last_end == end and address not in pieces.unreserved:
            return  # already its own piece (it was mapped here before)
        new: list[Span] = [(address, nbytes)]
        if first < address:
            new.append((first, address - first))
        if end < last_end:
            new.append((end, last_end - end))
        # Largest first. ROCr grants any free requested range, whatever the order. The
        # CUDA driver (under the CUDA-forwarding stand-in) grants fewer: on an H200 a
        # 2 MiB range at the end of a freed large range was granted only once the rest
        # had been reserved again first (docs/backends/rocm.md).
        new.sort(key=lambda span: -span[1])
        before = pieces.spans(old)
        with self._va_lock:
            freed: list[Span] = []
            try:
                for start, size in before:
                    if start not in pieces.unreserved:
                        self._call("hipMemAddressFree", start, size)
                        freed.append((start, size))
            except BaseException:  # put back what was freed; nothing was mapped
                made, _ = self._reserve_at(freed, keep_going=True)
                with self._registry_lock:
                    pieces.unreserved.update(span[0] for span in freed if span not in made)
                raise
            made, failure = self._reserve_at(new)
            if failure is None:
                with self._registry_lock:
                    pieces.replace(old, new, ())
                return
            self._free_quietly(made)
            made, _ = self._reserve_at(before, keep_going=True)
            missing = [span for span in before if span not in made]
            with self._registry_lock:
                pieces.replace(old, before, (start for start, _ in missing))
        detail = (
            f"could not give the mapping at [{address:#x}, {end:#x}) a hip reservation of "
            f"its own: {failure}. Nothing was mapped; "
        )
        if missing:
            lost = ", ".join(f"[{s:#x}, {s + n:#x})" for s, n in missing)
            detail += (
                f"these parts of the reservation could not be reserved again and cannot "
                f"be mapped until a later map there succeeds: {lost}"
            )
        else:
            detail += "the reservation is as it was before."
        raise DriverError("hipMemAddressReserve", -1, "requested address not granted", detail)

    def _recycle(self, address: int, nbytes: int) -> None:
        """After the mapping at `address` was unmapped: free its hip reservation and
        reserve it again at the same address, which makes the runtime let go of the
        memory it holds for the unmapped handle. The unmap has happened whatever
        goes wrong here, so failures are warnings, never errors. The caller holds the
        reservation's lock."""
        pieces = self._pieces_of(address)
        if pieces is None or pieces.sizes.get(address) != nbytes or address in pieces.unreserved:
            return  # not a piece of its own: cannot happen while the workaround is on
        span = (address, nbytes)
        with self._va_lock:
            try:
                self._call("hipMemAddressFree", address, nbytes)
            except KVCachedError as exc:
                warnings.warn(
                    f"could not free the hip reservation at {address:#x} after its unmap "
                    f"({exc}); released memory mapped there stays in use until the "
                    "reservation is freed",
                    RuntimeWarning,
                    stacklevel=4,
                )
                return
            _, failure = self._reserve_at([span])
            if failure is None:
                return
            with self._registry_lock:
                pieces.unreserved.add(address)
        warnings.warn(
            f"the memory unmapped at {address:#x} was returned, but the range "
            f"[{address:#x}, {address + nbytes:#x}) could not be reserved again ({failure}); "
            "a later map there reserves it again or fails with DriverError",
            RuntimeWarning,
            stacklevel=4,
        )

    def _reserve_at(
        self, spans: Sequence[Span], *, keep_going: bool = False
    ) -> tuple[list[Span], str | None]:
        """Reserve each (address, nbytes) at exactly that address. Returns the spans
        reserved and, on the first failure, why (what was got elsewhere is given back);
        with `keep_going`, tries every span and reports the first failure. The caller
        holds the VA lock."""
        made: list[Span] = []
        failure: str | None = None
        for start, size in spans:
            problem = self._reserve_exactly(start, size)
            if problem is None:
                made.append((start, size))
                continue
            failure = failure or problem
            if not keep_going:
                break
        return made, failure

    def _reserve_exactly(self, start: int, size: int) -> str | None:
        """Reserve [start, start + size) there, or say why not. See Note [a range taken
        for a moment]: a range granted elsewhere is given back and asked for again, up
        to `ADDRESS_ATTEMPTS` times over about 0.5 s, before the miss counts."""
        missed = ""
        for attempt in range(ADDRESS_ATTEMPTS):
            if attempt:
                time.sleep(ADDRESS_RETRY_S * (1 << (attempt - 1)))
            try:
                pointer = self._call("hipMemAddressReserve", size, self._granularity, start, 0)
            except KVCachedError as exc:
                return f"asked for [{start:#x}, {start + size:#x}): {exc}"
            got = bindings.address(pointer)
            if got == start:
                return None
            self._free_quietly([(got, size)])
            missed = missed or f"{got:#x}"
        return (
            f"asked for [{start:#x}, {start + size:#x}) and was given {missed} "
            f"(the range was taken meanwhile; {ADDRESS_ATTEMPTS} tries)"
        )

    def _free_quietly(self, spans: Sequence[Span]) -> None:
        for start, size in spans:
            with contextlib.suppress(Exception):
                self._call("hipMemAddressFree", start, size)

    # ------------------------------------------------------------- rollback
    def _undo_maps(self, mapped: Sequence[tuple[int, Page]]) -> None:
        """Unmap what a failing map call mapped; with the release workaround, recycle
        those ranges too, or the pages' memory would stay held after their release."""
        for address, page in mapped:
            try:
                self._call("hipMemUnmap", address, page.nbytes)
            except Exception:
                continue
            if self._release_workaround:
                self._recycle(address, page.nbytes)

    def _remap_quietly(self, ranges: Sequence[tuple[int, int]]) -> None:
        for address, _ in ranges:
            start = self._start_of(address)
            reservation = self._reservation_at(start) if start is not None else None
            page = reservation._mappings.get(address - reservation.address) if reservation else None
            if page is None:
                continue
            with contextlib.suppress(Exception):
                self._call("hipMemMap", address, page.nbytes, 0, page.handle, 0)
                self._grant_access(address, page.nbytes, ())

    # ------------------------------------------------------------ the probe
    def _release_bug_present(self) -> bool:
        """Whether memory released under a live reservation stays in use: create, map,
        unmap and release a probe allocation, then compare free memory before and after
        freeing its reservation. Undecidable (too little free memory) counts as yes."""
        g = self._granularity
        free_before, _ = self.mem_info()
        size = min(RELEASE_PROBE_GRANULES * g, free_before // 4 // g * g)
        if size < 4 * g:
            return True
        with self._on_device():
            start = bindings.address(self._call("hipMemAddressReserve", size, g, None, 0))
            try:
                try:
                    handle = self._call("hipMemCreate", size, self._prop, 0)
                except OutOfMemory:
                    return True
                try:
                    self._call("hipMemMap", start, size, 0, handle, 0)
                    try:
                        self._call("hipMemSetAccess", start, size, self._access, 1)
                    finally:
                        self._call("hipMemUnmap", start, size)
                finally:
                    self._call("hipMemRelease", handle)
                free_released, _ = self.mem_info()
            finally:
                self._call("hipMemAddressFree", start, size)
        free_after, _ = self.mem_info()
        tolerance = size // 2
        return free_before - free_released > tolerance and free_after - free_released > tolerance


def _hip_version(encoded: int) -> str:
    """HIP encodes versions as major * 10**7 + minor * 10**5 + patch."""
    return f"{encoded // 10_000_000}.{encoded // 100_000 % 100}.{encoded % 100_000}"


def _torch_is_rocm() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return getattr(torch.version, "hip", None) is not None
