"""CUDA backend: NVIDIA's driver VMM API through cuda-bindings."""

from kvcached.backends.cuda.backend import CudaBackend

__all__ = ["CudaBackend"]
