"""Every vLLM internal the adapter touches, one declarative entry each.

This table is the adapter's whole contact surface with vLLM. Each entry names a target
(``module:attribute``, or ``module:Class.attribute``), the vLLM minor versions it was
written for, and the file that holds its replacement. `install()` runs in every vLLM
process once the plugin is enabled: it refuses a vLLM version none of the entries was
written for, and an entry whose target is missing, naming both, before the engine
starts. Entries are wrapped, never rewritten: each replacement calls vLLM's own code
and changes one decision (where a buffer lives, which block ids are free).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: The vLLM minor versions this adapter was written for (CPU 0.32 in CI, GPU 0.26).
SUPPORTED = ("0.26", "0.32")


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


SHIMS: tuple[Shim, ...] = (
    # worker side: the KV buffer vLLM views is a kvcached reservation
    Shim(
        "KV buffer (V1 runner, vLLM-CPU)",
        "vllm.v1.worker.utils:allocate_kv_cache",
        ("0.32",),
        _allocation("allocate_kv_cache"),
        also_bound_in=("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.attn_utils"),
    ),
    Shim(
        "KV buffer (Model Runner V1)",
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner._allocate_kv_cache_tensors",
        ("0.26",),
        _allocation("_allocate_kv_cache_tensors"),
    ),
    Shim(
        "KV buffer (Model Runner V2)",
        "vllm.v1.worker.gpu.attn_utils:_allocate_kv_cache",
        ("0.26",),
        _allocation("_allocate_kv_cache"),
        optional=True,
    ),
    Shim(
        "warm-up blocks (Model Runner V2)",
        "vllm.v1.worker.gpu_worker:warmup_kernels",
        ("0.26",),
        _warmup,
        optional=True,
    ),
    # engine core: size the block pool from kvcached's virtual capacity, not a profile
    Shim(
        "block-pool size",
        "vllm.v1.engine.core:get_kv_cache_configs",
        ("0.26", "0.32"),
        _sizing,
    ),
    Shim(
        "block-pool size (reaching the workers)",
        "vllm.v1.engine.core:EngineCore._initialize_kv_caches",
        ("0.26", "0.32"),
        _executor,
    ),
    # tensor parallel: the scheduler's decisions reach every worker with each step
    Shim(
        "replay: ops ride on the scheduler output",
        "vllm.v1.core.sched.scheduler:Scheduler.schedule",
        ("0.26", "0.32"),
        _replay("attaches_ops"),
    ),
    Shim(
        "replay: a finished step acknowledges its ops",
        "vllm.v1.core.sched.scheduler:Scheduler.update_from_output",
        ("0.26", "0.32"),
        _replay("acknowledges_ops"),
    ),
    Shim(
        "replay: workers apply the ops before the model runs",
        "vllm.v1.worker.gpu_worker:Worker.execute_model",
        ("0.26", "0.32"),
        _replay("applies_ops"),
    ),
    # scheduler side: the free-block count follows what kvcached can supply
    Shim(
        "elastic block pool",
        "vllm.v1.core.kv_cache_coordinator:BlockPool",
        ("0.26", "0.32"),
        _block_pool,
    ),
    # one worker runs in the engine-core process, beside the scheduler that owns the
    # allocator (vLLM-CPU would otherwise start a separate worker process even for one)
    Shim(
        "executor for one worker",
        "vllm.v1.executor.abstract:Executor.get_class",
        ("0.26", "0.32"),
        _one_process,
    ),
    # lifecycle: the cache closes before the engine (and its ledger) goes away
    Shim("shutdown", "vllm.v1.engine.core:EngineCore.shutdown", ("0.26", "0.32"), _shutdown),
    # the busy loop of a separate engine process: upkeep while no request runs
    Shim(
        "idle upkeep",
        "vllm.v1.engine.core:EngineCoreProc._process_input_queue",
        ("0.26", "0.32"),
        _idle,
    ),
)


def vllm_minor() -> str:
    import vllm

    version = str(getattr(vllm, "__version__", "unknown"))
    return ".".join(version.split("+")[0].split(".")[:2])


def _resolve(target: str) -> tuple[Any, str, Any]:
    """(owner object, attribute name, current value) of a ``module:path`` target."""
    module_name, _, path = target.partition(":")
    owner: Any = importlib.import_module(module_name)
    *parents, attribute = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    return owner, attribute, getattr(owner, attribute)


_installed = False


def install() -> None:
    """Check the vLLM version and put every shim for it in place (idempotent)."""
    global _installed
    if _installed:
        return
    minor = vllm_minor()
    if minor not in SUPPORTED:
        raise UnsupportedVllm(
            f"kvcached's vLLM adapter supports vLLM {' and '.join(SUPPORTED)}; this is vLLM "
            f"{minor}. Unset ENABLE_KVCACHED to run vLLM without kvcached."
        )
    for shim in SHIMS:
        if minor not in shim.versions:
            continue
        try:
            owner, attribute, original = _resolve(shim.target)
        except (ImportError, AttributeError) as exc:
            if shim.optional:
                continue
            raise UnsupportedVllm(
                f"kvcached's vLLM adapter ({shim.concern}) needs {shim.target}, which vLLM "
                f"{minor} does not have ({exc}); this vLLM build moved an internal the "
                "adapter was written for. Unset ENABLE_KVCACHED to run without kvcached."
            ) from None
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
