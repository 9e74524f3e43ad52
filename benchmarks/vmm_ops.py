"""Per-operation latency of the VMM primitives: kvcached's backend vs. the raw driver.

For each page size (2 MiB ... 64 MiB) this times create, map (including set-access),
unmap and release of every page twice, back to back: once through `kvcached`'s public
Backend API and once through the same driver calls made directly (which goes first
alternates), so both see the same machine state; figures are medians over all pages
and rounds. Prints one JSON object per line:

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


def paired_round(
    backend: Backend, raw: Any, size: int, pages: int, flip: bool
) -> dict[str, list[tuple[float, float]]]:
    """Per page and op, (kvcached µs, raw µs) measured back to back: each page's op runs
    through kvcached and through the raw driver one right after the other (which goes
    first alternates by page and round), so machine drift hits both sides alike."""
    g = backend.granularity
    reservation = backend.reserve(size * pages)
    base = raw.reserve(size * pages, g)
    made: list[Any] = [None] * pages
    handles: list[Any] = [None] * pages
    ops: dict[str, tuple[Callable[[int], Any], Callable[[int], Any]]] = {
        "create": (
            lambda i: made.__setitem__(i, backend.create(size)),
            lambda i: handles.__setitem__(i, raw.create(size)),
        ),
        "map": (
            lambda i: backend.map(reservation, i * size, made[i]),
            lambda i: raw.map(base + i * size, size, handles[i]),
        ),
        "unmap": (
            lambda i: backend.unmap(reservation, i * size, size),
            lambda i: raw.unmap(base + i * size, size),
        ),
        "release": (
            lambda i: backend.release(made[i]),
            lambda i: raw.release(handles[i], size),
        ),
    }
    samples: dict[str, list[tuple[float, float]]] = {op: [] for op in ops}
    clock = time.perf_counter_ns
    for op, (ours, theirs) in ops.items():
        for i in range(pages):
            if (i % 2 == 0) != flip:
                t0 = clock()
                ours(i)
                t1 = clock()
                theirs(i)
                t2 = clock()
                samples[op].append(((t1 - t0) / 1e3, (t2 - t1) / 1e3))
            else:
                t0 = clock()
                theirs(i)
                t1 = clock()
                ours(i)
                t2 = clock()
                samples[op].append(((t2 - t1) / 1e3, (t1 - t0) / 1e3))
    backend.free(reservation)
    raw.free(base, size * pages)
    return samples


def batch_round(backend: Backend, size: int, pages: int) -> dict[str, float]:
    """µs per page of kvcached's batch forms: one map_many / unmap_many for all pages."""
    reservation = backend.reserve(size * pages)
    made = [backend.create(size) for _ in range(pages)]
    totals = {
        "map_many": _timed(
            lambda: backend.map_many(reservation, [(i * size, p) for i, p in enumerate(made)])
        ),
        "unmap_many": _timed(
            lambda: backend.unmap_many(reservation, [(i * size, size) for i in range(pages)])
        ),
    }
    for page in made:
        backend.release(page)
    backend.free(reservation)
    return {op: us / pages for op, us in totals.items()}


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
        paired_round(backend, raw, size, 8, False)  # warm-up both paths
        samples: dict[str, list[tuple[float, float]]] = {}
        batches: dict[str, list[float]] = {}
        for round_ in range(args.rounds):
            for op, pairs in paired_round(backend, raw, size, pages, round_ % 2 == 1).items():
                samples.setdefault(op, []).extend(pairs)
            for op, us in batch_round(backend, size, pages).items():
                batches.setdefault(op, []).append(us)
        samples["map+unmap"] = [
            (m[0] + u[0], m[1] + u[1])
            for m, u in zip(samples["map"], samples["unmap"], strict=True)
        ]
        rows = {op: [a for a, _ in pairs] for op, pairs in samples.items()}
        raws = {op: [b for _, b in pairs] for op, pairs in samples.items()}
        rows.update(batches)
        rows["batch map+unmap"] = [
            m + u for m, u in zip(batches["map_many"], batches["unmap_many"], strict=True)
        ]
        raws["map_many"], raws["unmap_many"] = raws["map"], raws["unmap"]
        raws["batch map+unmap"] = raws["map+unmap"]
        for op in (*OPS, "map+unmap", "map_many", "unmap_many", "batch map+unmap"):
            mine, theirs = statistics.median(rows[op]), statistics.median(raws[op])
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
                        "samples": len(rows[op]),
                        "pages": pages,
                        "rounds": args.rounds,
                    }
                ),
                flush=True,
            )
    backend.close()


if __name__ == "__main__":
    main()
