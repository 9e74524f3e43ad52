"""Many processes charging one ledger at once: no crash, no over-commit, exact totals,
and the bytes of a process killed with SIGKILL midway are reclaimed.

What is asserted does not depend on the interleaving. Every worker first charges an
equal share that fills the budget exactly and, once all have (a barrier), tries one
more charge, which must be refused: so every worker has both a granted and a refused
charge whatever the scheduler does. The victim keeps its share until it is killed, so
it certainly holds bytes then. The survivors keep charging until the test has seen the
victim's row reclaimed (by their refused charges: the test itself never reclaims) and
the sampler has taken enough samples, so neither can miss the other.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvcached.ledger import Ledger

MiB = 1 << 20
WORKERS = 8  # the last one is killed midway
CYCLES = 10_000  # at least this many random cycles per survivor
BUDGET = 40 * MiB  # each worker wants up to 8 charges of 1-3 MiB: demand is far above it
SHARE = BUDGET // WORKERS  # the first charge of every worker: together, the whole budget
LIMITED = 6 * MiB  # worker 0 also has a limit of its own
MAX_HELD = 8
VICTIM = WORKERS - 1
MIN_SAMPLES = 100


def _worker(
    folder: str,
    index: int,
    progress: Any,
    results: Any,
    filled: Any,
    finish: Any,
    release: Any,
) -> None:
    """Fill the budget with the others, then charge/refund at random until `finish`,
    report what it holds, and wait to be released. The victim never finishes."""
    rng = random.Random(index)
    with Ledger.open("stress-0", directory=folder) as ledger:
        account = ledger.register(f"w{index}", "stress", limit=LIMITED if index == 0 else None)
        granted = refused = 0
        assert account.try_charge(SHARE)
        granted += 1
        filled.wait()  # every worker holds its share: the budget is exactly full
        assert not account.try_charge(MiB)
        refused += 1
        filled.wait()  # nobody refunds before everyone has been refused
        held: list[int] = []
        if index != VICTIM:
            account.refund(SHARE)  # the victim keeps its share until it is killed
        cycle = 0
        while index == VICTIM or cycle < CYCLES or not finish.is_set():
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


def _wait_for(condition: Callable[[], bool], what: str, deadline: float) -> None:
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.005)


def test_processes_never_overcommit_and_a_killed_one_is_reclaimed(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    progress = ctx.Array("q", WORKERS, lock=False)
    results = ctx.Queue()
    filled = ctx.Barrier(WORKERS)
    finish = ctx.Event()
    release = ctx.Event()
    reports: list[tuple[int, int, int, int, int]] = []
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

        args = (progress, results, filled, finish, release)
        procs = [
            ctx.Process(target=_worker, args=(str(tmp_path), i, *args)) for i in range(WORKERS)
        ]
        for proc in procs:
            proc.start()
        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            victim, survivors = procs[VICTIM], procs[:VICTIM]
            deadline = time.monotonic() + 120  # only against a hang; nothing is timed

            # Kill the victim once every worker is well into its random cycles.
            _wait_for(lambda: min(progress[:]) >= CYCLES // 4, "progress", deadline)
            victim_bytes = _reserved(ledger, f"w{VICTIM}")
            assert victim_bytes is not None and victim_bytes >= SHARE  # it keeps its share
            os.kill(victim.pid, signal.SIGKILL)  # type: ignore[arg-type]
            victim.join()
            assert victim.exitcode == -signal.SIGKILL

            # The survivors' refused charges reclaim its row while they still run.
            _wait_for(lambda: _reserved(ledger, f"w{VICTIM}") is None, "the reclaim", deadline)
            assert all(proc.is_alive() for proc in survivors)
            _wait_for(lambda: samples >= MIN_SAMPLES, "samples", deadline)
            finish.set()

            reports = [results.get(timeout=60) for _ in survivors]
            # Every survivor finished and waits: the ledger must match what they hold.
            totals, rows = ledger.snapshot(reclaim=False)
            by_name = {row.name: row for row in rows}
            assert sorted(by_name) == [f"w{i}" for i in range(VICTIM)]
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
            finish.set()
            sampler.join()
            release.set()
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                    proc.join()
        print(f"{samples} samples, reports (index, held, reserved, granted, refused): {reports}")
        assert violations == []
        final = ledger.totals()
        assert (final.reserved, final.instances) == (0, 0)


def _reserved(ledger: Ledger, name: str) -> int | None:
    for row in ledger.rows(reclaim=False):
        if row.name == name:
            return row.reserved
    return None
