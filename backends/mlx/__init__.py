"""mlx backend: ledger-charged MLX arrays as pages (MLX has no VMM); see backend.py."""

from kvcached.backends.mlx.backend import MlxBackend, MlxBuffer, array_page_bytes

__all__ = ["MlxBackend", "MlxBuffer", "array_page_bytes"]
