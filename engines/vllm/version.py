"""Which vLLM minor version is installed: a leaf module, so that the shim table and the
start-up refusals can both ask without importing each other."""

from __future__ import annotations


def vllm_minor() -> str:
    """``major.minor`` of the installed vLLM (``0.32`` for ``0.32.0+cpu``)."""
    import vllm

    version = str(getattr(vllm, "__version__", "unknown"))
    return ".".join(version.split("+")[0].split(".")[:2])
