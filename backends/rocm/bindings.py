"""Import shim over hip-python's package layouts (6.x, 7.x, 10.x), and where HIP loads from.

hip-python has shipped in two shapes, and the ROCm backend supports both:

* **Before the package split** (6.x and the 7.x line; one `hip-python` wheel per ROCm
  release): the bindings are the Cython modules `hip.hip` (Python API) and `hip.chip`
  (the C layer). `hip.chip` opens the HIP runtime with `dlopen("libamdhip64.so")` on
  the first call, so the dynamic loader's search path (LD_LIBRARY_PATH, ld.so.cache)
  decides which runtime is used. The earliest releases opened it as soon as `hip.chip`
  was imported.
* **After the split** (10.x; hip-python's own compatibility code dates it to 7.14, see
  the "Package layout overhaul" of its CHANGELOG): the bindings live in
  `rocm-bindings-hip` as `rocm.bindings.hip`, and the `hip-python` wheel is a
  metapackage whose `hip` package re-exports them. The runtime is still opened lazily,
  but at the path `rocm.bindings.util.paths.get_library_path` resolves: a copy bundled
  in the wheel, the `rocm_sdk` package, `$ROCM_PATH/lib` (or `$ROCM_HOME`, else
  /opt/rocm), and only then the bare name for the loader to search.

`from hip import hip` works in every layout; `rocm.bindings.hip` alone (the bindings
without the metapackage) is the fallback. The backend uses only what all of them share:
the function names, their `(hipError_t, values...)` return tuples, the structures and
enums. Where releases differ it does not lean on either form: a field a release may not
expose (`hipMemAllocationProp.requestedHandleTypes`, absent from 10.x, whose zero
default means "none") is set only when present, C strings are read whether they come
back as bytes or as 10.x's `CStr`, and error names are taken from the `hipError_t` enum
rather than from `hipGetErrorName`. Only 10.x is installed in this project's test
environment; the 6.x/7.x paths are written from those releases' sources.

Nothing here loads the HIP runtime: importing the bindings only imports Cython modules.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from typing import Any

#: What hip-python 6.x/7.x hands to dlopen, and the file name in every layout.
LIBRARY_NAME = "libamdhip64.so"


def bindings_installed() -> bool:
    """True when some hip-python layout is importable (checked without importing it)."""
    return _spec_exists("hip") or _spec_exists("rocm.bindings.hip")


def load() -> Any:
    """The hip-python `hip` module of whichever layout is installed."""
    try:
        from hip import hip

        return hip
    except ImportError:
        from rocm.bindings import hip as bindings

        return bindings


def library_path() -> str:
    """The file (or bare name) hip-python will dlopen as the HIP runtime.

    For 10.x this is the answer of hip-python's own resolver, so a check of it loads
    exactly the library the bindings will use."""
    if _spec_exists("rocm.bindings.util.paths"):
        from rocm.bindings.util.paths import get_library_path

        return os.fsdecode(get_library_path("amdhip64"))
    return LIBRARY_NAME


def version() -> str:
    """The installed hip-python (or rocm-bindings-hip) version, for `describe()`."""
    for dist in ("hip-python", "rocm-bindings-hip"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def text(value: Any) -> str:
    """A C string that hip-python returned as bytes (6.x/7.x) or as a CStr (10.x)."""
    if isinstance(value, bytes):
        raw = value
    elif hasattr(value, "decode"):
        decoded = value.decode()
        raw = decoded.encode() if isinstance(decoded, str) else bytes(decoded)
    else:
        return str(value)
    return raw.split(b"\0", 1)[0].decode(errors="replace")


def address(pointer: Any) -> int:
    """The integer address behind a hip-python `Pointer` (or handle) object."""
    try:
        return int(pointer)
    except TypeError:
        value = pointer.as_c_void_p().value
        return int(value) if value is not None else 0


def _spec_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package is missing or broken
        return False
