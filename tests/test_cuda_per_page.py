"""The CUDA backend's per-page driver calls (`_map_one`, `_unmap_one`) without a device.

They are closures over the three driver functions (`_bind_per_page_calls`), so the GPU
machine is the only place they meet a real driver; their error paths (the retry once a
context is current, the undoing of a map whose access grant failed) are checked here
against a scripted driver that answers each call with the result it is told to.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
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


class ScriptedDriver:
    """Records every call; `cuMemMap`, `cuMemSetAccess` and `cuMemUnmap` answer with the
    next result queued for them (success once their queue is empty)."""

    CUresult = Result

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.queued: dict[str, list[Result]] = {
            "cuMemMap": [],
            "cuMemSetAccess": [],
            "cuMemUnmap": [],
        }

    def _answer(self, name: str, args: tuple[Any, ...]) -> tuple[Result]:
        self.calls.append((name, args))
        queue = self.queued[name]
        return (queue.pop(0) if queue else Result.CUDA_SUCCESS,)

    def cuMemMap(self, *args: Any) -> tuple[Result]:
        return self._answer("cuMemMap", args)

    def cuMemSetAccess(self, *args: Any) -> tuple[Result]:
        return self._answer("cuMemSetAccess", args)

    def cuMemUnmap(self, *args: Any) -> tuple[Result]:
        return self._answer("cuMemUnmap", args)

    def cuCtxSetCurrent(self, context: Any) -> tuple[Result]:
        self.calls.append(("cuCtxSetCurrent", (context,)))
        return (Result.CUDA_SUCCESS,)

    def cuGetErrorName(self, err: Result) -> tuple[Result, bytes]:
        return Result.CUDA_SUCCESS, err.name.encode()

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


@pytest.fixture
def scripted() -> Iterator[tuple[CudaBackend, ScriptedDriver]]:
    driver = ScriptedDriver()
    backend = CudaBackend.__new__(CudaBackend)
    Backend.__init__(backend)
    backend._driver = driver
    backend._granularity = 2 * MiB
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
