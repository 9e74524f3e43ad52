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
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
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
    model: Path, ledger: Path, args: tuple[str, ...], env: dict[str, str], *, kvcached: bool
) -> dict[str, Any]:
    environment = dict(os.environ)
    environment.update(
        ENABLE_KVCACHED="1" if kvcached else "0",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        KVCACHED_LEDGER_DIR=str(ledger),
        KVCACHED_BACKEND="host",
        **env,
    )
    if kvcached:
        environment.update(MANY_EXTENTS)
    done = subprocess.run(
        [sys.executable, str(GENERATE), str(model), *BATCH, *args],
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    import vllm

    from kvcached.testing.random_model import make_random_model

    work = Path(tempfile.mkdtemp(prefix="kvcached-connectors-"))
    model = make_random_model(work / "tiny-qwen3")
    ledger = work / "ledger"
    ledger.mkdir()
    common = {"bench": "vllm_connectors", "vllm": vllm.__version__, "host": platform.node()}
    out = a.out.open("w") if a.out else None

    def emit(row: dict[str, Any]) -> None:
        row = {**common, **row}
        tokens = row.pop("runs", None)
        if tokens is not None:
            row["tokens_equal_reference"] = tokens == reference
        line = json.dumps(row)
        print(line, flush=True)
        if out is not None:
            out.write(line + "\n")
            out.flush()

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
