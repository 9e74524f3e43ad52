"""Several models on one GPU: `kvcached serve` against a static split of the same memory.

Issue 20's device benchmark. The same models, the same seeded bursty phase-shifted
trace and the same KV memory (`--budget`) run in two set-ups, one per invocation
(`--mode`), so that each fits in one device call:

* `kvcached`: `python -m kvcached.apps.cli serve CONFIG` (the product command) with
  every model on vLLM, no per-model limit, `sleep: weights`, `keep_alive`
  `--keep-alive`: a bursting model takes the KV the quiet ones are not using, and an
  idle one sleeps (vLLM's level-1 sleep for its weights, kvcached's trim for its KV).
  Requests go through the router.
* `static`: one plain vLLM API server per model (no kvcached), each with
  `--kv-cache-memory-bytes budget / models`: the fixed split one configures without
  kvcached. Requests go to each engine directly (no router hop: in the baseline's
  favour). The engines run with `--enable-sleep-mode`, so that after the sweep the
  same processes measure vLLM's own wake (`POST /sleep?level=1`, then `POST /wake_up`
  and a request: asleep to first token).

The trace (`kvcached.apps.demo.BurstyLoad`): the period is one slot of `--slot` seconds
per model; in its own slot a model receives Poisson arrivals at the burst rate (times
its weight, `NAME=PATH@WEIGHT`), outside it `--quiet-rate`. Each request is a streamed
`/v1/completions` call with a prompt of random token ids (`--prompt-len`), `max_tokens`
from `--output-len`, `ignore_eos` and greedy sampling; its time to first token (TTFT)
is measured by the client from the moment it was sent to the first streamed chunk,
queueing, waking and the router included. A request that has not finished after
`--request-timeout` seconds counts as failed. The burst rates of `--rates` run in
increasing order; the sweep stops after the first rate whose p99 TTFT passes
`--stop-after` times the SLO (higher rates only fail worse).

Then the wake measure, `--wake-rounds` rounds per model, one model at a time:
kvcached: wait until the model is asleep (its `keep_alive` ran out), send one short
request, TTFT = asleep to first token (the supervisor's wake time is read from
`/api/state` too); static: `/sleep?level=1`, then time `/wake_up` plus one short request.

Prints (and with `--out` appends) one JSON line per rate (TTFT p50/p99 over all
requests and per model, failures, output tokens/s, wakes seen), one per wake, and a
summary: the highest burst rate whose p99 TTFT stayed within `--slo` with no failure.
GPU memory in use (nvidia-smi, every second, where it exists) is reported as a peak.

    # H200 (scripts/vllm-gpu-run.sh serve runs both modes with these settings)
    python3 benchmarks/serve_multi_model.py --mode kvcached --budget 8GiB \\
        --model a=/tmp/m-q06 --model b=/tmp/m-q06 --model c=/tmp/m-q06 \\
        --model big=/tmp/m-q8b@0.25 --rates 2,4,8,16,32 --out serve_multi_model.jsonl
    # CPU smoke run (vLLM-CPU, two tiny random models, a few seconds per rate)
    python benchmarks/serve_multi_model.py --cpu-smoke --mode kvcached
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MODES = ("kvcached", "static")
#: what every vLLM runs with on the GPU: bf16, eager (start-up in seconds, not minutes
#: of compiling; the same for both modes), a context that fits the prompts
GPU_ENGINE_ARGS = [
    "--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "4096",
    "--max-num-seqs", "256", "--disable-uvicorn-access-log",
]  # fmt: skip


@dataclass(frozen=True)
class ModelArg:
    name: str
    path: str
    weight: float  # its burst rate is the sweep's rate times this


def _model_arg(text: str) -> ModelArg:
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=PATH or NAME=PATH@WEIGHT")
    path, _, weight = rest.partition("@")
    try:
        return ModelArg(name, path, float(weight) if weight else 1.0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: the weight after @ must be a number") from None


def _range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    return int(low), int(high or low)


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _quantile(values: list[float], q: float) -> float | None:
    from kvcached.apps.serve.state import nearest_rank

    return None if not values else round(nearest_rank(sorted(values), q), 4)


# --------------------------------------------------------------------------- GPU memory
class GpuMemory:
    """The peak of nvidia-smi's memory.used (MiB) while `running`; None without one."""

    def __init__(self) -> None:
        self.peak_mib: int | None = None
        self._stop = threading.Event()
        self._tool = shutil.which("nvidia-smi")
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def now(self) -> int | None:
        if self._tool is None:
            return None
        try:
            text = subprocess.run(
                [self._tool, "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                capture_output=True, text=True, timeout=10, check=True,
            ).stdout  # fmt: skip
            return sum(int(line) for line in text.split())
        except (subprocess.SubprocessError, ValueError):
            return None

    def _poll(self) -> None:
        while not self._stop.wait(1.0):
            used = self.now()
            if used is not None:
                self.peak_mib = max(self.peak_mib or 0, used)

    def __enter__(self) -> GpuMemory:
        self.peak_mib = None
        if self._tool is not None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()


# ------------------------------------------------------------------------------ stacks
class Stack:
    """The processes serving the models, and where each model's requests go."""

    mode: str

    def __init__(self, a: argparse.Namespace, root: Path) -> None:
        self.a = a
        self.root = root
        self.processes: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []

    def base(self, name: str) -> str:
        raise NotImplementedError

    def start(self) -> None:
        raise NotImplementedError

    def _spawn(self, argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("wb") as out:
            process = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.processes.append(process)
        self.logs.append(log)
        return process

    def check_alive(self) -> None:
        for process, log in zip(self.processes, self.logs, strict=True):
            if process.poll() is not None:
                raise RuntimeError(f"{log.name}: exited with {process.returncode}:\n{tail(log)}")

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 60
        for process in self.processes:
            try:
                process.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def stop_on_sigterm() -> None:
    """Make SIGTERM (`timeout` in the device scripts) a SystemExit, so that the `finally`
    stopping the servers runs: they lead sessions of their own (`_spawn`), which the
    signal `timeout` sends its process group does not reach. On the H100 of 2026-12-05
    the two SGLang servers of a latency run cut this way held 38 GiB through the next
    run. A second SIGTERM while they stop is ignored, so it cannot cut the stop short."""

    def leave(signum: int, _frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, leave)


def tail(log: Path, lines: int = 25) -> str:
    text = log.read_text(errors="replace") if log.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


def _engine_env(a: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"})
    if a.cpu_smoke:
        from kvcached.apps.serve_demo import ENGINE_ENV

        env.update(ENGINE_ENV)
    return env


class KvcachedStack(Stack):
    """`kvcached serve` with every model (module docstring)."""

    mode = "kvcached"

    def start(self) -> None:
        import yaml

        a = self.a
        self.port = _free_port()
        ledger = self.root / "ledger"
        ledger.mkdir()
        self.ledger_dir = ledger
        engine_env = {"VLLM_USE_FLASHINFER_SAMPLER": "0"} if not a.cpu_smoke else {}
        if a.cpu_smoke:
            from kvcached.apps.serve_demo import ENGINE_ENV

            engine_env.update(ENGINE_ENV)
        document = {
            "budget": a.budget,
            "port": self.port,
            "log_dir": str(self.root / "logs"),
            "ledger_dir": str(ledger),
            "engine_env": engine_env,
            "models": {
                m.name: {
                    "engine": "vllm", "path": m.path, "keep_alive": a.keep_alive,
                    "sleep": a.sleep, "preload": True,
                    "args": [*a.engine_args, "--gpu-memory-utilization", str(a.gpu_mem_of(m))],
                }
                for m in a.model
            },
        }  # fmt: skip
        config = self.root / "serve.yaml"
        config.write_text(yaml.safe_dump(document, sort_keys=False))
        argv = [sys.executable, "-m", "kvcached.apps.cli", "serve", str(config)]
        self._spawn(argv, self.root / "serve.log", _engine_env(a))

    def base(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}"

    def state(self) -> dict[str, dict[str, Any]]:
        import httpx

        got = httpx.get(f"http://127.0.0.1:{self.port}/api/state", timeout=10).json()
        return {m["name"]: m for m in got["models"]}

    def wait_ready(self, timeout: float) -> None:
        import httpx

        names = [m.name for m in self.a.model]
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                states = {n: m["state"] for n, m in self.state().items()}
            except (httpx.HTTPError, ValueError):
                states = {}
            if states and all(states.get(n) == "awake" for n in names):
                return
            time.sleep(1.0)
        raise TimeoutError(f"not all awake within {timeout:g} s: {states}\n{tail(self.logs[0])}")

    def logs_tail(self) -> str:
        out = [tail(self.logs[0])]
        for log in sorted((self.root / "logs").glob("*.log")):
            out.append(f"--- {log.name}\n{tail(log, 15)}")
        return "\n".join(out)


class StaticStack(Stack):
    """One plain vLLM API server per model, each with an equal share of the KV memory."""

    mode = "static"

    def start(self) -> None:
        a = self.a
        from kvcached.config import parse_size

        share = parse_size(a.budget) // len(a.model)
        self.ports: dict[str, int] = {}
        env = _engine_env(a)
        env["ENABLE_KVCACHED"] = "0"
        env["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
        if not a.cpu_smoke:
            env["VLLM_SERVER_DEV_MODE"] = "1"  # serves /sleep and /wake_up
        for m in a.model:
            port = self.ports[m.name] = _free_port()
            argv = [
                sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                "--model", m.path, "--served-model-name", m.name,
                "--host", "127.0.0.1", "--port", str(port), *a.engine_args,
                "--gpu-memory-utilization", str(a.gpu_mem_of(m)),
                "--kv-cache-memory-bytes", str(share),
                *([] if a.cpu_smoke else ["--enable-sleep-mode"]),
            ]  # fmt: skip
            self._spawn(argv, self.root / "logs" / f"{m.name}.log", env)

    def base(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def wait_ready(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        pending = {m.name for m in self.a.model}
        while pending and time.monotonic() < deadline:
            self.check_alive()
            for name in list(pending):
                try:
                    if httpx.get(f"{self.base(name)}/health", timeout=5).status_code == 200:
                        pending.discard(name)
                except httpx.HTTPError:
                    pass
            time.sleep(1.0)
        if pending:
            raise TimeoutError(f"{sorted(pending)} not healthy within {timeout:g} s")

    def logs_tail(self) -> str:
        return "\n".join(f"--- {log.name}\n{tail(log, 15)}" for log in self.logs)


# ------------------------------------------------------------------------------ the load
@dataclass
class Result:
    model: str
    ok: bool
    ttft_s: float | None = None
    e2e_s: float | None = None
    tokens: int = 0
    error: str | None = None


@dataclass
class Sweep:
    results: list[Result] = field(default_factory=list)


def _prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab - 100) for _ in range(length)]


async def _one(
    client: Any, base: str, model: str, prompt: list[int], max_tokens: int, timeout: float
) -> Result:
    body = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
        "ignore_eos": True, "temperature": 0.0,
    }  # fmt: skip
    sent = time.monotonic()
    first: float | None = None
    tokens = 0
    headers = False  # did the answer begin? tells a dropped connection from a cut stream
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", f"{base}/v1/completions", json=body) as answer:
                headers = True
                if answer.status_code != 200:
                    text = (await answer.aread()).decode(errors="replace")[:200]
                    return Result(model, False, error=f"HTTP {answer.status_code}: {text}")
                async for line in answer.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return Result(model, False, error=str(chunk["error"])[:200])
                    if first is None:
                        first = time.monotonic()
                    tokens += 1
    except TimeoutError:
        return Result(model, False, error=f"no end within {timeout:g} s")
    except Exception as exc:
        # where it broke tells a refused or reused connection (no headers yet) from a
        # stream the server began and then cut
        where = (
            "mid-stream" if tokens
            else "after the headers, before the first token" if headers
            else "before the answer's headers"
        )  # fmt: skip
        return Result(model, False, error=f"{type(exc).__name__} {where}: {exc}"[:200])
    done = time.monotonic()
    if first is None:
        return Result(model, False, error="stream ended with no token")
    return Result(model, True, first - sent, done - sent, tokens)


def _vocab(path: str) -> int:
    config = json.loads((Path(path) / "config.json").read_text())
    return int(config.get("vocab_size") or config.get("text_config", {}).get("vocab_size"))


async def run_rate(stack: Stack, a: argparse.Namespace, rate: float, seed: int) -> Sweep:
    import httpx

    from kvcached.apps.demo import BurstyLoad, timed_requests

    period = a.slot * len(a.model)
    plan: list[tuple[float, ModelArg, list[int], int]] = []
    for index, m in enumerate(a.model):
        load = BurstyLoad(period, len(a.model), period, a.quiet_rate, rate * m.weight)
        rng = random.Random(seed * 7919 + index)
        vocab = _vocab(m.path)
        for req in timed_requests(
            load, index, seed=seed, prompt_tokens=a.prompt_len, output_tokens=a.output_len
        ):
            plan.append((req.at_s, m, _prompt(rng, req.prompt_tokens, vocab), req.output_tokens))
    plan.sort(key=lambda item: item[0])
    sweep = Sweep()
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=512)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        started = time.monotonic()
        tasks = []
        for at, m, prompt, out in plan:
            delay = started + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(
                asyncio.create_task(
                    _one(client, stack.base(m.name), m.name, prompt, out, a.request_timeout)
                )
            )
        sweep.results = list(await asyncio.gather(*tasks))
    return sweep


def _ttfts(results: list[Result], model: str | None = None) -> list[float]:
    return [
        r.ttft_s
        for r in results
        if r.ok and r.ttft_s is not None and (model is None or r.model == model)
    ]


def summarize_rate(
    mode: str, rate: float, sweep: Sweep, wall: float, a: argparse.Namespace
) -> dict[str, Any]:
    rs = sweep.results
    ttft = _ttfts(rs)
    failed = [r for r in rs if not r.ok]
    per_model = {}
    for m in a.model:
        mine = _ttfts(rs, m.name)
        per_model[m.name] = {
            "requests": sum(r.model == m.name for r in rs),
            "failed": sum(r.model == m.name and not r.ok for r in rs),
            "ttft_p50_s": _quantile(mine, 0.5),
            "ttft_p99_s": _quantile(mine, 0.99),
        }
    line: dict[str, Any] = {
        "bench": "serve_multi_model", "mode": mode, "burst_rate": rate,
        "quiet_rate": a.quiet_rate, "requests": len(rs), "ok": len(rs) - len(failed),
        "failed": len(failed), "ttft_p50_s": _quantile(ttft, 0.5),
        "ttft_p99_s": _quantile(ttft, 0.99),
        "output_tokens_per_s": round(sum(r.tokens for r in rs) / wall, 1),
        "wall_s": round(wall, 1), "per_model": per_model,
    }  # fmt: skip
    if failed:
        line["first_errors"] = sorted({r.error or "" for r in failed})[:3]
    p99 = line["ttft_p99_s"]
    line["holds_slo"] = not failed and p99 is not None and p99 <= a.slo
    return line


# ------------------------------------------------------------------------------ waking
async def _short(client: Any, base: str, name: str, vocab: int, a: argparse.Namespace) -> Result:
    prompt = _prompt(random.Random(len(name)), 128, vocab)
    return await _one(client, base, name, prompt, 16, a.request_timeout)


async def wake_kvcached(stack: KvcachedStack, a: argparse.Namespace) -> list[dict[str, Any]]:
    import httpx

    lines = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(None)) as client:
        for round_index in range(a.wake_rounds):
            for m in a.model:
                deadline = time.monotonic() + a.keep_alive + 120
                while stack.state()[m.name]["state"] != "asleep":
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{m.name} did not go to sleep: {stack.state()[m.name]}")
                    await asyncio.sleep(0.25)
                wakes = stack.state()[m.name]["wakes_total"]
                result = await _short(client, stack.base(m.name), m.name, _vocab(m.path), a)
                after = stack.state()[m.name]
                lines.append({
                    "bench": "serve_multi_model", "mode": "kvcached", "wake": m.name,
                    "round": round_index, "sleep": a.sleep, "ok": result.ok,
                    "asleep_to_first_token_s": _rounded(result.ttft_s),
                    "supervisor_wake_s": after["last_wake_s"],
                    "woken": after["wakes_total"] - wakes, "error": result.error,
                })  # fmt: skip
                print(json.dumps(lines[-1]), flush=True)
    return lines


async def wake_static(stack: StaticStack, a: argparse.Namespace) -> list[dict[str, Any]]:
    import httpx

    lines = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(None)) as client:
        for round_index in range(a.wake_rounds):
            for m in a.model:
                base = stack.base(m.name)
                t0 = time.monotonic()
                slept = await client.post(f"{base}/sleep?level=1")
                sleep_s = time.monotonic() - t0
                await asyncio.sleep(1.0)
                t1 = time.monotonic()
                woke = await client.post(f"{base}/wake_up")
                wake_s = time.monotonic() - t1
                result = await _short(client, base, m.name, _vocab(m.path), a)
                total = None if result.ttft_s is None else round(wake_s + result.ttft_s, 4)
                lines.append({
                    "bench": "serve_multi_model", "mode": "static", "wake": m.name,
                    "round": round_index, "sleep_status": slept.status_code,
                    "wake_status": woke.status_code, "sleep_s": round(sleep_s, 4),
                    "wake_up_s": round(wake_s, 4), "asleep_to_first_token_s": total,
                    "ok": result.ok and woke.status_code == 200, "error": result.error,
                })  # fmt: skip
                print(json.dumps(lines[-1]), flush=True)
    return lines


# ------------------------------------------------------------------------------ main
def _emit(line: dict[str, Any], out: Path | None) -> None:
    text = json.dumps(line)
    print(text, flush=True)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a") as f:
            f.write(text + "\n")


def _smoke_models(root: Path) -> list[ModelArg]:
    from kvcached.testing.random_model import make_random_model

    return [
        ModelArg(name, str(make_random_model(root / f"tiny-qwen3-seed{seed}", seed=seed)), 1.0)
        for name, seed in (("alpha", 0), ("beta", 1))
    ]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=MODES, required=True)
    ap.add_argument(
        "--model",
        type=_model_arg,
        action="append",
        default=[],
        help="NAME=PATH[@WEIGHT] (repeat); WEIGHT scales its burst rate",
    )
    ap.add_argument("--budget", default="8GiB", help="KV memory of all models together")
    ap.add_argument("--rates", default="2,4,8,16,32", help="burst rates (requests/s) to sweep")
    ap.add_argument("--quiet-rate", type=float, default=1.0, help="requests/s outside a burst")
    ap.add_argument("--slot", type=float, default=10.0, help="seconds of each model's burst")
    ap.add_argument("--prompt-len", type=_range, default=(1024, 2048))
    ap.add_argument("--output-len", type=_range, default=(128, 256))
    ap.add_argument("--slo", type=float, default=1.0, help="p99 TTFT target (s)")
    ap.add_argument(
        "--stop-after",
        type=float,
        default=3.0,
        help="stop the sweep after a rate whose p99 TTFT passes this times the SLO",
    )
    ap.add_argument("--request-timeout", type=float, default=90.0)
    ap.add_argument(
        "--keep-alive", type=float, default=10.0, help="kvcached mode: idle s before sleep"
    )
    ap.add_argument("--sleep", default="weights", choices=("kv", "weights", "unload"))
    ap.add_argument("--wake-rounds", type=int, default=2)
    ap.add_argument("--gpu-mem", default="0.1",
                    help="vLLM's --gpu-memory-utilization per engine (its start-up check): "
                         "F for all, or NAME=F,... with an optional default F first")  # fmt: skip
    ap.add_argument(
        "--engine-arg",
        dest="engine_args",
        action="append",
        default=None,
        help="an argument for every vLLM (repeat; default: the GPU set)",
    )
    ap.add_argument(
        "--prefix-caching",
        choices=("on", "off"),
        default="off",
        help="vLLM's prefix cache in both modes (default off: the prompts are random, so it "
        "hits nothing, and with it on kvcached's engines keep finished requests' blocks "
        "until budget pressure evicts them, which the first H200 run measured)",
    )
    ap.add_argument("--start-timeout", type=float, default=400.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="vLLM-CPU with two tiny random models and short, light settings",
    )
    ap.add_argument("--out", type=Path)
    ap.add_argument("--keep-logs", type=Path, help="copy every process's log here at the end")
    a = ap.parse_args(argv)
    if a.cpu_smoke:
        from kvcached.apps.serve_demo import VLLM_CPU_ARGS

        a.engine_args = a.engine_args or [
            x for x in VLLM_CPU_ARGS if x != "0.2" and x != "--gpu-memory-utilization"
        ]
        a.gpu_mem = "0.2" if a.gpu_mem == "0.1" else a.gpu_mem
        a.budget = a.budget if a.budget != "8GiB" else "16MiB"
        a.prompt_len, a.output_len = (48, 96), (8, 16)
        a.rates = a.rates if a.rates != "2,4,8,16,32" else "1,2"
        a.slot, a.quiet_rate, a.wake_rounds = 4.0, 0.3, 1
        a.keep_alive = 4.0
        a.sleep = "kv"
    elif a.engine_args is None:
        a.engine_args = list(GPU_ENGINE_ARGS)
    if a.prefix_caching == "off":
        a.engine_args = [*a.engine_args, "--no-enable-prefix-caching"]
    a.rate_list = [float(x) for x in a.rates.split(",") if x]
    default, per = 0.1, {}
    for part in a.gpu_mem.split(","):
        name, sep, value = part.partition("=")
        if sep:
            per[name] = float(value)
        else:
            default = float(name)
    a.gpu_mem_of = lambda m: per.get(m.name, default)
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    stop_on_sigterm()
    root = Path(tempfile.mkdtemp(prefix="serve-multi-"))
    if a.cpu_smoke and not a.model:
        a.model = _smoke_models(Path(tempfile.gettempdir()) / "kvcached-serve-multi-models")
    if not a.model:
        raise SystemExit("give at least one --model NAME=PATH")
    stack: KvcachedStack | StaticStack = (
        KvcachedStack(a, root) if a.mode == "kvcached" else StaticStack(a, root)
    )
    gpu = GpuMemory()
    header = {
        "bench": "serve_multi_model", "mode": a.mode, "models": [m.__dict__ for m in a.model],
        "budget": a.budget, "engine_args": a.engine_args, "slot_s": a.slot,
        "prompt_len": a.prompt_len, "output_len": a.output_len, "slo_s": a.slo,
        "keep_alive_s": a.keep_alive if a.mode == "kvcached" else None,
        "sleep": a.sleep if a.mode == "kvcached" else "vllm level 1",
        "host": platform.node(), "gpu_mib_before": gpu.now(),
    }  # fmt: skip
    summary: dict[str, Any] = {"bench": "serve_multi_model", "mode": a.mode, "summary": True}
    try:
        t0 = time.monotonic()
        stack.start()
        stack.wait_ready(a.start_timeout)
        header["startup_s"] = round(time.monotonic() - t0, 1)
        header["gpu_mib_ready"] = gpu.now()
        _emit(header, a.out)
        held: float | None = None
        for rate in a.rate_list:
            with gpu:
                began = time.monotonic()
                sweep = asyncio.run(run_rate(stack, a, rate, a.seed))
                wall = time.monotonic() - began
            line = summarize_rate(a.mode, rate, sweep, wall, a)
            line["gpu_peak_mib"] = gpu.peak_mib
            if isinstance(stack, KvcachedStack):
                line["states_after"] = {n: s["state"] for n, s in stack.state().items()}
                line["wakes_total"] = {n: s["wakes_total"] for n, s in stack.state().items()}
            _emit(line, a.out)
            if line["holds_slo"]:
                held = rate
            p99 = line["ttft_p99_s"]
            if line["failed"] or (p99 is not None and p99 > a.stop_after * a.slo):
                break
        summary["highest_burst_rate_within_slo"] = held
        wakes = (
            asyncio.run(wake_kvcached(stack, a))
            if isinstance(stack, KvcachedStack)
            else asyncio.run(wake_static(stack, a))
            if not a.cpu_smoke
            else []
        )
        for line in wakes:
            if a.out is not None:
                with a.out.open("a") as f:
                    f.write(json.dumps(line) + "\n")
        for m in a.model:
            times = [w["asleep_to_first_token_s"] for w in wakes if w["wake"] == m.name and w["ok"]]
            summary[f"wake_{m.name}_median_s"] = (
                None if not times else round(statistics.median(times), 4)
            )
        _emit(summary, a.out)
        return 0
    except Exception as exc:
        _emit(
            {
                "bench": "serve_multi_model",
                "mode": a.mode,
                "error": f"{type(exc).__name__}: {exc}"[:2000],
            },
            a.out,
        )
        print(stack.logs_tail(), file=sys.stderr)
        return 1
    finally:
        stack.stop()
        if a.keep_logs is not None:
            a.keep_logs.mkdir(parents=True, exist_ok=True)
            for log in root.rglob("*.log"):
                shutil.copy(log, a.keep_logs / f"{a.mode}-{log.name}")
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
