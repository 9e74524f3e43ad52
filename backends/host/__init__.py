"""Host backend: memfd + mmap in CPU RAM; the default where there is no accelerator."""

from kvcached.backends.host.backend import HostBackend

__all__ = ["HostBackend"]
