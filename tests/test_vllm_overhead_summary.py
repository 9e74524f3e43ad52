"""benchmarks/vllm_overhead.py's summary on the CPU machine, its engine processes stood
in for (vLLM's start takes minutes here): with `--second-baseline` the second vLLM-alone
process starts only once kvcached's engine has stopped, its batches stay out of the
pairs, and the summary says whether vLLM alone gave its own first process's tokens
again; and every summary says whether vLLM alone's pool held the batch."""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import vllm_overhead  # noqa: E402


class FakeEngines:
    """Engine processes by their environment: vLLM alone's n-th process answers with
    `alone[n]`'s checksum, kvcached's with `kvcached`; it also checks that no more than
    two engines are ever alive at once (the device holds two)."""

    def __init__(self, alone: list[str], kvcached: str) -> None:
        self.alone, self.kvcached = list(alone), kvcached
        self.live: list[Any] = []
        self.started: list[str] = []
        self.pool = 8192  # vLLM alone's KV tokens

    def __call__(self, argv: list[str], env: dict[str, str], log: Any) -> Any:
        fakes = self
        on = env["ENABLE_KVCACHED"] == "1"
        digest = self.kvcached if on else self.alone.pop(0)
        assert len(self.live) < 2, "a third engine started while two were alive"

        class Engine:
            batches = 0

            def answer(self, prefix: str) -> dict[str, Any]:
                return {"startup_s": 1.0, "pool_tokens": fakes.pool if not on else 10**7,
                        "batch_kv_tokens": 4096}  # fmt: skip

            def run_batch(self) -> dict[str, Any]:
                self.batches += 1
                speed = 100.0 if on else 101.0
                return {"batch": self.batches - 1, "tokens": 10, "seconds": 0.1,
                        "tokens_per_s": speed, "checksum": digest}  # fmt: skip

            def stop(self) -> None:
                if self in fakes.live:
                    fakes.live.remove(self)

        engine = Engine()
        self.live.append(engine)
        self.started.append("kvcached" if on else "vllm")
        return engine


def _run(monkeypatch: pytest.MonkeyPatch, fakes: FakeEngines, second: bool) -> dict[str, Any]:
    monkeypatch.setattr(vllm_overhead, "Engine", fakes)
    a = argparse.Namespace(seconds=None, repeats=4, second_baseline=second, budget="1GiB")
    records = vllm_overhead.measure(a, "v1", [], io.StringIO(), None)
    summary = vllm_overhead.summarize("v1", records)
    assert summary is not None and not fakes.live  # every engine stopped
    # the first pair maps kvcached's memory and is left out; the second process's too
    assert summary["pairs"] == 3 and summary["batches"] == 8
    return summary


def test_vllm_alone_agreeing_with_itself_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    fakes = FakeEngines(alone=["aaaa", "aaaa"], kvcached="aaaa")
    summary = _run(monkeypatch, fakes, second=True)
    assert fakes.started == ["vllm", "kvcached", "vllm"]
    assert summary["greedy_equal"] is True and summary["second_baseline_equal"] is True


def test_vllm_alone_differing_from_itself_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    fakes = FakeEngines(alone=["aaaa", "bbbb"], kvcached="cccc")
    summary = _run(monkeypatch, fakes, second=True)
    assert summary["greedy_equal"] is False and summary["second_baseline_equal"] is False


def test_kvcached_alone_differing_is_told_from_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    # vLLM alone repeats itself, kvcached does not: the mismatch is kvcached's to explain
    fakes = FakeEngines(alone=["aaaa", "aaaa"], kvcached="cccc")
    summary = _run(monkeypatch, fakes, second=True)
    assert summary["greedy_equal"] is False and summary["second_baseline_equal"] is True


def test_without_the_option_no_second_process_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    fakes = FakeEngines(alone=["aaaa"], kvcached="aaaa")
    summary = _run(monkeypatch, fakes, second=False)
    assert fakes.started == ["vllm", "kvcached"]
    assert "second_baseline_equal" not in summary


@pytest.mark.parametrize(("pool", "holds"), [(8192, True), (4095, False)])
def test_the_summary_says_whether_vllm_alones_pool_held_the_batch(
    monkeypatch: pytest.MonkeyPatch, pool: int, holds: bool
) -> None:
    fakes = FakeEngines(alone=["aaaa"], kvcached="aaaa")
    fakes.pool = pool
    summary = _run(monkeypatch, fakes, second=False)
    assert summary["baseline_pool_tokens"] == pool and summary["batch_kv_tokens"] == 4096
    assert summary["baseline_pool_holds_batch"] is holds


def test_the_batch_is_counted_in_whole_blocks() -> None:
    class Cache:
        num_gpu_blocks, block_size = 100, 16

    llm = type("LLM", (), {})()
    llm.llm_engine = type(
        "Engine", (), {"vllm_config": type("Config", (), {"cache_config": Cache})}
    )
    a = argparse.Namespace(max_tokens=5)
    # 10 + 5 tokens take one block of 16, 20 + 5 take two
    assert vllm_overhead.pool_fit(llm, [10, 20], a) == {"pool_tokens": 1600, "batch_kv_tokens": 48}
    assert vllm_overhead.pool_fit(object(), [10], a) == {}  # no cache config: no claim
