"""The CUDA backend's per-page driver calls made from C, where they can be.

`_vmm_calls` (C, built with the package when a compiler is there; see the top of its
source) makes a page's cuMemMap + cuMemSetAccess, or its cuMemUnmap, in one call from
Python, against the driver library that cuda.bindings has already loaded. This module
finds those three entry points, builds the `VmmCalls` object with the backend's access
descriptor, and gives the reason when it cannot, so the backend keeps its cuda.bindings
closures and `kvcached info` says why (`per_page_calls` in the backend's description).

The C calls replace cuda.bindings only on the per-page path (`Backend.map` and `unmap`
for one page); batches, creation and release stay on cuda.bindings, whose wrapper cost
is small next to theirs. `KVCACHED_COMPILED_CALLS=0` keeps every call on cuda.bindings.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from typing import Any

#: The driver library's name on Linux, as cuda.bindings loads it.
DRIVER_LIBRARY = "libcuda.so.1"
#: The per-page entry points, in the order VmmCalls takes them.
ENTRY_POINTS = ("cuMemMap", "cuMemSetAccess", "cuMemUnmap")

ErrorHandler = Callable[[str, int, int, Any], None]


def loaded_driver_entry_points() -> tuple[int, int, int] | str:
    """The addresses of cuMemMap, cuMemSetAccess and cuMemUnmap in the driver library
    this process has loaded (never loading one of its own), or why there are none."""
    no_load = getattr(os, "RTLD_NOLOAD", None)
    if no_load is None:
        return "this platform cannot look up an already-loaded library (no RTLD_NOLOAD)"
    try:
        library = ctypes.CDLL(DRIVER_LIBRARY, mode=no_load | os.RTLD_NOW)
    except OSError:
        return f"{DRIVER_LIBRARY} is not loaded in this process"
    addresses = []
    for name in ENTRY_POINTS:
        try:
            function = getattr(library, name)
        except AttributeError:
            return f"{DRIVER_LIBRARY} has no {name}"
        addresses.append(ctypes.cast(function, ctypes.c_void_p).value or 0)
    return addresses[0], addresses[1], addresses[2]


def read_write_access(driver: Any, ordinal: int) -> tuple[int, int, int]:
    """The access descriptor the backend grants, as `VmmCalls` takes it: (location type,
    location id, flags) for read-write access from device `ordinal`."""
    return (
        int(driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE),
        ordinal,
        int(driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE),
    )


def compiled_calls(
    entry_points: tuple[int, int, int],
    access: tuple[int, int, int],
    on_error: ErrorHandler,
) -> Any | str:
    """A `VmmCalls` over `entry_points` granting `access` (location type, location id,
    flags) on every map, or why the compiled module is missing."""
    try:
        from kvcached.backends.cuda._vmm_calls import VmmCalls
    except ImportError as error:
        return f"kvcached.backends.cuda._vmm_calls was not built ({error})"
    location_type, location_id, flags = access
    return VmmCalls(*entry_points, location_type, location_id, flags, on_error)
