"""Which vLLM KV connectors run on this machine, with and without kvcached, and what
the served one costs: one JSON line per run.

Each run is tests/vllm_connectors/generate.py in a fresh process (in-process engine,
a tiny random Qwen3, 4 prompts of 300 tokens, 16 greedy tokens). For every connector
it first runs vLLM alone: ``ran`` (with its tokens' agreement with vLLM without a
connector), or ``failed`` with vLLM's error. Each connector that ran then runs under
kvcached: ``refused`` with the adapter's message, or ``ran`` with its tokens compared.
The ExampleConnector runs as a producer (saves the KV to a folder) and then as a
consumer (a fresh engine loads it), each with and without kvcached, so its figures are
the time a prefill costs when it is computed and saved, and when it is loaded.

    python benchmarks/vllm_connectors.py \
        --out benchmarks/results/cpu-2026-12-02/vllm_connectors.jsonl

`--device gpu` (vLLM 0.26 on the H200, `scripts/vllm-gpu-run.sh connectors`) runs the
OffloadingConnector trial instead (`--model`, e.g. the recipe's Qwen3-0.6B shape; an
8 GiB CPU tier): bf16, 16 prompts of 1,024 tokens, 32 new tokens,
twice, the GPU prefix cache reset between so the second round loads from the CPU tier.
vLLM alone without a connector gives the reference; vLLM alone with the connector, then
kvcached with it (`--prove`: served for the trial), must give it too, both rounds; then
kvcached with the loaded blocks swapped (must differ, and must have loaded), and the
stores of blocks kvcached did not hold with and without Note [A connector may read a
freed block late]'s cooling (prefix cache off, so a freed block goes back at once);
last, a tight instance limit with and without the tier (preemptions, cached tokens).
`--trial lmcache` runs LMCache's connector the same way (lmcache 0.5.x, an 8 GiB CPU
tier: reference, alone, kvcached, loaded blocks swapped); `--trial capacity` runs a batch
that preempts (48 prompts of 1,024 tokens, 768 new, under a 2 GiB instance limit)
without and with the OffloadingConnector's tier, and `--trial capacity-alone` vLLM alone
with a 2 GiB pool the same two ways (two trials: the four runs pass one device command's
ten minutes): preemptions, the requests preempted, the blocks loaded back, the time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GENERATE = ROOT / "tests" / "vllm_connectors" / "generate.py"
BATCH = ("--prompts", "4", "--prompt-len", "300", "--max-tokens", "16")
MANY_EXTENTS = {
    "KVCACHED_HOST_GRANULARITY": "64KiB",
    "KVCACHED_EXTENT_SIZE": "64KiB",
    "KVCACHED_POOL_LOW": "0",
    "KVCACHED_POOL_HIGH": "0",
    "KVCACHED_POOL_RELEASE_DELAY": "0",
}
#: (row name, generate.py arguments, extra environment): the connectors tried
CONNECTORS: tuple[tuple[str, tuple[str, ...], dict[str, str]], ...] = (
    ("OffloadingConnector", ("--connector", "none", "--offload-gib", "0.1"), {}),
    (
        "SimpleCPUOffloadConnector",
        ("--connector", "none", "--offload-gib", "0.1"),
        {"VLLM_USE_SIMPLE_KV_OFFLOAD": "1"},
    ),
    ("DecodeBenchConnector", ("--connector", "DecodeBenchConnector"), {}),
)


def _error(text: str) -> str:
    for line in reversed(text.splitlines()):
        line = line.strip().removeprefix("[rank0]: ")
        if "kvcached: " in line:
            return line[line.index("kvcached: ") :][:400]
        head = line.split(":", 1)[0]
        if head.endswith(("Error", "Exception", "Unsupported")):
            return line[:400]
    return "no error line"


def run(
    model: Path,
    ledger: Path,
    args: tuple[str, ...],
    env: dict[str, str],
    *,
    kvcached: bool,
    batch: tuple[str, ...] = BATCH,
    backend: str | None = "host",
) -> dict[str, Any]:
    environment = dict(os.environ)
    environment.update(
        ENABLE_KVCACHED="1" if kvcached else "0",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        KVCACHED_LEDGER_DIR=str(ledger),
        **env,
    )
    if backend is not None:
        environment["KVCACHED_BACKEND"] = backend
    if kvcached and backend == "host":
        environment.update(MANY_EXTENTS)
    done = subprocess.run(
        [sys.executable, str(GENERATE), str(model), *batch, *args],
        env=environment,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode == 0 and lines:
        result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
        return {"outcome": "ran", **result}
    text = done.stdout + done.stderr
    outcome = "refused" if "Unset ENABLE_KVCACHED" in text else "failed"
    return {"outcome": outcome, "error": _error(text)}


GPU_BATCH = ("--prompts", "16", "--prompt-len", "1024", "--max-tokens", "32", "--repeat", "2",
             "--dtype", "bfloat16", "--max-model-len", "2048", "--max-num-seqs", "16",
             "--kv-bytes", str(4 << 30))  # fmt: skip
OFFLOAD = ("--connector", "none", "--offload-gib", "8", "--reset-between")
TRIAL = (*OFFLOAD, "--prove", "OffloadingConnector")


LMCACHE = ("--connector", "none", "--lmcache-gib", "8", "--reset-between")
LMCACHE_TRIAL = (*LMCACHE, "--prove", "LMCacheConnectorV1")
#: a Qwen3-0.6B shape's KV is 112 KiB a token: 2 GiB hold about 18K tokens, 10 of these
#: requests at their full 1,792; 48 of them admitted on their prompts must preempt
PREEMPTING = ("--prompts", "48", "--prompt-len", "1024", "--max-tokens", "768",
              "--dtype", "bfloat16", "--max-model-len", "2048", "--max-num-seqs", "48")  # fmt: skip


def gpu_trial(
    model: Path, ledger: Path, emit: Callable[[dict[str, Any]], None], trial: str
) -> None:
    """A connector trial on a GPU (the module docstring): `offloading`, `lmcache`, or
    `capacity` (a preempting batch under a tight limit, without and with a CPU tier)."""

    def one(name: str, args: tuple[str, ...], *, kvcached: bool, env: dict[str, str] | None = None,
            batch: tuple[str, ...] = GPU_BATCH) -> dict[str, Any]:  # fmt: skip
        result = run(model, ledger, args, env or {}, kvcached=kvcached, batch=batch, backend=None)
        for key in ("stored", "loaded", "corrupted", "load_errors", "loaded_bytes_equal",
                    "loaded_bytes_differ", "loaded_bytes_unwritten"):  # fmt: skip
            if key in result:
                result[key] = len(result[key])
        runs = result.get("runs")
        if runs is not None:  # per round, so that two rows' tokens can be told apart
            result["tokens_sha"] = [hashlib.sha256(json.dumps(r).encode()).hexdigest()[:12]
                                    for r in runs]  # fmt: skip
        if batch != GPU_BATCH:  # another batch: nothing to compare its tokens with
            result.pop("runs", None)
        connector = ("OffloadingConnector" if "--offload-gib" in args else
                     "LMCacheConnectorV1" if "--lmcache-gib" in args else "none")  # fmt: skip
        emit({"connector": connector, "row": name, "kvcached": kvcached, **result})
        return result

    if trial == "capacity":
        # kvcached under a 2 GiB limit (`capacity-alone`: vLLM alone with a 2 GiB pool,
        # which says whether the tier's effect on preemption is the connector's own or
        # kvcached's cooling)
        tight = {"KVCACHED_INSTANCE_LIMIT": "2GiB"}
        one("preempting, no tier", ("--connector", "none"), kvcached=True, env=tight,
            batch=PREEMPTING)  # fmt: skip
        one("preempting, OffloadingConnector tier", TRIAL, kvcached=True, env=tight,
            batch=PREEMPTING)  # fmt: skip
        return
    if trial == "capacity-alone":
        pool = ("--kv-bytes", str(2 << 30))
        one("preempting, vLLM alone, OffloadingConnector tier", (*OFFLOAD, *pool),
            kvcached=False, batch=PREEMPTING)  # fmt: skip
        one("preempting, vLLM alone, no tier", ("--connector", "none", *pool), kvcached=False,
            batch=PREEMPTING)  # fmt: skip
        return
    one("reference", ("--connector", "none", "--reset-between"), kvcached=False)
    if trial == "lmcache":
        one("alone", LMCACHE, kvcached=False)
        one("kvcached", LMCACHE_TRIAL, kvcached=True)
        one("kvcached, loaded blocks swapped", (*LMCACHE_TRIAL, "--corrupt-offload-loads"),
            kvcached=True)  # fmt: skip
        return
    one("alone", OFFLOAD, kvcached=False)
    one("kvcached", TRIAL, kvcached=True)
    one("kvcached, loaded blocks swapped", (*TRIAL, "--corrupt-offload-loads"), kvcached=True)
    for cooling in (True, False):
        flags = ("--no-prefix-caching",) + (() if cooling else ("--no-cooling",))
        one(f"stores, prefix cache off, cooling {'on' if cooling else 'off'}",
            (*TRIAL, *flags), kvcached=True)  # fmt: skip
    tight = {"KVCACHED_INSTANCE_LIMIT": "1GiB"}  # a Qwen3-0.6B shape: ~9K tokens
    busy = ("--prompts", "64", "--prompt-len", "1024", "--max-tokens", "64", "--repeat", "2",
            "--dtype", "bfloat16", "--max-model-len", "2048", "--max-num-seqs", "64")  # fmt: skip
    one("tight limit, no tier", ("--connector", "none", "--reset-between"), kvcached=True,
        env=tight, batch=busy)  # fmt: skip
    one("tight limit, CPU tier", TRIAL, kvcached=True, env=tight, batch=busy)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    ap.add_argument("--model", type=Path, default=None, help="default: a tiny random Qwen3")
    ap.add_argument("--trial", choices=("offloading", "lmcache", "capacity", "capacity-alone"),
                    default="offloading", help="--device gpu: which trial")  # fmt: skip
    a = ap.parse_args()
    import vllm

    from kvcached.testing.random_model import make_random_model

    work = Path(tempfile.mkdtemp(prefix="kvcached-connectors-"))
    model = a.model or make_random_model(work / "tiny-qwen3")
    ledger = work / "ledger"
    ledger.mkdir()
    common = {"bench": "vllm_connectors", "vllm": vllm.__version__, "host": platform.node()}
    out = a.out.open("w") if a.out else None
    alone: Any = None  # --device gpu: vLLM alone with the connector, what kvcached must equal
    # whether the connector alone put back every block's stored bytes: if not, it is broken
    # on this vLLM by itself (LMCache 0.5.3 on vLLM 0.26's packed K/V rows, LMCache issue
    # #4463), and kvcached's tokens against its tokens decide nothing
    alone_round_trips: bool | None = None

    def emit(row: dict[str, Any]) -> None:
        row = {**common, **row}
        tokens = row.pop("runs", None)
        if tokens is not None:
            row["tokens_equal_reference"] = tokens == reference
            if alone is not None and row.get("kvcached"):
                row["tokens_equal_alone"] = tokens == alone
                row["rounds_equal_alone"] = [x == y for x, y in zip(tokens, alone, strict=False)]
                if alone_round_trips is not None:
                    row["alone_round_trips"] = alone_round_trips
        line = json.dumps(row)
        print(line, flush=True)
        if out is not None:
            out.write(line + "\n")
            out.flush()

    if a.device == "gpu":
        reference: Any = None

        def keep_reference(row: dict[str, Any]) -> None:
            nonlocal reference, alone, alone_round_trips
            if row.get("row") == "reference":
                reference = row.get("runs")
            if row.get("row") == "alone":
                alone = row.get("runs")
                if "loaded_bytes_equal" in row:  # counts by now (gpu_trial's `one`)
                    alone_round_trips = row["loaded_bytes_equal"] == row.get("loaded", 0)
            emit(row)

        gpu_trial(model, ledger, keep_reference, a.trial)
        if out is not None:
            out.close()
        return
    plain = run(model, ledger, ("--connector", "none"), {}, kvcached=False)
    reference = plain["runs"]
    emit({"connector": "none", "kvcached": False, **plain})
    for phase_kvcached in (False, True):
        storage = work / f"storage-{int(phase_kvcached)}"
        args = ("--connector", "ExampleConnector", "--storage", str(storage))
        for phase in ("producer", "consumer"):
            result = run(model, ledger, args, {}, kvcached=phase_kvcached)
            result.pop("unmapped_loads", None)
            result["loaded_blocks"] = len(result.get("loaded_blocks", []))
            result.pop("corrupted", None)
            emit({"connector": "ExampleConnector", "phase": phase, "kvcached": phase_kvcached,
                  **result})  # fmt: skip
    for name, args, env in CONNECTORS:
        alone = run(model, ledger, args, env, kvcached=False)
        emit({"connector": name, "kvcached": False, **alone})
        if alone["outcome"] == "ran":
            emit(
                {
                    "connector": name,
                    "kvcached": True,
                    **run(model, ledger, args, env, kvcached=True),
                }
            )
    if out is not None:
        out.close()


if __name__ == "__main__":
    main()
