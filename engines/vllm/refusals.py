"""What the vLLM adapter does not support, refused at start-up with the option's name.

Each check looks at the engine configuration once, in the engine core, before any KV
memory exists. A refusal says which option is the problem and what is supported, so
the user can either change the option or run without kvcached (unset ENABLE_KVCACHED).
"""

from __future__ import annotations

from typing import Any


class Refused(RuntimeError):
    """A configuration the adapter does not support (raised before the engine starts)."""

    def __init__(self, message: str) -> None:
        super().__init__(f"kvcached: {message}. Unset ENABLE_KVCACHED to run without kvcached.")


def check(vllm_config: Any, kv_cache_specs: list[dict[str, Any]]) -> list[Any]:
    """Raise `Refused` for an unsupported configuration; return the layers' KV specs."""
    parallel = vllm_config.parallel_config
    if getattr(parallel, "pipeline_parallel_size", 1) != 1:
        raise Refused(
            f"pipeline_parallel_size={parallel.pipeline_parallel_size} is not supported yet; "
            "the adapter serves tensor parallelism (any tensor_parallel_size) with "
            "pipeline_parallel_size=1"
        )
    if len({tuple(sorted(specs)) for specs in kv_cache_specs}) != 1:
        raise Refused("the workers hold different layers; every rank must hold every layer")
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        raise Refused(
            "kv_transfer_config (KV connectors, prefill/decode disaggregation) is not "
            "supported; run without a KV connector"
        )
    if getattr(vllm_config.model_config, "enable_sleep_mode", False):
        raise Refused(
            "enable_sleep_mode is not supported (kvcached already returns idle KV memory); "
            "run without it"
        )
    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
    if cache_dtype != "auto":
        raise Refused(
            f"kv_cache_dtype={cache_dtype!r} is not supported yet; the adapter serves "
            "kv_cache_dtype='auto' (the model's dtype)"
        )
    specs = list(kv_cache_specs[0].values())
    if not specs:
        raise Refused("the model has no KV cache (attention-free models gain nothing)")
    from kvcached.engines.vllm.groups import refusal_for_kinds

    refusal = refusal_for_kinds(vllm_config, specs)
    if refusal is not None:
        raise Refused(refusal)
    # layers of different KV shapes are fine: vLLM unifies the groups' page sizes and
    # overlays them on one buffer (groups.py); allocation.py refuses what it cannot place
    return specs
