"""What the `kvcached serve` router adds to a request and to each streamed token.

Three processes on 127.0.0.1: a stand-in engine (Starlette under uvicorn, the server
vLLM and SGLang use, answering at once), the router (`build_router` under uvicorn, as
`kvcached serve` runs it, over a stand-in `Models` whose one model is that engine), and
this process, the client. Each measurement is a pair, the same request sent straight
to the engine and through the router, in alternating order (direct first in even pairs,
router first in odd ones) so that drift in the machine's load falls on both sides; the
figure is the paired difference, router minus direct.

Kinds (one JSON line each; every one also carries the router process's CPU time per
request or per token, from the scheduler's nanosecond count in /proc, which is what a
request or a token costs at the router whatever the other processes do):

- `request`: a non-streamed chat completion with a small body, wall time per request.
- `stream_token_throughput`: `--burst-tokens` events written back to back (one write
  each), the total time divided by the tokens: the per-token time of a stream, and with
  it how many tokens a second one router core relays. `*_chunks_mean` counts the reads
  the client saw (about one per token: the router passes each event on by itself).
- `stream_token_latency`: a stream of `--tokens` events paced `--interval-ms` apart, as
  an engine decoding would send them; each event carries the engine's send time
  (CLOCK_MONOTONIC, one clock for every process of the machine), the client notes its
  arrival, and the figure is the mean delivery latency per token. Between two events
  every process sleeps, so each token pays the wake-ups of one more process hop;
  `stream_token_latency_bare_relay` measures that floor with a relay that parses
  nothing (a byte copier between two sockets), so what the router adds beyond it is
  the router's own.

The engine and the router run on the loop `kvcached serve` runs (uvloop where installed);
`--server-loop asyncio` runs them on asyncio's own, for comparison.

Targets (issue 20): at most 2 ms per request and 50 µs per token at the router.

    python benchmarks/serve_router_overhead.py [--pairs 40] > results.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx

CHAT = "/v1/chat/completions"
#: `--server-loop asyncio` reaches the engine and router processes through this
SERVER_LOOP_ENV = "KVCACHED_BENCH_SERVER_LOOP"


# --- the stand-in engine and the router, each run as its own process -------------------


def engine_app() -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    async def answer(request: Request) -> Response:
        body = json.loads(await request.body())
        if not body.get("stream"):
            message = {"role": "assistant", "content": "hello"}
            return JSONResponse(
                {"id": "chatcmpl-1", "object": "chat.completion", "created": 0,
                 "model": body["model"],
                 "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                 "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
            )  # fmt: skip
        tokens, interval = int(body["x_tokens"]), float(body["x_interval_s"])

        async def events() -> AsyncIterator[bytes]:
            for i in range(tokens):
                event = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0,
                         "model": body["model"], "sent": time.monotonic(), "i": i,
                         "choices": [{"index": 0, "delta": {"content": f" tok{i}"},
                                      "logprobs": None, "finish_reason": None}]}  # fmt: skip
                yield b"data: " + json.dumps(event).encode() + b"\n\n"
                if interval > 0:
                    await asyncio.sleep(interval)
                else:
                    await asyncio.sleep(0)  # as an engine between steps: one write each
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route(CHAT, answer, methods=["POST"])])


def router_app(engine_url: str) -> Any:
    from kvcached.apps.serve.router import build_router
    from kvcached.apps.serve.state import ModelState, ModelStats, UnknownModel

    class Handle:
        name = "m"
        engine = "vllm"
        state = ModelState.AWAKE

        def __init__(self) -> None:
            self.stats = ModelStats()

        @contextlib.asynccontextmanager
        async def serving(self, timeout: float | None = None) -> AsyncIterator[str]:
            self.stats.in_flight += 1
            try:
                yield engine_url
            finally:
                self.stats.in_flight -= 1

    class OneModel:
        def __init__(self) -> None:
            self.only = Handle()

        def names(self) -> list[str]:
            return ["m"]

        def handle(self, name: object) -> Any:
            if name != "m":
                raise UnknownModel(name, ["m"])
            return self.only

        def snapshot(self) -> Any:
            return {"time": time.time(), "budget": 0, "max_awake": None, "models": [],
                    "history": []}  # fmt: skip

    return build_router(OneModel())


def bare_relay(engine_url: str) -> None:
    """The floor under any router: a process that copies bytes both ways between each
    client connection and a connection of its own to the engine, parsing nothing (uvloop,
    as uvicorn runs the router). What the router costs beyond it is the router's own."""
    import uvloop

    host, port = engine_url.removeprefix("http://").rsplit(":", 1)

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(host, int(port))
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    async def main() -> None:
        server = await asyncio.start_server(connection, "127.0.0.1", 0)
        print(server.sockets[0].getsockname()[1], flush=True)
        await server.serve_forever()

    uvloop.run(main())


def serve_role(role: str, engine_url: str) -> None:
    """Run the engine or the router on an ephemeral port; print the port, then serve."""
    import uvicorn

    if role == "relay":
        bare_relay(engine_url)
        return

    app = engine_app() if role == "engine" else router_app(engine_url)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", access_log=False)
    server = uvicorn.Server(config)

    async def main() -> None:
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        print(port, flush=True)
        await task

    # the loop `kvcached serve` runs its router on (uvloop where installed), for the
    # stand-in engine too: vLLM's and SGLang's uvicorn pick uvloop the same way
    from kvcached.apps.serve.app import loop_factory

    factory = None if os.environ.get(SERVER_LOOP_ENV) == "asyncio" else loop_factory()
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main())


@contextlib.contextmanager
def spawned(role: str, engine_url: str = "") -> Iterator[tuple[str, int]]:
    """(URL, pid) of a role started in a process of its own."""
    args = [sys.executable, __file__, "--role", role, "--engine-url", engine_url]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.strip():
            raise RuntimeError(f"the {role} process did not start (exit {proc.poll()})")
        yield f"http://127.0.0.1:{int(line)}", proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def cpu_seconds(pid: int) -> float:
    """CPU time of every thread of process `pid` so far, from the scheduler's own
    nanosecond count (/proc/PID/task/TID/schedstat), not the 10 ms ticks of
    /proc/PID/stat, which a process woken in step with the timer dodges or collects."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError), open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            total += int(f.read().split()[0])
    return total / 1e9


# --- measuring -------------------------------------------------------------------------


def one_request(client: httpx.Client, url: str) -> float:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    started = time.perf_counter()
    r = client.post(url + CHAT, json=body)
    elapsed = time.perf_counter() - started
    assert r.status_code == 200, r.text
    return elapsed


def one_stream(client: httpx.Client, url: str, tokens: int, interval: float) -> dict[str, float]:
    """Mean delivery latency per token, total time per token, chunks received."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "x_tokens": tokens, "x_interval_s": interval}  # fmt: skip
    latencies: list[float] = []
    chunks = 0
    held = b""
    started = time.perf_counter()
    with client.stream("POST", url + CHAT, json=body) as r:
        assert r.status_code == 200
        for piece in r.iter_raw():
            arrived = time.monotonic()
            chunks += 1
            held += piece
            *events, held = held.split(b"\n\n")
            for event in events:
                data = event.removeprefix(b"data: ")
                if data != b"[DONE]":
                    latencies.append(arrived - json.loads(data)["sent"])
    total = time.perf_counter() - started
    assert len(latencies) == tokens, (len(latencies), tokens)
    return {"latency": statistics.fmean(latencies), "per_token": total / tokens, "chunks": chunks}


def summary(
    kind: str, unit: str, direct: list[float], routed: list[float], extra: dict[str, Any]
) -> dict[str, Any]:
    """One result line: both sides and the paired difference with its 95% CI (bootstrap
    of the mean difference, 10,000 resamples, fixed seed)."""
    diffs = [r - d for r, d in zip(routed, direct, strict=True)]
    rng = random.Random(0)
    means = sorted(statistics.fmean(rng.choices(diffs, k=len(diffs))) for _ in range(10_000))
    scale = 1e6 if unit == "us" else 1e3

    def fig(x: float) -> float:
        return round(x * scale, 2)

    return {
        "benchmark": "serve_router_overhead",
        "kind": kind,
        "unit": unit,
        "pairs": len(diffs),
        "direct_mean": fig(statistics.fmean(direct)),
        "direct_median": fig(statistics.median(direct)),
        "router_mean": fig(statistics.fmean(routed)),
        "router_median": fig(statistics.median(routed)),
        "diff_mean": fig(statistics.fmean(diffs)),
        "diff_median": fig(statistics.median(diffs)),
        "diff_ci95": [fig(means[249]), fig(means[9749])],
        **extra,
    }


def cpu_figures(samples: list[float], scale: float, unit: str) -> dict[str, float]:
    """The router process's CPU time per unit (request or token), mean and median."""
    return {
        f"router_cpu_mean_{unit}": round(statistics.fmean(samples) * scale, 2),
        f"router_cpu_median_{unit}": round(statistics.median(samples) * scale, 2),
    }


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    load_before = os.getloadavg()
    results = []
    with (
        spawned("engine") as (engine, _),
        spawned("router", engine) as (router, router_pid),
        spawned("relay", engine) as (relay, _),
    ):
        limits = httpx.Limits(max_connections=4, max_keepalive_connections=4)
        with httpx.Client(timeout=60, limits=limits, trust_env=False) as client:
            for _ in range(20):  # warm both paths: connections, imports, caches
                one_request(client, engine)
                one_request(client, router)
                one_stream(client, router, 8, 0)
                one_stream(client, relay, 8, 0)

            def paired(run: Any, other: str = router) -> tuple[list[Any], list[Any]]:
                direct, routed = [], []
                for i in range(args.pairs):
                    order = (engine, other) if i % 2 == 0 else (other, engine)
                    got = {url: run(url) for url in order}
                    direct.append(got[engine])
                    routed.append(got[other])
                return direct, routed

            def at_router(run: Any, url: str, per: int, cpu: list[float]) -> Any:
                """`run(url)`, noting the router's CPU time per unit when it is the router."""
                before = cpu_seconds(router_pid) if url == router else 0.0
                got = run(url)
                if url == router:
                    cpu.append((cpu_seconds(router_pid) - before) / per)
                return got

            request_cpu: list[float] = []
            direct, routed = paired(
                lambda url: at_router(lambda u: one_request(client, u), url, 1, request_cpu)
            )
            results.append(
                summary(
                    "request",
                    "ms",
                    direct,
                    routed,
                    {**cpu_figures(request_cpu, 1e3, "ms"), "target_ms": 2.0},
                )
            )

            interval = args.interval_ms / 1e3
            paced_cpu: list[float] = []
            d, r = paired(
                lambda url: at_router(
                    lambda u: one_stream(client, u, args.tokens, interval),
                    url, args.tokens, paced_cpu,
                )
            )  # fmt: skip
            results.append(
                summary(
                    "stream_token_latency",
                    "us",
                    [x["latency"] for x in d],
                    [x["latency"] for x in r],
                    {
                        "tokens": args.tokens,
                        "interval_ms": args.interval_ms,
                        "router_chunks_mean": statistics.fmean(x["chunks"] for x in r),
                        **cpu_figures(paced_cpu, 1e6, "us"),
                        "target_us": 50.0,
                    },
                )
            )

            d, r = paired(lambda url: one_stream(client, url, args.tokens, interval), relay)
            results.append(
                summary(
                    "stream_token_latency_bare_relay",
                    "us",
                    [x["latency"] for x in d],
                    [x["latency"] for x in r],
                    {
                        "tokens": args.tokens,
                        "interval_ms": args.interval_ms,
                        "note": "the floor: any extra process hop on this machine, no parsing",
                    },
                )
            )

            burst_cpu: list[float] = []
            d, r = paired(
                lambda url: at_router(
                    lambda u: one_stream(client, u, args.burst_tokens, 0),
                    url, args.burst_tokens, burst_cpu,
                )
            )  # fmt: skip
            results.append(
                summary(
                    "stream_token_throughput",
                    "us",
                    [x["per_token"] for x in d],
                    [x["per_token"] for x in r],
                    {
                        "tokens": args.burst_tokens,
                        **cpu_figures(burst_cpu, 1e6, "us"),
                        "direct_chunks_mean": statistics.fmean(x["chunks"] for x in d),
                        "router_chunks_mean": statistics.fmean(x["chunks"] for x in r),
                        "target_us": 50.0,
                    },
                )
            )
    from kvcached.apps.serve.app import loop_factory

    load_after = os.getloadavg()
    for line in results:
        line["load_avg_before"] = [round(x, 2) for x in load_before]
        line["load_avg_after"] = [round(x, 2) for x in load_after]
        line["cpus"] = os.cpu_count()
        line["python"] = platform.python_version()
        line["server_loop"] = (
            "asyncio" if os.environ.get(SERVER_LOOP_ENV) == "asyncio" or not loop_factory()
            else "uvloop"
        )  # fmt: skip
        line["time"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=40, help="pairs per kind (≥ 30)")
    parser.add_argument("--tokens", type=int, default=64, help="events of a paced stream")
    parser.add_argument("--interval-ms", type=float, default=2.0, help="pace of that stream")
    parser.add_argument("--burst-tokens", type=int, default=512, help="events of a burst")
    parser.add_argument(
        "--server-loop", choices=["auto", "asyncio"], default="auto",
        help="the stand-in engine's and the router's event loop: auto is what `kvcached "
        "serve` runs (uvloop where installed); asyncio measures the plain loop",
    )  # fmt: skip
    parser.add_argument("--role", choices=["engine", "router", "relay"], help=argparse.SUPPRESS)
    parser.add_argument("--engine-url", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        serve_role(args.role, args.engine_url)
        return
    if args.server_loop == "asyncio":
        os.environ[SERVER_LOOP_ENV] = "asyncio"
    if args.pairs < 30:
        parser.error("--pairs must be at least 30 for the confidence interval to mean much")
    for line in measure(args):
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
