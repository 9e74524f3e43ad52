"""Every SGLang internal the adapter touches, one declarative entry each.

These two tables are the adapter's whole contact surface with SGLang. `SHIMS` are the
hooks: each names a target (a dotted path, as SGLang's `HookRegistry` takes it), the
SGLang versions it was written for, and the hook that wraps it. Every hook is an
AROUND hook: it calls SGLang's own code and changes one decision (how many bytes the
pool may use, where a buffer lives, which slots are free). Nothing is replaced
wholesale. `CONTACTS` are everything else the adapter's code reaches: what it imports
and calls (`get_num_new_pages`, `EvictParams`, the TP group), the options and pool
attributes it reads, what it writes (the per-layer buffers, the allocator's free
lists), what it swaps (the built allocator's `__class__`, the radix cache's eviction
strategy) and the allocator methods its elastic subclass overrides
(`kvcached.contacts.Contact` says how each is checked).

`install()` runs in every SGLang process once the plugin is enabled. It refuses an
SGLang version none of the entries was written for, and an entry of either table whose
target is missing, naming both, before any hook is registered. SGLang's `load_plugins`
logs and swallows a plugin's exception (and would then run without kvcached), so a
refusal is also made to stop the engine: it is raised again from the construction of
SGLang's `ServerArgs`, the first thing an `Engine` or server builds after loading
plugins. A test scans the adapter's code for what it imports from SGLang and for the
private names it reaches, and fails when one is not in a table; the tables are checked
against the places recorded from SGLang's wheel (tests/engine_facts/), and
docs/engines/shims.md is rendered from them (scripts/render_shims.py).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvcached.contacts import Contact, missing

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
    how: str = "wraps"  # an AROUND hook: SGLang's own code runs inside it
    optional: bool = False  # every SGLang target is required

    @property
    def used_in(self) -> str:
        """The adapter module that holds the hook."""
        return f"{getattr(self.hook, 'module', '?')}.py"


def _hook(module: str, name: str) -> Callable[[], Hook]:
    def load() -> Hook:
        found: Hook = getattr(importlib.import_module(f"kvcached.engines.sglang.{module}"), name)
        return found

    load.module = module  # type: ignore[attr-defined]  # for `Shim.used_in`
    return load


_CONFIGURATOR = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"
_POOLS = "sglang.srt.mem_cache.memory_pool"
_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
_CHECKER = "sglang.srt.managers.scheduler_components.invariant_checker"
_RECEIVER = "sglang.srt.managers.scheduler_components.request_receiver.SchedulerRequestReceiver"
_SWA_POOL = "sglang.srt.mem_cache.swa_memory_pool.SWAKVPool"
_SWA_ALLOCATOR = "sglang.srt.mem_cache.allocator.swa.SWATokenToKVPoolAllocator"
_STATS = "sglang.srt.managers.scheduler_components.pool_stats_observer"

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
    # swa.py: a hybrid sliding-window model's two pools, one instance over both
    Shim(
        "hybrid sliding-window pools",
        f"{_SWA_POOL}.__init__",
        SUPPORTED,
        _hook("swa", "builds_both_pools"),
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
    Shim(
        "idle invariant check (the window pool)",
        f"{_CHECKER}.SchedulerInvariantChecker._check_swa_pool",
        SUPPORTED,
        _hook("swa", "checks_window_capacity"),
    ),
    # pool statistics: usage measured against what the elastic pools can hold now
    Shim(
        "pool statistics",
        f"{_STATS}.SchedulerPoolStatsObserver.get_pool_stats",
        SUPPORTED,
        _hook("pool_stats", "usage_of_what_it_can_hold"),
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

_ALLOCATORS = "sglang.srt.mem_cache.allocator"
_BASE_ALLOCATOR = f"{_ALLOCATORS}.BaseTokenToKVPoolAllocator"
_RADIX = "sglang.srt.mem_cache.radix_cache"
_MAMBA_RADIX = "sglang.srt.mem_cache.mamba_radix_cache.MambaRadixCache"
_PREFIX = "sglang.srt.mem_cache.base_prefix_cache"
_ARGS = "sglang.srt.server_args.ServerArgs"
_GROUP = "sglang.srt.distributed.parallel_state.GroupCoordinator"


def _contacts(concern: str, how: str, used_in: str, targets: Sequence[str]) -> tuple[Contact, ...]:
    return tuple(Contact(concern, target, SUPPORTED, how, used_in) for target in targets)


#: everything else the adapter reaches (imports, calls, reads, writes, swaps); a moved
#: one is refused at start-up the same way
CONTACTS: tuple[Contact, ...] = (
    # refusals.py: the options SGLang completed (after ServerArgs.__post_init__)
    *_contacts(
        "refusals",
        "reads",
        "refusals.py",
        [
            f"{_ARGS}.{name}"
            for name in (
                "enable_hierarchical_cache",
                "enable_lmcache",
                "disaggregation_mode",
                "enable_dp_attention",
                "enable_memory_saver",
                "enable_hisparse",
                "enable_unified_memory",
                "speculative_algorithm",
                "tp_size",
                "pp_size",
                "dp_size",
                "dcp_size",
                "kv_cache_dtype",
                "post_capture_kv_sizing_planned",
            )
        ],
    ),
    # sizing.py: the configurator's view of the model
    *_contacts(
        "pool size",
        "reads",
        "sizing.py",
        [
            f"{_CONFIGURATOR}.{name}"
            for name in (
                "server_args",
                "model_config",
                "is_hybrid_swa",
                "mambaish_config",
                "is_draft_worker",
            )
        ]
        + ["sglang.srt.configs.model_config.ModelConfig.model_path"],
    ),
    # mamba.py: a hybrid Mamba model's state pool, sized by SGLang's own rule
    *_contacts(
        "Mamba state pool",
        "reads",
        "mamba.py",
        [f"{_ARGS}.max_mamba_cache_size", f"{_ARGS}.max_running_requests"],
    ),
    *_contacts(
        "Mamba state pool",
        "calls",
        "mamba.py",
        [
            f"{_CONFIGURATOR}._handle_max_mamba_cache",
            f"{_CONFIGURATOR}._calculate_mamba_ratio",
            f"{_ARGS}.override",
        ],
    ),
    # buffers.py: the pool's shape, and the buffers it gets instead of torch.zeros
    *_contacts(
        "MHA buffers",
        "reads",
        "buffers.py",
        [
            f"{_POOLS}.MHATokenToKVPool.{name}"
            for name in (
                "kv_cache_layout",
                "use_hnd",
                "head_num",
                "head_dim",
                "v_head_dim",
                "layer_num",
                "store_dtype",
                "size",
                "page_size",
                "device",
            )
        ],
    ),
    *_contacts(
        "MHA buffers",
        "writes",
        "buffers.py",
        [f"{_POOLS}.MHATokenToKVPool.k_buffer", f"{_POOLS}.MHATokenToKVPool.v_buffer"],
    ),
    *_contacts(
        "MLA buffers",
        "reads",
        "buffers.py",
        [
            f"{_POOLS}.MLATokenToKVPool.{name}"
            for name in ("kv_cache_dim", "layer_num", "store_dtype", "size", "page_size", "device")
        ],
    ),
    Contact(
        "MLA buffers", f"{_POOLS}.MLATokenToKVPool.kv_buffer", SUPPORTED, "writes", "buffers.py"
    ),
    # allocator.py: the built allocator's `__class__` becomes an elastic subclass of its
    # own class, whose methods wrap SGLang's
    *_contacts(
        "token allocator (its class swapped for an elastic subclass)",
        "swaps",
        "allocator.py",
        [f"{_ALLOCATORS}.TokenToKVPoolAllocator", f"{_ALLOCATORS}.PagedTokenToKVPoolAllocator"],
    ),
    *_contacts(
        "token allocator",
        "overrides",
        "allocator.py",
        [
            f"{_BASE_ALLOCATOR}.{name}"
            for name in (
                "available_size",
                "alloc",
                "alloc_extend",
                "alloc_decode",
                "backup_state",
                "restore_state",
                "clear",
                "resize",
            )
        ],
    ),
    *_contacts(
        "token allocator: the stock of mapped pages",
        "writes",
        "allocator.py",
        [f"{_BASE_ALLOCATOR}.free_pages", f"{_BASE_ALLOCATOR}.release_pages"],
    ),
    *_contacts(
        "token allocator",
        "reads",
        "allocator.py",
        [f"{_BASE_ALLOCATOR}.page_size", f"{_BASE_ALLOCATOR}.device"],
    ),
    Contact(
        "token allocator: pages an allocation needs",
        "sglang.srt.utils.get_num_new_pages",
        SUPPORTED,
        "imports",
        "elastic_classes.py",
    ),
    *_contacts(
        "idle invariant check",
        "reads",
        "allocator.py",
        [
            f"{_CHECKER}.SchedulerInvariantChecker.token_to_kv_pool_allocator",
            f"{_CHECKER}.SchedulerInvariantChecker.is_hybrid_ssm",
            "sglang.srt.managers.scheduler_components.pool_stats_observer.PoolStats"
            ".full_available_size",
        ],
    ),
    *_contacts(
        "idle invariant check (the total it checks against)",
        "swaps",
        "allocator.py",
        [
            f"{_CHECKER}.SchedulerInvariantChecker.max_total_num_tokens",
            f"{_BASE_ALLOCATOR}.size",  # a hybrid Mamba model's total
        ],
    ),
    # swa.py: the two pools of a hybrid sliding-window model and their allocator
    *_contacts(
        "hybrid sliding-window pools",
        "reads",
        "swa.py",
        [
            f"{_SWA_POOL}.{name}"
            for name in (
                "full_kv_pool",
                "swa_kv_pool",
                "full_layer_nums",
                "swa_layer_nums",
                "size",
                "size_swa",
            )
        ]
        + [f"{_POOLS}.MHATokenToKVPool.{name}" for name in ("k_buffer", "v_buffer", "page_size")],
    ),
    Contact(
        "hybrid sliding-window allocator (its class swapped for an elastic subclass)",
        _SWA_ALLOCATOR,
        SUPPORTED,
        "swaps",
        "swa.py",
    ),
    *_contacts(
        "hybrid sliding-window allocator",
        "reads",
        "swa.py",
        [f"{_SWA_ALLOCATOR}.{name}" for name in ("full_attn_allocator", "swa_attn_allocator")],
    ),
    *_contacts(
        "hybrid sliding-window allocator",
        "overrides",
        "swa.py",
        [
            f"{_SWA_ALLOCATOR}.{name}"
            for name in (
                "available_size",
                "full_available_size",
                "swa_available_size",
                "alloc",
                "alloc_extend",
                "alloc_decode",
                "resize",
            )
        ],
    ),
    *_contacts(
        "idle invariant check (the window pool)",
        "reads",
        "swa.py",
        [
            f"{_CHECKER}.SchedulerInvariantChecker.token_to_kv_pool_allocator",
            "sglang.srt.managers.scheduler_components.pool_stats_observer.PoolStats"
            ".swa_available_size",
            "sglang.srt.managers.scheduler_components.pool_stats_observer.PoolStats"
            ".full_available_size",
        ],
    ),
    Contact(
        "idle invariant check (the window pool's total)",
        f"{_CHECKER}.SchedulerInvariantChecker.swa_tokens_per_layer",
        SUPPORTED,
        "swaps",
        "swa.py",
    ),
    Contact(
        "idle invariant check (a hybrid sliding-window model's full pool total)",
        f"{_CHECKER}.SchedulerInvariantChecker.full_tokens_per_layer",
        SUPPORTED,
        "swaps",
        "swa.py",
    ),
    # pool_stats.py: the statistics' used tokens and usage of the elastic pools
    Contact(
        "pool statistics",
        f"{_STATS}.SchedulerPoolStatsObserver.token_to_kv_pool_allocator",
        SUPPORTED,
        "reads",
        "pool_stats.py",
    ),
    *_contacts(
        "pool statistics",
        "reads",
        "pool_stats.py",
        [
            f"{_STATS}.PoolStats.{name}"
            for name in (
                "full_available_size",
                "full_evictable_size",
                "swa_available_size",
                "swa_evictable_size",
            )
        ],
    ),
    *_contacts(
        "pool statistics",
        "writes",
        "pool_stats.py",
        [
            f"{_STATS}.PoolStats.{name}"
            for name in ("full_num_used", "full_token_usage", "swa_num_used", "swa_token_usage")
        ],
    ),
    # eviction.py: SGLang's own radix-cache eviction, in a page-first order
    Contact("eviction", f"{_PREFIX}.EvictParams", SUPPORTED, "imports", "eviction.py"),
    *_contacts(
        "eviction",
        "reads",
        "eviction.py",
        [
            f"{_PREFIX}.EvictParams.num_tokens",
            f"{_PREFIX}.EvictParams.swa_num_tokens",
            f"{_PREFIX}.EvictResult.num_tokens_evicted",
            f"{_RADIX}.RadixCache.evictable_leaves",
            f"{_RADIX}.TreeNode.value",
        ],
    ),
    *_contacts(
        "eviction",
        "calls",
        "eviction.py",
        [
            f"{_RADIX}.RadixCache.evict",
            f"{_RADIX}.RadixCache.evictable_size",
            f"{_MAMBA_RADIX}.evict",
            f"{_MAMBA_RADIX}.full_evictable_size",
            f"{_PREFIX}.BasePrefixCache.supports_mamba",
            f"{_PREFIX}.BasePrefixCache.supports_swa",
            "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.swa_evictable_size",
        ],
    ),
    Contact(
        "eviction (the order: page-first)",
        f"{_RADIX}.RadixCache.eviction_strategy",
        SUPPORTED,
        "swaps",
        "eviction.py",
    ),
    Contact(
        "eviction (the order: page-first)",
        "sglang.srt.mem_cache.evict_policy.EvictionStrategy.get_priority",
        SUPPORTED,
        "stands in for",
        "eviction.py",
    ),
    # lifecycle.py: the scheduler's allocator, cache and idleness
    *_contacts(
        "upkeep",
        "reads",
        "lifecycle.py",
        [
            f"{_SCHEDULER}.token_to_kv_pool_allocator",
            f"{_SCHEDULER}.tree_cache",
            "sglang.srt.managers.schedule_batch.NextBatchPlan.batch_to_run",
        ],
    ),
    Contact("upkeep while idle", f"{_SCHEDULER}.is_fully_idle", SUPPORTED, "calls", "lifecycle.py"),
    # tensor_parallel.py: the ranks' CPU group, for the decisions rank 0 broadcasts
    Contact(
        "tensor-parallel group",
        "sglang.srt.distributed.parallel_state.get_tp_group",
        SUPPORTED,
        "imports",
        "tensor_parallel.py",
    ),
    *_contacts(
        "tensor-parallel group",
        "reads",
        "tensor_parallel.py",
        [f"{_GROUP}.{name}" for name in ("world_size", "cpu_group", "ranks", "rank_in_group")],
    ),
    # shims.py: the registry every hook goes through
    *_contacts(
        "hook registration",
        "imports",
        "shims.py",
        [
            "sglang.srt.plugins.hook_registry.HookRegistry",
            "sglang.srt.plugins.hook_registry.HookType",
        ],
    ),
)


def sglang_version() -> str:
    """The installed SGLang's version, without importing SGLang."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def plan(
    version: str,
    shims: Sequence[Shim] = SHIMS,
    find: Callable[..., str | None] = missing,
    contacts: Sequence[Contact] = CONTACTS,
) -> list[Shim]:
    """The hooks to register on SGLang `version`; `UnsupportedSglang`, naming the
    version and the target, when the version is not supported or a target of either
    table moved. `find` says why a target is missing (None: it is there)."""
    if version not in SUPPORTED:
        raise UnsupportedSglang(
            f"kvcached's SGLang adapter supports SGLang {', '.join(SUPPORTED)}; this is "
            f"SGLang {version}. Unset ENABLE_KVCACHED to run SGLang without kvcached."
        )
    chosen = [shim for shim in shims if version in shim.versions]
    needed: list[Shim | Contact] = [*chosen]
    needed += [c for c in contacts if version in c.versions and not c.optional]
    for entry in needed:
        # a hook's target must be a real attribute; a contact may be an instance's
        reason = find(entry.target, declared=isinstance(entry, Contact))
        if reason is not None:
            raise UnsupportedSglang(
                f"kvcached's SGLang adapter ({entry.concern}) needs {entry.target}, which "
                f"SGLang {version} does not have ({reason}); this SGLang build moved an "
                "internal the adapter was written for. Unset ENABLE_KVCACHED to run "
                "without kvcached."
            )
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
        chosen = plan(version, SHIMS, missing, CONTACTS)
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
