"""kvcached's own host time per page on the map and unmap path, without a device.

`vmm_ops.py` times the CUDA backend against the raw driver on a GPU, where kvcached's
share of a map (a few microseconds of 25-40) moves with the machine. This measures that
share alone, on any machine: a `CudaBackend` is built without a device and its three
per-page driver entry points (`cuMemMap`, `cuMemSetAccess`, `cuMemUnmap`) are replaced by
stand-ins that return success at once. Each round maps `--pages` 2 MiB pages one by one
through `Backend.map`, unmaps them through `Backend.unmap`, and then makes the same
stand-in calls directly (the order alternates between rounds); the difference per page
is what kvcached's bookkeeping (checks, lock, granule map, the backend's dispatch) adds.

The `floor` is the least any Python library can add there: one call a page that takes a
lock, calls the backend's own per-page driver closures and records the mapping in a
dict, with no check at all. `floor_added_us` is its cost over the stand-in calls, so
`added_us - floor_added_us` is what kvcached's checks and books cost beyond that floor.

`--calls compiled` makes the per-page calls the way a GPU machine with the C module
makes them (`kvcached.backends.cuda._vmm_calls`): the stand-ins are then C functions that
return 0 at once (libm's `fegetround`, which reads no argument and answers FE_TONEAREST,
0 on x86-64 and arm64), and the direct calls and the floor go through the same module.

Prints one JSON line per round and a summary line with the medians:

    {"bench": "vmm_bookkeeping", "run": "summary", "map_us": 0.9, "unmap_us": 0.6,
     "map+unmap_us": 1.5, "stand_in_us": 0.18, "label": "...", ...}

    python benchmarks/vmm_bookkeeping.py [--rounds 40] [--pages 2000] [--label NAME]
        [--calls bindings|compiled]

To compare two trees, run it from each in turn (fresh processes, alternating) with
`--label`, and compare the summaries' `added_us`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from typing import Any

from kvcached.backend import Backend, Page, Reservation
from kvcached.backends.cuda.backend import CudaBackend

MiB = 1 << 20
SUCCESS = 0
_DONE = (SUCCESS,)


def _cu_mem_map(address: int, nbytes: int, offset: int, handle: Any, flags: int) -> tuple[int]:
    return _DONE


def _cu_mem_set_access(address: int, nbytes: int, access: Any, count: int) -> tuple[int]:
    return _DONE


def _cu_mem_unmap(address: int, nbytes: int) -> tuple[int]:
    return _DONE


def c_stand_in() -> int:
    """The address of a C function that returns 0 whatever it is passed (see the top)."""
    import ctypes

    fegetround = ctypes.CDLL(None).fegetround
    address = ctypes.cast(fegetround, ctypes.c_void_p).value
    if not address or fegetround() != SUCCESS:
        raise SystemExit("no C stand-in here: libm's fegetround is missing or not 0")
    return address


def deviceless_cuda_backend(granularity: int = 2 * MiB, *, compiled: bool = False) -> CudaBackend:
    """A CudaBackend whose per-page driver calls are the stand-ins above (`compiled`: C
    stand-ins called through the C module). Only `map`, `unmap` and the bookkeeping
    behind them may be used: nothing else is set up."""
    backend = CudaBackend.__new__(CudaBackend)
    Backend.__init__(backend)
    backend._granularity = granularity
    backend._ordinal = 0
    backend._success = SUCCESS
    backend._no_context = -1  # never returned by the stand-ins
    backend._access = [object()]
    backend._bind_per_page_calls(_cu_mem_map, _cu_mem_set_access, _cu_mem_unmap)
    if compiled:
        from types import SimpleNamespace

        backend._driver = SimpleNamespace(  # the two enums _bind_compiled_calls reads
            CUmemLocationType=SimpleNamespace(CU_MEM_LOCATION_TYPE_DEVICE=1),
            CUmemAccess_flags=SimpleNamespace(CU_MEM_ACCESS_FLAGS_PROT_READWRITE=3),
        )
        stand_in = c_stand_in()
        how = backend._bind_compiled_calls((stand_in, stand_in, stand_in))
        if how != "compiled":
            raise SystemExit(f"--calls compiled: {how}")
    return backend


def one_round(
    backend: CudaBackend, pages: int, stand_in_first: bool, *, compiled: bool = False
) -> dict[str, float]:
    """Per page, µs: kvcached's map and unmap, and the stand-in calls made directly
    (`compiled`: the backend was built with `compiled=True`, so through the C module)."""
    size = backend._g
    reservation = Reservation(backend, 1 << 40, size * pages)
    made = [Page(backend, i, size) for i in range(pages)]
    access = backend._access

    def direct() -> float:
        if compiled:  # the same C calls, one crossing a map and one an unmap
            map_one, unmap_one = backend._map_one, backend._unmap_one
            start = time.perf_counter_ns()
            for i in range(pages):
                map_one(i * size, made[i])
            for i in range(pages):
                unmap_one(i * size, size)
            return (time.perf_counter_ns() - start) / pages / 1e3
        start = time.perf_counter_ns()
        for i in range(pages):
            (err,) = _cu_mem_map(i * size, size, 0, i, 0)
            if err != SUCCESS:
                raise AssertionError(err)
            (err,) = _cu_mem_set_access(i * size, size, access, 1)
            if err != SUCCESS:
                raise AssertionError(err)
        for i in range(pages):
            (err,) = _cu_mem_unmap(i * size, size)
            if err != SUCCESS:
                raise AssertionError(err)
        return (time.perf_counter_ns() - start) / pages / 1e3

    def through_kvcached() -> tuple[float, float]:
        map_page, unmap_range = backend.map, backend.unmap
        start = time.perf_counter_ns()
        for i in range(pages):
            map_page(reservation, i * size, made[i])
        mapped = time.perf_counter_ns()
        for i in range(pages):
            unmap_range(reservation, i * size, size)
        done = time.perf_counter_ns()
        return (mapped - start) / pages / 1e3, (done - mapped) / pages / 1e3

    def floor() -> float:
        lock, mapped = threading.Lock(), {}
        map_one, unmap_one, base = backend._map_one, backend._unmap_one, reservation.address

        acquire, release = lock.acquire, lock.release  # cheaper than `with` (see map)

        def map_page(offset: int, page: Page) -> None:
            acquire()
            try:
                map_one(base + offset, page)
                mapped[offset] = page
            finally:
                release()

        def unmap_range(offset: int, nbytes: int) -> None:
            acquire()
            try:
                del mapped[offset]
                unmap_one(base + offset, nbytes)
            finally:
                release()

        start = time.perf_counter_ns()
        for i in range(pages):
            map_page(i * size, made[i])
        for i in range(pages):
            unmap_range(i * size, size)
        if mapped:
            raise AssertionError("the floor left a page mapped")
        return (time.perf_counter_ns() - start) / pages / 1e3

    if stand_in_first:
        stand_in = direct()
        map_us, unmap_us = through_kvcached()
        floor_us = floor()
    else:
        floor_us = floor()
        map_us, unmap_us = through_kvcached()
        stand_in = direct()
    if reservation._mappings or any(page._mapped_in for page in made):
        raise AssertionError("a page is still mapped after the round")
    return {"map_us": map_us, "unmap_us": unmap_us, "stand_in_us": stand_in, "floor_us": floor_us}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--pages", type=int, default=2000, help="pages per round")
    parser.add_argument("--label", default="", help="names this tree in the output")
    parser.add_argument(
        "--calls", choices=("bindings", "compiled"), default="bindings",
        help="the per-page calls' form: Python closures (as over cuda.bindings) or the C module",
    )  # fmt: skip
    args = parser.parse_args()

    compiled = args.calls == "compiled"
    backend = deviceless_cuda_backend(compiled=compiled)
    one_round(backend, 200, False, compiled=compiled)  # warm-up
    rounds = []
    for number in range(args.rounds):
        row = one_round(backend, args.pages, number % 2 == 1, compiled=compiled)
        row["map+unmap_us"] = row["map_us"] + row["unmap_us"]
        rounds.append(row)
        figures = {key: round(value, 4) for key, value in row.items()}
        print(json.dumps({"bench": "vmm_bookkeeping", "round": number, **figures}))
    summary = {
        key: round(statistics.median(row[key] for row in rounds), 4)
        for key in ("map_us", "unmap_us", "map+unmap_us", "stand_in_us", "floor_us")
    }
    summary["added_us"] = round(summary["map+unmap_us"] - summary["stand_in_us"], 4)
    summary["floor_added_us"] = round(summary["floor_us"] - summary["stand_in_us"], 4)
    print(
        json.dumps(
            {
                "bench": "vmm_bookkeeping",
                "run": "summary",
                "label": args.label,
                "calls": args.calls,
                "rounds": args.rounds,
                "pages": args.pages,
                **summary,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
