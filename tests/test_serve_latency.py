"""benchmarks/serve_latency.py with `--engine sglang`, end to end on the CPU machine
against a stand-in for SGLang's server (SGLang's server needs the GPU).

The stand-in is a package `sglang` put first on the servers' path: its `launch_server`
records the command line and kvcached's variables it was started with, then serves as
tests/serve_fake_engine.py does (OpenAI-shaped, streamed, deterministic tokens). So
this checks what the benchmark asks of each side, vanilla SGLang holding the KV's worth
of tokens and the kvcached side sized by its budget, and that the load, the per-rate
lines and the summary come out of a run; the figures themselves are the H200's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from process_state import ended  # tests/, on sys.path under pytest

pytest.importorskip("httpx")

ROOT = Path(__file__).resolve().parents[1]

STUB = """
import json, os, runpy, sys

argv = sys.argv[1:]
port = argv[argv.index("--port") + 1]
kvcached = os.environ.get("ENABLE_KVCACHED")
record = {"argv": argv, "ENABLE_KVCACHED": kvcached, "pid": os.getpid(),
          "KVCACHED_BUDGET": os.environ.get("KVCACHED_BUDGET") if kvcached == "1" else None}
side = "kvcached" if kvcached == "1" else "vanilla"
with open(os.path.join(os.environ["FAKE_SGLANG_RECORD"], side + ".json"), "w") as f:
    json.dump(record, f)
os.environ["KVCACHED_INSTANCE_NAME"] = "fake-" + side  # one ledger row each
sys.argv = ["serve_fake_engine.py", "--port", port, "--name", "m", "--bytes-per-request",
            "65536"]
runpy.run_path(os.environ["FAKE_ENGINE"], run_name="__main__")
"""


def _benchmark(tmp_path: Path, *options: str) -> tuple[list[str], dict[str, str], Path]:
    """The benchmark's command line against the stand-in, its environment, and the
    folder where each side's server records how it was started."""
    model = tmp_path / "model"
    model.mkdir()
    config = {"vocab_size": 1000, "num_hidden_layers": 4, "num_attention_heads": 8,
              "num_key_value_heads": 2, "hidden_size": 512}  # fmt: skip
    (model / "config.json").write_text(json.dumps(config))
    package = tmp_path / "stub" / "sglang"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "launch_server.py").write_text(STUB)
    records = tmp_path / "records"
    records.mkdir()
    ledger = tmp_path / "ledger"
    ledger.mkdir(mode=0o700)
    env = dict(
        os.environ,
        PYTHONPATH=str(tmp_path / "stub"),
        FAKE_ENGINE=str(ROOT / "tests" / "serve_fake_engine.py"),
        FAKE_SGLANG_RECORD=str(records),
        KVCACHED_LEDGER_DIR=str(ledger),
        KVCACHED_BACKEND="host",
    )
    command = [
        sys.executable, str(ROOT / "benchmarks" / "serve_latency.py"), "--engine", "sglang",
        "--model", str(model), "--kv", "16MiB", "--prompt-len", "16", "--output-len", "4",
        "--check", "2", "--start-timeout", "60", *options,
    ]  # fmt: skip
    return command, env, records


def test_an_sglang_run_gives_each_side_its_kv_the_way_its_server_takes_it(tmp_path: Path) -> None:
    per_token = 4 * 2 * (512 // 8) * 2 * 2  # layers x KV heads x head size x (K, V) x bf16
    out = tmp_path / "latency.jsonl"
    command, env, records = _benchmark(
        tmp_path, "--rates", "2,4", "--seconds", "2", "--out", str(out)
    )
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    header, summary = lines[0], lines[-1]
    assert header["engine"] == "sglang" and header["greedy_equal_alone"] is True
    runs = [line for line in lines if "side" in line]
    # each rate on both sides, the order alternating from one rate to the next
    assert [(x["rate"], x["side"]) for x in runs] == [
        (2.0, "vanilla"), (2.0, "kvcached"), (4.0, "kvcached"), (4.0, "vanilla")
    ]  # fmt: skip
    assert all(x["requests"] > 0 and x["ok"] == x["requests"] for x in runs)
    assert summary["summary"] and set(summary["kvcached_over_vanilla"]) == {"2", "4"}
    # what each server was asked: vanilla holds 16 MiB of tokens in a fixed pool,
    # kvcached's side is sized by its budget; both without the radix cache
    vanilla = json.loads((records / "vanilla.json").read_text())
    elastic = json.loads((records / "kvcached.json").read_text())
    tokens = vanilla["argv"][vanilla["argv"].index("--max-total-tokens") + 1]
    assert int(tokens) == (16 << 20) // per_token
    assert "--mem-fraction-static" in vanilla["argv"] and vanilla["ENABLE_KVCACHED"] == "0"
    assert elastic["ENABLE_KVCACHED"] == "1" and elastic["KVCACHED_BUDGET"] == str(16 << 20)
    assert "--max-total-tokens" not in elastic["argv"]
    for side in (vanilla, elastic):
        assert "--disable-radix-cache" in side["argv"]
        assert side["argv"][side["argv"].index("--served-model-name") + 1] == "m"


def test_a_run_cut_by_sigterm_stops_both_servers(tmp_path: Path) -> None:
    # `timeout` in the device scripts cuts a run with SIGTERM; the servers lead sessions
    # of their own, so only the benchmark's own stop reaches them (on the H100 of
    # 2026-12-05 a cut run's two SGLang servers held 38 GiB through the next run)
    command, env, records = _benchmark(tmp_path, "--rates", "2", "--seconds", "120")
    bench = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while len(list(records.glob("*.json"))) < 2 and time.monotonic() < deadline:
            assert bench.poll() is None, bench.stdout.read().decode()[-3000:]  # type: ignore[union-attr]
            time.sleep(0.5)
        pids = [json.loads(f.read_text())["pid"] for f in records.glob("*.json")]
        assert len(pids) == 2 and not any(ended(pid) for pid in pids)
        bench.send_signal(signal.SIGTERM)
        bench.wait(timeout=90)
    finally:
        if bench.poll() is None:
            bench.kill()
    deadline = time.monotonic() + 10
    while not all(ended(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(ended(pid) for pid in pids), "a server outlived the cut run"
    assert bench.returncode == 128 + signal.SIGTERM
