"""ROCm backend: AMD's HIP virtual memory management API through hip-python."""

from kvcached.backends.rocm.backend import RocmBackend

__all__ = ["RocmBackend"]
