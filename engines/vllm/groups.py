"""vLLM's KV cache groups (the hybrid allocator) on kvcached: what is served, what refused.

vLLM gives every layer a KV spec and groups layers of the same kind into KV cache
groups (full attention, sliding window, MLA, Mamba/GDN state). Since 0.32 every group
draws block ids from one block pool and all groups overlay one backing buffer: group
`g`'s layer `l` finds block `b` at ``offset + l * layer_stride + b * block_stride``, the
same strides in every group, because vLLM first makes every group's page the same size
(it scales block sizes or pads pages). A block id belongs to one group at a time, so
the overlaid groups never write the same bytes at once.

For kvcached that means a hybrid model is served exactly like a full-attention one: a
page id maps the same block range at each distinct layer offset (`allocation.py` counts
an offset that several groups share once), and the shared free queue hands ids to
whichever group asks. Per-group lifetimes need nothing extra: a sliding-window group
frees the blocks that slid out of its window through the pool like any other free, so
they are released (or kept as prefix cache and evicted page-aware) at once. Layers that
read another layer's KV (cross-layer sharing) own no spec and no memory.

Chunked local attention (Llama 4) is a window that jumps: a token attends to the tokens
of its own `attention_chunk_size` chunk only, so once a sequence has computed past a
chunk boundary its chunked group needs none of the blocks before it. vLLM's chunked
manager counts those tokens as skipped and frees their blocks through the pool, as the
sliding-window manager does (leaving the null block in their place in the block table,
which the chunk's attention never reads); a prefix hit gives the chunked group null
blocks for the chunks behind it and cached blocks only inside the current one. So
kvcached needs nothing beyond what a sliding window needs: the freed blocks go back to
the supply (or stay as prefix cache) while the full-attention group of the same
sequence keeps its own blocks for the same tokens, and since 0.32 vLLM-CPU gives the
chunked layers their own group in the shared pool (the hybrid allocator is on unless
`VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=0`; off, vLLM turns them into full
attention groups, served as such).

Gated DeltaNet (Mamba-style) layers fit the same pool: vLLM pads a layer's state (its
conv and SSM tensors) to the attention page size, so one state is one block, viewed
inside the layer's buffer at ``b * block_stride`` like a KV block. A sequence that has
no state yet (a new one, or one whose prefix ends off a cached block) starts from
zeros that vLLM writes, not from the block's bytes (0.32's CPU and GPU paths both zero
it; the conv kernel takes `has_initial_state`), so a page mapped fresh, or reused,
holds nothing the model reads. vLLM 0.26 (one buffer per `KVCacheTensor`) places a
layer's conv and SSM state views by offsets from the start of its buffer's storage, so
each buffer the adapter hands it must be a tensor of its own (`allocation.py`); over
slices of one tensor every layer's state fell into the first buffer, and the H200's
Qwen3.5 row gave other tokens. With prefix caching vLLM caches states at block
boundaries ("align" mode) and frees the others through the pool, so they are evicted
and released like KV blocks.

`SERVED` lists the spec kinds whose greedy tokens were shown equal to vLLM's own on
vLLM-CPU (`tests/test_vllm_groups.py`, `docs/compatibility.md`); any other kind is
refused at start-up with the model's architecture named.
"""

from __future__ import annotations

from typing import Any

#: KV spec kinds served, with the rows of the compatibility matrix that showed them equal
SERVED: dict[str, str] = {
    "FullAttentionSpec": "full attention (Qwen3)",
    "SlidingWindowSpec": "sliding-window attention beside full attention (GPT-OSS, Gemma-4)",
    "ChunkedLocalAttentionSpec": "chunked local attention beside full attention (Llama 4)",
    "MLAAttentionSpec": "multi-head latent attention (DeepSeek-V2, DeepSeek-V3)",
    "MambaSpec": "Gated DeltaNet state beside attention (Qwen3-Next)",
}


def architecture_of(vllm_config: Any) -> str:
    """The model's architecture class, as vLLM resolved it (for messages)."""
    model_config = getattr(vllm_config, "model_config", None)
    names = getattr(model_config, "architectures", None)
    if not names:
        hf_config = getattr(model_config, "hf_config", None)
        names = getattr(hf_config, "architectures", None)
    return ", ".join(names) if names else "this model"


def unserved_kinds(specs: list[Any]) -> list[str]:
    """The spec kinds among `specs` that kvcached does not serve, sorted."""
    return sorted({type(spec).__name__ for spec in specs} - set(SERVED))


def refusal_for_kinds(vllm_config: Any, specs: list[Any]) -> str | None:
    """The start-up refusal for layers of kinds not served, or None when all are."""
    unserved = unserved_kinds(specs)
    if not unserved:
        return None
    served = "; ".join(f"{kind}: {what}" for kind, what in SERVED.items())
    return (
        f"{architecture_of(vllm_config)} has KV cache layers of kind {', '.join(unserved)}, "
        f"which the adapter does not serve yet (served: {served})"
    )


def largest_page(specs: list[Any]) -> int:
    """The page (one block of one layer) every group's page is unified to."""
    return max(int(spec.page_size_bytes) for spec in specs)
