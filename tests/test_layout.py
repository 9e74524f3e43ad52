"""KV layout: block / page-id arithmetic, zero-copy views, groups, shared layers, bad specs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvcached.allocator import PageAllocator
from kvcached.backends.host import HostBackend
from kvcached.errors import InvalidArgument
from kvcached.layout import MAX_PAGE_BYTES, KVLayout, LayerSpec

G = 4096  # host granularity for these tests: small pages keep them fast


@pytest.fixture
def backend() -> Iterator[HostBackend]:
    b = HostBackend(budget=256 << 20, granularity=G)
    yield b
    b.close()


def allocator(group, **kwargs) -> PageAllocator:  # type: ignore[no-untyped-def]
    kwargs.setdefault("extent_bytes", G)
    kwargs.setdefault("pool_low", 0)
    kwargs.setdefault("pool_high", 0)
    return PageAllocator(group, background=False, **kwargs)


# --------------------------------------------------------------------------- arithmetic
def test_uniform_layout_arithmetic(backend: HostBackend) -> None:
    # 2 heads x 16 dims x fp16 x 4 tokens = 256 bytes per block per segment
    layout = KVLayout.uniform(
        backend, 3, num_kv_heads=2, head_dim=16, dtype="float16", block_size=4, max_tokens=1000
    )
    (group,) = layout.groups
    assert group.block_bytes == 256
    assert group.page_bytes == G
    assert group.blocks_per_page == 16
    assert group.num_pages == -(-250 // 16)  # 250 blocks of 4 tokens, whole pages
    assert group.num_blocks == group.num_pages * 16
    assert len(group.segments) == 6  # K and V of 3 layers
    assert group.page_id_bytes == 6 * G
    assert group.block_id_bytes == 6 * 256
    assert [s.part for s in group.segments] == ["k", "v"] * 3
    assert len(group.reservations) == 3  # one reservation per layer
    assert group.page_of(0) == 0 and group.page_of(15) == 0 and group.page_of(16) == 1
    assert list(group.blocks_of(2)) == list(range(32, 48))
    assert group.block_offset(17) == 17 * 256
    # a page id is the same offset range in every segment
    for segment in group.segments:
        assert segment.nbytes == group.num_pages * G
    k, v = group.segments[:2]
    assert k.reservation is v.reservation and v.offset == k.nbytes
    layout.close()


def test_single_buffer_layers_have_one_segment_per_layer(backend: HostBackend) -> None:
    layout = KVLayout.uniform(
        backend, 4, num_kv_heads=1, head_dim=32, dtype="bfloat16", block_size=8, kind="mla",
        max_tokens=512,
    )  # fmt: skip
    (group,) = layout.groups
    assert len(group.segments) == 4
    assert group.page_id_bytes == 4 * group.page_bytes
    assert group.block_bytes == 8 * 32 * 2
    layout.close()


def test_odd_block_sizes_get_page_ids_that_hold_whole_blocks(backend: HostBackend) -> None:
    # 3 heads x 8 dims x 2 bytes x 4 tokens = 192 bytes: lcm(4096, 192) = 12288
    layout = KVLayout.uniform(
        backend, 1, num_kv_heads=3, head_dim=8, dtype="float16", block_size=4, max_tokens=640
    )
    (group,) = layout.groups
    assert group.page_bytes == 12288
    assert group.blocks_per_page == 64
    assert group.page_bytes % G == 0 and group.page_bytes % group.block_bytes == 0
    layout.close()


def test_requested_page_bytes(backend: HostBackend) -> None:
    layout = KVLayout.uniform(
        backend, 2, num_kv_heads=2, head_dim=16, dtype="float16", block_size=4,
        max_tokens=4096, page_bytes=4 * G,
    )  # fmt: skip
    assert layout.groups[0].page_bytes == 4 * G
    assert layout.groups[0].blocks_per_page == 64
    layout.close()
    with pytest.raises(InvalidArgument, match="multiple of"):
        KVLayout.uniform(
            backend, 2, num_kv_heads=2, head_dim=16, block_size=4, max_tokens=64,
            page_bytes=G + 256,
        )  # fmt: skip
    assert backend.live_counts == (0, 0)


def test_default_virtual_size_covers_the_device(backend: HostBackend) -> None:
    layout = KVLayout.uniform(backend, 2, num_kv_heads=2, head_dim=16, block_size=4)
    (group,) = layout.groups
    total = backend.mem_info()[1]
    assert group.num_pages * group.page_id_bytes >= total
    assert (group.num_pages - 1) * group.page_id_bytes < total
    layout.close()


# ------------------------------------------------------------------------------- views
def test_view_shapes(backend: HostBackend) -> None:
    layers = [
        LayerSpec(2, 16, "float16"),
        LayerSpec(1, 24, "float16", kind="mla"),
        LayerSpec(2, 16, "float16", kind="packed"),
    ]
    layout = KVLayout(backend, layers, block_size=4, max_tokens=256)
    nb = layout.group_of(0).num_blocks
    assert layout.view(0, "k").shape == (nb, 4, 2, 16)
    assert layout.view(0, "v").shape == (nb, 4, 2, 16)
    assert layout.view(0).shape == (2, nb, 4, 2, 16)
    nb1 = layout.group_of(1).num_blocks
    assert layout.view(1).shape == (nb1, 4, 1, 24)
    nb2 = layout.group_of(2).num_blocks
    assert layout.view(2).shape == (nb2, 2, 4, 2, 16)
    # SGLang's token-major view of the same bytes, and a -1
    assert layout.view(0, "k", shape=(nb * 4, 2, 16)).shape == (nb * 4, 2, 16)
    assert layout.view(0, "k", shape=(-1, 2, 16)).shape == (nb * 4, 2, 16)
    # another dtype of the same bytes
    assert layout.view(0, "k", dtype="uint8").shape == (nb, 4, 2, 32)
    assert layout.view(0, "k", dtype=torch.uint8).dtype == torch.uint8
    layout.close()


def test_write_through_one_view_read_back_through_others(backend: HostBackend) -> None:
    layout = KVLayout.uniform(
        backend, 3, num_kv_heads=2, head_dim=16, dtype="float16", block_size=4, max_tokens=1024
    )
    group = layout.groups[0]
    with allocator(group) as alloc:
        blocks = alloc.alloc(40)
        assert blocks is not None
        b = blocks[-1]
        assert group.page_of(b) >= 1  # not only the first page
        k1 = layout.view(1, "k")
        k1[b] = torch.arange(4 * 2 * 16, dtype=torch.float16).reshape(4, 2, 16)
        # the same bytes through the [2, num_blocks, ...] view and the token view
        both = layout.view(1)
        assert torch.equal(both[0, b], k1[b])
        tokens = layout.view(1, "k", shape=(-1, 2, 16))
        assert torch.equal(tokens[b * 4 : (b + 1) * 4], k1[b])
        # nothing else changed: V of the same layer, K of the neighbours, other blocks
        assert not layout.view(1, "v")[b].any()
        assert not layout.view(0, "k")[b].any()
        assert not layout.view(2, "k")[b].any()
        assert not k1[blocks[0]].any()
        # write V through the combined view, read through the V view
        both[1, b] = 7
        assert bool((layout.view(1, "v")[b] == 7).all())
        assert torch.equal(k1[b].flatten()[:3], torch.tensor([0, 1, 2], dtype=torch.float16))
    layout.close()


def test_packed_layer_holds_k_then_v_per_block(backend: HostBackend) -> None:
    layout = KVLayout.uniform(
        backend, 2, num_kv_heads=2, head_dim=8, dtype="float32", block_size=4, kind="packed",
        max_tokens=256,
    )  # fmt: skip
    (group,) = layout.groups
    assert len(group.segments) == 2
    with allocator(group) as alloc:
        (b,) = alloc.alloc(1) or []
        view = layout.view(0)
        view[b, 0] = 1.0
        view[b, 1] = 2.0
        raw = layout.view(0, shape=(-1,))
        per_block = 2 * 4 * 2 * 8
        start = b * per_block
        assert bool((raw[start : start + per_block // 2] == 1.0).all())
        assert bool((raw[start + per_block // 2 : start + per_block] == 2.0).all())
        assert not layout.view(1)[b].any()
    layout.close()


# ------------------------------------------------------------------------------ groups
def test_heterogeneous_layers_get_their_own_page_id_spaces(backend: HostBackend) -> None:
    layers = [
        LayerSpec(2, 16, "float16"),  # 256 B blocks
        LayerSpec(4, 16, "float16"),  # 512 B blocks
        LayerSpec(2, 16, "float16"),
        LayerSpec(1, 24, "float16", kind="mla"),  # 192 B blocks, one segment
    ]
    layout = KVLayout(backend, layers, block_size=4, max_tokens=512)
    assert len(layout.groups) == 3
    g0, g1, g2 = layout.group_of(0), layout.group_of(1), layout.group_of(3)
    assert layout.group_of(2) is g0
    assert g0.layers == (0, 2) and g1.layers == (1,) and g2.layers == (3,)
    assert (g0.blocks_per_page, g1.blocks_per_page) == (16, 8)
    assert g2.page_bytes == 12288 and g2.blocks_per_page == 64
    assert len(g0.segments) == 4 and len(g1.segments) == 2 and len(g2.segments) == 1
    # every group allocates independently; block ids overlap across groups, bytes do not
    allocs = [allocator(g) for g in layout.groups]
    got = [a.alloc(3) for a in allocs]
    assert all(blocks == [0, 1, 2] for blocks in got)
    layout.view(0, "k")[1] = 1
    layout.view(1, "k")[1] = 2
    layout.view(3)[1] = 3
    assert bool((layout.view(0, "k")[1] == 1).all())
    assert bool((layout.view(1, "k")[1] == 2).all())
    assert bool((layout.view(3)[1] == 3).all())
    assert not layout.view(2, "k")[1].any()
    for a in allocs:
        a.close()
    layout.close()


def test_explicit_groups(backend: HostBackend) -> None:
    layers = [
        LayerSpec(2, 16, "float16", group="full"),
        LayerSpec(2, 16, "float16", group="sliding"),
        LayerSpec(2, 16, "float16", group="full"),
    ]
    layout = KVLayout(backend, layers, block_size=4, max_tokens=256)
    assert [g.name for g in layout.groups] == ["full", "sliding"]
    assert layout.group_of(2).layers == (0, 2)
    layout.close()
    bad = [LayerSpec(2, 16, "float16", group="x"), LayerSpec(4, 16, "float16", group="x")]
    with pytest.raises(InvalidArgument, match="different block sizes"):
        KVLayout(backend, bad, block_size=4, max_tokens=256)
    assert backend.live_counts == (0, 0)


# ------------------------------------------------------------------------ shared layers
def test_layer_sharing_kv_has_no_reservation_and_views_its_owner(backend: HostBackend) -> None:
    layers = [
        LayerSpec(2, 16, "float16"),
        LayerSpec(2, 16, "float16"),
        LayerSpec(2, 16, "float16", shares_kv_with=0),
        LayerSpec(2, 16, "float16", shares_kv_with=2),  # a chain resolves to layer 0
    ]
    layout = KVLayout(backend, layers, block_size=4, max_tokens=256)
    assert backend.live_counts[0] == 2  # only layers 0 and 1 reserve
    (group,) = layout.groups
    assert group.layers == (0, 1)
    assert layout.owner_of(2) == 0 and layout.owner_of(3) == 0
    assert layout.group_of(3) is group
    assert layout.segments_of(3) == layout.segments_of(0)
    with allocator(group) as alloc:
        (b,) = alloc.alloc(1) or []
        layout.view(0, "v")[b] = 5
        assert bool((layout.view(3, "v")[b] == 5).all())
        assert layout.view(2, "k").data_ptr() == layout.view(0, "k").data_ptr()
        assert not layout.view(1, "v")[b].any()
    layout.close()


def test_bad_sharing_is_refused(backend: HostBackend) -> None:
    spec = LayerSpec(2, 16, "float16")
    with pytest.raises(InvalidArgument, match="earlier layer"):
        KVLayout(backend, [spec, LayerSpec(2, 16, "float16", shares_kv_with=1)], block_size=4)
    with pytest.raises(InvalidArgument, match="earlier layer"):
        KVLayout(backend, [LayerSpec(2, 16, "float16", shares_kv_with=3), spec], block_size=4)
    with pytest.raises(InvalidArgument, match="geometry"):
        KVLayout(backend, [spec, LayerSpec(4, 16, "float16", shares_kv_with=0)], block_size=4)
    with pytest.raises(InvalidArgument, match="layer index"):
        LayerSpec(2, 16, shares_kv_with=-1)
    assert backend.live_counts == (0, 0)


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_kv_heads": 0, "head_dim": 16}, "num_kv_heads"),
        ({"num_kv_heads": 2, "head_dim": -1}, "head_dim"),
        ({"num_kv_heads": 2.0, "head_dim": 16}, "num_kv_heads"),
        ({"num_kv_heads": True, "head_dim": 16}, "num_kv_heads"),
        ({"num_kv_heads": 2, "head_dim": 16, "dtype": "complex64"}, "unsupported dtype"),
        ({"num_kv_heads": 2, "head_dim": 16, "kind": "interleaved"}, "kind"),
        ({"num_kv_heads": 2, "head_dim": 16, "group": 3}, "group"),
    ],
)
def test_bad_layer_specs(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        LayerSpec(**kwargs)  # type: ignore[arg-type]


def test_layer_spec_accepts_framework_dtypes() -> None:
    assert LayerSpec(2, 16, torch.bfloat16).dtype == "bfloat16"


def test_bad_layouts(backend: HostBackend) -> None:
    spec = LayerSpec(2, 16, "float16")
    with pytest.raises(InvalidArgument, match="at least one layer"):
        KVLayout(backend, [], block_size=4)
    with pytest.raises(InvalidArgument, match="block_size"):
        KVLayout(backend, [spec], block_size=0)
    with pytest.raises(InvalidArgument, match="max_tokens"):
        KVLayout(backend, [spec], block_size=4, max_tokens=-5)
    with pytest.raises(InvalidArgument, match="not a LayerSpec"):
        KVLayout(backend, [spec, (2, 16)], block_size=4)  # type: ignore[list-item]
    with pytest.raises(InvalidArgument, match="Backend"):
        KVLayout(object(), [spec], block_size=4)  # type: ignore[arg-type]
    big = HostBackend(budget=64 << 20, granularity=2 << 20)
    with pytest.raises(InvalidArgument, match=str(MAX_PAGE_BYTES)):
        # 257-byte blocks need 257 x 2 MiB page ids
        KVLayout.uniform(big, 1, num_kv_heads=1, head_dim=1, dtype="uint8", block_size=257)
    big.close()
    assert backend.live_counts == (0, 0)


def test_bad_views(backend: HostBackend) -> None:
    layers = [LayerSpec(2, 16, "float16"), LayerSpec(1, 24, "float16", kind="mla")]
    layout = KVLayout(backend, layers, block_size=4, max_tokens=256)
    with pytest.raises(InvalidArgument, match="outside"):
        layout.view(2)
    with pytest.raises(InvalidArgument, match="int"):
        layout.view("0")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="single-buffer"):
        layout.view(1, "k")
    with pytest.raises(InvalidArgument, match="part"):
        layout.view(0, "q")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="elements"):
        layout.view(0, "k", shape=(3, 3))
    with pytest.raises(InvalidArgument, match="more than one -1"):
        layout.view(0, "k", shape=(-1, -1))
    with pytest.raises(InvalidArgument, match="cannot hold"):
        layout.view(0, "k", shape=(-1, 7))
    with pytest.raises(InvalidArgument, match="outside"):
        layout.group_of(0).page_of(layout.group_of(0).num_blocks)
    with pytest.raises(InvalidArgument, match="outside"):
        layout.group_of(0).blocks_of(-1)
    layout.close()
    with pytest.raises(InvalidArgument, match="closed"):
        layout.view(0)


def test_close_frees_every_reservation(backend: HostBackend) -> None:
    with KVLayout.uniform(backend, 5, num_kv_heads=2, head_dim=16, block_size=4) as layout:
        assert backend.live_counts == (5, 0)
        assert not layout.closed
    assert layout.closed
    assert backend.live_counts == (0, 0)
    layout.close()  # idempotent
