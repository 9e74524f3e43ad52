"""The layout and the allocator on a real GPU (pytest -m gpu, on the device machine)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvcached.backends.cuda import CudaBackend

pytestmark = pytest.mark.gpu

if CudaBackend.unavailable_reason() is not None:
    pytest.skip(f"cuda: {CudaBackend.unavailable_reason()}", allow_module_level=True)

import torch  # noqa: E402

from kvcached.allocator import LocalAccount, PageAllocator  # noqa: E402
from kvcached.layout import KVLayout  # noqa: E402

MiB = 1 << 20


@pytest.fixture
def backend() -> Iterator[CudaBackend]:
    b = CudaBackend()
    yield b
    b.close()


def test_blocks_written_through_views_survive_growth_and_shrink(backend: CudaBackend) -> None:
    layout = KVLayout.uniform(
        backend, 4, num_kv_heads=8, head_dim=128, dtype="bfloat16", block_size=16,
        max_tokens=1 << 17,
    )  # fmt: skip
    (group,) = layout.groups
    assert group.page_bytes == backend.granularity == 2 * MiB
    account = LocalAccount()
    alloc = PageAllocator(
        group, account=account, extent_bytes=8 * MiB, pool_low=0, pool_high=0,
        release_delay=0, background=False,
    )  # fmt: skip
    blocks = alloc.alloc(300)  # 5 page ids of 64 blocks: two extents of 4 page ids
    assert blocks is not None
    assert alloc.extents() == [(0, 4), (4, 4)]
    for layer in range(4):
        k, v = layout.view(layer, "k"), layout.view(layer, "v")
        assert k.device.type == "cuda" and k.shape == (group.num_blocks, 16, 8, 128)
        for b in blocks[::7]:
            k[b] = layer * 1000 + b % 997
            v[b] = -(layer * 1000 + b % 997)
    torch.cuda.synchronize()
    for layer in range(4):
        both = layout.view(layer)
        tokens = layout.view(layer, "v", shape=(-1, 8, 128))
        for b in blocks[::7]:
            assert bool((both[0, b] == layer * 1000 + b % 997).all())
            assert bool((tokens[b * 16 : (b + 1) * 16] == -(layer * 1000 + b % 997)).all())
    # shrink under a limit while the low extent is busy: only the high one goes
    alloc.free([b for b in blocks if group.page_of(b) >= 4])
    assert alloc.set_limit(4 * group.page_id_bytes)
    assert alloc.extents() == [(0, 4)]
    for b in (b for b in blocks[::7] if group.page_of(b) < 4):
        assert bool((layout.view(1, "k")[b] == 1000 + b % 997).all())
    alloc.close()
    assert account.charged == 0 and backend.created_bytes == 0
    layout.close()


def test_device_memory_limit_is_exhaustion_not_an_error() -> None:
    backend = CudaBackend(memory_limit=64 * MiB)
    layout = KVLayout.uniform(
        backend, 2, num_kv_heads=8, head_dim=128, dtype="bfloat16", block_size=16,
        max_tokens=1 << 16,
    )  # fmt: skip
    (group,) = layout.groups
    alloc = PageAllocator(
        group, extent_bytes=32 * MiB, pool_low=0, pool_high=0, release_delay=0,
        background=False,
    )  # fmt: skip
    got = []
    while (block := alloc.alloc_one()) is not None:
        got.append(block)
    assert alloc.reserved_bytes == 64 * MiB == backend.created_bytes
    assert len(got) == 64 * MiB // group.block_id_bytes
    alloc.close()
    layout.close()
    backend.close()
