"""The CUDA backend's per-page driver calls (`_map_one`, `_unmap_one`) without a device.

They come in two forms: closures over cuda.bindings' three driver functions
(`_bind_per_page_calls`), and the C module `_vmm_calls` calling the driver's entry points
directly (`_bind_compiled_calls`). The GPU machine is the only place either meets a real
driver; their error paths (the retry once a context is current, the undoing of a map
whose access grant failed) are checked here against a scripted driver that answers each
call with the result it is told to, and the C calls against C-callable stand-ins
(ctypes callbacks) that read what the module passes, the access descriptor included.
"""

from __future__ import annotations

import ctypes
import enum
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from kvcached.backend import Backend, Page
from kvcached.backends.cuda.backend import CudaBackend, _ThreadState
from kvcached.errors import DriverError, OutOfMemory

MiB = 1 << 20


class Result(enum.IntEnum):  # the CUresult members the backend compares against
    CUDA_SUCCESS = 0
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_INVALID_CONTEXT = 201


class Recorder:
    """Records every call by name; the scripted ones answer with the next result queued
    for them (success, 0, once their queue is empty)."""

    def __init__(self, *scripted: str) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.queued: dict[str, list[int]] = {name: [] for name in scripted}

    def _next(self, name: str, args: tuple[Any, ...]) -> int:
        self.calls.append((name, args))
        queue = self.queued[name]
        return queue.pop(0) if queue else Result.CUDA_SUCCESS

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


class ScriptedDriver(Recorder):
    """cuda.bindings' driver module as the backend uses it: `cuMemMap`, `cuMemSetAccess`
    and `cuMemUnmap` are scripted and answer a (CUresult,) tuple."""

    CUresult = Result
    CUmemLocationType = SimpleNamespace(CU_MEM_LOCATION_TYPE_DEVICE=1)
    CUmemAccess_flags = SimpleNamespace(CU_MEM_ACCESS_FLAGS_PROT_READWRITE=3)

    def __init__(self) -> None:
        super().__init__("cuMemMap", "cuMemSetAccess", "cuMemUnmap")

    def cuMemMap(self, *args: Any) -> tuple[Result]:
        return (Result(self._next("cuMemMap", args)),)

    def cuMemSetAccess(self, *args: Any) -> tuple[Result]:
        return (Result(self._next("cuMemSetAccess", args)),)

    def cuMemUnmap(self, *args: Any) -> tuple[Result]:
        return (Result(self._next("cuMemUnmap", args)),)

    def cuCtxSetCurrent(self, context: Any) -> tuple[Result]:
        self.calls.append(("cuCtxSetCurrent", (context,)))
        return (Result.CUDA_SUCCESS,)

    def cuGetErrorName(self, err: Result) -> tuple[Result, bytes]:
        return Result.CUDA_SUCCESS, err.name.encode()


@pytest.fixture
def scripted() -> Iterator[tuple[CudaBackend, ScriptedDriver]]:
    driver = ScriptedDriver()
    backend = CudaBackend.__new__(CudaBackend)
    Backend.__init__(backend)
    backend._driver = driver
    backend._granularity = 2 * MiB
    backend._ordinal = 0
    backend._context = "context"
    backend._thread = _ThreadState()
    backend._access = ["access"]
    backend._success = Result.CUDA_SUCCESS
    backend._no_context = Result.CUDA_ERROR_INVALID_CONTEXT
    backend._bind_per_page_calls(driver.cuMemMap, driver.cuMemSetAccess, driver.cuMemUnmap)
    yield backend, driver
    backend._context = None  # nothing to release: there is no device


def test_a_map_maps_then_grants_access_to_the_same_range(scripted):
    backend, driver = scripted
    page = Page(backend, "handle", 4 * MiB)
    backend._map_one(1 << 40, page)
    assert driver.calls == [
        ("cuMemMap", (1 << 40, 4 * MiB, 0, "handle", 0)),
        ("cuMemSetAccess", (1 << 40, 4 * MiB, ["access"], 1)),
    ]


def test_a_map_without_a_current_context_makes_it_current_and_retries_once(scripted):
    backend, driver = scripted
    driver.queued["cuMemMap"] = [Result.CUDA_ERROR_INVALID_CONTEXT]
    driver.queued["cuMemSetAccess"] = [Result.CUDA_ERROR_INVALID_CONTEXT]
    backend._map_one(1 << 40, Page(backend, "handle", 2 * MiB))
    assert driver.names() == [
        "cuMemMap", "cuCtxSetCurrent", "cuMemMap", "cuMemSetAccess", "cuMemSetAccess",
    ]  # fmt: skip
    assert backend._thread.current  # made current once, for the thread


def test_a_refused_access_grant_unmaps_the_page_and_names_the_call(scripted):
    backend, driver = scripted
    driver.queued["cuMemSetAccess"] = [Result.CUDA_ERROR_INVALID_VALUE]
    with pytest.raises(DriverError, match="cuMemSetAccess failed: CUDA_ERROR_INVALID_VALUE"):
        backend._map_one(1 << 40, Page(backend, "handle", 2 * MiB))
    assert driver.names() == ["cuMemMap", "cuMemSetAccess", "cuMemUnmap"]
    assert driver.calls[-1] == ("cuMemUnmap", (1 << 40, 2 * MiB))


def test_a_map_the_device_cannot_back_is_out_of_memory(scripted):
    backend, driver = scripted
    driver.queued["cuMemMap"] = [Result.CUDA_ERROR_OUT_OF_MEMORY]
    with pytest.raises(OutOfMemory, match="cuMemMap"):
        backend._map_one(1 << 40, Page(backend, "handle", 2 * MiB))
    assert driver.names() == ["cuMemMap"]  # no retry, no access grant


def test_an_unmap_retries_once_current_and_names_a_failure(scripted):
    backend, driver = scripted
    driver.queued["cuMemUnmap"] = [Result.CUDA_ERROR_INVALID_CONTEXT]
    backend._unmap_one(1 << 40, 2 * MiB)
    assert driver.names() == ["cuMemUnmap", "cuCtxSetCurrent", "cuMemUnmap"]
    driver.queued["cuMemUnmap"] = [Result.CUDA_ERROR_INVALID_VALUE]
    with pytest.raises(DriverError, match="cuMemUnmap failed"):
        backend._unmap_one(1 << 40, 2 * MiB)


def test_a_failed_map_through_the_public_api_leaves_nothing_mapped(scripted):
    backend, driver = scripted
    from kvcached.backend import Reservation

    reservation = Reservation(backend, 1 << 40, 8 * MiB)
    page = Page(backend, "handle", 2 * MiB)
    driver.queued["cuMemSetAccess"] = [Result.CUDA_ERROR_INVALID_VALUE]
    with pytest.raises(DriverError):
        backend.map(reservation, 2 * MiB, page)
    assert page.mapped_count == 0 and not reservation.is_mapped(2 * MiB, 2 * MiB)
    backend.map(reservation, 2 * MiB, page)  # the same offset maps once the driver agrees
    assert page.mapped_count == 1 and reservation.is_mapped(2 * MiB, 2 * MiB)
    backend.unmap(reservation, 2 * MiB, 2 * MiB)
    assert page.mapped_count == 0
    assert driver.names()[-3:] == ["cuMemMap", "cuMemSetAccess", "cuMemUnmap"]


# ------------------------------------------------------------ the compiled calls

# Imported outright, not skipped when missing: `make test` installs kvcached with a C
# compiler at hand, so a module that did not build is a failure here
from kvcached.backends.cuda import _vmm_calls as vmm_calls  # noqa: E402


class Location(ctypes.Structure):  # CUmemLocation
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", Location), ("flags", ctypes.c_int)]


MapFn = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_ulonglong, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_ulonglong,
    ctypes.c_ulonglong,
)  # fmt: skip
SetAccessFn = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_ulonglong, ctypes.c_size_t, ctypes.POINTER(AccessDesc), ctypes.c_size_t
)
UnmapFn = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_ulonglong, ctypes.c_size_t)


class StandInEntryPoints(Recorder):
    """C-callable stand-ins for cuMemMap, cuMemSetAccess and cuMemUnmap: each records
    its arguments as the C module passed them and answers with the next queued result."""

    def __init__(self) -> None:
        super().__init__("map", "set_access", "unmap")
        # kept on self: a ctypes callback must outlive every call made through it
        self._functions = (
            MapFn(self._map), SetAccessFn(self._set_access), UnmapFn(self._unmap)
        )  # fmt: skip

    def _map(self, address: int, size: int, offset: int, handle: int, flags: int) -> int:
        return self._next("map", (address, size, offset, handle, flags))

    def _set_access(self, address: int, size: int, desc: Any, count: int) -> int:
        d = desc[0]
        return self._next(
            "set_access", (address, size, (d.location.type, d.location.id, d.flags), count)
        )

    def _unmap(self, address: int, size: int) -> int:
        return self._next("unmap", (address, size))

    @property
    def addresses(self) -> tuple[int, int, int]:
        a, b, c = (ctypes.cast(f, ctypes.c_void_p).value or 0 for f in self._functions)
        return a, b, c


class Handle:
    """Like cuda.bindings' CUmemGenericAllocationHandle: an object that int() converts."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __int__(self) -> int:
        return self.value


@pytest.fixture
def compiled(
    scripted: tuple[CudaBackend, ScriptedDriver],
) -> tuple[CudaBackend, ScriptedDriver, StandInEntryPoints]:
    backend, driver = scripted
    entry = StandInEntryPoints()
    assert backend._bind_compiled_calls(entry.addresses) == "compiled"
    return backend, driver, entry


def test_compiled_calls_pass_the_page_and_the_access_descriptor_through(compiled):
    backend, driver, entry = compiled
    backend._map_one(1 << 40, Page(backend, Handle(0xABCD), 4 * MiB))
    backend._unmap_one(1 << 40, 4 * MiB)
    backend._map_one(3 << 40, Page(backend, 77, 2 * MiB))  # a plain int handle too
    assert entry.calls == [
        ("map", (1 << 40, 4 * MiB, 0, 0xABCD, 0)),
        ("set_access", (1 << 40, 4 * MiB, (1, 0, 3), 1)),  # device 0, read-write
        ("unmap", (1 << 40, 4 * MiB)),
        ("map", (3 << 40, 2 * MiB, 0, 77, 0)),
        ("set_access", (3 << 40, 2 * MiB, (1, 0, 3), 1)),
    ]
    assert driver.calls == []  # nothing went through cuda.bindings


def test_a_compiled_map_the_device_cannot_back_is_out_of_memory(compiled):
    backend, driver, entry = compiled
    entry.queued["map"] = [Result.CUDA_ERROR_OUT_OF_MEMORY]
    with pytest.raises(OutOfMemory, match="cuMemMap"):
        backend._map_one(1 << 40, Page(backend, Handle(5), 2 * MiB))
    assert entry.names() == ["map"] and driver.calls == []  # no grant, no retry


def test_a_compiled_refused_access_grant_is_undone_before_the_error(compiled):
    backend, _driver, entry = compiled
    entry.queued["set_access"] = [Result.CUDA_ERROR_INVALID_VALUE]
    with pytest.raises(DriverError, match="cuMemSetAccess failed: CUDA_ERROR_INVALID_VALUE"):
        backend._map_one(1 << 40, Page(backend, Handle(5), 2 * MiB))
    assert entry.calls[1:] == [
        ("set_access", (1 << 40, 2 * MiB, (1, 0, 3), 1)),
        ("unmap", (1 << 40, 2 * MiB)),
    ]


def test_compiled_calls_without_a_current_context_retry_once_through_the_bindings(compiled):
    backend, driver, entry = compiled
    entry.queued["map"] = [Result.CUDA_ERROR_INVALID_CONTEXT]
    page = Page(backend, Handle(5), 2 * MiB)
    backend._map_one(1 << 40, page)
    assert entry.names() == ["map"]
    assert driver.calls == [
        ("cuCtxSetCurrent", ("context",)),
        ("cuMemMap", (1 << 40, 2 * MiB, 0, page.handle, 0)),
        ("cuMemSetAccess", (1 << 40, 2 * MiB, ["access"], 1)),
    ]
    entry.queued["unmap"] = [Result.CUDA_ERROR_INVALID_CONTEXT]
    backend._unmap_one(1 << 40, 2 * MiB)
    assert driver.names()[-1] == "cuMemUnmap"  # current already: no second cuCtxSetCurrent
    entry.queued["unmap"] = [Result.CUDA_ERROR_INVALID_VALUE]
    with pytest.raises(DriverError, match="cuMemUnmap failed"):
        backend._unmap_one(1 << 40, 2 * MiB)


def test_a_result_code_cuda_bindings_does_not_know_is_still_a_driver_error(compiled):
    backend, _driver, entry = compiled
    backend._driver.cuGetErrorName = lambda err: (Result.CUDA_ERROR_INVALID_VALUE, b"")
    entry.queued["map"] = [999]
    with pytest.raises(DriverError, match="999"):
        backend._map_one(1 << 40, Page(backend, Handle(5), 2 * MiB))


def test_the_public_api_keeps_its_books_through_the_compiled_calls(compiled):
    from kvcached.backend import Reservation

    backend, driver, entry = compiled
    reservation = Reservation(backend, 1 << 40, 8 * MiB)
    page = Page(backend, Handle(9), 2 * MiB)
    entry.queued["set_access"] = [Result.CUDA_ERROR_INVALID_VALUE]
    with pytest.raises(DriverError):
        backend.map(reservation, 2 * MiB, page)
    assert page.mapped_count == 0 and not reservation.is_mapped(2 * MiB, 2 * MiB)
    backend.map(reservation, 2 * MiB, page)
    assert page.mapped_count == 1 and reservation.is_mapped(2 * MiB, 2 * MiB)
    backend.unmap(reservation, 2 * MiB, 2 * MiB)
    assert page.mapped_count == 0
    assert entry.calls[-3:] == [
        ("map", ((1 << 40) + 2 * MiB, 2 * MiB, 0, 9, 0)),
        ("set_access", ((1 << 40) + 2 * MiB, 2 * MiB, (1, 0, 3), 1)),
        ("unmap", ((1 << 40) + 2 * MiB, 2 * MiB)),
    ]
    assert driver.calls == []


def test_no_driver_library_keeps_the_bindings_and_says_why(scripted):
    backend, _driver = scripted
    before = backend._map_one
    assert backend._bind_compiled_calls("libcuda.so.1 is not loaded in this process") == (
        "cuda.bindings (libcuda.so.1 is not loaded in this process)"
    )
    assert backend._map_one is before
    from kvcached.backends.cuda.compiled import loaded_driver_entry_points

    # this machine has no NVIDIA driver: the lookup must say so, never load one
    assert "libcuda.so.1 is not loaded" in str(loaded_driver_entry_points())


def test_vmm_calls_refuses_what_it_cannot_call():
    entry = StandInEntryPoints()
    a, b, c = entry.addresses
    with pytest.raises(ValueError, match="set_access: a function address is needed"):
        vmm_calls.VmmCalls(a, 0, c, 1, 0, 3, print)
    with pytest.raises(TypeError, match="on_error must be callable"):
        vmm_calls.VmmCalls(a, b, c, 1, 0, 3, None)
    calls = vmm_calls.VmmCalls(a, b, c, 1, 2, 3, print)
    assert calls.access == (1, 2, 3)
    with pytest.raises(TypeError, match="takes 2 arguments"):
        calls.map(1 << 40)
    with pytest.raises(OverflowError):
        calls.unmap(-1, 2 * MiB)
    with pytest.raises(AttributeError):
        calls.map(1 << 40, object())  # not a page: no nbytes
    with pytest.raises(TypeError):
        calls.map(1 << 40, SimpleNamespace(nbytes=2 * MiB, handle="not a number"))
    assert entry.calls == []  # nothing reached the driver


def test_the_driver_runs_without_the_gil():
    """A thread keeps running Python while the C module waits in a slow driver call.

    The stand-in is libc's usleep, which takes the map's first argument (the address,
    read as microseconds) and returns 0: a real C function that holds no GIL."""
    libc = ctypes.CDLL(None)
    sleep = ctypes.cast(libc.usleep, ctypes.c_void_p).value
    calls = vmm_calls.VmmCalls(sleep, sleep, sleep, 1, 0, 3, print)
    ticks = 0
    stop = threading.Event()

    def count() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1

    thread = threading.Thread(target=count)
    thread.start()
    time.sleep(0.05)
    before = ticks
    started = time.perf_counter()
    calls.unmap(300_000, 2 * MiB)  # usleep(300 ms)
    waited = time.perf_counter() - started
    during = ticks - before
    stop.set()
    thread.join()
    assert waited >= 0.29  # the call really waited in C
    # with the GIL held, the counter would have stood still for the whole 300 ms
    assert during > 10_000, during
