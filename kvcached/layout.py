"""Where every layer's KV blocks live, and which bytes a block or a page id covers.

An engine describes its model as a list of `LayerSpec`s and a block size (tokens per
block); `KVLayout` turns that into virtual reservations, one per layer, and answers
three questions the rest of kvcached asks:

* **Views.** Each layer's buffer is dense in its own range (block `b` of a layer sits at
  `b * block_bytes` of that layer's K range, and likewise in V), so an attention kernel
  indexes it exactly as it would a tensor from `torch.empty`: vanilla speed. `view()`
  hands out zero-copy tensors over those ranges in the shape the engine asks for, e.g.
  vLLM's `[num_blocks, block_size, num_kv_heads, head_dim]` per K and V (or
  `[2, num_blocks, ...]` over both), or SGLang's `[num_tokens, heads, head_dim]`.
* **Page ids.** A page id `p` names the byte range `[p * page_bytes, (p + 1) * page_bytes)`
  of *every* buffer of a group: every layer's K and V range (one "segment" each). Mapping
  page id `p` therefore means mapping `len(segments)` physical pages, 2·L for an L-layer
  model with separate K and V, L for single-buffer layers. Block `b` lives in page id
  `b // blocks_per_page`. The page allocator hands out blocks and maps page ids; it never
  needs to know about layers.
* **Groups.** Layers whose blocks have different sizes (other KV head counts, head dims,
  dtypes, or MLA next to regular attention) cannot share one page-id space, because a
  page id must hold a whole number of blocks in every segment. Each such set of layers
  is a `KVGroup` with its own page ids, blocks per page and allocator. Layers can also
  be grouped explicitly (`LayerSpec.group`), as engines do for sliding-window layers
  that keep their own block table.

Buffer kinds (`LayerSpec.kind`):

* ``"kv"``: K and V are two segments of the layer's one reservation, K first, each
  `[num_blocks, block_size, num_kv_heads, head_dim]`; together they are also the
  `[2, num_blocks, block_size, num_kv_heads, head_dim]` tensor vLLM's FlashAttention
  backend allocates, zero-copy.
* ``"mla"``: one segment per layer holding the compressed latent (MLA): each token is
  `num_kv_heads x head_dim` values (typically 1 x (kv_lora_rank + rope_dim)).
* ``"packed"``: one segment per layer in which each block holds its K then its V,
  `[num_blocks, 2, block_size, num_kv_heads, head_dim]` (FlashInfer's layout).

A layer can instead read the KV of an earlier layer (`LayerSpec.shares_kv_with`,
cross-layer KV sharing): it gets no reservation, and its views are the earlier layer's.

Page size. A page id's range per segment (`page_bytes`) must be a multiple of the
backend granularity (2 MiB on CUDA) *and* of the block size in bytes, so that no block
straddles two page ids. The default is the least common multiple of the two: the
granularity itself for the usual power-of-two block sizes, larger for odd ones (an MLA
block of 16 x 576 bf16 values, 18 KiB, gives 18 MiB page ids on CUDA).

Virtual size. Each group reserves enough address space for `max_tokens` tokens; the
default is as many tokens as the device's whole memory could hold for that group. It
costs no physical memory.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kvcached.backend import Backend, Reservation, dtype_itemsize, dtype_name
from kvcached.errors import InvalidArgument
from kvcached.lifetime import Closeable

LayerKind = Literal["kv", "mla", "packed"]
Part = Literal["kv", "k", "v"]

KINDS: tuple[str, ...] = ("kv", "mla", "packed")
#: A page id larger than this per segment is refused: growth and release would be too coarse.
MAX_PAGE_BYTES = 512 << 20


def check_granularity(backend: Backend) -> int:
    """`backend`'s granularity, if a KV layout can be built on it: every page id holds at
    least one granule per segment, and at most MAX_PAGE_BYTES. InvalidArgument naming
    the backend otherwise. `KVLayout` and `kvcached info` both run this."""
    g = backend.granularity
    if isinstance(g, bool) or not isinstance(g, int) or not 0 < g <= MAX_PAGE_BYTES:
        raise InvalidArgument(
            f"backend {backend.name!r} has a granularity of {g!r} bytes, and a page id is "
            f"at most {MAX_PAGE_BYTES >> 20} MiB, so no KV layout fits on it; check the "
            "setting that chose it (for the host backend, KVCACHED_HOST_GRANULARITY, "
            "2MiB by default)"
        )
    return g


def _positive_int(what: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InvalidArgument(f"{what} must be a positive int, got {value!r}")
    return value


@dataclass(frozen=True)
class LayerSpec:
    """One attention layer's KV cache.

    `num_kv_heads` x `head_dim` values of `dtype` per token in each of K and V (for
    ``kind="mla"``: per token, the latent). `shares_kv_with` names an earlier layer whose
    KV this layer reads instead of having its own (its geometry must match). `group`
    puts the layer in a named group; by default layers are grouped by block size.
    """

    num_kv_heads: int
    head_dim: int
    dtype: Any = "bfloat16"
    kind: LayerKind = "kv"
    shares_kv_with: int | None = None
    group: str | None = None

    def __post_init__(self) -> None:
        _positive_int("num_kv_heads", self.num_kv_heads)
        _positive_int("head_dim", self.head_dim)
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        if self.kind not in KINDS:
            raise InvalidArgument(
                f"layer kind {self.kind!r} is not one of {', '.join(map(repr, KINDS))}"
            )
        if self.shares_kv_with is not None and (
            not isinstance(self.shares_kv_with, int)
            or isinstance(self.shares_kv_with, bool)
            or self.shares_kv_with < 0
        ):
            raise InvalidArgument(
                f"shares_kv_with must be a layer index, got {self.shares_kv_with!r}"
            )
        if self.group is not None and not isinstance(self.group, str):
            raise InvalidArgument(f"group must be a str, got {self.group!r}")

    @property
    def itemsize(self) -> int:
        return dtype_itemsize(self.dtype)

    @property
    def segments(self) -> int:
        """Buffers this layer owns per page id: 2 (K and V) or 1."""
        return 2 if self.kind == "kv" else 1

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one block in one segment."""
        per_token = self.num_kv_heads * self.head_dim * self.itemsize
        return block_size * per_token * (2 if self.kind == "packed" else 1)

    def geometry(self) -> tuple[int, int, str, str]:
        return (self.num_kv_heads, self.head_dim, self.dtype, self.kind)


@dataclass(frozen=True)
class Segment:
    """One buffer of a layer (its K, its V, or its single buffer) inside a reservation."""

    layer: int
    part: Part
    reservation: Reservation
    offset: int
    nbytes: int


@dataclass(frozen=True, eq=False)
class KVGroup:
    """Layers that share one page-id space: page id `p` covers the same
    `[p * page_bytes, (p + 1) * page_bytes)` of every segment of the group."""

    index: int
    name: str
    layers: tuple[int, ...]  # layers owning buffers here, in model order
    block_size: int  # tokens per block
    block_bytes: int  # bytes of one block in one segment
    page_bytes: int  # bytes of one page id in one segment
    num_pages: int  # page ids in the virtual range
    segments: tuple[Segment, ...]
    #: (reservation, offsets of its segments) in layer order: one map call per entry.
    reservations: tuple[tuple[Reservation, tuple[int, ...]], ...] = field(repr=False)

    @property
    def blocks_per_page(self) -> int:
        return self.page_bytes // self.block_bytes

    @property
    def num_blocks(self) -> int:
        return self.num_pages * self.blocks_per_page

    @property
    def page_id_bytes(self) -> int:
        """Physical bytes that mapping one page id costs (all segments)."""
        return self.page_bytes * len(self.segments)

    @property
    def block_id_bytes(self) -> int:
        """Physical bytes one block id stands for (all segments)."""
        return self.block_bytes * len(self.segments)

    def page_of(self, block: int) -> int:
        """The page id holding block `block`."""
        if not 0 <= block < self.num_blocks:
            raise InvalidArgument(f"block {block} is outside 0..{self.num_blocks - 1}")
        return block // self.blocks_per_page

    def blocks_of(self, page: int) -> range:
        """The block ids page id `page` holds."""
        if not 0 <= page < self.num_pages:
            raise InvalidArgument(f"page id {page} is outside 0..{self.num_pages - 1}")
        bpp = self.blocks_per_page
        return range(page * bpp, (page + 1) * bpp)

    def block_offset(self, block: int) -> int:
        """Byte offset of block `block` from the start of any segment of the group."""
        self.page_of(block)
        return block * self.block_bytes


class KVLayout(Closeable):
    """Per-layer virtual reservations for a model's KV cache, split into page-id groups.

    `layers` describes every attention layer in model order; `block_size` is tokens per
    block (one value for the whole model, as engines use). `max_tokens` caps each
    group's virtual size (default: what the device's whole memory could hold).
    `page_bytes`, when given, is the per-segment size of a page id for every group and
    must be a multiple of the granularity and of each group's block bytes.

    The layout owns its reservations: `close()` frees them (unmap everything first,
    i.e. close the allocators that map into it).
    """

    def __init__(
        self,
        backend: Backend,
        layers: Sequence[LayerSpec],
        *,
        block_size: int,
        max_tokens: int | None = None,
        page_bytes: int | None = None,
    ) -> None:
        if not isinstance(backend, Backend):
            raise InvalidArgument(f"expected a kvcached Backend, got {type(backend).__name__}")
        check_granularity(backend)
        self.backend = backend
        self.block_size = _positive_int("block_size", block_size)
        if max_tokens is not None:
            _positive_int("max_tokens", max_tokens)
        if page_bytes is not None:
            _positive_int("page_bytes", page_bytes)
        self.layers: tuple[LayerSpec, ...] = tuple(layers)
        if not self.layers:
            raise InvalidArgument("a KV layout needs at least one layer")
        for i, spec in enumerate(self.layers):
            if not isinstance(spec, LayerSpec):
                raise InvalidArgument(f"layer {i} is a {type(spec).__name__}, not a LayerSpec")
        self._owner = self._resolve_sharing()
        members = self._group_members()

        self._layer_segments: dict[int, tuple[Segment, ...]] = {}
        self._group_of_layer: dict[int, KVGroup] = {}
        groups: list[KVGroup] = []
        try:
            for index, (name, owners) in enumerate(members.items()):
                group = self._build_group(index, name, owners, max_tokens, page_bytes)
                groups.append(group)
                for layer in owners:
                    self._group_of_layer[layer] = group
        except BaseException:
            self._free_reservations()
            raise
        self.groups: tuple[KVGroup, ...] = tuple(groups)
        self._closed = False

    @classmethod
    def uniform(
        cls,
        backend: Backend,
        num_layers: int,
        *,
        num_kv_heads: int,
        head_dim: int,
        dtype: Any = "bfloat16",
        block_size: int,
        kind: LayerKind = "kv",
        max_tokens: int | None = None,
        page_bytes: int | None = None,
    ) -> KVLayout:
        """A model whose layers all have the same geometry (one group)."""
        _positive_int("num_layers", num_layers)
        spec = LayerSpec(num_kv_heads, head_dim, dtype, kind)
        return cls(
            backend,
            [spec] * num_layers,
            block_size=block_size,
            max_tokens=max_tokens,
            page_bytes=page_bytes,
        )

    # ------------------------------------------------------------ construction
    def _resolve_sharing(self) -> list[int]:
        """For each layer, the layer whose buffers it uses (itself unless shared)."""
        owner: list[int] = []
        for i, spec in enumerate(self.layers):
            target = spec.shares_kv_with
            if target is None:
                owner.append(i)
                continue
            if target >= i:
                raise InvalidArgument(
                    f"layer {i} shares KV with layer {target}; it can only share with an "
                    "earlier layer"
                )
            root = owner[target]
            if self.layers[root].geometry() != spec.geometry():
                raise InvalidArgument(
                    f"layer {i} shares KV with layer {target} but its geometry "
                    f"{spec.geometry()} differs from {self.layers[root].geometry()} "
                    "(num_kv_heads, head_dim, dtype, kind)"
                )
            owner.append(root)
        return owner

    def _group_members(self) -> dict[str, list[int]]:
        """Group name -> owning layers. Unnamed layers group by (kind, block bytes)."""
        members: dict[str, list[int]] = {}
        for i, spec in enumerate(self.layers):
            if self._owner[i] != i:
                continue
            if spec.group is not None:
                name = spec.group
            else:
                name = f"{spec.kind}:{spec.block_bytes(self.block_size)}B"
            members.setdefault(name, []).append(i)
        for name, owners in members.items():
            sizes = {self.layers[i].block_bytes(self.block_size) for i in owners}
            if len(sizes) > 1:
                raise InvalidArgument(
                    f"layers {owners} of group {name!r} have different block sizes "
                    f"({sorted(sizes)} bytes); a group needs one block size"
                )
        return members

    def _build_group(
        self,
        index: int,
        name: str,
        owners: list[int],
        max_tokens: int | None,
        requested_page_bytes: int | None,
    ) -> KVGroup:
        g = self.backend.granularity
        block_bytes = self.layers[owners[0]].block_bytes(self.block_size)
        least = math.lcm(g, block_bytes)
        if requested_page_bytes is None:
            page_bytes = least
        elif requested_page_bytes % least:
            raise InvalidArgument(
                f"page_bytes {requested_page_bytes} must be a multiple of {least} for group "
                f"{name!r} (the granularity {g} and the block size {block_bytes} bytes)"
            )
        else:
            page_bytes = requested_page_bytes
        if page_bytes > MAX_PAGE_BYTES:
            raise InvalidArgument(
                f"group {name!r}: blocks of {block_bytes} bytes need page ids of {page_bytes} "
                f"bytes to fit the {g}-byte granularity, more than {MAX_PAGE_BYTES}; choose a "
                "block_size that makes the block size in bytes a power of two times a small "
                "odd number"
            )
        bpp = page_bytes // block_bytes
        num_segments = sum(self.layers[i].segments for i in owners)
        if max_tokens is None:
            total = self.backend.mem_info()[1]
            num_pages = max(1, -(-total // (page_bytes * num_segments)))
        else:
            blocks = -(-max_tokens // self.block_size)
            num_pages = -(-blocks // bpp)
        segment_bytes = num_pages * page_bytes

        segments: list[Segment] = []
        by_reservation: list[tuple[Reservation, tuple[int, ...]]] = []
        for layer in owners:
            spec = self.layers[layer]
            reservation = self.backend.reserve(segment_bytes * spec.segments)
            parts: tuple[Part, ...] = ("k", "v") if spec.kind == "kv" else ("kv",)
            layer_segments = tuple(
                Segment(layer, part, reservation, i * segment_bytes, segment_bytes)
                for i, part in enumerate(parts)
            )
            self._layer_segments[layer] = layer_segments
            segments.extend(layer_segments)
            by_reservation.append((reservation, tuple(s.offset for s in layer_segments)))
        return KVGroup(
            index=index,
            name=name,
            layers=tuple(owners),
            block_size=self.block_size,
            block_bytes=block_bytes,
            page_bytes=page_bytes,
            num_pages=num_pages,
            segments=tuple(segments),
            reservations=tuple(by_reservation),
        )

    # ------------------------------------------------------------------ queries
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def _check_layer(self, layer: int) -> int:
        if not isinstance(layer, int) or isinstance(layer, bool):
            raise InvalidArgument(f"layer must be an int, got {layer!r}")
        if not 0 <= layer < len(self.layers):
            raise InvalidArgument(f"layer {layer} is outside 0..{len(self.layers) - 1}")
        return layer

    def owner_of(self, layer: int) -> int:
        """The layer whose buffers `layer` uses: itself, or the one it shares KV with."""
        return self._owner[self._check_layer(layer)]

    def group_of(self, layer: int) -> KVGroup:
        """The page-id group `layer`'s blocks live in (for a sharing layer, its owner's)."""
        return self._group_of_layer[self.owner_of(layer)]

    def segments_of(self, layer: int) -> tuple[Segment, ...]:
        """The buffers `layer` reads: its own, or those of the layer it shares KV with."""
        return self._layer_segments[self.owner_of(layer)]

    def default_shape(self, layer: int, part: Part = "kv") -> tuple[int, ...]:
        """The natural shape of `view(layer, part)`, blocks first."""
        spec = self.layers[self.owner_of(layer)]
        self._check_part(layer, part)
        nb = self.group_of(layer).num_blocks
        token = (self.block_size, spec.num_kv_heads, spec.head_dim)
        if spec.kind == "kv":
            return (2, nb, *token) if part == "kv" else (nb, *token)
        if spec.kind == "packed":
            return (nb, 2, *token)
        return (nb, *token)

    def _check_part(self, layer: int, part: str) -> None:
        kind = self.layers[self.owner_of(layer)].kind
        if part not in ("kv", "k", "v"):
            raise InvalidArgument(f"part must be 'kv', 'k' or 'v', got {part!r}")
        if part != "kv" and kind != "kv":
            raise InvalidArgument(
                f"layer {layer} is a single-buffer ({kind!r}) layer; view its part 'kv'"
            )

    def view(
        self,
        layer: int,
        part: Part = "kv",
        *,
        shape: Sequence[int] | None = None,
        dtype: Any = None,
    ) -> Any:
        """A zero-copy framework tensor over `layer`'s buffer.

        `part` is ``"k"`` or ``"v"`` for one half of a ``"kv"`` layer, or ``"kv"`` for the
        whole buffer (both halves, K first; the only part of single-buffer layers). The
        default shape is `default_shape(layer, part)`; `shape` reinterprets the same
        bytes in another shape of as many elements (one dimension may be -1), and
        `dtype` in another dtype of the same total size (e.g. uint8 for fp8 kernels).

        The view spans the whole virtual range: only blocks the allocator handed out are
        backed by memory, and touching any other is a fault (SIGSEGV on host).
        """
        self._check_open()
        segments = self.segments_of(layer)
        self._check_part(layer, part)
        spec = self.layers[self.owner_of(layer)]
        if part == "kv":
            first, nbytes = segments[0], sum(s.nbytes for s in segments)
        else:
            first = segments[0] if part == "k" else segments[1]
            nbytes = first.nbytes
        view_dtype = spec.dtype if dtype is None else dtype_name(dtype)
        itemsize = dtype_itemsize(view_dtype)
        if nbytes % itemsize:
            raise InvalidArgument(f"{nbytes} bytes are not a whole number of {view_dtype}")
        count = nbytes // itemsize
        if shape is None:
            default = self.default_shape(layer, part)
            if view_dtype == spec.dtype:
                dims: tuple[int, ...] = default
            else:
                dims = (*default[:-1], default[-1] * spec.itemsize // itemsize)
                if math.prod(dims) != count:
                    dims = (count,)
        else:
            dims = _fit_shape(tuple(shape), count)
        return self.backend.view(first.reservation, first.offset, dims, view_dtype)

    # ----------------------------------------------------------------- lifetime
    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgument("this KV layout was closed")

    def _free_reservations(self) -> None:
        seen: set[int] = set()
        for segments in self._layer_segments.values():
            reservation = segments[0].reservation
            if id(reservation) not in seen and not reservation.closed:
                seen.add(id(reservation))
                reservation.close()

    def close(self) -> None:
        """Free every reservation. Its pages must have been unmapped (allocators closed)."""
        if self._closed:
            return
        self._free_reservations()
        self._closed = True

    def __repr__(self) -> str:
        groups = ", ".join(
            f"{g.name}: {len(g.layers)} layers x {len(g.segments) // len(g.layers)} segments, "
            f"{g.blocks_per_page} blocks/page, {g.num_pages} pages"
            for g in self.groups
        )
        return f"KVLayout({self.num_layers} layers, block_size={self.block_size}; {groups})"


def _fit_shape(shape: tuple[int, ...], count: int) -> tuple[int, ...]:
    """`shape` with its one -1 resolved, checked to hold exactly `count` elements."""
    for d in shape:
        if not isinstance(d, int) or isinstance(d, bool) or (d < 0 and d != -1):
            raise InvalidArgument(f"view shape {shape} must hold non-negative ints (one -1)")
    unknown = [i for i, d in enumerate(shape) if d == -1]
    if len(unknown) > 1:
        raise InvalidArgument(f"view shape {shape} has more than one -1")
    known = math.prod(d for d in shape if d != -1)
    if unknown:
        if known == 0 or count % known:
            raise InvalidArgument(f"view shape {shape} cannot hold {count} elements")
        shape = tuple(count // known if d == -1 else d for d in shape)
    elif known != count:
        raise InvalidArgument(f"view shape {shape} has {known} elements; the buffer holds {count}")
    return shape
