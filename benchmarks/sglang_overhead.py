"""SGLang with and without kvcached, side by side in one process: throughput, start-up,
greedy-token equality (also under pool pressure), and a corrupted run that must differ.

Two `sglang.Engine`s live at once on one GPU: the first without kvcached (SGLang's static
pool, `--mem-fraction`), the second with it (ENABLE_KVCACHED=1 is set in os.environ
before it is created; SGLang spawns its scheduler process, which inherits it and loads
the plugin). Both run `--deterministic` (batch-invariant kernels) with the radix cache on.
Steps, each printed as JSON lines and written to OUT_DIR/sglang_overhead.jsonl:

1. `startup`: each Engine's start-up time.
2. `warmup`: one full batch per engine (kvcached grows its memory here, on the critical
   path: the cold figure), its checksum too.
3. `run`: timed `generate` batches, alternating (off, on, on, off, off, on, ...) for
   `--repeats` pairs; `summary`: median output tokens/s each side, their ratio, the
   median paired ratio with its bootstrap interval and verdict (paired_ratios.py: met
   when the lower bound is >= 0.98 and the median >= 0.99), and whether every checksum
   equals the baseline's. The prompts repeat, so after the warm-up the radix cache holds
   them and the timed batches are decode: what KV reads dominate.
4. `pressure`: the kvcached instance's ledger limit is lowered to `--pressure-limit`
   (`Ledger.set_limit`, what `kvctl limit` does), so the batch no longer fits and SGLang
   queues and retracts; its checksum must still equal the baseline's.
5. `corrupt`: the test-only SGLang plugin
   tests/sglang_engine/plugins/kvcached_corrupt_kv.py (put on the path here, armed by
   its trigger file) rotates every mapped KV page while the engine is idle; the next
   batch reads corrupted cached prefixes and its checksum must differ (the comparison can fail).

A step that fails prints its traceback and a JSON line {"step": ..., "error": ...}; the
later steps still run where they can. The ledger's view of the kvcached instance is
recorded after every step. `--dry-run` checks the arguments and prints the plan without
importing SGLang.

    python benchmarks/sglang_overhead.py /tmp/m-q06 --out-dir $OUT [--repeats 3]
        [--prompts 256] [--prompt-len 128] [--max-tokens 128] [--mem-fraction 0.3]
        [--budget 40GiB] [--pressure-limit 2GiB] [--context-length 2048]
        [--seconds S] [--label NAME]
    python benchmarks/sglang_overhead.py --cell q06-long --out-dir $OUT [--seconds S]

`--cell NAME` runs one cell of the per-configuration sweep (`SWEEP_CELLS`: the model, the
batch's shape and kvcached's extent size; `scripts/sglang-gpu-run.sh sweep` runs them
all), labelled with its name. `--seconds S` starts no pair of timed batches after S
seconds from the start, so that the summary comes out before a `timeout` of the whole
run. The summary's `config` says what ran.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

INSTANCE = "sglang-overhead-kvcached"
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "sglang_engine" / "plugins"))
import kvcached_corrupt_kv  # noqa: E402  (the test-only corrupting plugin; not in kvcached)
from paired_ratios import pair_ratios, verdict  # noqa: E402  (benchmarks/, beside this file)

CORRUPT_ENV = kvcached_corrupt_kv.CORRUPT_ENV

for _key, _value in {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "PYTHONUNBUFFERED": "1",
    "SGLANG_USE_SGL_FA3_KERNEL": "1",
    "TVM_FFI_CACHE_DIR": "/tmp/tvm-ffi-cache",
    "FLASHINFER_WORKSPACE_BASE": "/tmp",
}.items():
    os.environ.setdefault(_key, _value)


@dataclass(frozen=True)
class Cell:
    """One configuration of the sweep: a model folder (the recipe's random checkpoints),
    the batch's shape and the kvcached extent size (KVCACHED_EXTENT_SIZE)."""

    model: str
    prompts: int
    prompt_len: tuple[int, int]  # shortest, longest
    max_tokens: int
    context_length: int
    extent_size: str


#: the SGLang side of the characterization sweep (issue 22), the shapes of the vLLM
#: sweep's cells (scripts/vllm-gpu-run.sh sweep): short requests, long prompts, the long
#: ones with 2 MiB and 64 MiB extents, and the same two shapes on the Qwen3-8B shape
SWEEP_CELLS = {
    "q06-short": Cell("/tmp/m-q06", 256, (128, 128), 128, 2048, "32MiB"),
    "q06-long": Cell("/tmp/m-q06", 64, (2048, 4096), 256, 8192, "32MiB"),
    "q06-long-2MiB": Cell("/tmp/m-q06", 64, (2048, 4096), 256, 8192, "2MiB"),
    "q06-long-64MiB": Cell("/tmp/m-q06", 64, (2048, 4096), 256, 8192, "64MiB"),
    "q8b-short": Cell("/tmp/m-q8b", 128, (512, 512), 128, 2048, "32MiB"),
    "q8b-long": Cell("/tmp/m-q8b", 32, (2048, 6144), 256, 8192, "32MiB"),
}


class _ListCells(argparse.Action):
    """`--list-cells`: the cell names, one line, then exit (before the required options
    are checked, as --help does)."""

    def __call__(self, parser: argparse.ArgumentParser, *_args: Any, **_kwargs: Any) -> None:
        print(" ".join(SWEEP_CELLS))
        parser.exit()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", default=None, help="the model folder (or --cell)")
    ap.add_argument(
        "--cell", choices=sorted(SWEEP_CELLS), default=None,
        help="one cell of the sweep: its model, batch and extent size",
    )  # fmt: skip
    ap.add_argument(
        "--list-cells", action=_ListCells, nargs=0,
        help="print the sweep's cell names and exit (scripts/sglang-gpu-run.sh sweep)",
    )  # fmt: skip
    ap.add_argument("--label", default=None, help="what the summary's config calls this run")
    ap.add_argument(
        "--seconds", type=float, default=None,
        help="start no pair of timed batches after this many seconds from the start",
    )  # fmt: skip
    ap.add_argument("--out-dir", required=True, help="JSON lines and logs go here")
    ap.add_argument("--repeats", type=int, default=3, help="timed batches per side (>= 3)")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument(
        "--prompt-len-max", type=int, default=None, help="lengths from --prompt-len to this"
    )
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--mem-fraction", type=float, default=0.3, help="the baseline's pool")
    ap.add_argument("--budget", default="40GiB", help="the kvcached ledger's device budget")
    ap.add_argument("--pressure-limit", default="2GiB", help="kvcached limit for step 4")
    ap.add_argument("--context-length", type=int, default=2048)
    ap.add_argument(
        "--tp-size", type=int, default=1, help="tensor parallel ranks (GPUs) per engine"
    )
    ap.add_argument("--skip", default="", help="comma list of pressure,corrupt")
    ap.add_argument("--log-level", default="error")
    ap.add_argument("--dry-run", action="store_true", help="print the plan, start nothing")
    a = ap.parse_args(argv)
    a.extent_size = os.environ.get("KVCACHED_EXTENT_SIZE")
    if a.cell is not None:
        cell = SWEEP_CELLS[a.cell]
        a.model = a.model or cell.model
        a.prompts, a.max_tokens = cell.prompts, cell.max_tokens
        a.context_length = cell.context_length
        a.prompt_len, a.prompt_len_max = cell.prompt_len
        a.extent_size = cell.extent_size
        a.label = a.label or a.cell
    if a.model is None:
        ap.error("give the model folder, or --cell NAME (one of the sweep's cells)")
    if a.repeats < 1 or a.prompts < 1 or a.max_tokens < 1:
        ap.error("--repeats, --prompts and --max-tokens must be at least 1")
    # the longest prompt, from here on (--prompt-len-max defaults to --prompt-len)
    a.prompt_len_max = max(a.prompt_len, a.prompt_len_max or 0)
    if a.prompt_len_max + a.max_tokens > a.context_length:
        ap.error(f"--context-length {a.context_length} is shorter than the longest prompt "
                 f"({a.prompt_len_max}) plus --max-tokens ({a.max_tokens}): raise it")  # fmt: skip
    from kvcached.config import parse_size

    a.budget_bytes = parse_size(a.budget, what="--budget")
    a.pressure_bytes = parse_size(a.pressure_limit, what="--pressure-limit")
    a.skip = {s.strip() for s in a.skip.split(",") if s.strip()}
    unknown = a.skip - {"pressure", "corrupt"}
    if unknown:
        ap.error(f"--skip takes pressure and corrupt, not {sorted(unknown)}")
    return a


def config(a: argparse.Namespace) -> dict[str, Any]:
    """What ran, for the summary (the performance page's sweep table reads it)."""
    return {
        "label": a.label,
        "model": a.model,
        "prompts": a.prompts,
        "prompt_len": [a.prompt_len, a.prompt_len_max],
        "max_tokens": a.max_tokens,
        "context_length": a.context_length,
        "extent_size": a.extent_size or "default",
        "mem_fraction": a.mem_fraction,
        "repeats": a.repeats,
        "seconds": a.seconds,
    }


def order(repeats: int) -> list[str]:
    """off, on, on, off, off, on, ...: drift falls on both sides alike."""
    sides = []
    for i in range(repeats):
        sides += ["off", "on"] if i % 2 == 0 else ["on", "off"]
    return sides


def out_of_time(began: float, seconds: float | None, now: float | None = None) -> bool:
    """Whether a run given `seconds` from `began` (time.monotonic) should start no more
    pairs."""
    if seconds is None:
        return False
    return (time.monotonic() if now is None else now) - began > seconds


def checksum(outputs: list[dict[str, Any]]) -> tuple[str, int, int]:
    digest = hashlib.sha256()
    total = cached = 0
    for out in outputs:
        ids = list(out["output_ids"])
        total += len(ids)
        cached += int((out.get("meta_info") or {}).get("cached_tokens", 0) or 0)
        digest.update(json.dumps(ids).encode() + b"\n")
    return digest.hexdigest()[:16], total, cached


class Report:
    def __init__(self, out_dir: Path) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / "sglang_overhead.jsonl"
        self.file = self.path.open("a")

    def emit(self, line: dict[str, Any]) -> None:
        text = json.dumps(line, sort_keys=True)
        print(text, flush=True)
        self.file.write(text + "\n")
        self.file.flush()

    def step(self, name: str, action: Callable[[], Any]) -> Any:
        try:
            return action()
        except Exception as exc:  # report and go on: the next steps may still run
            traceback.print_exc()
            self.emit({"step": name, "error": f"{type(exc).__name__}: {exc}"})
            return None


def ledger_row(ledger_dir: str) -> dict[str, Any]:
    from kvcached.ledger import Ledger, default_key

    with Ledger.open(default_key("cuda"), directory=ledger_dir) as ledger:
        for row in ledger.rows(reclaim=False):
            if row.name == INSTANCE:
                return {"reserved": row.reserved, "used": row.used, "limit": row.limit}
    return {}


def set_limit(ledger_dir: str, nbytes: int | None) -> None:
    from kvcached.ledger import Ledger, default_key

    with Ledger.open(default_key("cuda"), directory=ledger_dir) as ledger:
        ledger.set_limit(INSTANCE, nbytes)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    out_dir = Path(a.out_dir)
    plan = ["startup off", "startup on", "warmup"] + [f"run {s}" for s in order(a.repeats)]
    plan += [s for s in ("pressure", "corrupt") if s not in a.skip]
    if a.dry_run:
        print(json.dumps({"step": "plan", "steps": plan, "budget": a.budget_bytes,
                          "config": config(a)}))  # fmt: skip
        return 0
    began = time.monotonic()
    report = Report(out_dir)
    ledger_dir = os.environ.get("KVCACHED_LEDGER_DIR") or str(out_dir / "ledger")
    os.makedirs(ledger_dir, exist_ok=True)
    trigger = Path(ledger_dir) / "corrupt-now"  # OUT_DIR keeps only what is reported
    trigger.unlink(missing_ok=True)

    from sglang.srt.entrypoints.engine import Engine

    kvcached_corrupt_kv.activate()  # the spawned schedulers find the plugin too

    def start(side: str) -> Any:
        env = {
            "ENABLE_KVCACHED": "1" if side == "on" else "0",
            "KVCACHED_LEDGER_DIR": ledger_dir,
            "KVCACHED_BUDGET": str(a.budget_bytes),
            "KVCACHED_INSTANCE_NAME": INSTANCE,
            CORRUPT_ENV: str(trigger),
        }
        if a.extent_size:  # read by kvcached in the scheduler process SGLang spawns
            env["KVCACHED_EXTENT_SIZE"] = a.extent_size
        os.environ.update(env)  # the scheduler process spawned now inherits it
        options: dict[str, Any] = {}
        if a.tp_size > 1:  # rank 0 decides the pages, every rank maps them (kvcached side)
            options["tp_size"] = a.tp_size
        if side == "off":
            options["mem_fraction_static"] = a.mem_fraction
            os.environ.pop(CORRUPT_ENV)
        began = time.perf_counter()
        engine = Engine(
            model_path=a.model,
            tokenizer_path=a.model,
            dtype="bfloat16",
            context_length=a.context_length,
            random_seed=0,
            enable_deterministic_inference=True,
            log_level=a.log_level,
            **options,
        )
        seconds = time.perf_counter() - began
        info = engine.get_server_info()
        pool_tokens[side] = info.get("max_total_num_tokens")
        report.emit(
            {
                "step": "startup",
                "side": side,
                "startup_s": round(seconds, 2),
                "max_total_num_tokens": info.get("max_total_num_tokens"),
            }
        )
        return engine

    engines: dict[str, Any] = {}
    pool_tokens: dict[str, Any] = {}
    for side in ("off", "on"):
        engine = report.step(f"startup {side}", lambda side=side: start(side))
        if engine is not None:
            engines[side] = engine
    os.environ["ENABLE_KVCACHED"] = "0"
    if "off" not in engines:
        report.emit({"step": "summary", "error": "the baseline engine did not start"})
        return 1
    tokenizer = engines["off"].tokenizer_manager.tokenizer
    vocab = len(tokenizer) if tokenizer is not None else 1000
    rng = random.Random(0)
    prompts = [
        [rng.randrange(16, max(17, vocab - 16))
         for _ in range(rng.randint(a.prompt_len, a.prompt_len_max))]
        for _ in range(a.prompts)
    ]  # fmt: skip
    params = {"temperature": 0.0, "max_new_tokens": a.max_tokens, "ignore_eos": True}

    def batch(side: str, step: str, repeat: int | None = None) -> dict[str, Any]:
        began = time.perf_counter()
        outputs = engines[side].generate(input_ids=prompts, sampling_params=params)
        seconds = time.perf_counter() - began
        digest, tokens, cached = checksum(outputs)
        line = {
            "step": step,
            "side": side,
            "gen_s": round(seconds, 3),
            "out_tokens": tokens,
            "out_tok_per_s": round(tokens / seconds, 1),
            "cached_prompt_tokens": cached,
            "checksum": digest,
        }
        if repeat is not None:
            line["repeat"] = repeat
        if side == "on":
            line["ledger"] = ledger_row(ledger_dir)
        report.emit(line)
        return line

    results: list[dict[str, Any]] = []
    for side in engines:
        report.step("warmup", lambda side=side: results.append(batch(side, "warmup")))
    for index, side in enumerate(order(a.repeats)):
        if index % 2 == 0 and out_of_time(began, a.seconds):
            report.emit({"step": "out_of_time", "pairs_run": index // 2})
            break
        if side in engines:  # the two batches of repeat i run back to back: its pair
            report.step(
                f"run {side}",
                lambda side=side, i=index // 2: results.append(batch(side, "run", i)),
            )
    baseline = {r["checksum"] for r in results if r["side"] == "off"}
    runs = {
        side: [r for r in results if r["step"] == "run" and r["side"] == side] for side in engines
    }
    speed = {
        side: statistics.median(r["out_tok_per_s"] for r in rs) for side, rs in runs.items() if rs
    }
    summary: dict[str, Any] = {
        "step": "summary",
        "baseline_checksums": sorted(baseline),
        "kvcached_checksums": sorted({r["checksum"] for r in results if r["side"] == "on"}),
        "equal": len(baseline) == 1
        and all(r["checksum"] in baseline for r in results if r["side"] == "on"),
        "median_out_tok_per_s": speed,
        "config": config(a),
    }
    # a baseline pool smaller than the batch queues and retracts: its throughput is then
    # SGLang under pressure, not the overhead (the sweep's mem fraction must hold it)
    batch_tokens = sum(len(p) for p in prompts) + a.prompts * a.max_tokens
    summary["batch_kv_tokens"] = batch_tokens
    summary["baseline_pool_tokens"] = pool_tokens.get("off")
    if isinstance(pool_tokens.get("off"), int):
        summary["baseline_pool_holds_batch"] = pool_tokens["off"] >= batch_tokens
    if "on" in speed and "off" in speed:
        summary["throughput_ratio"] = round(speed["on"] / speed["off"], 4)
        sides = [{**r, "kvcached": r["side"] == "on"} for rs in runs.values() for r in rs]
        pairs = pair_ratios(sides, key="out_tok_per_s")
        summary["paired_ratios"] = [round(x, 4) for x in pairs]
        summary.update(verdict(pairs))
    report.emit(summary)
    reference = next(iter(baseline)) if len(baseline) == 1 else None

    if "on" in engines and "pressure" not in a.skip:

        def pressure() -> None:
            set_limit(ledger_dir, a.pressure_bytes)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # the idle upkeep evicts down to the limit
                if ledger_row(ledger_dir).get("reserved", 0) <= a.pressure_bytes:
                    break
                time.sleep(0.2)
            line = batch("on", "pressure")
            report.emit(
                {
                    "step": "pressure_check",
                    "limit": a.pressure_bytes,
                    "equal": line["checksum"] == reference,
                }
            )
            set_limit(ledger_dir, None)

        report.step("pressure", pressure)

    if "on" in engines and "corrupt" not in a.skip:

        def corrupt() -> None:
            batch("on", "before_corrupt")  # the radix cache holds these prompts now
            pages = kvcached_corrupt_kv.pull(trigger, timeout=60.0)
            if pages < 2:
                raise RuntimeError(
                    f"the corruption hook changed {pages} KV pages (it needs at least 2 "
                    "mapped pages of cached prefixes): the check would prove nothing"
                )
            line = batch("on", "corrupt")
            report.emit(
                {
                    "step": "corrupt_check",
                    "corrupted_pages": pages,
                    "changed_tokens": line["checksum"] != reference,
                    "cached_prompt_tokens": line["cached_prompt_tokens"],
                }
            )

        report.step("corrupt", corrupt)

    for side, engine in engines.items():
        report.step(f"shutdown {side}", engine.shutdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
