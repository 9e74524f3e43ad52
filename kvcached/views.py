"""Zero-copy torch views over raw addresses, shared by the torch-based backends.

torch is imported here and only here, on the first view: `import kvcached` and the MLX
path work on machines without torch. Views are built as flat uint8 tensors first and
reinterpreted afterwards, because not every dtype (bfloat16, float8) has a
`__cuda_array_interface__` type string.
"""

from __future__ import annotations

import ctypes
from typing import Any

from kvcached.backend import dtype_name
from kvcached.errors import BackendUnavailable


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - exercised only without torch
        raise BackendUnavailable(
            "views of this backend are torch tensors, and torch is not installed"
        ) from exc
    return torch


def _reinterpret(flat: Any, shape: tuple[int, ...], dtype: Any) -> Any:
    torch = _torch()
    target = getattr(torch, dtype_name(dtype))
    return flat.view(target).reshape(shape)


def host_tensor(address: int, nbytes: int, shape: tuple[int, ...], dtype: Any) -> Any:
    """A CPU tensor over host memory at `address`; it keeps no reference to the mapping."""
    torch = _torch()
    if nbytes == 0:
        return torch.empty(shape, dtype=getattr(torch, dtype_name(dtype)))
    buffer = (ctypes.c_char * nbytes).from_address(address)
    flat = torch.frombuffer(buffer, dtype=torch.uint8)
    return _reinterpret(flat, shape, dtype)


class _DevicePointer:
    """The minimal `__cuda_array_interface__` exporter torch needs to wrap a pointer."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
            "strides": None,
        }


def device_tensor(
    address: int, nbytes: int, shape: tuple[int, ...], dtype: Any, device: str
) -> Any:
    """A tensor on `device` ('cuda:N', also ROCm's torch) over device memory at `address`."""
    torch = _torch()
    if nbytes == 0:
        return torch.empty(shape, dtype=getattr(torch, dtype_name(dtype)), device=device)
    flat = torch.as_tensor(_DevicePointer(address, nbytes), device=torch.device(device))
    return _reinterpret(flat, shape, dtype)
