"""Where SGLang's pool puts its pages, and the one page it keeps for padding.

A leaf of the adapter: the instance, the capacity and the tensor-parallel ranks all
build on these two names, so they live apart from each of them (no import circle).

Page 0 holds slot 0, where SGLang writes padded tokens: it is taken from the allocator
as soon as the cache exists, so its memory is mapped before any forward pass (CUDA-graph
capture included) and is never handed out or released.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvcached.backing import BackingBuffer, blocks_multiple

PADDING_PAGE = 0


@dataclass(frozen=True)
class PoolGeometry:
    """Where SGLang's pool puts every page: `segments` buffers (2 per layer for MHA,
    1 for MLA) of `rows` token rows of `row_bytes`, `page_size` rows per page."""

    segments: int
    rows: int
    row_bytes: int
    page_size: int

    @property
    def pages(self) -> int:
        """SGLang's pages, the padding page 0 included (a partial last page counted:
        the address space covers it)."""
        return -(-self.rows // self.page_size)

    @property
    def last_page(self) -> int:
        """The highest page id SGLang's allocator hands out: its pages are 1 to
        `size // page_size`, with `size + page_size` rows in the buffers. A size that is
        not a whole number of pages (SGLang's window pool can get one: its configurator
        caps it at --max-total-tokens) leaves a partial page no allocator may hand out."""
        return self.rows // self.page_size - 1

    @property
    def page_bytes(self) -> int:
        return self.row_bytes * self.page_size

    def blocks_per_segment(self, granularity: int) -> int:
        """The pool's pages rounded up to whole kvcached page ids (the rounding is
        reserved address space that is never handed out)."""
        multiple = blocks_multiple(granularity, self.page_bytes)
        return -(-self.pages // multiple) * multiple

    def backing(self, backend: Any) -> BackingBuffer:
        blocks = self.blocks_per_segment(backend.granularity)
        segment_bytes = blocks * self.page_bytes
        return BackingBuffer(
            backend,
            nbytes=self.segments * segment_bytes,
            num_blocks=blocks,
            block_bytes=self.page_bytes,
            segment_offsets=[i * segment_bytes for i in range(self.segments)],
            name="sglang-kv",
        )
