"""Many processes charging one ledger at once: no crash, no over-commit, exact totals,
and the bytes of a process killed with SIGKILL midway are reclaimed."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

from kvcached.ledger import Ledger

MiB = 1 << 20
WORKERS = 8  # the last one is killed midway
CYCLES = 10_000
BUDGET = 40 * MiB  # each worker wants up to 8 charges of 1-3 MiB: demand is far above it
LIMITED = 6 * MiB  # worker 0 also has a limit of its own
MAX_HELD = 8


def _worker(
    folder: str,
    index: int,
    progress: Any,
    results: Any,
    release: Any,
) -> None:
    """CYCLES charge/refund cycles, then report what it holds and wait to be released."""
    rng = random.Random(index)
    with Ledger.open("stress-0", directory=folder) as ledger:
        account = ledger.register(f"w{index}", "stress", limit=LIMITED if index == 0 else None)
        held: list[int] = []
        granted = refused = 0
        cycle = 0
        while cycle < CYCLES or index == WORKERS - 1:  # the victim runs until it is killed
            if len(held) < MAX_HELD and rng.random() < 0.6:
                nbytes = rng.randint(1, 3) * MiB
                if account.try_charge(nbytes):
                    held.append(nbytes)
                    granted += 1
                else:
                    refused += 1
            elif held:
                account.refund(held.pop(rng.randrange(len(held))))
            cycle += 1
            if cycle % 100 == 0:
                progress[index] = cycle
        progress[index] = cycle
        results.put((index, sum(held), account.reserved, granted, refused))
        release.wait(60)
        account.refund(sum(held))
        account.close()


def test_processes_never_overcommit_and_a_killed_one_is_reclaimed(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    progress = ctx.Array("q", WORKERS, lock=False)
    results = ctx.Queue()
    release = ctx.Event()
    with Ledger.open("stress-0", budget=BUDGET, directory=tmp_path) as ledger:
        samples = 0
        violations: list[str] = []
        stop = threading.Event()

        def sample() -> None:
            nonlocal samples
            while not stop.is_set():
                totals, rows = ledger.snapshot(reclaim=False)
                samples += 1
                if totals.reserved > totals.budget:
                    violations.append(f"reserved {totals.reserved} > budget {totals.budget}")
                for row in rows:
                    if row.limit is not None and row.reserved > row.limit:
                        violations.append(f"{row.name}: {row.reserved} > limit {row.limit}")
                time.sleep(0.0005)

        procs = [
            ctx.Process(target=_worker, args=(str(tmp_path), i, progress, results, release))
            for i in range(WORKERS)
        ]
        for proc in procs:
            proc.start()
        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            victim = procs[-1]
            survivors = procs[:-1]

            # Kill the victim once every worker is well under way and it holds bytes.
            deadline = time.monotonic() + 60
            while min(progress[:]) < CYCLES // 4 or not _reserved(ledger, f"w{WORKERS - 1}"):
                assert time.monotonic() < deadline, f"no progress: {progress[:]}"
                time.sleep(0.01)
            victim_bytes = _reserved(ledger, f"w{WORKERS - 1}")
            os.kill(victim.pid, signal.SIGKILL)  # type: ignore[arg-type]
            victim.join()
            assert victim.exitcode == -signal.SIGKILL
            assert victim_bytes > 0

            # The survivors' failing charges reclaim its row while they still run.
            while _reserved(ledger, f"w{WORKERS - 1}") is not None:
                assert time.monotonic() < deadline, "the killed worker's row was never reclaimed"
                time.sleep(0.005)
            assert min(progress[: WORKERS - 1]) < CYCLES, "reclaimed only after the run"

            reports = [results.get(timeout=60) for _ in survivors]
            # Every survivor finished and waits: the ledger must match what they hold.
            totals, rows = ledger.snapshot(reclaim=False)
            by_name = {row.name: row for row in rows}
            assert sorted(by_name) == [f"w{i}" for i in range(WORKERS - 1)]
            for index, held, reserved, granted, refused in reports:
                assert held == reserved == by_name[f"w{index}"].reserved
                assert granted > 0 and refused > 0
                assert by_name[f"w{index}"].denied == refused
            assert totals.reserved == sum(r[1] for r in reports) <= BUDGET
            release.set()
            for proc in survivors:
                proc.join(60)
                assert proc.exitcode == 0
        finally:
            stop.set()
            sampler.join()
            release.set()
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                    proc.join()
        print(f"{samples} samples, reports (index, held, reserved, granted, refused): {reports}")
        assert violations == []
        assert samples > 100
        final = ledger.totals()
        assert (final.reserved, final.instances) == (0, 0)


def _reserved(ledger: Ledger, name: str) -> int | None:
    for row in ledger.rows(reclaim=False):
        if row.name == name:
            return row.reserved
    return None
