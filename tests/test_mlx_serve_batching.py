"""`serve-mlx` decodes the requests to one model together, and reuses cached prefixes
(Note [batched decoding], Note [prompt cache] in engines/mlx_lm/batching.py), over
HTTP through the `openai` client on a tiny random model (issue 24)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from mlx_serving import Running, tiny_models, wait_for

from kvcached.engines.mlx_lm import batching, serve
from kvcached.engines.mlx_lm.serve import MultiModelServer

PROMPTS = [
    "the quick brown fox",
    "memory follows use and idle models",
    "several models share one budget on one machine",
    "pages are charged to the ledger before",
]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return tiny_models(tmp_path_factory.mktemp("models"))


@contextlib.contextmanager
def _running(
    model_dirs: list[str], tmp_path_factory: pytest.TempPathFactory, **options: Any
) -> Iterator[Running]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVCACHED_LEDGER_DIR", str(tmp_path_factory.mktemp("ledger")))
        instance = Running(
            MultiModelServer(model_dirs[:1], keep_alive_s=3600, budget="1GiB", **options)
        )
        try:
            yield instance
        finally:
            instance.stop()


@pytest.fixture(scope="module")
def running(model_dirs: list[str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    with _running(model_dirs, tmp_path_factory) as instance:
        yield instance


@pytest.fixture(scope="module")
def cached(model_dirs: list[str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    """A server that keeps the KV of 3 finished requests for prefix reuse."""
    with _running(model_dirs, tmp_path_factory, prompt_cache_size=3) as instance:
        yield instance


def tokens_of(running: Running, prompt: str, **request: Any) -> tuple[list[str], str]:
    """(tokens, text) of a greedy completion of alpha (`logprobs=0` lists its tokens)."""
    body = {"model": "alpha", "prompt": prompt, "max_tokens": 24, "logprobs": 0, **request}
    choice = running.client.completions.create(**body).choices[0]
    assert choice.logprobs is not None and choice.logprobs.tokens is not None
    return list(choice.logprobs.tokens), choice.text


def together(running: Running, calls: list[Callable[[], Any]]) -> list[Any]:
    """Run `calls` concurrently, all of them queued before the first decode step: the
    test holds the MLX lock until each has reached its model's scheduler."""
    served = running.server.models["alpha"]
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []

    def call(i: int) -> None:
        try:
            results[i] = calls[i]()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(calls))]
    with serve._MLX_LOCK:
        for thread in threads:
            thread.start()
        wait_for(lambda: served.active >= len(calls) or bool(errors), "requests to queue")
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    return results


def scheduler(running: Running) -> batching.BatchScheduler:
    return running.server._schedulers["alpha"]


def test_greedy_tokens_alone_equal_tokens_in_a_batch_of_four(running: Running) -> None:
    alone = [tokens_of(running, p) for p in PROMPTS]
    assert len({tuple(t) for t, _ in alone}) == len(PROMPTS)  # four different answers
    before = dict(scheduler(running).steps)
    batched = together(running, [lambda p=p: tokens_of(running, p) for p in PROMPTS])
    steps = scheduler(running).steps
    shortest = min(len(t) for t, _ in alone)  # an end-of-sequence token may end one early
    assert steps.get(4, 0) - before.get(4, 0) >= max(1, shortest - len(PROMPTS))  # as one batch
    assert batched == alone


def test_the_comparison_can_fail_rows_whose_kv_are_swapped(
    running: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    alone = [tokens_of(running, p) for p in PROMPTS]
    real = batching.fetch_rows

    def swapped(view: Any, keys: Any, values: Any) -> tuple[Any, Any]:
        k, v = real(view, keys, values)
        return k[::-1], v[::-1]  # row i attends to row B-1-i's KV

    monkeypatch.setattr(batching, "fetch_rows", swapped)
    for _ in range(5):  # on a loaded machine the four may not all overlap: try again
        before = dict(scheduler(running).steps)
        batched = together(running, [lambda p=p: tokens_of(running, p) for p in PROMPTS])
        if scheduler(running).steps.get(4, 0) > before.get(4, 0):
            break
    assert scheduler(running).steps.get(4, 0) > before.get(4, 0)  # precondition: batched
    assert len({tuple(t) for t, _ in alone}) == len(PROMPTS)  # precondition: rows differ
    assert batched != alone


def test_max_batch_caps_the_rows_of_a_step(
    model_dirs: list[str], tmp_path_factory: pytest.TempPathFactory
) -> None:
    with _running(model_dirs, tmp_path_factory, max_batch=2) as instance:
        alone = [tokens_of(instance, p) for p in PROMPTS]
        batched = together(instance, [lambda p=p: tokens_of(instance, p) for p in PROMPTS])
        assert scheduler(instance).max_batch_seen == 2 and batched == alone


def test_per_request_options_hold_in_a_batch(running: Running) -> None:
    full = tokens_of(running, PROMPTS[0])[1]
    stop = next(full[i : i + 2] for i in range(3, len(full)) if full[i : i + 2].strip())

    def seeded() -> str:
        answer = running.client.completions.create(
            model="alpha", prompt=PROMPTS[1], max_tokens=24, temperature=1.0, seed=7
        )
        return answer.choices[0].text

    def stopped() -> tuple[str, str | None]:
        answer = running.client.completions.create(
            model="alpha", prompt=PROMPTS[0], max_tokens=24, stop=stop
        )
        return answer.choices[0].text, answer.choices[0].finish_reason

    def scored() -> tuple[list[str], list[float]]:
        answer = running.client.completions.create(
            model="alpha", prompt=PROMPTS[2], max_tokens=12, logprobs=3,
            extra_body={"repetition_penalty": 1.5},
        )  # fmt: skip
        logprobs = answer.choices[0].logprobs
        assert logprobs is not None and logprobs.tokens and logprobs.token_logprobs
        assert logprobs.top_logprobs and all(1 <= len(t) <= 3 for t in logprobs.top_logprobs)
        return logprobs.tokens, [float(x) for x in logprobs.token_logprobs]

    def greedy() -> tuple[list[str], str]:
        return tokens_of(running, PROMPTS[3])

    calls: list[Callable[[], Any]] = [seeded, stopped, scored, greedy]
    alone = [call() for call in calls]
    assert alone[1] == (full[: full.index(stop)], "stop")
    for _ in range(5):  # on a loaded machine the four may not all overlap: try again
        before = dict(scheduler(running).steps)
        batched = together(running, calls)
        if scheduler(running).steps.get(4, 0) > before.get(4, 0):
            break
    assert scheduler(running).steps.get(4, 0) > before.get(4, 0)  # precondition: batched
    assert batched[0] == alone[0]  # same seed, same text
    assert batched[1] == alone[1] and batched[3] == alone[3]
    assert batched[2][0] == alone[2][0]
    assert batched[2][1] == pytest.approx(alone[2][1], abs=1e-4)


def test_cancelling_one_request_leaves_the_others_in_its_batch_alone(running: Running) -> None:
    alone = [tokens_of(running, p, max_tokens=48)[1] for p in PROMPTS[1:]]

    def cancelled() -> int:
        stream = running.client.completions.create(
            model="alpha", prompt=PROMPTS[0], max_tokens=400, stream=True
        )
        chunks = 0
        for _ in stream:
            chunks += 1
            if chunks == 3:
                stream.close()  # the client goes away mid-stream
                break
        return chunks

    def whole(prompt: str) -> str:
        return tokens_of(running, prompt, max_tokens=48)[1]

    calls: list[Callable[[], Any]] = [cancelled] + [lambda p=p: whole(p) for p in PROMPTS[1:]]
    results = together(running, calls)
    assert results[0] == 3 and results[1:] == alone
    pool = running.server.models["alpha"].pool
    wait_for(lambda: pool.held_bytes == 0, "the cancelled request's KV to return")
    assert running.server.models["alpha"].active == 0


def test_a_request_the_budget_refuses_waits_for_the_batch_then_runs(running: Running) -> None:
    served = running.server.models["alpha"]
    alone = [tokens_of(running, p, max_tokens=200) for p in PROMPTS[:2]]
    held: list[int] = []
    stream = running.client.completions.create(
        model="alpha", prompt=PROMPTS[0], max_tokens=200, stream=True
    )
    next(iter(stream))
    held.append(served.pool.held_bytes)  # one request's KV
    for _ in stream:
        pass
    row = running.rows()["serve-mlx/alpha"]
    served.pool.set_limit(row.reserved + held[0] + held[0] // 2)  # room for one request
    try:
        steps_before = dict(scheduler(running).steps)
        peak: list[int] = []
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                peak.append(served.pool.held_bytes)
                time.sleep(0.002)

        watcher = threading.Thread(target=watch)
        watcher.start()
        results = together(
            running, [lambda p=p: tokens_of(running, p, max_tokens=200) for p in PROMPTS[:2]]
        )
        done.set()
        watcher.join()
    finally:
        served.pool.set_limit(None)
    assert results == alone  # the refused one waited, then ran to the end
    assert max(peak) <= held[0] + held[0] // 2  # never both at once
    new_steps = {b: n - steps_before.get(b, 0) for b, n in scheduler(running).steps.items()}
    generated = sum(len(tokens) for tokens, _ in alone)  # one step each, one at a time
    assert new_steps.get(2, 0) == 0 and generated <= new_steps.get(1, 0) <= generated + 2


# ------------------------------------------------------------------ prompt cache
LONG = " ".join(PROMPTS * 6)


def prompt_len(running: Running, text: str) -> int:
    return len(running.server.models["alpha"].tokenizer.encode(text))


def clear_cache(running: Running) -> None:
    prefixes = running.server.models["alpha"].prefixes
    assert prefixes is not None
    with serve._MLX_LOCK:
        prefixes.clear()


def test_a_shared_prefix_reuses_the_cached_kv_and_gives_the_same_tokens(
    cached: Running, caplog: pytest.LogCaptureFixture
) -> None:
    clear_cache(cached)
    follow = LONG + " the quick brown"
    cold = tokens_of(cached, follow)  # nothing cached shares its prefix... but it is kept
    clear_cache(cached)
    first = cached.client.completions.create(model="alpha", prompt=LONG, max_tokens=8)
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    with caplog.at_level(logging.INFO, logger="kvcached.serve_mlx"):
        warm = cached.client.completions.create(
            model="alpha", prompt=follow, max_tokens=24, logprobs=0
        )
    assert warm.usage is not None and warm.usage.prompt_tokens_details is not None
    reused = warm.usage.prompt_tokens_details.cached_tokens
    assert reused is not None and prompt_len(cached, LONG) - 2 <= reused < prompt_len(
        cached, follow
    )
    assert f"cached_tokens={reused} " in caplog.text
    logprobs = warm.choices[0].logprobs
    assert logprobs is not None and (list(logprobs.tokens or []), warm.choices[0].text) == cold
    again = cached.client.completions.create(model="alpha", prompt=follow, max_tokens=4)
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens == prompt_len(cached, follow) - 1


def test_the_reuse_check_can_fail_a_corrupted_cached_prefix_changes_the_tokens(
    cached: Running,
) -> None:
    import mlx.core as mx

    clear_cache(cached)
    follow = LONG + " the quick brown"
    cold = tokens_of(cached, follow)
    clear_cache(cached)
    cached.client.completions.create(model="alpha", prompt=LONG, max_tokens=8)
    prefixes = cached.server.models["alpha"].prefixes
    assert prefixes is not None and len(prefixes) == 1
    with serve._MLX_LOCK:
        for entry in prefixes._entries.values():
            for cache in entry.caches:
                keys, values, offset = cache.state
                noise = mx.random.normal(keys.shape, key=mx.random.key(3)).astype(keys.dtype)
                cache.state = (keys + 4 * noise, values, offset)
                mx.eval(*cache.state[:2])  # here: MLX streams belong to their thread
    warm = tokens_of(cached, follow)
    assert warm != cold


def test_cached_prefixes_are_charged_evicted_when_memory_is_needed_and_on_unload(
    cached: Running,
) -> None:
    served = cached.server.models["alpha"]
    prefixes = served.prefixes
    assert prefixes is not None
    clear_cache(cached)
    assert served.pool.held_bytes == 0
    for prompt in PROMPTS:  # four prompts, three kept: the least recently used goes
        cached.client.completions.create(model="alpha", prompt=prompt, max_tokens=8)
    assert len(prefixes) == 3
    oldest = tuple(served.tokenizer.encode(PROMPTS[0]))
    assert not any(key[: len(oldest)] == oldest for key in prefixes._entries)
    row = cached.rows()["serve-mlx/alpha"]
    assert served.pool.held_bytes == prefixes.nbytes > 0 and row.used == prefixes.nbytes
    evictions = served.pool.stats["prefix_evictions"]
    served.pool.set_limit(row.reserved - prefixes.nbytes + (256 << 10))  # weights + 256 KiB
    try:
        answer = cached.client.completions.create(model="alpha", prompt="dog", max_tokens=8)
        assert answer.usage is not None and answer.usage.completion_tokens > 0
    finally:
        served.pool.set_limit(None)
    assert served.pool.stats["prefix_evictions"] > evictions and len(prefixes) < 3
    assert cached.post("/api/unload", {"model": "alpha"}).json()["status"] == "unloaded"
    assert len(prefixes) == 0 and served.pool.held_bytes == 0
    row = cached.rows()["serve-mlx/alpha"]
    assert row.used == 0 and row.reserved == 0
    tokens_of(cached, PROMPTS[0])  # it reloads and serves again


def test_a_cached_prefix_keeps_only_the_room_its_tokens_need(cached: Running) -> None:
    served = cached.server.models["alpha"]
    prefixes = served.prefixes
    assert prefixes is not None
    clear_cache(cached)
    stream = cached.client.completions.create(
        model="alpha", prompt=PROMPTS[1], max_tokens=4000, stream=True
    )
    next(iter(stream))
    running_bytes = served.pool.held_bytes  # room for prompt + 4000 tokens
    stream.close()
    wait_for(lambda: len(prefixes) == 1 and served.active == 0, "the cancelled KV to be cached")
    assert 0 < prefixes.nbytes == served.pool.held_bytes < running_bytes // 8
    again = cached.client.completions.create(model="alpha", prompt=PROMPTS[1], max_tokens=4)
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens == prompt_len(cached, PROMPTS[1]) - 1
