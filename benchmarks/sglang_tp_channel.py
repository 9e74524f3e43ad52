"""What the SGLang adapter's tensor parallelism costs a scheduler iteration, on CPU.

SGLang's TP schedulers broadcast rank 0's new requests every iteration over the TP
group's gloo group (an empty list: one 8-byte broadcast). The adapter hooks that
broadcast (`engines/sglang/tensor_parallel.carries_decisions`): without news it adds
nothing to the wire; with news (a changed free count, ops to replay) it appends a
`Step`, which makes the list non-empty (pickled, a second broadcast) and, when the step
carries ops, one all-reduce. A top-up (`SharedCapacity.take`) is one exchange of its own.

Two ranks (processes) in one gloo group, each with its own ledger (host-0, host-1), time
per iteration, in alternating rounds:

* ``plain``: the request broadcast alone, as SGLang makes it (the baseline);
* ``quiet``: the same through `carries_decisions`, rank 0 without news;
* ``news``: every iteration a changed free count (rank 1's neighbour moves), a Step;
* ``take``: one top-up of 1,024 pages (the tensor-parallel top-up) and its give-back.

    python benchmarks/sglang_tp_channel.py [--rounds 5] [--iterations 2000]
        [--out benchmarks/results/cpu/sglang_tp_channel.jsonl]

Prints one JSON line per round and mode (median microseconds per iteration) and a
summary line with the medians over rounds and the ratios to ``plain``.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODES = ("plain", "quiet", "news", "take")


def requests_broadcast(group: Any, is_leader: bool) -> Any:
    """A stand-in for SGLang's request broadcast with its wire behaviour: the list's
    pickled size from rank 0, then its bytes when it is not empty."""
    import torch
    import torch.distributed as dist

    def broadcast(_receiver: Any, reqs: Any) -> list[Any]:
        if is_leader:
            data = pickle.dumps(reqs) if reqs else b""
            size = torch.tensor([len(data)], dtype=torch.int64)
            dist.broadcast(size, src=0, group=group)
            if data:
                dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), 0, group)
            return list(reqs or [])
        size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=0, group=group)
        if int(size.item()) == 0:
            return []
        buffer = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(buffer, src=0, group=group)
        loaded: list[Any] = pickle.loads(buffer.numpy().tobytes())
        return loaded

    return broadcast


def rank_main(rank: int, rendezvous: str, rounds: int, iterations: int) -> None:
    import torch.distributed as dist

    from kvcached.engines.sglang import instance, tensor_parallel
    from kvcached.engines.sglang.geometry import PoolGeometry
    from kvcached.registry import get_backend

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    group, leader = dist.group.WORLD, rank == 0
    channel = tensor_parallel.ProcessGroupChannel(group, leader=0, is_leader=leader)
    geometry = PoolGeometry(segments=4, rows=8 * 8192, row_bytes=256, page_size=1)
    found = tensor_parallel.start_shared(
        geometry, get_backend("host"), channel, model="bench", device=str(rank)
    )
    capacity = found.capacity
    plain = requests_broadcast(group, leader)
    from kvcached import supply

    supply.CHECK_S = 1e9  # no upkeep decisions: the channel alone is measured

    def one(mode: str) -> float:
        started = time.perf_counter()
        if mode == "plain":
            plain(None, [] if leader else None)
        elif mode == "take":
            ids = capacity.take(1024)
            assert ids is not None
            capacity.give(ids)
        else:
            if mode == "news" and leader:
                capacity._counts = tensor_parallel.Counts(-1, 0, 0)  # forces a Step
            tensor_parallel.carries_decisions(plain, None, [] if leader else None)
        return time.perf_counter() - started

    for round_ in range(rounds):
        for mode in MODES if round_ % 2 == 0 else tuple(reversed(MODES)):
            for _ in range(50):  # warm
                one(mode)
            dist.barrier()
            times = sorted(one(mode) for _ in range(iterations))
            if leader:
                print(
                    json.dumps(
                        {
                            "benchmark": "sglang_tp_channel",
                            "round": round_,
                            "mode": mode,
                            "iterations": iterations,
                            "median_us": round(statistics.median(times) * 1e6, 2),
                            "p99_us": round(times[int(0.99 * len(times))] * 1e6, 2),
                        }
                    ),
                    flush=True,
                )
    dist.barrier()
    instance.close()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iterations", type=int, default=2000)
    ap.add_argument("--out", type=Path, default=None, help="also append the lines here")
    ap.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--rendezvous", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank is not None:
        rank_main(args.rank, args.rendezvous, args.rounds, args.iterations)
        return 0
    with tempfile.TemporaryDirectory(prefix="kvcached-tp-bench-") as tmp:
        ledgers = Path(tmp) / "ledgers"
        ledgers.mkdir()
        env = dict(os.environ, KVCACHED_LEDGER_DIR=str(ledgers), KVCACHED_BACKEND="host")
        env.update(KVCACHED_BUDGET="256MiB", KVCACHED_EXTENT_SIZE="2MiB")
        command = [sys.executable, __file__, "--rounds", str(args.rounds)]
        command += ["--iterations", str(args.iterations), "--rendezvous", f"{tmp}/rdv"]
        ranks = [
            subprocess.Popen(
                [*command, "--rank", str(r)], env=env, stdout=subprocess.PIPE, text=True
            )
            for r in (0, 1)
        ]
        lines = [line for line in ranks[0].communicate()[0].splitlines() if line.startswith("{")]
        ranks[1].communicate()
        if any(r.returncode for r in ranks):
            print("a rank failed", file=sys.stderr)
            return 1
    rows = [json.loads(line) for line in lines]
    by_mode = {m: [r["median_us"] for r in rows if r["mode"] == m] for m in MODES}
    medians = {m: round(statistics.median(v), 2) for m, v in by_mode.items()}
    summary = {
        "benchmark": "sglang_tp_channel",
        "summary": True,
        "median_us": medians,
        "vs_plain": {m: round(medians[m] / medians["plain"], 3) for m in MODES},
        "host": f"{os.cpu_count()} CPUs",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
    }
    out_lines = [*lines, json.dumps(summary)]
    for line in out_lines:
        print(line)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("a") as f:
            f.write("\n".join(out_lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
