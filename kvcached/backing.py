"""An engine-defined backing buffer for KV blocks, over one kvcached reservation.

`KVLayout` decides where every layer's blocks live. Some engines decide it themselves:
vLLM computes one flat byte buffer per KV cache tensor (in 0.32 one for all layers) and
places block `b` of layer `l` at `offset + l * layer_stride + b * block_stride`, then
views that buffer in whatever shape its attention backend wants. To serve such an
engine without re-deriving its layout, kvcached takes the buffer's geometry as given:

* a total size in bytes (what the engine would have allocated),
* `num_blocks` and the block stride (`block_bytes`),
* the start offset of each *segment*: a run of `num_blocks` equally spaced blocks.
  A layer-outermost buffer has one segment per layer (stride = one layer's page); a
  block-outermost buffer has one segment whose blocks hold every layer's page.

`BackingBuffer` reserves that many bytes of address space and describes it as a
`KVGroup`, so the ordinary `PageAllocator` maps page id `p` under block range
`[p * blocks_per_page, (p + 1) * blocks_per_page)` of every segment at once. The page
size is the least common multiple of the granularity and the block stride, and every
segment must start on a page boundary and hold a whole number of page ids: the
constructor checks both and says which number to change when they do not hold.
`raw()` is the zero-copy view of the whole buffer that the engine then reshapes.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import Any

from kvcached.backend import Backend
from kvcached.errors import InvalidArgument
from kvcached.layout import MAX_PAGE_BYTES, KVGroup, Segment
from kvcached.lifetime import Closeable


def blocks_multiple(granularity: int, block_bytes: int) -> int:
    """The block counts a segment of `block_bytes` blocks may have are multiples of this
    (so that it is a whole number of page ids)."""
    return math.lcm(granularity, block_bytes) // block_bytes


class BackingBuffer(Closeable):
    """One reserved buffer of `nbytes` whose blocks sit at the engine's offsets.

    Arguments:
        backend: where to reserve.
        nbytes: the buffer's size as the engine computed it.
        num_blocks: blocks per segment (the engine's block-pool size).
        block_bytes: the stride between consecutive blocks of a segment.
        segment_offsets: where each segment's block 0 starts, in bytes.
        name: for messages and the allocator's thread.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        nbytes: int,
        num_blocks: int,
        block_bytes: int,
        segment_offsets: Sequence[int],
        name: str = "backing",
    ) -> None:
        for what, value in (
            ("nbytes", nbytes),
            ("num_blocks", num_blocks),
            ("block_bytes", block_bytes),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidArgument(f"{what} must be a positive int, got {value!r}")
        offsets = sorted(segment_offsets)
        if not offsets or len(set(offsets)) != len(offsets):
            raise InvalidArgument(f"segment offsets {list(segment_offsets)} must be distinct")
        g = backend.granularity
        page_bytes = math.lcm(g, block_bytes)
        if page_bytes > MAX_PAGE_BYTES:
            raise InvalidArgument(
                f"{name}: blocks of {block_bytes} bytes need page ids of {page_bytes} bytes "
                f"to fit the {g}-byte granularity (more than {MAX_PAGE_BYTES}); use a block "
                "size that makes a block's bytes a power of two times a small odd number"
            )
        segment_bytes = num_blocks * block_bytes
        multiple = page_bytes // block_bytes
        if num_blocks % multiple:
            raise InvalidArgument(
                f"{name}: {num_blocks} blocks of {block_bytes} bytes are not a whole number "
                f"of {page_bytes}-byte page ids; the block count must be a multiple of "
                f"{multiple}"
            )
        for offset in offsets:
            if offset < 0 or offset % page_bytes:
                raise InvalidArgument(
                    f"{name}: a segment starts at byte {offset}, which is not a multiple of "
                    f"the {page_bytes}-byte page id (granularity {g})"
                )
        for first, second in itertools.pairwise(offsets):
            if first + segment_bytes > second:
                raise InvalidArgument(f"{name}: segments at {first} and {second} overlap")
        if offsets[-1] + segment_bytes > nbytes:
            raise InvalidArgument(
                f"{name}: the segment at {offsets[-1]} ends past the buffer's {nbytes} bytes"
            )
        self.backend = backend
        self.nbytes = nbytes
        self.reservation = backend.reserve(-(-nbytes // g) * g)
        self._closed = False
        segments = tuple(
            Segment(i, "kv", self.reservation, offset, segment_bytes)
            for i, offset in enumerate(offsets)
        )
        self.group = KVGroup(
            index=0,
            name=name,
            layers=tuple(range(len(offsets))),
            block_size=1,
            block_bytes=block_bytes,
            page_bytes=page_bytes,
            num_pages=num_blocks // multiple,
            segments=segments,
            reservations=((self.reservation, tuple(offsets)),),
        )

    @property
    def groups(self) -> tuple[KVGroup, ...]:
        return (self.group,)

    def raw(self, dtype: Any = "int8") -> Any:
        """The whole buffer as a flat zero-copy tensor (only mapped blocks may be touched)."""
        self._check_open()
        from kvcached.backend import dtype_itemsize

        itemsize = dtype_itemsize(dtype)
        if self.nbytes % itemsize:
            raise InvalidArgument(f"{self.nbytes} bytes are not a whole number of {dtype}")
        return self.backend.view(self.reservation, 0, (self.nbytes // itemsize,), dtype)

    def part(self, offset: int, nbytes: int) -> Any:
        """A flat int8 tensor of its own over [offset, offset + nbytes) of the buffer.

        Unlike a slice of `raw()`, its storage begins at `offset`, as a fresh
        allocation's does: code that places views by absolute storage offsets
        (`torch.as_strided(t, ..., storage_offset=k)` means `k` elements from the start
        of `t`'s storage, not of `t`) sees only this part, not the buffer before it."""
        self._check_open()
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise InvalidArgument(
                f"part [{offset}, {offset + nbytes}) is outside the buffer's {self.nbytes} bytes"
            )
        return self.backend.view(self.reservation, offset, (nbytes,), "int8")

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgument("this backing buffer was closed")

    def close(self) -> None:
        """Free the reservation (its pages must have been unmapped: close the allocator)."""
        if self._closed:
            return
        self._closed = True
        self.reservation.close()

    def __repr__(self) -> str:
        g = self.group
        return (
            f"BackingBuffer({g.name}: {self.nbytes} bytes, {len(g.segments)} segment(s) of "
            f"{g.num_blocks} blocks x {g.block_bytes} bytes, page id {g.page_bytes} bytes)"
        )


class BackingSet(Closeable):
    """Several engine-placed buffers as one cache layout: buffer `i` is group `i`, with
    page ids of its own. For an engine that keeps two pools of different geometry side
    by side and indexes each on its own (SGLang's hybrid sliding-window models: one
    pool for the full-attention layers, one for the window layers): one `KVCache` over
    the set gives each pool its own allocator, all charging the instance's one ledger
    row. Closing the set closes every buffer.

    Arguments:
        buffers: the `BackingBuffer`s, over one backend, in group order; the set owns
            them from the call on (closed also when the arguments are refused).
    """

    def __init__(self, buffers: Sequence[BackingBuffer]) -> None:
        self.buffers = tuple(buffers)
        self._closed = False
        if not self.buffers:
            raise InvalidArgument("a BackingSet needs at least one BackingBuffer")
        backends = {id(buffer.backend) for buffer in self.buffers}
        if len(backends) != 1:
            self.close()
            raise InvalidArgument("the buffers of a BackingSet must share one backend")
        self.backend = self.buffers[0].backend
        self._groups = tuple(
            dataclasses.replace(buffer.group, index=i) for i, buffer in enumerate(self.buffers)
        )

    @property
    def groups(self) -> tuple[KVGroup, ...]:
        return self._groups

    def close(self) -> None:
        """Free every buffer's reservation (their pages must have been unmapped)."""
        if self._closed:
            return
        self._closed = True
        for buffer in self.buffers:
            buffer.close()

    def __repr__(self) -> str:
        return f"BackingSet({', '.join(repr(buffer) for buffer in self.buffers)})"
