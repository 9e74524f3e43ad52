"""`kvcached serve` with MLX models (mlx[cpu]): the same router in front of serve-mlx workers.

One `kvcached serve` process (the product command) with two tiny random MLX models, one
serve-mlx worker each: alpha (`sleep: weights`: its worker unloads the weights and keeps
running) and beta (`sleep: unload`: its worker stops). Greedy answers through the router
equal the worker's own, and equal again after each kind of sleep; the two models answer
differently, so a request routed to the wrong model would be seen (that KV corruption
changes serve-mlx's tokens is shown by tests/test_mlx_serve_batching.py and
tests/test_mlx_lm_cache.py).
"""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

pytest.importorskip("mlx_lm", reason="the MLX tests need mlx[cpu] and mlx-lm (make setup)")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
yaml = pytest.importorskip("yaml")

from serve_harness import ServeProcess  # noqa: E402  (tests/, on sys.path under pytest)

from kvcached.apps.serve.supervisor import group_alive  # noqa: E402
from kvcached.engines.mlx_lm.tiny import build_model  # noqa: E402

pytestmark = pytest.mark.slow

MiB = 1 << 20
PROMPTS = ["the quick brown fox", "a tiny model on a laptop", "elastic memory for KV"]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    root = tmp_path_factory.mktemp("serve-mlx")
    serve = ServeProcess(
        root,
        {
            "budget": 512 * MiB,
            "models": {
                "alpha": {
                    "engine": "mlx",
                    "path": str(build_model(root / "a", "qwen3", seed=1)),
                    "sleep": "weights",
                    "keep_alive": 2,
                },
                "beta": {
                    "engine": "mlx",
                    "path": str(build_model(root / "b", "llama", seed=2)),
                    "sleep": "unload",
                    "keep_alive": 2,
                },
            },
        },
    )
    try:
        serve.wait_all_started(["alpha", "beta"], 120)
        yield serve
    finally:
        serve.stop()


def _answer(base: str, model: str, prompt: str) -> str:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", timeout=120, max_retries=0)
    out = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
    assert out.usage is not None and out.usage.completion_tokens == 12
    return out.choices[0].text


def test_answers_through_the_router_equal_the_workers_own(served: ServeProcess) -> None:
    for prompt in PROMPTS:
        routed = _answer(served.base, "alpha", prompt)  # wakes alpha if it slept
        endpoint = served.state()["alpha"]["endpoint"]
        assert endpoint and endpoint != served.base
        assert _answer(endpoint, "alpha", prompt) == routed
    assert [_answer(served.base, "beta", p) for p in PROMPTS] != [
        _answer(served.base, "alpha", p) for p in PROMPTS
    ], "two models with other weights answered alike: a misrouted request would pass"


def test_weights_sleep_keeps_the_worker_and_gives_the_same_answers(served: ServeProcess) -> None:
    before = [_answer(served.base, "alpha", p) for p in PROMPTS]
    asleep = served.wait("alpha", lambda m: m["state"] == "asleep", "asleep", 30)
    assert asleep["pid"] is not None and asleep["kv_reserved"] == 0  # weights given back
    assert [_answer(served.base, "alpha", p) for p in PROMPTS] == before
    now = served.state()["alpha"]
    assert now["pid"] == asleep["pid"] and now["wakes_total"] >= 1


def test_unload_stops_the_worker_and_the_next_request_starts_it(served: ServeProcess) -> None:
    before = _answer(served.base, "beta", PROMPTS[0])
    old = served.state()["beta"]["pid"]
    served.wait("beta", lambda m: m["pid"] is None, "unloaded", 30)
    assert not group_alive(old)
    assert _answer(served.base, "beta", PROMPTS[0]) == before
    assert served.state()["beta"]["pid"] not in (None, old)


def test_sigterm_leaves_no_worker(served: ServeProcess) -> None:
    pids = [m["pid"] for m in served.state().values() if m["pid"] is not None]
    assert pids
    served.process.send_signal(signal.SIGTERM)
    assert served.process.wait(60) == 0
    assert not any(group_alive(pid) for pid in pids)
