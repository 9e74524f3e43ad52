"""What the SGLang adapter does not support, refused at start-up with the option's name.

`check` reads SGLang's `ServerArgs` once, in the engine process, right after SGLang
built them and before any scheduler process or KV memory exists. It takes any object
with SGLang's option names as attributes (a missing one counts as its default), so the
rules are tested without SGLang. A refusal names the option, the value given, and what
is supported; the user can change the option or run without kvcached.
"""

from __future__ import annotations

from typing import Any

from kvcached.errors import Unsupported

#: kv_cache_dtype values the buffers serve: the model's own dtype, or bf16/fp16 spelled out
#: (plain element types; quantized formats carry scales the adapter does not place yet)
SUPPORTED_KV_DTYPES = ("auto", "bf16", "bfloat16", "fp16", "float16")


#: the adapter's name for kvcached's one "configuration not supported" error: a
#: refusal of either engine adapter is the same `kvcached.errors.Unsupported`
Refused = Unsupported


def _option(args: Any, name: str, default: Any) -> Any:
    value = getattr(args, name, default)
    return default if value is None else value


#: (option, its off value, why it is refused): each is a flag or a mode that must be off
_MUST_BE_OFF: tuple[tuple[str, Any, str], ...] = (
    (
        "enable_hierarchical_cache",
        False,
        "the hierarchical (host-memory) cache copies KV pages behind the allocator's back",
    ),
    ("enable_lmcache", False, "LMCache offloads KV pages the allocator does not track"),
    (
        "disaggregation_mode",
        "null",
        "prefill/decode disaggregation transfers KV pages between instances",
    ),
    (
        "enable_dp_attention",
        False,
        "DP attention runs several schedulers over one pool; the adapter serves one",
    ),
    (
        "enable_memory_saver",
        False,
        "the memory saver pauses and resumes the KV buffers itself; kvcached already "
        "returns idle KV memory",
    ),
    ("enable_hisparse", False, "hierarchical sparse attention keeps part of the KV on the host"),
    ("enable_unified_memory", False, "the unified memory pool is a different allocator"),
    (
        "speculative_algorithm",
        None,
        "speculative decoding adds a draft model's pool and rolls allocations back",
    ),
)


def check(args: Any) -> None:
    """Raise `Unsupported` for an option the adapter does not support."""
    for name, off, why in _MUST_BE_OFF:
        value = getattr(args, name, off)
        if value not in (off, None, False):
            raise Unsupported(f"{name}={value!r} is not supported ({why}); run without it")
    for name in ("pp_size", "dp_size", "dcp_size"):
        size = int(_option(args, name, 1))
        if size != 1:
            raise Unsupported(f"{name}={size} is not supported yet; the adapter serves {name}=1")
    dtype = str(_option(args, "kv_cache_dtype", "auto"))
    if dtype not in SUPPORTED_KV_DTYPES:
        raise Unsupported(
            f"kv_cache_dtype={dtype!r} is not supported yet; the adapter serves "
            f"{', '.join(SUPPORTED_KV_DTYPES)} (the model's dtype or plain 16-bit floats)"
        )
    planned = getattr(args, "post_capture_kv_sizing_planned", None)
    if callable(planned) and planned():
        raise Unsupported(
            "SGLANG_ENABLE_POST_CAPTURE_KV_SIZING (SGLang's own CUDA-VMM KV arena) is not "
            "supported together with kvcached, which maps the KV memory itself; unset it"
        )


def refuse_unsupported(original: Any, self: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND `ServerArgs.__post_init__`: SGLang completes the options, then we check."""
    result = original(self, *args, **kwargs)
    check(self)
    return result
