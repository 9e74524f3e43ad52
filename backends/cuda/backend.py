"""The CUDA backend: the driver's virtual memory management API via `cuda.bindings.driver`.

The four VMM steps map one to one: `cuMemAddressReserve` (address space only),
`cuMemCreate` (physical memory, a "generic allocation handle"), `cuMemMap` followed by
`cuMemSetAccess` (nothing can touch a mapping until access is granted), and the
reverse `cuMemUnmap`, `cuMemRelease`, `cuMemAddressFree`.

Costs that shape this file (measured on an H200, see docs/): the driver's price is per
handle, not per byte. `cuMemSetAccess` is the dominant call, so a batch grants access
once per contiguous run of freshly mapped pages instead of once per page, and unmaps
coalesce contiguous mappings into one `cuMemUnmap`. `cuMemMap` of a handle at a
non-zero offset is unsupported, so a page is always mapped whole.

Contexts: we use the device's *primary* context, the one torch and every runtime-API
library share, retained when the backend is created and made current lazily in each
thread that calls the driver (threads start with no current context). Detection
(`unavailable_reason`) goes through NVML instead of the driver: `cuInit` in a parent
process breaks CUDA in every child it forks afterwards, and engines fork workers after
importing us.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from kvcached.backend import Backend, Page
from kvcached.backends.cuda.compiled import (
    compiled_calls,
    loaded_driver_entry_points,
    read_write_access,
)
from kvcached.backends.cuda.detect import cuda_unavailable_reason
from kvcached.config import settings
from kvcached.errors import BackendUnavailable, DriverError, InvalidArgument, OutOfMemory
from kvcached.views import device_tensor


class CudaBackend(Backend):
    """NVIDIA GPUs through CUDA VMM; views are `torch` tensors on `cuda:N`."""

    name = "cuda"

    def __init__(self, *, memory_limit: int | None = None, device: int | None = None) -> None:
        super().__init__(memory_limit=memory_limit)
        reason = self.unavailable_reason()
        if reason is not None:
            raise BackendUnavailable(f"cuda backend: {reason}")
        from cuda.bindings import driver

        self._driver = driver
        self._ordinal = settings().device if device is None else device
        self._check(driver.cuInit(0), "cuInit")
        count = self._check(driver.cuDeviceGetCount(), "cuDeviceGetCount")
        if not 0 <= self._ordinal < count:
            raise InvalidArgument(
                f"CUDA device {self._ordinal} does not exist; this machine has {count} "
                f"(valid: 0..{count - 1}; set KVCACHED_DEVICE)"
            )
        self._cu_device = self._check(driver.cuDeviceGet(self._ordinal), "cuDeviceGet")
        vmm = self._check(
            driver.cuDeviceGetAttribute(
                driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                self._cu_device,
            ),
            "cuDeviceGetAttribute",
        )
        if not vmm:
            raise BackendUnavailable(
                f"CUDA device {self._ordinal} does not support virtual memory management"
            )
        self._context = self._check(
            driver.cuDevicePrimaryCtxRetain(self._cu_device), "cuDevicePrimaryCtxRetain"
        )
        self._thread = _ThreadState()
        self._make_current()

        prop = driver.CUmemAllocationProp()
        prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self._ordinal
        prop.requestedHandleTypes = driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
        self._prop = prop
        self._granularity = int(
            self._check(
                driver.cuMemGetAllocationGranularity(
                    prop,
                    driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM,
                ),
                "cuMemGetAllocationGranularity",
            )
        )
        access = driver.CUmemAccessDesc()
        access.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = self._ordinal
        access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = [access]
        self._success = driver.CUresult.CUDA_SUCCESS
        self._no_context = driver.CUresult.CUDA_ERROR_INVALID_CONTEXT
        self._bind_per_page_calls(driver.cuMemMap, driver.cuMemSetAccess, driver.cuMemUnmap)
        self._per_page_calls = (
            self._bind_compiled_calls(loaded_driver_entry_points())
            if settings().compiled_calls
            else "cuda.bindings (KVCACHED_COMPILED_CALLS=0)"
        )

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return cuda_unavailable_reason()

    # ---------------------------------------------------------------- helpers
    def _check(self, result: Any, api: str) -> Any:
        """Unpack a cuda-bindings (CUresult, value...) tuple or raise a typed error."""
        err, *values = result
        if err != self._driver.CUresult.CUDA_SUCCESS:
            self._raise(err, api)
        if not values:
            return None
        return values[0] if len(values) == 1 else tuple(values)

    def _raise(self, err: Any, api: str) -> None:
        driver = self._driver
        if err == driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
            raise OutOfMemory(f"{api}: the CUDA device is out of memory")
        status, name = driver.cuGetErrorName(err)
        text = name.decode() if status == driver.CUresult.CUDA_SUCCESS else str(err)
        raise DriverError(api, int(err), text)

    def _make_current(self) -> None:
        if self._thread.current:
            return
        self._check(self._driver.cuCtxSetCurrent(self._context), "cuCtxSetCurrent")
        self._thread.current = True

    # ------------------------------------------------------------ device facts
    @property
    def granularity(self) -> int:
        return self._granularity

    @property
    def device(self) -> str:
        return f"cuda:{self._ordinal}"

    def synchronize(self) -> None:
        self._make_current()
        self._check(self._driver.cuCtxSynchronize(), "cuCtxSynchronize")

    def mem_info(self) -> tuple[int, int]:
        self._make_current()
        free, total = self._check(self._driver.cuMemGetInfo(), "cuMemGetInfo")
        return int(free), int(total)

    def describe(self) -> dict[str, Any]:
        import importlib.metadata

        driver = self._driver
        info = super().describe()
        name = self._check(driver.cuDeviceGetName(256, self._cu_device), "cuDeviceGetName")
        info["device_name"] = name.split(b"\0", 1)[0].decode()
        attr = driver.CUdevice_attribute
        major = self._check(
            driver.cuDeviceGetAttribute(
                attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self._cu_device
            ),
            "cuDeviceGetAttribute",
        )
        minor = self._check(
            driver.cuDeviceGetAttribute(
                attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self._cu_device
            ),
            "cuDeviceGetAttribute",
        )
        info["compute_capability"] = f"{major}.{minor}"
        info["per_page_calls"] = self._per_page_calls
        version = int(self._check(driver.cuDriverGetVersion(), "cuDriverGetVersion"))
        info["versions"] = {
            "cuda_driver_api": f"{version // 1000}.{version % 1000 // 10}",
            "cuda-bindings": importlib.metadata.version("cuda-bindings"),
        }
        return info

    # ------------------------------------------------------------ primitives
    def _reserve(self, nbytes: int) -> int:
        self._make_current()
        ptr = self._check(
            self._driver.cuMemAddressReserve(nbytes, self._granularity, 0, 0),
            "cuMemAddressReserve",
        )
        return int(ptr)

    def _free(self, address: int, nbytes: int) -> None:
        self._make_current()
        self._check(self._driver.cuMemAddressFree(address, nbytes), "cuMemAddressFree")

    def _create(self, nbytes: int) -> Any:
        self._make_current()
        return self._check(self._driver.cuMemCreate(nbytes, self._prop, 0), "cuMemCreate")

    def _release(self, handle: Any, nbytes: int) -> None:
        self._make_current()
        self._check(self._driver.cuMemRelease(handle), "cuMemRelease")

    def _map_batch(self, items: Sequence[tuple[int, Page]]) -> None:
        self._make_current()
        driver, success = self._driver, self._success
        done: list[tuple[int, int]] = []
        try:
            for address, page in items:
                (err,) = driver.cuMemMap(address, page.nbytes, 0, page.handle, 0)
                if err != success:
                    self._raise(err, "cuMemMap")
                done.append((address, page.nbytes))
            for start, length in _contiguous_runs(done):
                (err,) = driver.cuMemSetAccess(start, length, self._access, 1)
                if err != success:
                    self._raise(err, "cuMemSetAccess")
        except BaseException:
            self._unmap_batch(done)
            raise

    def _bind_per_page_calls(
        self, cu_mem_map: Any, cu_mem_set_access: Any, cu_mem_unmap: Any
    ) -> None:
        """Set `_map_one` and `_unmap_one` as closures over the three driver calls.

        Instance attributes rather than methods: `Backend.map` calls `self._map_one` once
        per page, and a closure spares the bound method and the five attribute lookups
        a method would make. With the driver stubbed, kvcached's time per map+unmap
        went from 0.88 to 0.69 us on the CPU machine and from 3.03 to 2.37 us on an H100
        machine's host, where the overhead target is measured (vmm_bookkeeping_trees.jsonl
        in benchmarks/results/cpu-2026-12-05c and h100-2026-12-05d).

        They skip the per-thread context check: the VMM calls take the device from their
        arguments, and if a driver does want a current context after all, the call fails
        with CUDA_ERROR_INVALID_CONTEXT and is retried once current."""
        success, no_context, access = self._success, self._no_context, self._access
        make_current, fail = self._make_current, self._raise

        def map_one(address: int, page: Page) -> None:
            nbytes = page.nbytes
            (err,) = cu_mem_map(address, nbytes, 0, page.handle, 0)
            if err != success:
                if err != no_context:
                    fail(err, "cuMemMap")
                make_current()
                (err,) = cu_mem_map(address, nbytes, 0, page.handle, 0)
                if err != success:
                    fail(err, "cuMemMap")
            (err,) = cu_mem_set_access(address, nbytes, access, 1)
            if err != success:
                if err == no_context:
                    make_current()
                    (err,) = cu_mem_set_access(address, nbytes, access, 1)
                if err != success:
                    cu_mem_unmap(address, nbytes)
                    fail(err, "cuMemSetAccess")

        def unmap_one(address: int, nbytes: int) -> None:
            (err,) = cu_mem_unmap(address, nbytes)
            if err != success:
                if err != no_context:
                    fail(err, "cuMemUnmap")
                make_current()
                (err,) = cu_mem_unmap(address, nbytes)
                if err != success:
                    fail(err, "cuMemUnmap")

        self._map_one = map_one  # type: ignore[method-assign]
        self._unmap_one = unmap_one  # type: ignore[method-assign]

    def _bind_compiled_calls(self, entry_points: tuple[int, int, int] | str) -> str:
        """Make `_map_one` and `_unmap_one` the C module's calls into `entry_points` (the
        driver's cuMemMap, cuMemSetAccess, cuMemUnmap), keeping the cuda.bindings
        closures for the retry after CUDA_ERROR_INVALID_CONTEXT. Returns what the
        per-page path now is, with the reason when it stays on cuda.bindings.

        With the same bookkeeping around them, the C calls took kvcached's map+unmap of
        a page from 1.06-1.09 to 1.00-1.04 of the same three calls made directly through
        cuda.bindings on an H200 (vmm_ops_cuda*.jsonl in
        benchmarks/results/h200-2026-12-06; decision 0010)."""
        if isinstance(entry_points, str):
            return f"cuda.bindings ({entry_points})"
        access = read_write_access(self._driver, self._ordinal)
        calls = compiled_calls(entry_points, access, self._compiled_call_failed)
        if isinstance(calls, str):
            return f"cuda.bindings ({calls})"
        self._bindings_map_one, self._bindings_unmap_one = self._map_one, self._unmap_one
        self._map_one = calls.map  # type: ignore[method-assign]
        self._unmap_one = calls.unmap  # type: ignore[method-assign]
        return "compiled"

    def _compiled_call_failed(self, api: str, result: int, address: int, what: Any) -> None:
        """`VmmCalls`' answer to a failed driver call (`what` is the page for a map, the
        byte count for an unmap; a map whose access grant failed is already undone).
        Like the closures: retry once through cuda.bindings when the thread had no
        current context, else raise kvcached's error for the call."""
        try:
            err = self._driver.CUresult(result)
        except ValueError:  # a code this cuda.bindings does not know
            err = result
        if err != self._no_context:
            self._raise(err, api)
        self._make_current()
        if api == "cuMemUnmap":
            self._bindings_unmap_one(address, what)
        else:
            self._bindings_map_one(address, what)

    def _unmap_batch(self, ranges: Sequence[tuple[int, int]]) -> None:
        self._make_current()
        driver, success = self._driver, self._success
        for start, length in _contiguous_runs(ranges):
            (err,) = driver.cuMemUnmap(start, length)
            if err != success:
                self._raise(err, "cuMemUnmap")

    def _view(self, address: int, nbytes: int, shape: tuple[int, ...], dtype: Any) -> Any:
        return device_tensor(address, nbytes, shape, dtype, self.device)

    def _close_device(self) -> None:
        if self._context is not None:
            self._driver.cuDevicePrimaryCtxRelease(self._cu_device)
            self._context = None


class _ThreadState(threading.local):
    current = False  # whether this thread has made the backend's context current


def _contiguous_runs(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merge (address, nbytes) ranges that touch end to start, in the order given."""
    runs: list[tuple[int, int]] = []
    for address, nbytes in ranges:
        if runs and runs[-1][0] + runs[-1][1] == address:
            runs[-1] = (runs[-1][0], runs[-1][1] + nbytes)
        else:
            runs.append((address, nbytes))
    return runs
