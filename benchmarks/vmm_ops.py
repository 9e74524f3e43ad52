"""Per-operation latency of the VMM primitives: kvcached's backend vs. the raw driver.

For each page size (2 MiB ... 64 MiB) this times create, map (including set-access),
unmap and release, once through `kvcached`'s public Backend API and once through the
same driver calls made directly, alternating the two in rounds inside one process so
both see the same machine state. Prints one JSON object per line:

    {"bench": "vmm_ops", "backend": "cuda", "page_mib": 2, "op": "map",
     "kvcached_us": 41.2, "raw_us": 40.1, "ratio": 1.027, ...}

plus a `map+unmap` row per size (the figure the overhead target is about) and
`map_many` / `unmap_many` / `batch map+unmap` rows: our batch forms, one call for all
pages of a round (set-access once per contiguous run), against the same raw per-page
calls.

    python benchmarks/vmm_ops.py [--backend cuda|host] [--rounds 7] [--pages 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import kvcached
from kvcached.backend import Backend

MiB = 1 << 20
OPS = ("create", "map", "unmap", "release")


class RawCuda:
    """The same cuda.bindings calls the CUDA backend makes, without kvcached around them."""

    def __init__(self, backend: Any) -> None:
        from cuda.bindings import driver

        self.d = driver
        self.prop = backend._prop
        self.access = backend._access
        self.ok = driver.CUresult.CUDA_SUCCESS

    def reserve(self, nbytes: int, align: int) -> int:
        err, ptr = self.d.cuMemAddressReserve(nbytes, align, 0, 0)
        assert err == self.ok, err
        return int(ptr)

    def free(self, address: int, nbytes: int) -> None:
        (err,) = self.d.cuMemAddressFree(address, nbytes)
        assert err == self.ok, err

    def create(self, nbytes: int) -> Any:
        err, handle = self.d.cuMemCreate(nbytes, self.prop, 0)
        assert err == self.ok, err
        return handle

    def map(self, address: int, nbytes: int, handle: Any) -> None:
        (err,) = self.d.cuMemMap(address, nbytes, 0, handle, 0)
        assert err == self.ok, err
        (err,) = self.d.cuMemSetAccess(address, nbytes, self.access, 1)
        assert err == self.ok, err

    def unmap(self, address: int, nbytes: int) -> None:
        (err,) = self.d.cuMemUnmap(address, nbytes)
        assert err == self.ok, err

    def release(self, handle: Any, nbytes: int) -> None:
        (err,) = self.d.cuMemRelease(handle)
        assert err == self.ok, err


class RawHost:
    """The libc calls the host backend makes, on a memfd arena of its own."""

    def __init__(self, backend: Any) -> None:
        import os

        from kvcached.backends.host import libc

        self.libc = libc
        self.fd = os.memfd_create("raw-bench", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, 1 << 40)
        self.next_offset = 0

    def reserve(self, nbytes: int, align: int) -> int:
        raw = self.libc.mmap_anonymous_reserve(0, nbytes + align, fixed=False)
        return (raw + align - 1) & ~(align - 1)

    def free(self, address: int, nbytes: int) -> None:
        pass  # the over-reserved range is left to process exit; it holds no memory

    def create(self, nbytes: int) -> Any:
        offset = self.next_offset
        self.next_offset += nbytes
        self.libc.fallocate(self.fd, 0, offset, nbytes)
        return offset

    def map(self, address: int, nbytes: int, handle: Any) -> None:
        self.libc.mmap_file_fixed(address, nbytes, self.fd, handle)

    def unmap(self, address: int, nbytes: int) -> None:
        self.libc.mmap_anonymous_reserve(address, nbytes, fixed=True)

    def release(self, handle: Any, nbytes: int) -> None:
        mode = self.libc.FALLOC_FL_PUNCH_HOLE | self.libc.FALLOC_FL_KEEP_SIZE
        self.libc.fallocate(self.fd, mode, handle, nbytes)


class RawRocm:
    """The hip-python calls the ROCm backend makes, without kvcached around them."""

    def __init__(self, backend: Any) -> None:
        self.hip = backend._hip
        self.prop = backend._prop
        self.access = backend._access

    def _ok(self, result: Any) -> Any:
        err, *values = result
        assert int(err) == 0, err
        return values[0] if values else None

    def reserve(self, nbytes: int, align: int) -> int:
        from kvcached.backends.rocm import bindings

        return bindings.address(self._ok(self.hip.hipMemAddressReserve(nbytes, align, None, 0)))

    def free(self, address: int, nbytes: int) -> None:
        self._ok(self.hip.hipMemAddressFree(address, nbytes))

    def create(self, nbytes: int) -> Any:
        return self._ok(self.hip.hipMemCreate(nbytes, self.prop, 0))

    def map(self, address: int, nbytes: int, handle: Any) -> None:
        self._ok(self.hip.hipMemMap(address, nbytes, 0, handle, 0))
        self._ok(self.hip.hipMemSetAccess(address, nbytes, self.access, 1))

    def unmap(self, address: int, nbytes: int) -> None:
        self._ok(self.hip.hipMemUnmap(address, nbytes))

    def release(self, handle: Any, nbytes: int) -> None:
        self._ok(self.hip.hipMemRelease(handle))


RAW_DRIVERS: dict[str, Callable[[Any], Any]] = {
    "cuda": RawCuda,
    "host": RawHost,
    "rocm": RawRocm,
}


def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - start) / 1e3


def round_kvcached(backend: Backend, size: int, pages: int) -> dict[str, float]:
    """Total µs of each op over `pages` pages of `size` bytes, through kvcached."""
    reservation = backend.reserve(size * pages)
    made: list[Any] = []
    totals = {}
    totals["create"] = _timed(lambda: made.extend(backend.create(size) for _ in range(pages)))
    totals["map"] = _timed(
        lambda: [backend.map(reservation, i * size, p) for i, p in enumerate(made)]
    )
    totals["unmap"] = _timed(
        lambda: [backend.unmap(reservation, i * size, size) for i in range(pages)]
    )
    totals["map_many"] = _timed(
        lambda: backend.map_many(reservation, [(i * size, p) for i, p in enumerate(made)])
    )
    totals["unmap_many"] = _timed(
        lambda: backend.unmap_many(reservation, [(i * size, size) for i in range(pages)])
    )
    totals["release"] = _timed(lambda: [backend.release(p) for p in made])
    backend.free(reservation)
    return totals


def round_raw(raw: Any, size: int, pages: int, align: int) -> dict[str, float]:
    """The same sequence with direct driver calls."""
    base = raw.reserve(size * pages, align)
    handles: list[Any] = []
    totals = {}
    totals["create"] = _timed(lambda: handles.extend(raw.create(size) for _ in range(pages)))
    totals["map"] = _timed(
        lambda: [raw.map(base + i * size, size, h) for i, h in enumerate(handles)]
    )
    totals["unmap"] = _timed(lambda: [raw.unmap(base + i * size, size) for i in range(pages)])
    totals["release"] = _timed(lambda: [raw.release(h, size) for h in handles])
    raw.free(base, size * pages)
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default=None, help="default: auto-detected")
    parser.add_argument("--sizes-mib", default="2,4,8,16,32,64")
    parser.add_argument("--pages", type=int, default=64, help="pages per round and size")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    backend = kvcached.get_backend(args.backend)
    if backend.name not in RAW_DRIVERS:
        raise SystemExit(f"no raw-driver baseline for backend {backend.name!r}")
    raw = RAW_DRIVERS[backend.name](backend)
    g = backend.granularity
    for size_mib in (int(s) for s in args.sizes_mib.split(",")):
        size = size_mib * MiB
        if size % g:
            continue
        pages = args.pages
        round_kvcached(backend, size, 4)  # warm-up both paths
        round_raw(raw, size, 4, g)
        ours: dict[str, list[float]] = {}
        base: dict[str, list[float]] = {}
        for _ in range(args.rounds):  # alternate, so drift hits both equally
            for op, us in round_kvcached(backend, size, pages).items():
                ours.setdefault(op, []).append(us / pages)
            for op, us in round_raw(raw, size, pages, g).items():
                base.setdefault(op, []).append(us / pages)
        ours["map+unmap"] = [m + u for m, u in zip(ours["map"], ours["unmap"], strict=True)]
        base["map+unmap"] = [m + u for m, u in zip(base["map"], base["unmap"], strict=True)]
        ours["batch map+unmap"] = [
            m + u for m, u in zip(ours["map_many"], ours["unmap_many"], strict=True)
        ]
        base["map_many"], base["unmap_many"] = base["map"], base["unmap"]
        base["batch map+unmap"] = base["map+unmap"]
        for op in (*OPS, "map+unmap", "map_many", "unmap_many", "batch map+unmap"):
            mine, theirs = statistics.median(ours[op]), statistics.median(base[op])
            print(
                json.dumps(
                    {
                        "bench": "vmm_ops",
                        "backend": backend.name,
                        "device": backend.device,
                        "page_mib": size_mib,
                        "op": op,
                        "kvcached_us": round(mine, 2),
                        "raw_us": round(theirs, 2),
                        "ratio": round(mine / theirs, 3) if theirs else None,
                        "pages": pages,
                        "rounds": args.rounds,
                    }
                ),
                flush=True,
            )
    backend.close()


if __name__ == "__main__":
    main()
