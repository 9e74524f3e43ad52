"""Two engines on one GPU under one kvcached ledger, with phase-shifted load: memory moves.

Each instance is a separate process (its own PYTHONPATH, so an SGLang instance and a
vLLM instance can share a GPU although their sites cannot be mixed) with ENABLE_KVCACHED=1
and the same KVCACHED_LEDGER_DIR; the ledger's budget is `--budget`. Once all have
started, instance `i` is busy during its own slot of every `--period` seconds (generate
batches of `--prompts` prompts back to back) and idle in the others, for `--seconds`;
an idle instance gives its memory back after KVCACHED_CACHE_IDLE_EVICT (`--idle-evict`).
The parent samples the ledger every `--sample` seconds.

Prints and writes to OUT_DIR/multi_instance.jsonl: a `started` line per instance
(start-up time), `ledger` lines over time (reserved bytes per instance), a `batch` line
per batch served, a `served` line per instance (batches, tokens/s) and a `summary`:
did every instance serve, the peak of each, and whether memory moved (each instance's
peak came while the other held less than its own peak).

    # two SGLang instances (PYTHONPATH=/tmp/site-sglang)
    python benchmarks/sglang_multi_instance.py /tmp/m-q06 --out-dir $OUT
    # SGLang beside vLLM, each with its own site
    python benchmarks/sglang_multi_instance.py /tmp/m-q06 --out-dir $OUT \\
        --engines sglang,vllm --sglang-path /tmp/site-sglang --vllm-path /tmp/site

`child` is the per-instance entry (internal): `... child ENGINE INDEX ARGS-JSON`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

ENGINES = ("sglang", "vllm")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--engines", default="sglang,sglang", help="one per instance")
    ap.add_argument("--budget", default="16GiB", help="the ledger budget (all instances)")
    ap.add_argument("--seconds", type=float, default=90.0, help="load duration")
    ap.add_argument("--period", type=float, default=30.0, help="a full cycle of slots")
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--idle-evict", type=float, default=2.0, help="KVCACHED_CACHE_IDLE_EVICT")
    ap.add_argument("--sample", type=float, default=0.5, help="ledger sampling interval")
    ap.add_argument("--sglang-path", default=os.environ.get("SGLANG_SITE", "/tmp/site-sglang"))
    ap.add_argument("--vllm-path", default=os.environ.get("VLLM_SITE", "/tmp/site"))
    ap.add_argument("--vllm-gpu-mem", type=float, default=0.25)
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args(argv)
    a.engine_list = [e.strip() for e in a.engines.split(",") if e.strip()]
    bad = [e for e in a.engine_list if e not in ENGINES]
    if bad or len(a.engine_list) < 2:
        ap.error(f"--engines takes two or more of {', '.join(ENGINES)}, got {a.engines!r}")
    from kvcached.config import parse_size

    a.budget_bytes = parse_size(a.budget, what="--budget")
    return a


def busy_at(index: int, instances: int, period: float, elapsed: float) -> bool:
    """Instance `index` is busy in its own 1/instances slot of every period."""
    slot = period / instances
    return int((elapsed % period) // slot) == index


# ------------------------------------------------------------------ one instance
def _emit(line: dict[str, Any]) -> None:
    print("MULTI " + json.dumps(line, sort_keys=True), flush=True)


def _prompts(index: int, n: int, length: int, batch: int) -> list[list[int]]:
    rng = random.Random(1000 * index + batch)
    return [[rng.randrange(16, 4000) for _ in range(length)] for _ in range(n)]


def child(engine_name: str, index: int, config: dict[str, Any]) -> None:
    began = time.perf_counter()
    if engine_name == "sglang":
        from sglang.srt.entrypoints.engine import Engine

        engine = Engine(
            model_path=config["model"],
            tokenizer_path=config["model"],
            dtype="bfloat16",
            context_length=2048,
            random_seed=0,
            log_level="error",
        )

        def generate(prompts: list[list[int]]) -> list[list[int]]:
            params = {
                "temperature": 0.0,
                "max_new_tokens": config["max_tokens"],
                "ignore_eos": True,
            }
            return [
                list(o["output_ids"])
                for o in engine.generate(input_ids=prompts, sampling_params=params)
            ]

        shutdown = engine.shutdown
    else:
        from vllm import LLM, SamplingParams

        llm = LLM(
            config["model"],
            dtype="bfloat16",
            seed=0,
            max_model_len=2048,
            gpu_memory_utilization=config["vllm_gpu_mem"],
        )
        sampling = SamplingParams(temperature=0, max_tokens=config["max_tokens"], ignore_eos=True)

        def generate(prompts: list[list[int]]) -> list[list[int]]:
            requests = [{"prompt_token_ids": p} for p in prompts]
            outs = llm.generate(requests, sampling, use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outs]

        def shutdown() -> None:
            return None

    _emit({"step": "started", "instance": index, "engine": engine_name,
           "startup_s": round(time.perf_counter() - began, 2)})  # fmt: skip
    go = Path(config["go_file"])
    while not go.exists():
        time.sleep(0.05)
    start = float(go.read_text())
    served = tokens = 0
    busy_s = 0.0
    while True:
        elapsed = time.time() - start
        if elapsed >= config["seconds"]:
            break
        if not busy_at(index, config["instances"], config["period"], elapsed):
            time.sleep(0.1)
            continue
        t0 = time.perf_counter()
        outs = generate(_prompts(index, config["prompts"], config["prompt_len"], served))
        seconds = time.perf_counter() - t0
        count = sum(len(o) for o in outs)
        digest = hashlib.sha256(json.dumps(outs).encode()).hexdigest()[:16]
        served, tokens, busy_s = served + 1, tokens + count, busy_s + seconds
        _emit({"step": "batch", "instance": index, "engine": engine_name, "at_s": round(elapsed, 2),
               "gen_s": round(seconds, 3), "out_tokens": count, "checksum": digest})  # fmt: skip
    _emit({"step": "served", "instance": index, "engine": engine_name, "batches": served,
           "out_tok_per_s_busy": round(tokens / busy_s, 1) if busy_s else None})  # fmt: skip
    shutdown()


# ------------------------------------------------------------------ the parent
def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    out_dir = Path(a.out_dir)
    names = [f"{engine}-{i}" for i, engine in enumerate(a.engine_list)]
    if a.dry_run:
        print(json.dumps({"step": "plan", "instances": names, "budget": a.budget_bytes}))
        return 0
    out_dir.mkdir(parents=True, exist_ok=True)
    report = (out_dir / "multi_instance.jsonl").open("a")
    lock = threading.Lock()

    def emit(line: dict[str, Any]) -> None:
        text = json.dumps(line, sort_keys=True)
        with lock:
            print(text, flush=True)
            report.write(text + "\n")
            report.flush()

    from kvcached.ledger import Ledger, default_key

    ledger_dir = Path(os.environ.get("KVCACHED_LEDGER_DIR") or out_dir / "ledger")
    ledger_dir.mkdir(parents=True, exist_ok=True)
    ledger = Ledger.open(default_key("cuda"), budget=a.budget_bytes, directory=ledger_dir)
    go_file = ledger_dir / "go"  # beside the ledger: OUT_DIR keeps only what is reported
    go_file.unlink(missing_ok=True)
    config = {
        "model": a.model,
        "instances": len(names),
        "period": a.period,
        "seconds": a.seconds,
        "prompts": a.prompts,
        "prompt_len": a.prompt_len,
        "max_tokens": a.max_tokens,
        "vllm_gpu_mem": a.vllm_gpu_mem,
        "go_file": str(go_file),
    }
    procs: list[subprocess.Popen[str]] = []
    events: dict[int, list[dict[str, Any]]] = {i: [] for i in range(len(names))}
    for i, engine in enumerate(a.engine_list):
        env = dict(os.environ)
        env.update(
            ENABLE_KVCACHED="1",
            KVCACHED_LEDGER_DIR=str(ledger_dir),
            KVCACHED_INSTANCE_NAME=names[i],
            KVCACHED_CACHE_IDLE_EVICT=str(a.idle_evict),
            PYTHONPATH=a.sglang_path if engine == "sglang" else a.vllm_path,
            PYTHONUNBUFFERED="1",
            HF_HUB_OFFLINE="1",
        )
        if engine == "vllm":
            env.setdefault("VLLM_HOST_IP", "127.0.0.1")
            env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        log = (out_dir / f"{names[i]}.log").open("w")
        proc = subprocess.Popen(
            [sys.executable, __file__, "child", engine, str(i), json.dumps(config)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
        procs.append(proc)

        def read(index: int, stream: Any) -> None:
            for raw in stream:
                if raw.startswith("MULTI "):
                    line = json.loads(raw[6:])
                    events[index].append(line)
                    emit(line)

        threading.Thread(target=read, args=(i, proc.stdout), daemon=True).start()
    deadline = time.monotonic() + a.start_timeout
    while time.monotonic() < deadline:
        if all(any(e["step"] == "started" for e in events[i]) for i in events):
            break
        failed = [names[i] for i, p in enumerate(procs) if p.poll() is not None]
        if failed:
            emit({"step": "summary", "error": f"{failed} exited while starting; see their logs"})
            return 1
        time.sleep(0.2)
    else:
        emit({"step": "summary", "error": "not every instance started in time"})
        for proc in procs:
            proc.kill()
        return 1
    start = time.time() + 1.0
    go_file.write_text(repr(start))
    samples: list[dict[str, int]] = []
    while any(p.poll() is None for p in procs) and time.time() < start + a.seconds + 60:
        rows = {r.name: r.reserved for r in ledger.rows(reclaim=False)}
        sample = {name: rows.get(name, 0) for name in names}
        samples.append(sample)
        emit({"step": "ledger", "at_s": round(time.time() - start, 2), "reserved": sample})
        time.sleep(a.sample)
    for proc in procs:
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
    peaks = {name: max((s[name] for s in samples), default=0) for name in names}
    moved = all(
        any(
            s[name] == peaks[name] and all(s[o] < peaks[o] for o in names if o != name)
            for s in samples
        )
        for name in names
    ) and all(peaks.values())
    served = {names[i]: sum(1 for e in events[i] if e["step"] == "batch") for i in events}
    emit(
        {
            "step": "summary",
            "all_served": all(served.values()),
            "batches": served,
            "peak_reserved": peaks,
            "memory_moved": moved,
            "budget": a.budget_bytes,
        }
    )
    ledger.close()
    return 0 if all(served.values()) else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        try:
            child(sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4]))
        except Exception:
            traceback.print_exc()
            _emit(
                {
                    "step": "error",
                    "instance": int(sys.argv[3]),
                    "error": traceback.format_exc()[-800:],
                }
            )
            sys.exit(1)
    else:
        sys.exit(main())
