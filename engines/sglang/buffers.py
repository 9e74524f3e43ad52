"""Model-runner side: the pool's per-layer KV buffers are views of a kvcached reservation.

SGLang's `MHATokenToKVPool` allocates one `[size + page_size, heads, head_dim]` tensor
per layer for K and one for V; `MLATokenToKVPool` one `[size + page_size, 1, kv_dim]`
tensor per layer. Row `r` is token slot `r`; slot 0 (and the rest of page 0) absorbs
the writes of padded tokens. The hooks wrap the two methods that create those tensors
and, instead of `torch.zeros`, hand SGLang zero-copy views of one kvcached
reservation in exactly those shapes and dtypes: one segment per buffer, SGLang's page
`p` at the same offset in every segment, so kvcached's block `p` is SGLang's page `p`
in every layer at once. Addresses never move (kernels and CUDA graphs run unchanged);
physical pages come and go under the views as the allocator hands out pages.

A hybrid sliding-window model's `SWAKVPool` builds two such pools; each gets views of
a reservation of its own, which `swa.py` puts into one instance once both exist.

Only the plain layouts are served: NHD rows, K and V of one width. The pool's other
attributes (data pointers, strides, descriptors) are SGLang's own code, run on the
views afterwards.
"""

from __future__ import annotations

import logging
from typing import Any

from kvcached.engines.sglang import instance, swa
from kvcached.engines.sglang.geometry import PoolGeometry
from kvcached.engines.sglang.refusals import Refused

log = logging.getLogger("sglang.kvcached")


def _views(found: Any, shapes: list[tuple[int, ...]], dtype: Any) -> list[Any]:
    """One view per segment, in the given shapes (rows first), over the reservation: each a
    tensor of its own whose storage begins where it does, as SGLang's own buffers' do
    (`BackingBuffer.part`; a slice of one tensor would share the reservation's storage)."""
    segment_bytes = found.backing.group.num_blocks * found.backing.group.block_bytes
    geometry = found.geometry
    views = []
    for i, shape in enumerate(shapes):
        part = found.backing.part(i * segment_bytes, geometry.rows * geometry.row_bytes)
        views.append(part.view(dtype).view(*shape))
    return views


def _model_name() -> str | None:
    return instance.slot.planned_model  # set by sizing.py in this scheduler process


def _start(pool: Any, segments: int, row_bytes: int) -> Any:
    """This pool's memory: the process's instance, or inside a hybrid sliding-window
    pool (`swa.py`) a reservation the instance takes over once both sub-pools exist."""
    from kvcached.registry import get_backend

    if instance.current() is not None:
        raise Refused(
            "this SGLang process builds a second KV pool (a draft model's); the adapter "
            "serves one model's pools"
        )
    device = str(pool.device)
    ordinal = None
    if device.startswith("cuda"):
        import torch

        index = torch.device(device).index
        ordinal = int(torch.cuda.current_device()) if index is None else int(index)
    backend = get_backend(device=ordinal)  # the GPU SGLang placed the pool on
    if device.split(":")[0] != str(backend.device).split(":")[0]:
        raise Refused(
            f"SGLang runs on {device} but the kvcached backend's memory is on "
            f"{backend.device} (KVCACHED_BACKEND)"
        )
    geometry = PoolGeometry(
        segments=segments,
        rows=int(pool.size) + int(pool.page_size),
        row_bytes=row_bytes,
        page_size=int(pool.page_size),
    )
    hybrid = swa.building()
    if hybrid is not None:  # the padding page is mapped, and zeroed, by swa.py
        return hybrid.add(geometry, backend)
    from kvcached.engines.sglang.tensor_parallel import sglang_channel, start_shared

    channel = sglang_channel()
    if channel is not None:  # a tensor-parallel rank: rank 0 decides, every rank maps
        return start_shared(geometry, backend, channel, model=_model_name())
    return instance.start(geometry, backend, model=_model_name())


def _zero_padding(found: Any, views: list[Any], page_size: int) -> None:
    """The padding page starts clean, as torch.zeros made it (once it is mapped: a
    hybrid pool's sub-pools are mapped when both exist, `swa.py`)."""
    if isinstance(found, instance.SglangInstance):
        for view in views:
            view[:page_size].zero_()


def mha_buffers(original: Any, pool: Any) -> None:
    """AROUND `MHATokenToKVPool._create_buffers_normal`."""
    if getattr(pool, "kv_cache_layout", "nhd") != "nhd" or getattr(pool, "use_hnd", False):
        raise Refused(
            f"the KV cache layout {pool.kv_cache_layout!r} is not supported; the adapter "
            "serves SGLang's NHD layout (unset SGLANG_USE_HND_KVCACHE)"
        )
    if pool.head_dim != pool.v_head_dim:
        raise Refused(
            f"K and V of different widths (head_dim {pool.head_dim}, v_head_dim "
            f"{pool.v_head_dim}) are not supported yet"
        )
    dtype = pool.store_dtype
    row_bytes = pool.head_num * pool.head_dim * dtype.itemsize
    found = _start(pool, 2 * pool.layer_num, row_bytes)
    rows = found.geometry.rows
    shape = (rows, pool.head_num, pool.head_dim)
    try:
        views = _views(found, [shape] * (2 * pool.layer_num), dtype)
        _zero_padding(found, views, pool.page_size)
    except BaseException:
        instance.close()  # a hybrid pool's reservations: swa.py closes them
        raise
    pool.k_buffer = views[: pool.layer_num]
    pool.v_buffer = views[pool.layer_num :]
    log.info("kvcached serves the MHA pool: %d layers x %s %s", pool.layer_num, shape, dtype)


def mla_buffers(original: Any, pool: Any) -> None:
    """AROUND `MLATokenToKVPool._create_buffers`."""
    dtype = pool.store_dtype
    row_bytes = pool.kv_cache_dim * dtype.itemsize
    found = _start(pool, pool.layer_num, row_bytes)
    shape = (found.geometry.rows, 1, pool.kv_cache_dim)
    try:
        views = _views(found, [shape] * pool.layer_num, dtype)
        _zero_padding(found, views, pool.page_size)
    except BaseException:
        instance.close()
        raise
    pool.kv_buffer = views
    log.info("kvcached serves the MLA pool: %d layers x %s %s", pool.layer_num, shape, dtype)
