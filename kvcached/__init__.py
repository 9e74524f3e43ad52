"""kvcached: an elastic, virtualized KV cache for LLM serving engines.

`import kvcached` is fast and has no side effects: it creates no device context and
reads no driver. The backend is resolved on first use: `kvcached.get_backend()` (or the
`kvcached.backend` attribute) honours KVCACHED_BACKEND, else picks the first available
of cuda, rocm, mlx and host.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvcached.backend import Backend, Page, Reservation
from kvcached.errors import (
    BackendUnavailable,
    DriverError,
    InvalidArgument,
    KVCachedError,
    OutOfMemory,
)
from kvcached.registry import availability, backend_names, get_backend

if TYPE_CHECKING:
    backend: Backend

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "BackendUnavailable",
    "DriverError",
    "InvalidArgument",
    "KVCachedError",
    "OutOfMemory",
    "Page",
    "Reservation",
    "availability",
    "backend_names",
    "get_backend",
]


def __getattr__(name: str) -> Any:
    if name == "backend":
        return get_backend()
    raise AttributeError(f"module 'kvcached' has no attribute {name!r}")
