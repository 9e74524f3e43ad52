"""Every SGLang internal the adapter touches, one declarative entry each.

This table is the adapter's whole contact surface with SGLang. Each entry names a
target (a dotted path, as SGLang's `HookRegistry` takes it), the SGLang versions it
was written for, and the hook that wraps it. Every hook is an AROUND hook: it calls
SGLang's own code and changes one decision (how many bytes the pool may use, where a
buffer lives, which slots are free). Nothing is replaced wholesale.

`install()` runs in every SGLang process once the plugin is enabled. It refuses an
SGLang version none of the entries was written for, and an entry whose target is
missing, naming both, before any hook is registered. SGLang's `load_plugins` logs and
swallows a plugin's exception (and would then run without kvcached), so a refusal is
also made to stop the engine: it is raised again from the construction of SGLang's
`ServerArgs`, the first thing an `Engine` or server builds after loading plugins.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("sglang.kvcached")

#: The SGLang versions this adapter was written for.
SUPPORTED = ("0.5.16",)

#: where a refusal is raised again when SGLang swallowed it (see the module docstring)
SERVER_ARGS_INIT = "sglang.srt.server_args.ServerArgs.__post_init__"


class UnsupportedSglang(RuntimeError):
    """The installed SGLang is not one the adapter targets, or a target moved."""


Hook = Callable[..., Any]  # (original, *args, **kwargs) -> result


@dataclass(frozen=True)
class Shim:
    concern: str
    target: str
    versions: tuple[str, ...]
    hook: Callable[[], Hook]  # imported lazily: the hook's module needs torch/SGLang


def _hook(module: str, name: str) -> Callable[[], Hook]:
    def load() -> Hook:
        found: Hook = getattr(importlib.import_module(f"kvcached.engines.sglang.{module}"), name)
        return found

    return load


_CONFIGURATOR = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"
_POOLS = "sglang.srt.mem_cache.memory_pool"
_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
_CHECKER = "sglang.srt.managers.scheduler_components.invariant_checker"
_RECEIVER = "sglang.srt.managers.scheduler_components.request_receiver.SchedulerRequestReceiver"

SHIMS: tuple[Shim, ...] = (
    # start-up: unsupported options are refused before any process is spawned
    Shim("refusals", SERVER_ARGS_INIT, SUPPORTED, _hook("refusals", "refuse_unsupported")),
    # sizing: the pool holds what the ledger's budget could hold, not a profiled figure
    Shim(
        "pool size",
        f"{_CONFIGURATOR}._profile_available_bytes",
        SUPPORTED,
        _hook("sizing", "budget_instead_of_profile"),
    ),
    # buffers: each layer's K/V (MHA) or KV (MLA) buffer is a view of kvcached memory
    Shim(
        "MHA buffers",
        f"{_POOLS}.MHATokenToKVPool._create_buffers_normal",
        SUPPORTED,
        _hook("buffers", "mha_buffers"),
    ),
    Shim(
        "MLA buffers",
        f"{_POOLS}.MLATokenToKVPool._create_buffers",
        SUPPORTED,
        _hook("buffers", "mla_buffers"),
    ),
    # allocator: SGLang's own allocator, made to hand out only mapped slots
    Shim(
        "token allocator",
        f"{_CONFIGURATOR}._build_token_to_kv_pool_allocator",
        SUPPORTED,
        _hook("allocator", "elastic_allocator"),
    ),
    # the idle invariant check compares against the elastic capacity
    Shim(
        "idle invariant check",
        f"{_CHECKER}.SchedulerInvariantChecker._check_full_pool",
        SUPPORTED,
        _hook("allocator", "checks_elastic_capacity"),
    ),
    # upkeep on the scheduler's thread: while busy (limit, budget pressure) and idle
    Shim(
        "upkeep while busy",
        f"{_SCHEDULER}.get_next_batch_to_run",
        SUPPORTED,
        _hook("lifecycle", "upkeep_between_batches"),
    ),
    Shim(
        "upkeep while idle", f"{_SCHEDULER}.on_idle", SUPPORTED, _hook("lifecycle", "upkeep_idle")
    ),
    # tensor parallelism: rank 0's page decisions ride on the requests it broadcasts
    Shim(
        "tensor-parallel decisions",
        f"{_RECEIVER}._broadcast_reqs_across_ranks",
        SUPPORTED,
        _hook("tensor_parallel", "carries_decisions"),
    ),
)

#: internals the adapter calls without hooking them; a moved one is refused the same way
USES: tuple[tuple[str, str], ...] = (
    ("tensor-parallel group", "sglang.srt.distributed.parallel_state.get_tp_group"),
)


def sglang_version() -> str:
    """The installed SGLang's version, without importing SGLang."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _resolve(target: str) -> Any:
    """The object a dotted `target` names (a module attribute or a class attribute)."""
    parts = target.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            owner: Any = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:]:
            owner = getattr(owner, name)
        return owner
    raise ImportError(f"no module of {target} can be imported")


def plan(
    version: str,
    shims: Sequence[Shim] = SHIMS,
    resolve: Callable[[str], Any] = _resolve,
    uses: Sequence[tuple[str, str]] = USES,
) -> list[Shim]:
    """The entries to install on SGLang `version`; `UnsupportedSglang`, naming the
    version and the target, when the version is not supported or a target moved."""
    if version not in SUPPORTED:
        raise UnsupportedSglang(
            f"kvcached's SGLang adapter supports SGLang {', '.join(SUPPORTED)}; this is "
            f"SGLang {version}. Unset ENABLE_KVCACHED to run SGLang without kvcached."
        )
    chosen = [shim for shim in shims if version in shim.versions]
    needed = [(shim.concern, shim.target) for shim in chosen] + list(uses)
    for concern, target in needed:
        try:
            resolve(target)
        except (ImportError, AttributeError) as exc:
            raise UnsupportedSglang(
                f"kvcached's SGLang adapter ({concern}) needs {target}, which "
                f"SGLang {version} does not have ({exc}); this SGLang build moved an "
                "internal the adapter was written for. Unset ENABLE_KVCACHED to run "
                "without kvcached."
            ) from None
    return chosen


def as_around(hook: Hook) -> Hook:
    """`hook` marked so that a test or a log can tell it is kvcached's."""
    hook.__kvcached_hook__ = True  # type: ignore[attr-defined]
    return hook


_installed = False


def install() -> None:
    """Check the SGLang version, then register every hook with SGLang's HookRegistry
    (SGLang applies them right after its plugins ran). Idempotent."""
    global _installed
    if _installed:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    version = sglang_version()
    try:
        chosen = plan(version)
    except UnsupportedSglang as refusal:
        _refuse_at_start(HookRegistry, HookType, refusal)
        raise
    for shim in chosen:
        HookRegistry.register(shim.target, as_around(shim.hook()), HookType.AROUND)
    _installed = True
    log.info("kvcached: %d hooks registered for SGLang %s", len(chosen), version)


def _refuse_at_start(registry: Any, hook_type: Any, refusal: Exception) -> None:
    def refuse(*_args: Any, **_kwargs: Any) -> None:
        raise refusal

    log.error("%s", refusal)
    registry.register(SERVER_ARGS_INIT, refuse, hook_type.BEFORE)
