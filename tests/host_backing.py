"""The small host-backend KV buffer that the supply and budget-race tests run over (not
a test module: `tests/conftest.py` makes it the `backing` fixture)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from kvcached.backends.host import HostBackend
from kvcached.backing import BackingBuffer

G = 64 << 10  # the host backend's granularity here: one page id per layer buffer
BPP = 4  # blocks per page id
BLOCKS = 64  # 16 page ids of virtual range


@contextmanager
def host_backing() -> Iterator[BackingBuffer]:
    """BLOCKS blocks of G / BPP bytes in one segment, its backend closed after."""
    backend = HostBackend(granularity=G)
    with BackingBuffer(
        backend, nbytes=BLOCKS * G // BPP, num_blocks=BLOCKS, block_bytes=G // BPP,
        segment_offsets=[0],
    ) as buf:  # fmt: skip
        yield buf
    backend.close()
