"""Is CUDA usable here? Answered without initialising the CUDA driver.

`cuInit` in a process that later forks leaves the children unable to use CUDA, and
serving engines import plug-ins (us) in a parent that forks workers. NVML has no such
effect, so the answer comes from NVML's device count; where NVML is missing, from the
device nodes and a loadable `libcuda.so.1` (loading a library initialises nothing).
"""

from __future__ import annotations

import ctypes
import functools
import glob
import importlib.util


@functools.cache
def cuda_unavailable_reason() -> str | None:
    if (
        importlib.util.find_spec("cuda") is None
        or importlib.util.find_spec("cuda.bindings") is None
    ):
        return "cuda-bindings is not installed (pip install cuda-bindings)"
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "no NVIDIA driver: libcuda.so.1 cannot be loaded"
    count = _nvml_device_count()
    if count is None:
        if not glob.glob("/dev/nvidia[0-9]*"):
            return "no NVIDIA device found (no /dev/nvidiaN and NVML is unavailable)"
        return None
    if count == 0:
        return "the NVIDIA driver reports no devices"
    return None


def _nvml_device_count() -> int | None:
    """Number of NVIDIA devices by NVML, or None when NVML cannot answer."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        count = ctypes.c_uint(0)
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return None
        return int(count.value)
    finally:
        nvml.nvmlShutdown()
