"""The compatibility matrix: each architecture on an engine, with and without kvcached.

For every row of `kvcached.random_arch.ARCHITECTURES` it builds the random-weight model,
runs greedy generation once with the engine alone and once with kvcached (a fresh
process each, `tests/vllm_engine/generate.py`), and records one outcome:

* ``equal``: the greedy tokens match;
* ``different_tokens``: both ran, the tokens differ (garbled output: a bug);
* ``crash_at_start`` / ``crash``: kvcached's run failed without a start-up refusal;
* ``refused``: kvcached refused the model at start-up, with its message;
* ``not_run``: the engine alone cannot run it here (the reason is its error), or the
  row was not asked for.

The batch is long enough to span many extents (every 64 KiB block is its own extent)
and, at 300 prompt tokens, past the 128-token sliding windows of the scaled models.

    python tests/matrix/harness.py --out tests/matrix/results/vllm-cpu.json [ROW ...]
    python tests/matrix/harness.py --gpu --out $OUT/vllm-gpu.json   # scripts/matrix-gpu.sh

With ``--gpu`` (vLLM on the H200) the models keep their real KV shapes with fewer
layers (`random_arch`'s ``gpu`` scale), the batch is larger and deterministic, and each
equal row also gets its throughput ratio (tokens/s with kvcached over without, one run
each: a rough figure).

`scripts/render_compatibility.py` turns the JSON files into docs/compatibility.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
GENERATE = ROOT / "tests" / "vllm_engine" / "generate.py"

#: every block its own extent, released as soon as it is empty (as in test_vllm_engine)
MANY_EXTENTS = {
    "KVCACHED_HOST_GRANULARITY": "64KiB",
    "KVCACHED_EXTENT_SIZE": "64KiB",
    "KVCACHED_POOL_LOW": "0",
    "KVCACHED_POOL_HIGH": "0",
    "KVCACHED_POOL_RELEASE_DELAY": "0",
}
#: the CPU batch: 4 prompts of 300 tokens, 32 greedy tokens each, run twice in the
#: engine (the second time from the prefix cache)
BATCH = ("--prompts", "4", "--prompt-len", "300", "--max-tokens", "32", "--repeat", "2")
#: the H200 batch (scripts/matrix-gpu.sh): deterministic, as the device recipe found
#: bf16 tokens repeat only with prefix caching off and every prompt queued at once
GPU_BATCH = (
    *("--prompts", "64", "--prompt-len", "1200", "--max-tokens", "128"),
    *("--no-prefix-caching", "--max-num-seqs", "64", "--kv-bytes", str(16 << 30)),
)
OUTCOMES = ("equal", "different_tokens", "crash_at_start", "crash", "refused", "not_run")


#: errors that name a root cause better than the last exception does
ROOT_CAUSES = ("ModuleNotFoundError", "NotImplementedError")


def _last_error(text: str) -> str:
    """The most telling line of a failed run: a root cause, else the last exception."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in lines:
        if any(cause in line for cause in ROOT_CAUSES):
            return line[line.index(next(c for c in ROOT_CAUSES if c in line)) :][:400]
    for line in reversed(lines):
        head = line.split(":", 1)[0]
        if head.endswith(("Error", "Exception", "Refused", "UnsupportedVllm")):
            return line[:400]
    return (lines[-1] if lines else "no output")[:400]


def run_engine(
    model: Path,
    ledger_dir: Path,
    *,
    kvcached: bool,
    batch: tuple[str, ...] = BATCH,
    many_extents: bool = True,
) -> dict[str, Any]:
    """One generation run in a fresh process: its result, or how it failed."""
    ledger_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update(
        ENABLE_KVCACHED="1" if kvcached else "0",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        KVCACHED_LEDGER_DIR=str(ledger_dir),
    )
    env.setdefault("KVCACHED_BACKEND", "host")
    if kvcached and many_extents:
        env.update(MANY_EXTENTS)
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, str(GENERATE), str(model), *batch],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    seconds = round(time.perf_counter() - started, 1)
    output = done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode == 0 and lines:
        result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
        return {"ok": True, "seconds": seconds, **result}
    return {
        "ok": False,
        "seconds": seconds,
        "error": _last_error(output),
        "refused": "kvcached: " in output and "Unset ENABLE_KVCACHED" in output,
        "started": "RESULT" in output or "Processed prompts" in output,
    }


def judge(baseline: dict[str, Any], with_kvcached: dict[str, Any]) -> dict[str, Any]:
    """The cell for one row from its two runs."""
    if not baseline["ok"]:
        return {"outcome": "not_run", "detail": f"the engine alone fails: {baseline['error']}"}
    if not with_kvcached["ok"]:
        if with_kvcached["refused"]:
            return {"outcome": "refused", "detail": with_kvcached["error"]}
        outcome = "crash" if with_kvcached["started"] else "crash_at_start"
        return {"outcome": outcome, "detail": with_kvcached["error"]}
    if with_kvcached["runs"] != baseline["runs"]:
        return {"outcome": "different_tokens", "detail": "greedy tokens differ"}
    runs = baseline["runs"]
    return {"outcome": "equal", "detail": f"{len(runs)} runs of {len(runs[0])} prompts equal"}


def run_row(
    name: str, work: Path, *, gpu: bool = False, keep_tokens: bool = False
) -> dict[str, Any]:
    """One row's cell; `keep_tokens` adds the engine's own greedy tokens (``runs``)."""
    from kvcached.random_arch import ARCHITECTURES, make_arch_model

    arch = ARCHITECTURES[name]
    row = {"architecture": name, "representative": arch.representative, "class": arch.architecture}
    folder = work / "models" / name
    try:  # the installed transformers may lack the architecture (older releases)
        if gpu:
            model = make_arch_model(folder, name, scale="gpu", dtype="bfloat16")
        else:
            model = make_arch_model(folder, name)
    except Exception as exc:
        detail = f"the model cannot be built here: {type(exc).__name__}: {exc}"[:400]
        return {**row, "outcome": "not_run", "detail": detail}
    if gpu:
        batch: tuple[str, ...] = (*GPU_BATCH, "--dtype", "bfloat16")
    else:
        batch = (*BATCH, "--dtype", arch.cpu_dtype)
    baseline = run_engine(model, work / f"{name}-ledger-baseline", kvcached=False, batch=batch)
    # a model the engine cannot run alone says nothing about kvcached: not run with it
    with_kvcached = (
        run_engine(model, work / f"{name}-ledger", kvcached=True, batch=batch, many_extents=not gpu)
        if baseline["ok"]
        else baseline
    )
    cell = judge(baseline, with_kvcached)
    if gpu and cell["outcome"] == "equal":
        cell["throughput_ratio"] = round(
            with_kvcached["tokens_per_s"] / baseline["tokens_per_s"], 3
        )
    return {
        **row,
        **cell,
        "seconds": {"baseline": baseline["seconds"], "kvcached": with_kvcached["seconds"]},
        **({"runs": baseline.get("runs")} if keep_tokens else {}),
    }


def engine_label(gpu: bool) -> str:
    import vllm

    return f"vLLM-GPU {vllm.__version__} (H200)" if gpu else f"vLLM-CPU {vllm.__version__}"


def main(argv: list[str] | None = None) -> int:
    from kvcached.random_arch import ARCHITECTURES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rows", nargs="*", help=f"rows to run (default all: {list(ARCHITECTURES)})")
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    parser.add_argument(
        "--gpu", action="store_true", help="the H200 column: real KV shapes, throughput"
    )
    parser.add_argument(
        "--deadline",
        type=float,
        default=None,
        help="seconds: rows that would start past it are recorded as not run",
    )
    args = parser.parse_args(argv)
    unknown = [row for row in args.rows if row not in ARCHITECTURES]
    if unknown:
        parser.error(f"unknown rows {unknown}; accepted: {', '.join(ARCHITECTURES)}")
    wanted = args.rows or list(ARCHITECTURES)
    table: dict[str, Any] = {
        "engine": "vllm-gpu" if args.gpu else "vllm-cpu",
        "label": engine_label(args.gpu),
        "host": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "command": "python tests/matrix/harness.py "
        + ("--gpu " if args.gpu else "")
        + "--out "
        + str(args.out.name),
        "rows": [],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    started, slowest = time.monotonic(), 0.0
    with tempfile.TemporaryDirectory(prefix="kvcached-matrix-") as tmp:
        for name in ARCHITECTURES:
            if name not in wanted:
                continue
            elapsed = time.monotonic() - started
            if args.deadline is not None and elapsed + slowest > args.deadline:
                row = {
                    "architecture": name,
                    "representative": ARCHITECTURES[name].representative,
                    "class": ARCHITECTURES[name].architecture,
                    "outcome": "not_run",
                    "detail": f"out of time: {elapsed:.0f} s of this command's "
                    f"{args.deadline:.0f} s were spent on the rows before it",
                }
            else:
                row = run_row(name, Path(tmp), gpu=args.gpu)
                slowest = max(slowest, time.monotonic() - started - elapsed)
            print(json.dumps(row), flush=True)
            table["rows"].append(row)
            # written after every row, so a run cut short keeps the rows it finished
            args.out.write_text(json.dumps(table, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
