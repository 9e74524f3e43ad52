"""kvcached: an elastic, virtualized KV cache for LLM serving engines.

`import kvcached` is fast and has no side effects: it creates no device context and
reads no driver. The backend is resolved on first use: `kvcached.get_backend()` honours
KVCACHED_BACKEND, else picks the first available of cuda, rocm, mlx and host.
"""

from __future__ import annotations

from kvcached.backend import Backend, Page, Reservation
from kvcached.errors import (
    BackendUnavailable,
    DriverError,
    InvalidArgument,
    KVCachedError,
    OutOfMemory,
)
from kvcached.registry import availability, backend_names, get_backend

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
