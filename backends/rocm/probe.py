"""Ask the HIP runtime whether a usable device is there; run as a throw-away process.

`python probe.py ORDINAL` prints one JSON object: {"reason": null, ...facts} when device
ORDINAL exists and supports virtual memory management, else {"reason": "why not"}.

It runs in a child process because the questions need the HIP runtime initialised
(`hipGetDeviceCount` sets it up), and an initialised runtime must not be left behind in
a process that forks engine workers afterwards. A child also contains the failures a
broken install can cause: early hip-python releases call through a null function
pointer when a symbol is missing. This file uses only the standard library and
hip-python, so it runs without kvcached on the path.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def _hip() -> Any:
    try:
        from hip import hip

        return hip
    except ImportError:
        from rocm.bindings import hip as bindings

        return bindings


def _name(error: Any) -> str:
    return f"{getattr(error, 'name', 'hipError')} ({int(error)})"


def probe(ordinal: int) -> dict[str, Any]:
    try:
        hip = _hip()
    except Exception as exc:
        return {"reason": f"hip-python cannot be imported: {exc}"}
    try:
        err, count = hip.hipGetDeviceCount()
    except RuntimeError as exc:  # hip-python could not dlopen the runtime or a symbol
        return {"reason": f"libamdhip64.so cannot be loaded: {exc}"}
    if int(err) != 0 or count <= 0:
        hint = ""
        if not os.path.exists("/dev/kfd"):
            hint = (
                "; /dev/kfd is missing, so the amdgpu kernel driver is not loaded or the "
                "device is not passed into this container"
            )
        return {
            "reason": f"no device (hipGetDeviceCount returned {_name(err)}, {count} devices){hint}"
        }
    if not 0 <= ordinal < count:
        return {
            "reason": f"no device {ordinal}; HIP sees {count} "
            f"(valid: 0..{count - 1}; set KVCACHED_DEVICE)"
        }
    attribute = hip.hipDeviceAttribute_t.hipDeviceAttributeVirtualMemoryManagementSupported
    err, vmm = hip.hipDeviceGetAttribute(attribute, ordinal)
    if int(err) != 0:
        return {
            "reason": "hipDeviceGetAttribute(hipDeviceAttributeVirtualMemoryManagementSupported)"
            f" failed: {_name(err)}"
        }
    err, raw_name = hip.hipDeviceGetName(256, ordinal)
    name = _text(raw_name) if int(err) == 0 else "unknown"
    if not vmm:
        return {
            "reason": f"device {ordinal} ({name}) does not support virtual memory management "
            "(hipDeviceAttributeVirtualMemoryManagementSupported is 0; see "
            "docs/backends/rocm.md for the ROCm releases and GPUs that have it)"
        }
    return {"reason": None, "devices": count, "name": name}


def _text(value: Any) -> str:
    if hasattr(value, "decode"):
        value = value.decode()
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    return str(value).split("\0", 1)[0]


def main() -> None:
    ordinal = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    try:
        result = probe(ordinal)
    except Exception as exc:  # an answer, not a traceback, is what the parent needs
        result = {"reason": f"the HIP probe failed: {type(exc).__name__}: {exc}"}
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
