"""Worker side: vLLM's KV buffer is a kvcached reservation.

vLLM allocates its KV cache as flat int8 buffers (`torch.zeros(size, dtype=int8)`) and
then views them per layer in the shape, dtype and strides its attention backend wants.
The adapter keeps all of that vLLM's own code: it wraps the function that allocates,
and while it runs, the function's `torch.zeros` of exactly the planned sizes returns
zero-copy tensors over parts of one kvcached reservation instead of fresh memory,
each with a storage of its own that begins where it does, as fresh memory's would.
Every other call goes to torch. So shapes, strides and the layout (LBHNC on vLLM-CPU,
blocks-first FlashAttention on the GPU) are vLLM's, addresses never move (kernels and
CUDA graphs run unchanged), and physical pages come and go under the views as blocks
are used.

Where the blocks are. Block `b` of every layer's page lies at a fixed stride
(`KVCacheTensor` says where): one run of blocks per layer in layer-outermost buffers,
one run holding all layers in block-outermost ones. `geometry_of` turns that into a
`BackingBuffer`'s segments, so a page id maps the same blocks in every layer at once.

Only the allocation the engine core sized for kvcached is served (its block count is
`instance.planned_blocks`); a smaller one (a profiling pass) runs untouched.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvcached.backing import BackingBuffer
from kvcached.engines.vllm import instance

log = logging.getLogger("vllm.kvcached")  # shown by vLLM's own log handler


@dataclass(frozen=True)
class Geometry:
    nbytes: int  # the reservation
    num_blocks: int
    block_bytes: int
    segment_offsets: tuple[int, ...]
    #: the `torch.zeros` calls vLLM will make: (size, offset of its view in the reservation)
    calls: tuple[tuple[int, int], ...]

    def backing(self, backend: Any) -> BackingBuffer:
        """A reservation on `backend` laid out like this buffer."""
        return BackingBuffer(
            backend,
            nbytes=self.nbytes,
            num_blocks=self.num_blocks,
            block_bytes=self.block_bytes,
            segment_offsets=self.segment_offsets,
            name="vllm-kv",
        )


def _refuse(what: str) -> RuntimeError:
    return RuntimeError(
        f"kvcached cannot serve this vLLM KV cache: {what}. Supported: KV cache groups "
        "that share one block size in bytes (vLLM unifies them; see groups.py). Unset "
        "ENABLE_KVCACHED to run without kvcached."
    )


def geometry_of(kv_cache_config: Any, granularity: int) -> Geometry:
    """Where vLLM will place every block, for both KVCacheTensor forms (0.26 and 0.32)."""
    tensors = list(kv_cache_config.kv_cache_tensors)
    num_blocks = int(kv_cache_config.num_blocks)
    if not tensors:
        raise _refuse("the model has no KV cache tensors")
    if hasattr(tensors[0], "layers"):  # 0.32: one backing buffer, placed by strides
        sizes = {t.size for t in tensors}
        strides = {t.block_stride for t in tensors}
        if len(sizes) != 1 or len(strides) != 1:
            raise _refuse("its KV cache tensors do not share one backing buffer and stride")
        size, stride = sizes.pop(), strides.pop()
        offsets: list[int] = []
        for t in tensors:
            count = len(t.layers)
            if count == 1 or t.layer_stride >= num_blocks * stride:  # layer-outermost
                offsets += [t.offset + i * t.layer_stride for i in range(count)]
            elif stride >= count * t.layer_stride:  # block-outermost
                offsets.append(t.offset)
            else:
                raise _refuse(f"its layers interleave ({t})")
        # KV cache groups overlay one buffer (groups.py): a shared offset is one segment
        # (runs that overlap only in part are refused by BackingBuffer)
        segments = tuple(sorted(set(offsets)))
        return Geometry(size, num_blocks, stride, segments, ((size, 0),))
    packed = [t for t in tensors if t.block_stride > 0]
    if packed:  # 0.26 Model Runner V2's packed form: all tensors alias one backing
        if len(packed) != len(tensors) or len({t.size for t in tensors}) != 1:
            raise _refuse("it mixes packed and separate KV cache tensors")
        size, stride = tensors[0].size, tensors[0].block_stride
        return Geometry(size, num_blocks, stride, (0,), ((size, 0),))
    pages = {t.size // num_blocks for t in tensors}
    if len(pages) != 1 or any(t.size % num_blocks for t in tensors):
        raise _refuse("its KV cache tensors have different page sizes")
    page = pages.pop()
    at, calls = 0, []
    for t in tensors:  # 0.26: one buffer per tensor, laid side by side in one reservation
        calls.append((t.size, at))
        at += -(-t.size // granularity) * granularity
    return Geometry(at, num_blocks, page, tuple(off for _, off in calls), tuple(calls))


class _ZerosFromReservation:
    """Stands in for the `torch` module inside vLLM's allocating function: the planned
    int8 `zeros` calls get their parts of the reservation, everything else is torch's.

    Each part is a tensor of its own whose storage begins where the part does
    (`BackingBuffer.part`), as a fresh `torch.zeros` result's does, not a slice of one
    tensor over the whole reservation. vLLM 0.26 reads its buffers' *storage* in several
    places, all of which assume that: it places a Mamba layer's state views with
    `torch.as_strided(..., storage_offset=...)`, an offset from the start of the storage
    (over slices every layer's state landed in the first buffer, and the H200's Qwen3.5
    row gave other tokens than vLLM alone, benchmarks/results/h200-2026-12-04b); the
    NixlConnector takes buffers that share one storage for a packed, block-interleaved
    allocation; the OffloadingConnector asserts a Mamba layer's storage offset is 0; and
    its block copies (`copy_kv_cache_blocks_inplace`) view each distinct storage as
    (num_blocks, page) rows."""

    def __init__(self, torch: Any, parts: Sequence[Any]) -> None:
        self._torch = torch
        self._parts = list(parts)  # flat int8, one per planned call, in the calls' order
        self.served = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)

    def zeros(self, *args: Any, **kwargs: Any) -> Any:
        torch = self._torch
        shape = args[0] if len(args) == 1 else args
        if (
            self.served < len(self._parts)
            and kwargs.get("dtype") is torch.int8
            and isinstance(shape, int)
            and shape == self._parts[self.served].numel()
        ):
            part = self._parts[self.served]
            self.served += 1
            device = torch.device(kwargs.get("device") or "cpu")
            if device.type != part.device.type or (
                device.index is not None and device.index != part.device.index
            ):
                raise _refuse(
                    f"vLLM runs on {device} but the kvcached backend's memory is on "
                    f"{part.device} (KVCACHED_BACKEND)"
                )
            return part
        return torch.zeros(*args, **kwargs)


def _serve(
    original: Callable[..., Any], kv_cache_config: Any, model: str | None
) -> Callable[..., Any]:
    """Run `original` with its raw KV allocations served from a new kvcached instance."""
    from kvcached.registry import framework_device, get_backend

    backend = get_backend(device=framework_device())  # a TP rank: its own GPU
    geometry = geometry_of(kv_cache_config, backend.granularity)
    log.info(
        "kvcached serves %s: %d blocks of %d bytes in %d segment(s) (first %s), calls %s",
        original.__qualname__,
        geometry.num_blocks,
        geometry.block_bytes,
        len(geometry.segment_offsets),
        kv_cache_config.kv_cache_tensors[0],
        geometry.calls[:2],
    )
    backing = geometry.backing(backend)
    try:
        parts = [backing.part(offset, size) for size, offset in geometry.calls]
    except BaseException:
        backing.close()
        raise
    if instance.replica_ops is not None:  # a tensor-parallel worker: replay the plan
        from kvcached.replay import Replica

        replica = Replica(backend, [backing.reservation])
        replica.apply(*instance.replica_ops)
        instance.replica_ops = None
        instance.replica = replica
    else:
        instance.start(backing, model=model)
    module_globals = original.__globals__
    stand_in = _ZerosFromReservation(module_globals["torch"], parts)

    def call(*args: Any, **kwargs: Any) -> Any:
        module_globals["torch"] = stand_in
        try:
            result = original(*args, **kwargs)
        finally:
            module_globals["torch"] = stand_in._torch
        if stand_in.served != len(geometry.calls):
            instance.close()
            raise RuntimeError(
                f"kvcached expected vLLM's {original.__qualname__} to allocate "
                f"{len(geometry.calls)} KV buffer(s) of {[s for s, _ in geometry.calls]} "
                f"bytes and saw {stand_in.served}: the vLLM internal moved"
            )
        return result

    return call


def _model_of(vllm_config: Any) -> str | None:
    model_config = getattr(vllm_config, "model_config", None)
    return getattr(model_config, "model", None)


def serve_from_kvcached(original: Callable[..., Any], name: str) -> Callable[..., Any]:
    """The wrapper installed for vLLM's allocating function `name` (see shims.py)."""

    def sized_for_us(kv_cache_config: Any) -> bool:
        return instance.planned_blocks == int(kv_cache_config.num_blocks)

    if name == "_allocate_kv_cache_tensors":  # GPUModelRunner method (0.26, V1)

        @functools.wraps(original)
        def method(self: Any, kv_cache_config: Any) -> Any:
            if not sized_for_us(kv_cache_config):
                return original(self, kv_cache_config)
            model = _model_of(getattr(self, "vllm_config", None))
            return _serve(original, kv_cache_config, model)(self, kv_cache_config)

        return method

    @functools.wraps(original)
    def function(kv_cache_config: Any, *args: Any, **kwargs: Any) -> Any:
        if not sized_for_us(kv_cache_config):
            return original(kv_cache_config, *args, **kwargs)
        if name == "_allocate_kv_cache" and instance.replica_ops is not None:
            from kvcached.engines.vllm.refusals import Refused

            # V2 warms up on block ids it makes up (warmup.py); a tensor-parallel
            # worker replays the scheduler's blocks and has none of its own to lend
            raise Refused(
                "vLLM's Model Runner V2 with tensor_parallel_size > 1 is not supported yet "
                "(its warm-up uses KV blocks the workers cannot map on their own); set "
                "VLLM_USE_V2_MODEL_RUNNER=0 for Model Runner V1, which kvcached supports "
                "with tensor parallelism, or run V2 with tensor_parallel_size=1"
            )
        return _serve(original, kv_cache_config, instance.slot.planned_model)(
            kv_cache_config, *args, **kwargs
        )

    return function
