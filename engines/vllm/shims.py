"""Every vLLM internal the adapter touches, one declarative entry each.

These two tables are the adapter's whole contact surface with vLLM. `SHIMS` are the
internals it replaces: each names a target (``module:attribute``, or
``module:Class.attribute``), the vLLM minor versions it was written for, and the
adapter file that holds the replacement. Entries are wrapped, never rewritten: each
replacement calls vLLM's own code and changes one decision (where a buffer lives, which
block ids are free). `CONTACTS` are everything else the adapter's code reaches: what it
imports, calls, reads and writes on the objects vLLM hands it, the `torch` global it
swaps inside vLLM's allocating function, the free queue it stands in for
(`kvcached.contacts.Contact` says how each is checked).

`install()` runs in every vLLM process once the plugin is enabled: it refuses a vLLM
version none of the entries was written for, and an entry of either table whose target
is missing, naming both, before any shim is put in place and before the engine starts.
A test scans the adapter's code for what it imports from vLLM and for the private
names it reaches, and fails when one is not in a table; docs/engines/shims.md is
rendered from the tables (scripts/render_shims.py).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvcached.contacts import Contact, missing
from kvcached.engines.vllm.version import vllm_minor  # a leaf: refusals.py asks too

#: The vLLM minor versions this adapter was written for (CPU 0.32 in CI, GPU 0.26).
SUPPORTED = ("0.26", "0.32")
_BOTH = SUPPORTED


class UnsupportedVllm(RuntimeError):
    """The installed vLLM is not one the adapter targets, or a target moved."""


@dataclass(frozen=True)
class Shim:
    concern: str
    target: str
    versions: tuple[str, ...]
    replace: Callable[[Any], Any]  # vLLM's original -> the object installed instead
    #: modules that did `from <module> import <attribute>`: rebound there as well
    also_bound_in: tuple[str, ...] = ()
    #: a target that exists only in some builds (e.g. the GPU model runners on CPU)
    optional: bool = False
    #: the adapter module that holds the replacement
    used_in: str = ""
    #: what the replacement is: a wrapper calling the original, or a subclass of it
    how: str = "wraps"


def _allocation(name: str) -> Callable[[Any], Any]:
    def replace(original: Any) -> Any:
        from kvcached.engines.vllm import allocation

        return allocation.serve_from_kvcached(original, name)

    return replace


def _replay(name: str) -> Callable[[Any], Any]:
    def replace(original: Any) -> Any:
        from kvcached.engines.vllm import replay

        wrapper: Callable[[Any], Any] = getattr(replay, name)
        return wrapper(original)

    return replace


def _executor(original: Any) -> Any:
    from kvcached.engines.vllm.sizing import remembers_executor

    return remembers_executor(original)


def _block_pool(original: Any) -> Any:
    from kvcached.engines.vllm.block_pool import elastic_block_pool

    return elastic_block_pool(original)


def _comparison(original: Any) -> Any:
    from kvcached.engines.vllm.block_pool import counted_for_the_comparison

    return counted_for_the_comparison(original)


def _sizing(original: Any) -> Any:
    from kvcached.engines.vllm.sizing import sized_by_kvcached

    return sized_by_kvcached(original)


def _shutdown(original: Any) -> Any:
    from kvcached.engines.vllm.lifecycle import closes_kvcached_first

    return closes_kvcached_first(original)


def _one_process(original: Any) -> Any:
    from kvcached.engines.vllm.lifecycle import scheduler_and_worker_share_a_process

    return scheduler_and_worker_share_a_process(original)


def _warmup(original: Any) -> Any:
    from kvcached.engines.vllm.warmup import on_kvcached_blocks

    return on_kvcached_blocks(original)


def _idle(original: Any) -> Any:
    from kvcached.engines.vllm.lifecycle import maintains_when_idle

    return maintains_when_idle(original)


def _sleep(name: str) -> Callable[[Any], Any]:
    def replace(original: Any) -> Any:
        from kvcached.engines.vllm import sleep

        wrapper: Callable[[Any], Any] = getattr(sleep, name)
        return wrapper(original)

    return replace


def _connector(what: str) -> Callable[[Any], Any]:
    def replace(original: Any) -> Any:
        from kvcached.engines.vllm.connectors import checks_mapped_blocks

        return checks_mapped_blocks(original, what)

    return replace


def _cooling(original: Any) -> Any:
    from kvcached.engines.vllm.connectors import cools_freed_blocks

    return cools_freed_blocks(original)


_EXAMPLE = "vllm.distributed.kv_transfer.kv_connector.v1.example_connector"
_OFFLOADING = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler"
_NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
_LMCACHE = "vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector"


SHIMS: tuple[Shim, ...] = (
    # worker side: the KV buffer vLLM views is a kvcached reservation
    Shim(
        "KV buffer (V1 runner, vLLM-CPU)",
        "vllm.v1.worker.utils:allocate_kv_cache",
        ("0.32",),
        _allocation("allocate_kv_cache"),
        also_bound_in=("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.attn_utils"),
        used_in="allocation.py",
    ),
    Shim(
        "KV buffer (Model Runner V1)",
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner._allocate_kv_cache_tensors",
        ("0.26",),
        _allocation("_allocate_kv_cache_tensors"),
        used_in="allocation.py",
    ),
    Shim(
        "KV buffer (Model Runner V2)",
        "vllm.v1.worker.gpu.attn_utils:_allocate_kv_cache",
        ("0.26",),
        _allocation("_allocate_kv_cache"),
        optional=True,
        used_in="allocation.py",
    ),
    Shim(
        "warm-up blocks (Model Runner V2)",
        "vllm.v1.worker.gpu_worker:warmup_kernels",
        ("0.26",),
        _warmup,
        optional=True,
        used_in="warmup.py",
    ),
    # engine core: size the block pool from kvcached's virtual capacity, not a profile
    Shim(
        "block-pool size",
        "vllm.v1.engine.core:get_kv_cache_configs",
        _BOTH,
        _sizing,
        used_in="sizing.py",
    ),
    Shim(
        "block-pool size (reaching the workers)",
        "vllm.v1.engine.core:EngineCore._initialize_kv_caches",
        _BOTH,
        _executor,
        used_in="sizing.py",
    ),
    # tensor parallel: the scheduler's decisions reach every worker with each step
    Shim(
        "replay: ops ride on the scheduler output",
        "vllm.v1.core.sched.scheduler:Scheduler.schedule",
        _BOTH,
        _replay("attaches_ops"),
        used_in="replay.py",
    ),
    Shim(
        "replay: a finished step acknowledges its ops",
        "vllm.v1.core.sched.scheduler:Scheduler.update_from_output",
        _BOTH,
        _replay("acknowledges_ops"),
        used_in="replay.py",
    ),
    Shim(
        "replay: workers apply the ops before the model runs",
        "vllm.v1.worker.gpu_worker:Worker.execute_model",
        _BOTH,
        _replay("applies_ops"),
        used_in="replay.py",
    ),
    # scheduler side: the free-block count follows what kvcached can supply (the name
    # the coordinator builds its pool from, replaced by a subclass of vLLM's class)
    Shim(
        "elastic block pool",
        "vllm.v1.core.kv_cache_coordinator:BlockPool",
        _BOTH,
        _block_pool,
        used_in="block_pool.py",
        how="subclasses",
    ),
    # the count allocate_slots compares with the free blocks is staged at that
    # comparison, so another instance cannot take it before the take (block_pool.py)
    Shim(
        "a counted block is a taken block",
        "vllm.v1.core.kv_cache_coordinator:KVCacheCoordinator.get_num_blocks_to_allocate",
        _BOTH,
        _comparison,
        used_in="block_pool.py",
    ),
    # one worker runs in the engine-core process, beside the scheduler that owns the
    # allocator (vLLM-CPU would otherwise start a separate worker process even for one)
    Shim(
        "executor for one worker",
        "vllm.v1.executor.abstract:Executor.get_class",
        _BOTH,
        _one_process,
        used_in="lifecycle.py",
    ),
    # lifecycle: the cache closes before the engine (and its ledger) goes away
    Shim(
        "shutdown",
        "vllm.v1.engine.core:EngineCore.shutdown",
        _BOTH,
        _shutdown,
        used_in="lifecycle.py",
    ),
    # the busy loop of a separate engine process: upkeep while no request runs
    Shim(
        "idle upkeep",
        "vllm.v1.engine.core:EngineCoreProc._process_input_queue",
        _BOTH,
        _idle,
        used_in="lifecycle.py",
    ),
    # sleep mode: vLLM's sleep moves the weights, kvcached gives back the KV it maps itself
    Shim(
        "sleep mode: the KV to nothing",
        "vllm.v1.engine.core:EngineCore.sleep",
        _BOTH,
        _sleep("trims_kv_on_sleep"),
        used_in="sleep.py",
    ),
    Shim(
        "sleep mode: the KV on demand again",
        "vllm.v1.engine.core:EngineCore.wake_up",
        _BOTH,
        _sleep("regrows_kv_on_wake"),
        used_in="sleep.py",
    ),
    # KV connectors (connectors.py): a served connector's transfers touch only held blocks
    Shim(
        "KV connector loads only into held blocks",
        f"{_EXAMPLE}:ExampleConnector.start_load_kv",
        ("0.32",),
        _connector("start_load_kv"),
        used_in="connectors.py",
    ),
    Shim(
        "KV connector saves only held blocks",
        f"{_EXAMPLE}:ExampleConnector.save_kv_layer",
        ("0.32",),
        _connector("save_kv_layer"),
        used_in="connectors.py",
    ),
    Shim(
        "KV connector loads only into held blocks (NIXL: the blocks a read lands in)",
        f"{_NIXL}.connector:NixlPullConnector.start_load_kv",
        _BOTH,
        _connector("start_load_kv"),
        used_in="connectors.py",
    ),
    Shim(
        "KV connector saves only held blocks (NIXL: staged to its host buffer)",
        f"{_NIXL}.connector:NixlBaseConnector.wait_for_save",
        _BOTH,
        _connector("wait_for_save"),
        used_in="connectors.py",
    ),
    Shim(
        "KV connector loads only into held blocks (LMCache: its retrieved chunks)",
        f"{_LMCACHE}:LMCacheConnectorV1.start_load_kv",
        ("0.26",),
        _connector("start_load_kv"),
        used_in="connectors.py",
    ),
    Shim(
        "KV connector saves only held blocks (LMCache: stored at the step's end)",
        f"{_LMCACHE}:LMCacheConnectorV1.wait_for_save",
        ("0.26",),
        _connector("wait_for_save"),
        used_in="connectors.py",
    ),
    Shim(
        "KV connector stores freed blocks a step late: they stay mapped",
        f"{_OFFLOADING}:OffloadingConnectorScheduler.build_connector_meta",
        _BOTH,
        _cooling,
        used_in="connectors.py",
    ),
)

_CORE = "vllm.v1.engine.core"
_POOL = "vllm.v1.core.block_pool:BlockPool"
_QUEUE = "vllm.v1.core.kv_cache_utils:FreeKVCacheBlockQueue"
_BLOCK = "vllm.v1.core.kv_cache_utils:KVCacheBlock"
_KV = "vllm.v1.kv_cache_interface"
_OUTPUT = "vllm.v1.core.sched.output"


def _contacts(
    concern: str, how: str, used_in: str, targets: tuple[str, ...], versions: tuple[str, ...]
) -> tuple[Contact, ...]:
    return tuple(Contact(concern, target, versions, how, used_in) for target in targets)


CONTACTS: tuple[Contact, ...] = (
    # version.py: which vLLM this is (the minor version picks the entries)
    Contact("version check", "vllm:__version__", _BOTH, "reads", "version.py"),
    # allocation.py: vLLM's allocating function runs with its module's `torch` global
    # swapped for a stand-in whose int8 `zeros` are views of the reservation
    Contact("KV buffer", "vllm.v1.worker.utils:torch", ("0.32",), "swaps", "allocation.py"),
    Contact(
        "KV buffer", "vllm.v1.worker.gpu_model_runner:torch", ("0.26",), "swaps", "allocation.py"
    ),
    Contact(
        "KV buffer",
        "vllm.v1.worker.gpu.attn_utils:torch",
        ("0.26",),
        "swaps",
        "allocation.py",
        optional=True,
    ),
    *_contacts(
        "KV buffer geometry",
        "reads",
        "allocation.py",
        (
            f"{_KV}:KVCacheConfig.kv_cache_tensors",
            f"{_KV}:KVCacheConfig.num_blocks",
            f"{_KV}:KVCacheTensor.size",
            f"{_KV}:KVCacheTensor.offset",
            f"{_KV}:KVCacheTensor.block_stride",
        ),
        _BOTH,
    ),
    *_contacts(
        "KV buffer geometry (one backing buffer placed by strides)",
        "reads",
        "allocation.py",
        (f"{_KV}:KVCacheTensor.layers", f"{_KV}:KVCacheTensor.layer_stride"),
        ("0.32",),
    ),
    Contact(
        "KV buffer (Model Runner V1)",
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner.vllm_config",
        ("0.26",),
        "reads",
        "allocation.py",
    ),
    # sizing.py and refusals.py: the engine configuration, read once at start-up
    *_contacts(
        "block-pool size",
        "reads",
        "sizing.py",
        (
            "vllm.config:VllmConfig.cache_config",
            "vllm.config:VllmConfig.model_config",
            "vllm.config:ModelConfig.model",
            f"{_KV}:KVCacheSpec.page_size_bytes",
            f"{_CORE}:EngineCore.model_executor",
        ),
        _BOTH,
    ),
    Contact(
        "block-pool size",
        "vllm.config:CacheConfig.num_gpu_blocks_override",
        _BOTH,
        "writes",
        "sizing.py",
    ),
    Contact(
        "tensor parallel: ask and tell the workers",
        "vllm.v1.executor.abstract:Executor.collective_rpc",
        _BOTH,
        "calls",
        "sizing.py, replay.py",
    ),
    *_contacts(
        "refusals at start-up",
        "reads",
        "refusals.py",
        (
            "vllm.config:VllmConfig.parallel_config",
            "vllm.config:ParallelConfig.pipeline_parallel_size",
            "vllm.config:VllmConfig.kv_transfer_config",
            "vllm.config:CacheConfig.cache_dtype",
            "vllm.config:VllmConfig.device_config",
            "vllm.config:DeviceConfig.device_type",
        ),
        _BOTH,
    ),
    *_contacts(
        "KV cache groups served (by spec class name)",
        "reads",
        "groups.py",
        (
            f"{_KV}:FullAttentionSpec",
            f"{_KV}:SlidingWindowSpec",
            f"{_KV}:ChunkedLocalAttentionSpec",
            f"{_KV}:MLAAttentionSpec",
            f"{_KV}:MambaSpec",
            "vllm.config:ModelConfig.architectures",
            "vllm.config:ModelConfig.hf_config",
        ),
        _BOTH,
    ),
    # block_pool.py: the elastic pool subclasses vLLM's BlockPool and stands in for its
    # free queue; eviction goes through vLLM's own prefix-cache bookkeeping
    *_contacts(
        "elastic free queue",
        "stands in for",
        "block_pool.py",
        (
            f"{_QUEUE}.num_free_blocks",
            f"{_QUEUE}.popleft",
            f"{_QUEUE}.popleft_n",
            f"{_QUEUE}.remove",
            f"{_QUEUE}.append",
            f"{_QUEUE}.append_n",
            f"{_QUEUE}.prepend_n",
            f"{_QUEUE}.get_all_free_blocks",
        ),
        _BOTH,
    ),
    *_contacts(
        "elastic block pool",
        "overrides",
        "block_pool.py",
        (f"{_POOL}.get_num_free_blocks", f"{_POOL}.get_usage", f"{_POOL}.reset_prefix_cache"),
        _BOTH,
    ),
    *_contacts(
        "elastic block pool",
        "reads",
        "block_pool.py",
        (
            f"{_POOL}.blocks",
            f"{_POOL}.null_block",
            f"{_BLOCK}.block_id",
            f"{_BLOCK}.block_hash",
        ),
        _BOTH,
    ),
    *_contacts(
        "elastic block pool",
        "writes",
        "block_pool.py",
        (
            f"{_POOL}.free_block_queue",
            f"{_POOL}.cached_block_hash_to_block",
            f"{_POOL}.cached_block_hashes_by_block",
        ),
        _BOTH,
    ),
    Contact(
        "a counted block is a taken block: the pool the count is for",
        "vllm.v1.core.kv_cache_coordinator:KVCacheCoordinator.block_pool",
        _BOTH,
        "reads",
        "block_pool.py",
    ),
    *_contacts(
        "eviction of retained prefix-cache blocks",
        "calls",
        "block_pool.py",
        (
            f"{_POOL}._maybe_evict_cached_block",
            f"{_BLOCK}.reset_hash",
        ),
        _BOTH,
    ),
    Contact(
        "eviction of retained prefix-cache blocks",
        f"{_POOL}._notify_reuse",
        ("0.32",),
        "calls",
        "block_pool.py",
        optional=True,  # called when present
    ),
    # lifecycle.py: one worker in-process, and upkeep on the engine loop while idle
    Contact(
        "executor for one worker",
        "vllm.v1.executor.uniproc_executor:UniProcExecutor",
        _BOTH,
        "imports",
        "lifecycle.py",
    ),
    *_contacts(
        "executor for one worker",
        "reads",
        "lifecycle.py",
        ("vllm.config:VllmConfig.parallel_config", "vllm.config:ParallelConfig.world_size"),
        _BOTH,
    ),
    Contact(
        "idle upkeep: wake the engine loop",
        "vllm.v1.engine:EngineCoreRequestType.WAKEUP",
        _BOTH,
        "imports",
        "lifecycle.py",
    ),
    Contact("idle upkeep", f"{_CORE}:EngineCoreProc.has_work", _BOTH, "calls", "lifecycle.py"),
    *_contacts(
        "idle upkeep: queue a callback, then wake the loop",
        "writes",
        "lifecycle.py",
        (f"{_CORE}:EngineCoreProc._idle_state_callbacks", f"{_CORE}:EngineCoreProc.input_queue"),
        _BOTH,
    ),
    # replay.py: kvcached's ops ride on vLLM's scheduler output, as attributes of its own
    Contact(
        "replay: ops ride on the scheduler output",
        f"{_OUTPUT}:SchedulerOutput",
        _BOTH,
        "writes",
        "replay.py",
    ),
    # connectors.py: which connector is configured, and the block ids of its transfers
    *_contacts(
        "KV connectors served (by name)",
        "reads",
        "connectors.py",
        (
            "vllm.config.kv_transfer:KVTransferConfig.kv_connector",
            "vllm.config.kv_transfer:KVTransferConfig.kv_connector_module_path",
        ),
        _BOTH,
    ),
    Contact(
        "KV connector transfers only held blocks",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:"
        "KVConnectorBase_V1._get_connector_metadata",
        _BOTH,
        "calls",
        "connectors.py",
    ),
    *_contacts(
        "KV connector transfers only held blocks",
        "reads",
        "connectors.py",
        (
            f"{_EXAMPLE}:ExampleConnector._block_size",
            f"{_EXAMPLE}:ExampleConnectorMetadata.requests",
            f"{_EXAMPLE}:ReqMeta.slot_mapping",
        ),
        ("0.32",),
    ),
    # LMCache's metadata (its requests' slot_mapping) is lmcache's, not vLLM's: the
    # connector's block size is vLLM's
    Contact(
        "KV connector transfers only held blocks (LMCache: the block size)",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1._vllm_config",
        ("0.26",),
        "reads",
        "connectors.py",
    ),
    Contact(
        "KV connector transfers only held blocks (checked once per step's metadata)",
        f"{_EXAMPLE}:ExampleConnectorMetadata",
        ("0.32",),
        "writes",
        "connectors.py",
    ),
    Contact(
        "KV connector transfers only held blocks (checked once per step's metadata)",
        f"{_NIXL}.metadata:NixlConnectorMetadata",
        _BOTH,
        "writes",
        "connectors.py",
    ),
    *_contacts(
        "KV connector transfers only held blocks (NIXL)",
        "reads",
        "connectors.py",
        (
            f"{_NIXL}.metadata:NixlConnectorMetadata.reqs_to_recv",
            f"{_NIXL}.metadata:NixlConnectorMetadata.reqs_to_save",
            f"{_NIXL}.metadata:ReqMeta.local_block_ids",
        ),
        _BOTH,
    ),
    Contact(
        "NIXL is served staging through host memory only",
        "vllm.config.kv_transfer:KVTransferConfig.kv_buffer_device",
        _BOTH,
        "reads",
        "connectors.py",
    ),
    # a MultiConnector's children are built as vLLM builds them, and each is checked
    *_contacts(
        "MultiConnector served when every child is",
        "reads",
        "connectors.py",
        (
            "vllm.config.kv_transfer:KVTransferConfig.kv_connector_extra_config",
            "vllm.config.kv_transfer:KVTransferConfig.engine_id",
        ),
        _BOTH,
    ),
    # warmup.py: Model Runner V2's made-up block ids are swapped for lent ones
    *_contacts(
        "warm-up blocks (Model Runner V2)",
        "writes",
        "warmup.py",
        (
            f"{_OUTPUT}:SchedulerOutput.scheduled_new_reqs",
            f"{_OUTPUT}:SchedulerOutput.scheduled_cached_reqs",
            f"{_OUTPUT}:NewRequestData.block_ids",
            f"{_OUTPUT}:CachedRequestData.new_block_ids",
        ),
        ("0.26",),
    ),
)


def _resolve(target: str) -> tuple[Any, str, Any]:
    """(owner object, attribute name, current value) of a ``module:path`` target."""
    module_name, _, path = target.partition(":")
    owner: Any = importlib.import_module(module_name)
    *parents, attribute = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    return owner, attribute, getattr(owner, attribute)


def _moved(concern: str, target: str, minor: str, reason: str) -> UnsupportedVllm:
    return UnsupportedVllm(
        f"kvcached's vLLM adapter ({concern}) needs {target}, which vLLM {minor} does not "
        f"have ({reason}); this vLLM build moved an internal the adapter was written for. "
        "Unset ENABLE_KVCACHED to run without kvcached."
    )


def check(
    minor: str,
    shims: Sequence[Shim] = SHIMS,
    contacts: Sequence[Contact] = CONTACTS,
    find: Callable[..., str | None] = missing,
) -> None:
    """Refuse vLLM `minor` (`UnsupportedVllm`, naming the version and the target) when
    the adapter does not support it or an entry of either table written for it moved.
    `find` says why a target is missing (None: it is there)."""
    if minor not in SUPPORTED:
        raise UnsupportedVllm(
            f"kvcached's vLLM adapter supports vLLM {' and '.join(SUPPORTED)}; this is vLLM "
            f"{minor}. Unset ENABLE_KVCACHED to run vLLM without kvcached."
        )
    entries: list[Shim | Contact] = [*shims, *contacts]
    for entry in entries:
        if minor not in entry.versions or entry.optional:
            continue
        # a shim's target must be a real attribute; a contact may be an instance's
        reason = find(entry.target, declared=isinstance(entry, Contact))
        if reason is not None:
            raise _moved(entry.concern, entry.target, minor, reason)


_installed = False


def install() -> None:
    """Check the vLLM version and both tables, then put every shim for it in place
    (idempotent)."""
    global _installed
    if _installed:
        return
    minor = vllm_minor()
    check(minor, SHIMS, CONTACTS)  # the tables as they are now (tests replace them)
    for shim in SHIMS:
        if minor not in shim.versions:
            continue
        try:
            owner, attribute, original = _resolve(shim.target)
        except (ImportError, AttributeError) as exc:
            if shim.optional:
                continue
            raise _moved(shim.concern, shim.target, minor, str(exc)) from None
        if getattr(original, "__kvcached_original__", None) is not None:
            continue
        replacement = shim.replace(original)
        for marked in (replacement, getattr(replacement, "__func__", None)):
            if marked is not None:
                marked.__kvcached_original__ = original
        setattr(owner, attribute, replacement)
        for module_name in shim.also_bound_in:
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                continue
            if getattr(module, attribute, None) is original:
                setattr(module, attribute, replacement)
    _installed = True
