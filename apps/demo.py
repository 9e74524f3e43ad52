"""`kvcached demo --engine synthetic`: instances share one budget, elastic vs. static.

This module is the synthetic demo and what every engine demo shares: the phase-shifted
bursty load (`BurstyLoad`, `timed_requests`) and the plot (`plot_modes`).
`--engine vllm` runs real vLLM servers instead (`kvcached.apps.vllm_demo`).

What runs. `--instances` worker processes each own a KV cache for a realistic model
shape (Llama-3.2-1B's by default: 16 layers, 8 KV heads, head dim 64, bf16) on the
detected backend, allocated through `KVLayout` and `PageAllocator` and charged to one
shared `Ledger` whose budget is `--budget`. Every worker replays the same kind of
bursty synthetic load, phase-shifted so that the instances peak at different times:
requests arrive, wait in a FIFO queue until their blocks can be had, write their K and
V blocks in every layer through the zero-copy views, decode for a while, read every
block back to check it, and free them.

The same seeded load runs twice: **elastic** (no per-instance limit: an instance in a
burst may use what the idle ones do not) and **static** (each instance limited to an
equal share of the budget, which is what a fixed `gpu_memory_utilization` split gives).
The demo prints a live table while it runs, then a comparison (requests served,
requests that had to wait, wait times), writes a PNG of each instance's KV memory over
time for both modes side by side, and one JSON line per mode.

Elastic wins when loads peak at different times; that is the whole case for kvcached.

Stopping it. Ctrl-C reaches the whole terminal process group, so the workers ignore
SIGINT and the coordinator alone stops them. They are started with SIGINT held back
(blocked, which a spawned Python inherits) until `worker` ignores it; the coordinator
holds it back only while it starts them, so a Ctrl-C pressed meanwhile reaches it
right after, not lost; SIGTERM to the coordinator is turned into the same
orderly exit (`stop_on_sigterm`). Either way the workers are terminated, the
temporary ledger folder is removed and the multiprocessing semaphores are unlinked.
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import queue
import random
import signal
import statistics
import tempfile
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MODEL_SHAPES: dict[str, dict[str, Any]] = {
    # name: layers, KV heads, head dim (per the published configs; weights not needed)
    "llama-3.2-1b": {"num_layers": 16, "num_kv_heads": 8, "head_dim": 64},
    "qwen3-0.6b": {"num_layers": 28, "num_kv_heads": 8, "head_dim": 128},
    "llama-3.1-8b": {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128},
}

#: what `kvcached demo --engine` accepts: this module's synthetic load, or real vLLM servers
#: (kvcached.apps.vllm_demo)
ENGINES = ("synthetic", "vllm", "serve")

TICK_S = 0.05  # one scheduler step
TOKENS_PER_TICK = 4  # decode speed of one request per step
REPORT_EVERY = 5  # ticks between reports to the coordinator


@dataclass
class DemoConfig:
    instances: int = 3
    seconds: float = 24.0
    budget: int = 1 << 30
    model: str = "llama-3.2-1b"
    block_size: int = 16
    seed: int = 0
    backend: str | None = None
    burst_period_s: float = 8.0
    quiet_rate: float = 0.5  # requests/s outside an instance's burst
    burst_rate: float = 9.0  # requests/s during it
    prompt_tokens: tuple[int, int] = (256, 1024)
    output_tokens: tuple[int, int] = (64, 256)


@dataclass
class Request:
    rid: int
    arrival_tick: int
    tokens: int  # prompt + output: blocks are taken for all of it at admission
    decode_ticks: int
    blocks: list[int] = field(default_factory=list)
    admitted_tick: int = -1
    done_tick: int = -1


@dataclass(frozen=True)
class BurstyLoad:
    """Phase-shifted bursts: every instance bursts once per period, in its own slot.

    The period is cut into one slot per instance; instance i's burst starts with its
    slot, at ``i * period / instances``, and lasts the slot or `window_s` if shorter.
    Arrivals are Poisson per step, at `burst_rate` inside the burst and `quiet_rate`
    outside it, so the instances peak at different times.
    Shared by the synthetic demo and the engine demos, which add their own sizes."""

    seconds: float
    instances: int
    period_s: float
    quiet_rate: float  # requests/s outside the instance's burst
    burst_rate: float  # requests/s during it
    step_s: float = TICK_S
    window_s: float | None = None  # a burst's length (default: its whole slot)

    def in_burst(self, instance: int, t: float) -> bool:
        slot = self.period_s / self.instances
        window = slot if self.window_s is None else min(self.window_s, slot)
        return ((t - instance * slot) % self.period_s) < window

    def arrival_steps(self, rng: random.Random, instance: int) -> Iterator[int]:
        """The step index of every arrival, in order; drawn from `rng` lazily, so a
        caller may draw request sizes from the same `rng` between arrivals."""
        for step in range(int(self.seconds / self.step_s)):
            in_burst = self.in_burst(instance, step * self.step_s)
            rate = self.burst_rate if in_burst else self.quiet_rate
            for _ in range(_poisson(rng, rate * self.step_s)):
                yield step


@dataclass(frozen=True)
class TimedRequest:
    """A request of an engine demo or benchmark: when it arrives and how big it is."""

    instance: int
    rid: int
    at_s: float  # seconds after the load starts
    prompt_tokens: int
    output_tokens: int


def timed_requests(
    load: BurstyLoad,
    instance: int,
    *,
    seed: int,
    prompt_tokens: tuple[int, int],
    output_tokens: tuple[int, int],
) -> list[TimedRequest]:
    """The seeded arrivals of one instance with their sizes (uniform in the ranges)."""
    rng = random.Random(seed * 1000 + instance)
    return [
        TimedRequest(
            instance,
            rid,
            step * load.step_s,
            rng.randint(*prompt_tokens),
            rng.randint(*output_tokens),
        )
        for rid, step in enumerate(load.arrival_steps(rng, instance))
    ]


def make_load(config: DemoConfig, instance: int) -> list[Request]:
    """The seeded, phase-shifted bursty arrivals of one instance."""
    rng = random.Random(config.seed * 1000 + instance)
    load = BurstyLoad(
        config.seconds,
        config.instances,
        config.burst_period_s,
        config.quiet_rate,
        config.burst_rate,
    )
    requests: list[Request] = []
    for tick in load.arrival_steps(rng, instance):
        prompt = rng.randint(*config.prompt_tokens)
        output = rng.randint(*config.output_tokens)
        requests.append(
            Request(
                rid=len(requests),
                arrival_tick=tick,
                tokens=prompt + output,
                decode_ticks=math.ceil(output / TOKENS_PER_TICK),
            )
        )
    return requests


def _poisson(rng: random.Random, mean: float) -> int:
    threshold, k, product = math.exp(-mean), 0, rng.random()
    while product > threshold:
        k += 1
        product *= rng.random()
    return k


# ----------------------------------------------------------------------------- worker
def worker(
    config: DemoConfig,
    mode: str,
    instance: int,
    ledger_dir: str,
    reports: Any,
    start: Any,
) -> None:
    """One model instance: a `KVCache` of its own, charged to the demo's ledger."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the coordinator's to handle
    os.environ["KVCACHED_LEDGER_DIR"] = ledger_dir  # the demo's ledger, not the device's
    import torch

    from kvcached.cache import KVCache
    from kvcached.layout import LayerSpec

    torch.set_num_threads(1)
    shape = MODEL_SHAPES[config.model]
    layer = LayerSpec(shape["num_kv_heads"], shape["head_dim"], "bfloat16")
    page_bytes = 2 << 20  # the granularity of host and CUDA: one page id per extent
    cache = KVCache(
        [layer] * shape["num_layers"],
        block_size=config.block_size,
        name=f"{mode}-{instance}",
        engine="demo",
        limit=config.budget // config.instances if mode == "static" else None,
        backend=config.backend,
        max_tokens=config.budget // _token_bytes(config),
        extent_bytes=page_bytes,  # grow and shrink one page id at a time
        pool_low=0,  # an idle pool is memory a neighbour in a burst cannot have
        pool_high=page_bytes * 2 * shape["num_layers"],  # at most one idle page id
        release_delay=0.2,
    )
    allocator = cache.allocators[0]
    group = cache.layout.groups[0]
    # [num_blocks, block_size * heads * head_dim] per K and per V of every layer
    views = [
        cache.view(index, part).view(group.num_blocks, -1)
        for index in range(shape["num_layers"])
        for part in ("k", "v")
    ]
    load = deque(make_load(config, instance))
    waiting: deque[Request] = deque()
    running: list[Request] = []
    served = waited = corrupted = 0
    waits: list[float] = []
    reports.put({"instance": instance, "ready": True})
    start.wait()
    begin = time.monotonic()
    ticks = int(config.seconds / TICK_S)
    for tick in range(ticks):
        while load and load[0].arrival_tick <= tick:
            waiting.append(load.popleft())
        while waiting:  # FIFO admission: the head waits until its blocks can be had
            request = waiting[0]
            blocks = allocator.alloc(math.ceil(request.tokens / config.block_size))
            if blocks is None:
                break
            waiting.popleft()
            request.blocks, request.admitted_tick = blocks, tick
            if tick > request.arrival_tick:
                waited += 1
            waits.append((tick - request.arrival_tick) * TICK_S)
            index = torch.tensor(blocks)
            stamp = float(request.rid % 251 + 1)
            for view in views:  # prefill: write this request's K and V in every layer
                view.index_fill_(0, index, stamp)
            running.append(request)
        still: list[Request] = []
        for request in running:
            if tick - request.admitted_tick < request.decode_ticks:
                still.append(request)
                continue
            index = torch.tensor(request.blocks)
            stamp = float(request.rid % 251 + 1)
            for view in views:  # read every block back before freeing it
                chunk = view.index_select(0, index)
                if not bool((chunk == stamp).all()):
                    corrupted += 1
                    break
            allocator.free(request.blocks)
            served += 1
        running = still
        if tick % REPORT_EVERY == 0 or tick == ticks - 1:
            reports.put(
                {
                    "instance": instance,
                    "t": round(tick * TICK_S, 3),
                    "reserved": allocator.reserved_bytes,
                    "used": allocator.used_blocks * group.block_id_bytes,
                    "running": len(running),
                    "waiting": len(waiting),
                    "served": served,
                    "waited": waited,
                }
            )
        delay = begin + (tick + 1) * TICK_S - time.monotonic()
        if delay > 0:
            time.sleep(delay)
    reports.put(
        {
            "instance": instance,
            "final": True,
            "served": served,
            "waited": waited,
            "arrived": served + len(running) + len(waiting),
            "still_waiting": len(waiting),
            "corrupted": corrupted,
            "mean_wait_s": statistics.fmean(waits) if waits else 0.0,
            "p95_wait_s": percentile(waits, 95),
            "late_s": round(max(0.0, time.monotonic() - begin - config.seconds), 3),
        }
    )
    for request in running:
        allocator.free(request.blocks)
    cache.close()


def _token_bytes(config: DemoConfig) -> int:
    shape = MODEL_SHAPES[config.model]
    return int(2 * shape["num_layers"] * shape["num_kv_heads"] * shape["head_dim"] * 2)


def percentile(values: list[float], pct: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * pct / 100))]


# ------------------------------------------------------------------------ coordinator
@dataclass
class ModeResult:
    mode: str
    timeline: dict[int, list[tuple[float, int]]]
    finals: dict[int, dict[str, Any]]

    def summary(self, config: DemoConfig) -> dict[str, Any]:
        finals = self.finals.values()
        return {
            "bench": "demo",
            "mode": self.mode,
            "instances": config.instances,
            "budget_bytes": config.budget,
            "seconds": config.seconds,
            "model": config.model,
            "arrived": sum(f["arrived"] for f in finals),
            "served": sum(f["served"] for f in finals),
            "waited": sum(f["waited"] for f in finals),
            "still_waiting": sum(f["still_waiting"] for f in finals),
            "mean_wait_s": round(statistics.fmean(f["mean_wait_s"] for f in finals), 3),
            "p95_wait_s": round(max(f["p95_wait_s"] for f in finals), 3),
            "corrupted": sum(f["corrupted"] for f in finals),
            "peak_reserved_bytes": {
                str(i): max((b for _, b in points), default=0)
                for i, points in self.timeline.items()
            },
        }


def run_mode(config: DemoConfig, mode: str, live: bool) -> ModeResult:
    """Start the workers of one mode on a fresh ledger and collect their reports."""
    from rich.live import Live

    from kvcached.ledger import Ledger, default_key

    context = mp.get_context("spawn")
    reports = context.Queue()
    start = context.Event()
    with tempfile.TemporaryDirectory(prefix="kvcached-demo-") as ledger_dir:
        ledger = Ledger.open(
            default_key(config.backend), budget=config.budget, directory=ledger_dir
        )
        processes = [
            context.Process(
                target=worker,
                args=(config, mode, i, ledger_dir, reports, start),
                name=f"kvcached-demo-{mode}-{i}",
            )
            for i in range(config.instances)
        ]
        timeline: dict[int, list[tuple[float, int]]] = {i: [] for i in range(config.instances)}
        latest: dict[int, dict[str, Any]] = {}
        finals: dict[int, dict[str, Any]] = {}
        ready = 0
        stopped = True  # until the mode has run to its end
        try:
            with _sigint_held():  # inherited by the spawned workers from their start
                for process in processes:
                    process.start()
            while ready < config.instances:
                message = _next_report(reports, processes)
                ready += bool(message.get("ready"))
            start.set()
            with Live(
                _table(config, mode, latest), refresh_per_second=4, transient=not live
            ) as view:
                while len(finals) < config.instances:
                    message = _next_report(reports, processes)
                    instance = message["instance"]
                    if message.get("final"):
                        finals[instance] = message
                    elif "t" in message:
                        latest[instance] = message
                        timeline[instance].append((message["t"], message["reserved"]))
                        view.update(_table(config, mode, latest))
            stopped = False
        finally:
            for process in processes:
                if process.pid is None:
                    continue  # interrupted before it was started
                if stopped and process.is_alive():
                    process.terminate()  # interrupted, or a worker failed: stop the rest
                process.join(timeout=10 if stopped else 60)
                if process.is_alive():
                    process.kill()
                    process.join()
            reports.cancel_join_thread()  # reports nobody will read must not block exit
            reports.close()
            leftover = ledger.totals().reserved
            ledger.close()
        if leftover:
            raise RuntimeError(f"{leftover} bytes stayed charged in the ledger after {mode}")
    return ModeResult(mode, timeline, finals)


@contextmanager
def _sigint_held() -> Iterator[None]:
    """Block SIGINT while inside: a child started meanwhile inherits it blocked, and a
    SIGINT that arrives is delivered on the way out. Ignoring it instead would lose a
    Ctrl-C pressed while the workers start (a test that pressed it as soon as a worker
    was forked saw the demo run on to its end). The mask is the calling thread's: a
    thread that does not block SIGINT may still take it and interrupt at once, which
    is why the workers are started inside `run_mode`'s clean-up."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """While inside, SIGTERM raises SystemExit(143) in the main thread, so `finally`
    blocks and context managers clean up as they do for Ctrl-C."""

    def terminate(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _next_report(reports: Any, processes: list[Any]) -> dict[str, Any]:
    while True:
        try:
            message: dict[str, Any] = reports.get(timeout=1.0)
            return message
        except queue.Empty:
            dead = [p for p in processes if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(
                    f"demo worker {dead[0].name} exited with code {dead[0].exitcode}"
                ) from None


def _table(config: DemoConfig, mode: str, latest: dict[int, dict[str, Any]]) -> Any:
    """The live table of one mode (it fits any terminal without cutting a figure)."""
    from kvcached.apps.tables import Cell, Column, FittedTable

    columns = [Column(title) for title in ("inst", "t (s)", "KV held", "KV used", "running",
                                           "queued", "served", "waited")]  # fmt: skip
    rows: list[list[Cell]] = []
    for i in range(config.instances):
        row = latest.get(i)
        if row is None:
            rows.append([str(i), *["-"] * 7])
            continue
        rows.append([
            str(i), f"{row['t']:.1f}", _gib(row["reserved"]), _gib(row["used"]),
            str(row["running"]), str(row["waiting"]), str(row["served"]), str(row["waited"]),
        ])  # fmt: skip
    return FittedTable(columns, rows, title=f"kvcached demo: {mode} ({_gib(config.budget)} budget)")


def _gib(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB"


@dataclass
class Panel:
    """One mode's side of the plot: reserved bytes over time per instance."""

    mode: str
    timeline: dict[str, list[tuple[float, int]]]  # instance label: (t, reserved bytes)
    caption: str
    share: int | None = None  # the per-instance limit, drawn when there is one


def plot_modes(
    panels: list[Panel],
    *,
    budget: int,
    bars: dict[str, list[float]],
    bars_title: str,
    title: str,
    path: Path,
) -> None:
    """Each instance's reserved KV memory over time, one panel per mode, then a bar
    chart comparing the modes (`bars`: label -> one value per panel)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(
        1, len(panels) + 1, figsize=(6 * len(panels) + 4, 4.5),
        gridspec_kw={"width_ratios": [3] * len(panels) + [2]},
    )  # fmt: skip
    unit, unit_name = (1 << 30, "GiB") if budget >= 1 << 30 else (1 << 20, "MiB")
    for ax, panel in zip(axes, panels, strict=False):
        for label, points in panel.timeline.items():
            ax.plot([t for t, _ in points], [b / unit for _, b in points], label=label)
        ax.axhline(budget / unit, color="black", linestyle="--", linewidth=1, label="budget")
        if panel.share is not None:
            ax.axhline(panel.share / unit, color="grey", linestyle=":", linewidth=1,
                       label="static share")  # fmt: skip
        ax.set_title(f"{panel.mode}: {panel.caption}")
        ax.set_xlabel("time (s)")
        ax.set_ylabel(f"KV memory reserved ({unit_name})")
        ax.set_ylim(0, budget / unit * 1.1)
        ax.legend(loc="upper right", fontsize=8)
    chart = axes[-1]
    x = range(len(panels))
    width = 0.8 / max(1, len(bars))
    for n, (label, values) in enumerate(bars.items()):
        offset = (n - (len(bars) - 1) / 2) * width
        chart.bar([i + offset for i in x], values, width=width, label=label)
    chart.set_xticks(list(x), [p.mode for p in panels])
    chart.set_title(bars_title)
    chart.legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot(config: DemoConfig, results: list[ModeResult], path: Path) -> None:
    """The synthetic demo's plot: memory per instance per mode, requests per mode."""
    summaries = [result.summary(config) for result in results]
    panels = [
        Panel(
            result.mode,
            {f"instance {i}": points for i, points in sorted(result.timeline.items())},
            f"{summary['served']} served, {summary['waited']} waited",
            config.budget // config.instances if result.mode == "static" else None,
        )
        for result, summary in zip(results, summaries, strict=True)
    ]
    plot_modes(
        panels,
        budget=config.budget,
        bars={
            "served": [s["served"] for s in summaries],
            "had to wait": [s["waited"] for s in summaries],
        },
        bars_title="requests",
        title=f"{config.instances} x {config.model} KV caches sharing "
        f"{config.budget / (1 << 30):.2f} GiB ({config.seconds:.0f} s of bursty load, "
        f"seed {config.seed})",
        path=path,
    )


def comparison_table(summaries: list[dict[str, Any]]) -> Any:
    """Both modes side by side, from their JSON summaries (whole at any width)."""
    from kvcached.apps.tables import Cell, Column, FittedTable

    # queued: still waiting when the run ended; corrupt: blocks that read back wrong
    columns = [Column(title) for title in ("mode", "arrived", "served", "waited", "queued",
                                           "wait avg", "wait p95", "corrupt")]  # fmt: skip
    rows: list[list[Cell]] = []
    for s in summaries:
        rows.append([
            s["mode"], str(s["arrived"]), str(s["served"]), str(s["waited"]),
            str(s["still_waiting"]), f"{s['mean_wait_s']:.2f}s", f"{s['p95_wait_s']:.2f}s",
            str(s["corrupted"]),
        ])  # fmt: skip
    return FittedTable(columns, rows, title="elastic vs. static split of the same budget and load")


def run_demo(config: DemoConfig, *, out: Path, live: bool = True) -> list[dict[str, Any]]:
    """Both modes, the comparison table, the plot; returns the JSON summaries."""
    from rich.console import Console

    if config.model not in MODEL_SHAPES:
        from kvcached.errors import InvalidArgument

        raise InvalidArgument(
            f"unknown demo model {config.model!r}; choose from {', '.join(MODEL_SHAPES)}"
        )
    console = Console()
    results = []
    for mode in ("elastic", "static"):
        results.append(run_mode(config, mode, live))
        console.print()  # the live table's last frame stays; start below it
    summaries = [result.summary(config) for result in results]
    console.print(comparison_table(summaries))
    out.parent.mkdir(parents=True, exist_ok=True)
    plot(config, results, out)
    console.print(f"plot written to {out}")
    for s in summaries:
        print(json.dumps(s))
    return summaries
