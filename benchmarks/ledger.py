"""What one ledger operation costs: a charge, a refund, and a charge the budget refuses.

The cross-process ledger (`kvcached.ledger`, ADR 0002) is on the allocator's growth and
release path: every extent mapped is charged, every extent released refunded, each one
two `flock` calls and a few struct operations on a shared file (Note [The hot path] in
kvcached/ledger/account.py). A refused charge also looks for dead instances' rows before
it retries once. This times them through the public API, in one process, on a ledger
of its own in a temporary folder, with 1 and with 8 instances registered (the others
idle, so the sum over rows reads more of them):

* ``charge``: `try_charge` of one page that fits, mean over a batch of ROUNDS;
* ``refund``: `refund` of it again, the same;
* ``refused charge``: `try_charge` past the budget (the dead-row scan included).

Each figure is the median over REPEATS batches, with the batches' range. Prints one JSON
object per line:

    python benchmarks/ledger.py [--rounds 20000] [--repeats 7] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from kvcached.ledger import Ledger

PAGE = 2 << 20


def _batch(op: Any, rounds: int) -> float:
    """Mean microseconds of `op()` over `rounds` calls."""
    started = time.perf_counter_ns()
    for _ in range(rounds):
        op()
    return (time.perf_counter_ns() - started) / rounds / 1000


def measure(instances: int, rounds: int, repeats: int, folder: Path) -> list[dict[str, Any]]:
    budget = (rounds + 1) * PAGE
    with Ledger.open(f"bench-{instances}", budget=budget, directory=folder) as ledger:
        accounts = [ledger.register(f"instance-{i}", "bench") for i in range(instances)]
        mine = accounts[0]
        figures: dict[str, list[float]] = {"charge": [], "refund": [], "refused charge": []}
        refused_rounds = max(1, rounds // 20)
        for _ in range(repeats):

            def charge() -> None:
                assert mine.try_charge(PAGE)

            figures["charge"].append(_batch(charge, rounds))
            figures["refund"].append(_batch(lambda: mine.refund(PAGE), rounds))
            assert mine.try_charge(budget - PAGE)  # all but one page: the next page is past it
            assert mine.try_charge(PAGE)

            def refused() -> None:
                assert not mine.try_charge(PAGE)

            figures["refused charge"].append(_batch(refused, refused_rounds))
            mine.refund(budget)
        for account in accounts:
            account.close()
    return [
        {
            "case": case, "instances": instances, "us": round(statistics.median(values), 3),
            "us_range": [round(min(values), 3), round(max(values), 3)],
            "batches": repeats, "rounds": refused_rounds if case == "refused charge" else rounds,
        }
        for case, values in figures.items()
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=None)
    a = parser.parse_args(argv)
    common = {"bench": "ledger", "python": platform.python_version(), "cpu": platform.machine()}
    lines = []
    with tempfile.TemporaryDirectory(prefix="kvcached-ledger-bench-") as folder:
        for instances in (1, 8):
            for row in measure(instances, a.rounds, a.repeats, Path(folder)):
                line = json.dumps({**common, **row})
                print(line, flush=True)
                lines.append(line)
    if a.out is not None:
        a.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
