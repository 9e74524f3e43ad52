"""BackingBuffer (engine-placed blocks) and the allocator queries engine adapters use."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvcached.allocator import LocalAccount, PageAllocator
from kvcached.backends.host import HostBackend
from kvcached.backing import BackingBuffer
from kvcached.errors import InvalidArgument

G = 64 << 10


@pytest.fixture
def backend():
    b = HostBackend(granularity=G)
    yield b
    b.close()


def test_layer_outermost_segments_map_the_same_blocks_in_every_layer(backend) -> None:
    # two layers, 8 blocks of 32 KiB each: layer l starts at l * 8 * 32 KiB
    block, blocks = 32 << 10, 8
    with BackingBuffer(
        backend,
        nbytes=2 * blocks * block,
        num_blocks=blocks,
        block_bytes=block,
        segment_offsets=[0, blocks * block],
    ) as buf:
        alloc = PageAllocator(buf.group, extent_bytes=G, pool_low=0, pool_high=0, background=False)
        got = alloc.alloc(3)
        assert got == [0, 1, 2]
        raw = buf.raw("uint8")
        for layer in range(2):
            for b in got:
                start = layer * blocks * block + b * block
                raw[start : start + block] = layer * 10 + b  # mapped: no fault
        assert int(raw[blocks * block + 2 * block]) == 12
        alloc.close()


def test_misaligned_segment_is_refused_with_the_multiple_to_use(backend) -> None:
    with pytest.raises(InvalidArgument, match="multiple of 2"):
        BackingBuffer(
            backend, nbytes=3 << 20, num_blocks=3, block_bytes=32 << 10, segment_offsets=[0]
        )
    with pytest.raises(InvalidArgument, match="not a multiple of the"):
        BackingBuffer(
            backend, nbytes=1 << 20, num_blocks=2, block_bytes=32 << 10, segment_offsets=[4096]
        )


def test_obtainable_blocks_follows_limit_and_headroom(backend) -> None:
    with BackingBuffer(
        backend, nbytes=64 * G, num_blocks=64, block_bytes=G, segment_offsets=[0]
    ) as buf:
        account = LocalAccount(limit=4 * G)
        alloc = PageAllocator(
            buf.group, account=account, extent_bytes=G, pool_low=0, pool_high=0, background=False
        )
        assert alloc.obtainable_blocks() == 4
        assert alloc.alloc(3) is not None
        assert alloc.obtainable_blocks() == 1
        account.headroom = lambda: 0  # type: ignore[attr-defined]  # the budget is full
        assert alloc.obtainable_blocks() == 0  # nothing mapped free, nothing growable
        alloc.close()


def test_blocks_mapped_over_a_lowered_limit_are_not_promised(backend) -> None:
    # the pool thread mapped pages ahead, then the limit went below what is mapped: those
    # pages go back (the reclaim policy), so the free count must not promise them
    with BackingBuffer(
        backend, nbytes=64 * G, num_blocks=64, block_bytes=G, segment_offsets=[0]
    ) as buf:
        account = LocalAccount(limit=8 * G)
        alloc = PageAllocator(
            buf.group, account=account, extent_bytes=G, pool_low=0, pool_high=0, background=False
        )
        blocks = alloc.alloc(6)
        assert blocks is not None
        alloc.free(blocks[2:])  # 2 held, 4 mapped and free
        assert alloc.reserved_bytes == 6 * G and alloc.obtainable_blocks() == 6  # 4 + 2 more
        account.limit = 3 * G  # 3 G over the limit: 3 of the 4 free pages must go
        assert alloc.obtainable_blocks() == 1
        account.limit = G  # more over than is free: nothing, never below zero
        assert alloc.obtainable_blocks() == 0
        alloc.close()


def test_release_order_puts_blocks_that_empty_a_page_first(backend) -> None:
    with BackingBuffer(
        backend, nbytes=8 * G, num_blocks=16, block_bytes=G // 2, segment_offsets=[0]
    ) as buf:  # 2 blocks per page id
        alloc = PageAllocator(buf.group, extent_bytes=G, pool_low=0, pool_high=0, background=False)
        blocks = alloc.alloc(6)
        assert blocks == [0, 1, 2, 3, 4, 5]
        # candidates 1, 2, 3, 5: page 1 (blocks 2, 3) empties entirely; 1 and 5 share
        # their pages with blocks nobody frees
        assert alloc.release_order([1, 2, 3, 5])[:2] == [2, 3]
        alloc.close()


def test_vllm_plugin_is_inert_and_imports_nothing_without_the_variable() -> None:
    code = (
        "import os, sys; os.environ.pop('ENABLE_KVCACHED', None);"
        "from kvcached.engines.vllm import register; register();"
        "print(sorted(m for m in sys.modules if m.startswith(('vllm', 'torch',"
        " 'kvcached.engines.vllm.'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_part_is_a_tensor_of_its_own_starting_where_it_lies(backend) -> None:
    # engines place views by absolute storage offsets (vLLM 0.26's Mamba state): a part
    # must start its storage at its own first byte, as a fresh allocation does
    block, blocks = 32 << 10, 8
    with BackingBuffer(
        backend, nbytes=2 * blocks * block, num_blocks=blocks, block_bytes=block,
        segment_offsets=[0, blocks * block],
    ) as buf:  # fmt: skip
        part = buf.part(blocks * block, blocks * block)
        assert part.storage_offset() == 0
        assert part.data_ptr() == buf.raw("int8").data_ptr() + blocks * block
        assert part.untyped_storage().nbytes() == blocks * block
        with pytest.raises(InvalidArgument, match=r"outside the buffer's 524288 bytes"):
            buf.part(blocks * block, blocks * block + 1)
