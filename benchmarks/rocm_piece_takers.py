"""How often another thread's mapping takes a piece the ROCm release workaround frees.

Under the release workaround (docs/backends/rocm.md) every map and unmap frees a piece
of a reservation and reserves it again at the same address; a mapping made by another
thread in between can land in the piece and keep it. This runs the workaround's maps
and unmaps (2-granule pages over a 64-granule reservation) beside a thread that makes
1 MiB anonymous mappings without an address and keeps one in 50 (the last 1,000), as
a process's Python arenas and malloc chunks do, and counts the maps that failed
(DriverError) and the unmaps that warned. Two placements, each in fresh child
processes, alternating:

* ``low``: what the backend does (Note [holes below the frontier] in
  backends/rocm/backend.py): reservations asked for upwards from 16 TiB;
* ``frontier``: reservations wherever the runtime puts them unasked, as before.

Needs the ROCm backend: real ROCm, or the host stand-in with its release bug on:

    eval "$(python tests/rocm/standin.py --out /tmp/hipstandin)"
    HIPSTANDIN_BUG_RELEASE=1 HIPSTANDIN_STATE=/tmp/hipstandin-state \\
        python benchmarks/rocm_piece_takers.py [--pairs 2] [--seconds 15]

Prints one JSON object per child, then a summary per placement.
"""

from __future__ import annotations

import argparse
import json
import mmap
import subprocess
import sys
import threading
import time
import warnings
from typing import Any

MiB = 1 << 20


def emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def child(placement: str, seconds: float) -> None:
    from kvcached.backends.rocm import RocmBackend
    from kvcached.backends.rocm import backend as rocm_backend
    from kvcached.errors import DriverError

    if placement == "frontier":
        rocm_backend._LOW_PLACEMENT.claim = lambda nbytes, alignment: None  # type: ignore[method-assign]
    backend = RocmBackend(release_workaround=True)
    page_bytes = 2 * backend.granularity
    reservation = backend.reserve(32 * page_bytes)
    offsets = range(0, 32 * page_bytes, 2 * page_bytes)  # every other page's place
    stop = threading.Event()
    kept: list[mmap.mmap] = []

    def mapper() -> None:
        made = 0
        while not stop.is_set():
            taker = mmap.mmap(-1, MiB)
            made += 1
            if made % 50 == 0:
                kept.append(taker)  # one in 50 stays, as a long-lived arena does
                if len(kept) > 1000:  # within the kernel's limit on mappings
                    kept.pop(0).close()
            else:
                taker.close()

    other = threading.Thread(target=mapper)
    other.start()
    rounds = failed_maps = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for offset in offsets:
                page = backend.create(page_bytes)
                try:
                    backend.map(reservation, offset, page)
                    backend.unmap(reservation, offset, page_bytes)
                except DriverError:
                    failed_maps += 1
                backend.release(page)
            rounds += 1
    stop.set()
    other.join()
    warned = sum("could not be reserved again" in str(w.message) for w in caught)
    emit(
        bench="rocm_piece_takers",
        placement=placement,
        seconds=seconds,
        rounds=rounds,
        maps=rounds * len(offsets),
        failed_maps=failed_maps,
        unmaps_warned=warned,
        reservation=hex(reservation.address),
        kept_mappings=len(kept),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--child", choices=["low", "frontier"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.seconds)
        return
    rows: list[dict[str, Any]] = []
    for _ in range(args.pairs):
        for placement in ("frontier", "low"):
            done = subprocess.run(
                [sys.executable, __file__, "--child", placement, "--seconds", str(args.seconds)],
                capture_output=True,
                text=True,
            )
            if done.returncode != 0:
                sys.exit(f"the {placement} child failed:\n{done.stderr[-3000:]}")
            row = json.loads(done.stdout.strip().splitlines()[-1])
            print(json.dumps(row), flush=True)
            rows.append(row)
    for placement in ("frontier", "low"):
        mine = [r for r in rows if r["placement"] == placement]
        emit(
            bench="rocm_piece_takers",
            summary=placement,
            runs=len(mine),
            maps=sum(r["maps"] for r in mine),
            failed_maps=sum(r["failed_maps"] for r in mine),
            unmaps_warned=sum(r["unmaps_warned"] for r in mine),
        )


if __name__ == "__main__":
    main()
