"""Per-operation latency of the VMM primitives: kvcached's backend vs. the raw driver.

For each page size (2 MiB ... 64 MiB) this times create, map (including set-access),
unmap and release of every page twice, back to back: once through `kvcached`'s public
Backend API and once through the same driver calls made directly (which goes first
alternates), so both see the same machine state; figures are medians over all pages
and rounds. Prints one JSON object per line:

    {"bench": "vmm_ops", "backend": "cuda", "page_mib": 2, "op": "map",
     "kvcached_us": 41.2, "raw_us": 40.1, "ratio": 1.027, ...}

plus a `map+unmap` row per size (the figure the overhead target is about, with the
median of its per-page ratios, a bootstrap 95 % interval and the verdict against 1.05)
and `map_many` / `unmap_many` / `batch map+unmap` rows: our batch forms, one call for
all pages of a round (set-access once per contiguous run), against the same raw
per-page calls. Each size also gets `"control": "raw vs raw"` rows: the raw calls
paired against themselves exactly as they are paired against kvcached, on two ranges.
A control ratio away from 1.0 is what the pairing itself reads (the address range, the
order), and the kvcached rows are only as exact as it is.

On CUDA, where kvcached makes its per-page calls from C (`per_page_calls: compiled` in
every row), a second baseline follows: `"baseline": "compiled calls"` rows pair kvcached
with the same C calls made directly (`VmmCalls`, one crossing from Python a map and one
an unmap, with none of kvcached's checks or books). The first baseline answers what a
page costs through kvcached against calling the driver through cuda.bindings; the
second, what kvcached's own Python adds on top of the cheapest call Python can make.
`KVCACHED_COMPILED_CALLS=0` runs kvcached on cuda.bindings, as before the C module.

    python benchmarks/vmm_ops.py [--backend cuda|host] [--rounds 7] [--pages 64]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from paired_ratios import bootstrap_median_interval  # benchmarks/, this script's folder

import kvcached
from kvcached.backend import Backend

MiB = 1 << 20
OPS = ("create", "map", "unmap", "release")
TARGET = 1.05  # map+unmap through kvcached over the raw calls (issue 22)
RESAMPLES = 2000  # a few hundred pages a row: enough for a stable 95 % interval
INTERVAL_OPS = ("map", "unmap", "map+unmap")


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


class RawPage:
    """What `VmmCalls.map` reads of a page: its handle and its size."""

    __slots__ = ("handle", "nbytes")

    def __init__(self, handle: Any, nbytes: int) -> None:
        self.handle, self.nbytes = handle, nbytes


class RawCompiledCuda(RawCuda):
    """RawCuda with map and unmap made by kvcached's C module directly: the driver's
    entry points, one Python-to-C crossing each, and nothing of kvcached around them."""

    def __init__(self, backend: Any) -> None:
        super().__init__(backend)
        from kvcached.backends.cuda import compiled

        entry_points = compiled.loaded_driver_entry_points()
        if isinstance(entry_points, str):
            raise SystemExit(f"compiled calls: {entry_points}")
        access = compiled.read_write_access(self.d, backend._ordinal)
        calls = compiled.compiled_calls(entry_points, access, self._failed)
        if isinstance(calls, str):
            raise SystemExit(f"compiled calls: {calls}")
        self.calls = calls

    @staticmethod
    def _failed(api: str, result: int, address: int, what: Any) -> None:
        raise AssertionError(f"{api} failed: {result}")

    def create(self, nbytes: int) -> Any:
        return RawPage(super().create(nbytes), nbytes)

    def map(self, address: int, nbytes: int, handle: Any) -> None:
        self.calls.map(address, handle)

    def unmap(self, address: int, nbytes: int) -> None:
        self.calls.unmap(address, nbytes)

    def release(self, handle: Any, nbytes: int) -> None:
        super().release(handle.handle, nbytes)


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


class KvcachedSide:
    """One page's ops through kvcached's public Backend API, on a reservation of its own."""

    def __init__(self, backend: Backend, size: int, pages: int) -> None:
        self.backend, self.size = backend, size
        self.reservation = backend.reserve(size * pages)
        self.made: list[Any] = [None] * pages

    def create(self, i: int) -> None:
        self.made[i] = self.backend.create(self.size)

    def map(self, i: int) -> None:
        self.backend.map(self.reservation, i * self.size, self.made[i])

    def unmap(self, i: int) -> None:
        self.backend.unmap(self.reservation, i * self.size, self.size)

    def release(self, i: int) -> None:
        self.backend.release(self.made[i])

    def free(self) -> None:
        self.backend.free(self.reservation)


class RawSide:
    """The same ops as direct driver calls, on an address range of its own."""

    def __init__(self, raw: Any, granularity: int, size: int, pages: int) -> None:
        self.raw, self.size, self.nbytes = raw, size, size * pages
        self.base = raw.reserve(self.nbytes, granularity)
        self.handles: list[Any] = [None] * pages

    def create(self, i: int) -> None:
        self.handles[i] = self.raw.create(self.size)

    def map(self, i: int) -> None:
        self.raw.map(self.base + i * self.size, self.size, self.handles[i])

    def unmap(self, i: int) -> None:
        self.raw.unmap(self.base + i * self.size, self.size)

    def release(self, i: int) -> None:
        self.raw.release(self.handles[i], self.size)

    def free(self) -> None:
        self.raw.free(self.base, self.nbytes)


Side = KvcachedSide | RawSide


def paired_round(
    make_a: Callable[[int], Side], make_b: Callable[[int], Side], pages: int, flip: bool
) -> dict[str, list[tuple[float, float]]]:
    """Per page and op, (side a µs, side b µs) measured back to back: each page's op runs
    on one side and then the other (which goes first alternates by page and round), so
    machine drift hits both alike. Which side reserves its range first alternates by
    round too, so neither keeps the lower (or the fresher) addresses."""
    if flip:
        b = make_b(pages)
        a = make_a(pages)
    else:
        a = make_a(pages)
        b = make_b(pages)
    samples: dict[str, list[tuple[float, float]]] = {op: [] for op in OPS}
    clock = time.perf_counter_ns
    for op in OPS:
        first, second = getattr(a, op), getattr(b, op)
        for i in range(pages):
            if (i % 2 == 0) != flip:
                t0 = clock()
                first(i)
                t1 = clock()
                second(i)
                t2 = clock()
                samples[op].append(((t1 - t0) / 1e3, (t2 - t1) / 1e3))
            else:
                t0 = clock()
                second(i)
                t1 = clock()
                first(i)
                t2 = clock()
                samples[op].append(((t2 - t1) / 1e3, (t1 - t0) / 1e3))
    a.free()
    b.free()
    return samples


def pair_interval(pairs: list[tuple[float, float]]) -> dict[str, Any]:
    """The median of the per-page ratios a / b and its bootstrap 95 % interval."""
    ratios = [x / y for x, y in pairs if y > 0]
    low, high = bootstrap_median_interval(ratios, resamples=RESAMPLES)
    return {
        "paired_ratio_median": round(statistics.median(ratios), 4),
        "paired_ratio_ci95": [round(low, 4), round(high, 4)],
    }


def _paired_figures(pairs: list[tuple[float, float]], first: str, second: str) -> dict[str, Any]:
    """Each side's median µs (under the names given), their ratio, and the median paired
    ratio with its interval."""
    a = statistics.median(x for x, _ in pairs)
    b = statistics.median(y for _, y in pairs)
    return {
        first: round(a, 2),
        second: round(b, 2),
        "ratio": round(a / b, 3) if b else None,
        "samples": len(pairs),
        **pair_interval(pairs),
    }


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


def _with_sum(samples: dict[str, list[tuple[float, float]]]) -> None:
    samples["map+unmap"] = [
        (m[0] + u[0], m[1] + u[1]) for m, u in zip(samples["map"], samples["unmap"], strict=True)
    ]


def _target_verdict(low: float, high: float) -> str:
    if high <= TARGET:
        return "met"
    if low > TARGET:
        return "missed"
    return "undecided"


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
    per_page_calls = backend.describe().get("per_page_calls")
    # the second baseline, where kvcached itself makes its per-page calls from C
    raw_compiled = RawCompiledCuda(backend) if per_page_calls == "compiled" else None
    g = backend.granularity
    for size_mib in (int(s) for s in args.sizes_mib.split(",")):
        size = size_mib * MiB
        if size % g:
            continue
        pages = args.pages

        ours = functools.partial(KvcachedSide, backend, size)
        theirs = functools.partial(RawSide, raw, g, size)
        direct_c = functools.partial(RawSide, raw_compiled, g, size) if raw_compiled else None

        paired_round(ours, theirs, 8, False)  # warm-up both paths
        samples: dict[str, list[tuple[float, float]]] = {}
        control: dict[str, list[tuple[float, float]]] = {}
        against_c: dict[str, list[tuple[float, float]]] = {}
        batches: dict[str, list[float]] = {}
        for round_ in range(args.rounds):
            flip = round_ % 2 == 1
            for op, pairs in paired_round(ours, theirs, pages, flip).items():
                samples.setdefault(op, []).extend(pairs)
            # the control: the raw calls against themselves, made the same way, shows
            # what the pairing reads when both sides run the same code
            for op, pairs in paired_round(theirs, theirs, pages, flip).items():
                control.setdefault(op, []).extend(pairs)
            if direct_c is not None:
                for op, pairs in paired_round(ours, direct_c, pages, flip).items():
                    against_c.setdefault(op, []).extend(pairs)
            for op, us in batch_round(backend, size, pages).items():
                batches.setdefault(op, []).append(us)
        _with_sum(samples)
        _with_sum(control)
        if against_c:
            _with_sum(against_c)
        rows = {op: [a for a, _ in pairs] for op, pairs in samples.items()}
        raws = {op: [b for _, b in pairs] for op, pairs in samples.items()}
        rows.update(batches)
        rows["batch map+unmap"] = [
            m + u for m, u in zip(batches["map_many"], batches["unmap_many"], strict=True)
        ]
        raws["map_many"], raws["unmap_many"] = raws["map"], raws["unmap"]
        raws["batch map+unmap"] = raws["map+unmap"]
        common = {
            "bench": "vmm_ops",
            "backend": backend.name,
            "device": backend.device,
            "page_mib": size_mib,
            "per_page_calls": per_page_calls,
        }
        for op in (*OPS, "map+unmap", "map_many", "unmap_many", "batch map+unmap"):
            mine, theirs_us = statistics.median(rows[op]), statistics.median(raws[op])
            row: dict[str, Any] = {
                **common,
                "op": op,
                "kvcached_us": round(mine, 2),
                "raw_us": round(theirs_us, 2),
                "ratio": round(mine / theirs_us, 3) if theirs_us else None,
                "baseline": "cuda.bindings" if backend.name == "cuda" else "raw calls",
                "samples": len(rows[op]),
                "pages": pages,
                "rounds": args.rounds,
            }
            if op in INTERVAL_OPS:
                row.update(pair_interval(samples[op]))
            if op == "map+unmap":
                low, high = row["paired_ratio_ci95"]
                row["target"] = f"paired ratio's 95 % interval <= {TARGET}"
                row["verdict"] = _target_verdict(low, high)
            print(json.dumps(row), flush=True)
        for op in INTERVAL_OPS if against_c else ():
            row = {**common, "op": op, "baseline": "compiled calls",
                   **_paired_figures(against_c[op], "kvcached_us", "raw_us")}  # fmt: skip
            if op == "map+unmap":
                low, high = row["paired_ratio_ci95"]
                row["verdict"] = _target_verdict(low, high)
            print(json.dumps(row), flush=True)
        for op in INTERVAL_OPS:
            line = {**common, "op": op, "control": "raw vs raw",
                    **_paired_figures(control[op], "a_us", "b_us")}  # fmt: skip
            print(json.dumps(line), flush=True)
    backend.close()


if __name__ == "__main__":
    main()
