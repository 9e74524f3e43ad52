"""`serve-mlx` over HTTP on 127.0.0.1, driven through the `openai` client: two tiny
models, concurrent streams to both, their ledger rows while they run and after."""

from __future__ import annotations

import json
import platform
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("openai")
pytest.importorskip("uvicorn")

import httpx
import openai
from mlx_serving import Running, tiny_models, wait_for

from kvcached.engines.mlx_lm.serve import ModelDoesNotFit, MultiModelServer
from kvcached.engines.mlx_lm.tiny import build_model
from kvcached.errors import InvalidArgument
from kvcached.ledger import Ledger


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return tiny_models(tmp_path_factory.mktemp("models"))


@pytest.fixture
def running(model_dirs: list[str], ledger_dir: Path) -> Iterator[Running]:
    instance = Running(MultiModelServer(model_dirs, keep_alive_s=3600, budget="1GiB"))
    yield instance
    instance.stop()


def test_models_are_listed_and_each_is_a_ledger_row(running: Running) -> None:
    assert sorted(m.id for m in running.client.models.list().data) == ["alpha", "beta"]
    rows = running.rows()
    for name in ("alpha", "beta"):
        row = rows[f"serve-mlx/{name}"]
        assert row.engine == "mlx-lm" and row.reserved > 0 and row.used == 0  # weights only


def test_concurrent_streams_to_both_models_hold_kv_while_they_run(running: Running) -> None:
    weights = {name: row.reserved for name, row in running.rows().items()}
    streams = {
        name: running.client.completions.create(
            model=name, prompt="the quick brown fox", max_tokens=64, stream=True
        )
        for name in ("alpha", "beta")
    }
    firsts = {name: next(iter(stream)) for name, stream in streams.items()}  # both running
    during = running.rows()
    for name in ("alpha", "beta"):
        assert firsts[name].model == name
        row = during[f"serve-mlx/{name}"]
        assert row.used > 0 and row.reserved == weights[f"serve-mlx/{name}"] + row.used
    texts: dict[str, str] = {}
    errors: list[BaseException] = []

    def drain(name: str) -> None:
        try:
            texts[name] = firsts[name].choices[0].text + "".join(
                chunk.choices[0].text for chunk in streams[name]
            )
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=drain, args=(name,)) for name in streams]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors and set(texts) == {"alpha", "beta"}
    assert all(texts.values())
    wait_for(lambda: all(r.used == 0 for r in running.rows().values()), "idle KV to return")
    assert {name: row.reserved for name, row in running.rows().items()} == weights


def test_kvctl_lists_and_limits_the_model_rows(running: Running) -> None:
    from typer.testing import CliRunner

    from kvcached.apps.kvctl import app as kvctl

    runner = CliRunner()
    listed = runner.invoke(kvctl, ["list", "--json", "--backend", "mlx"])
    assert listed.exit_code == 0, listed.output
    report = json.loads(listed.stdout)
    assert report["key"] == "mlx-0"
    names = {row["name"] for row in report["instances"]}
    assert names == {"serve-mlx/alpha", "serve-mlx/beta"}
    limited = runner.invoke(kvctl, ["limit", "serve-mlx/alpha", "1MiB", "--backend", "mlx"])
    assert limited.exit_code == 0, limited.output
    assert running.rows()["serve-mlx/alpha"].limit == 1 << 20


def test_chat_and_plain_completions_answer(running: Running) -> None:
    chat = running.client.chat.completions.create(
        model="beta", messages=[{"role": "user", "content": "hello"}], max_tokens=8
    )
    assert chat.choices[0].message.role == "assistant" and chat.model == "beta"
    plain = running.client.completions.create(model="alpha", prompt="memory", max_tokens=8)
    assert plain.usage is not None and 0 < plain.usage.completion_tokens <= 8


def test_kv_the_budget_refuses_is_a_503_that_holds_nothing(running: Running) -> None:
    row = running.rows()["serve-mlx/alpha"]
    running.server.models["alpha"].pool.set_limit(row.reserved + (256 << 10))  # weights + 256 KiB
    client = running.client.with_options(max_retries=0)
    for stream in (False, True):
        with pytest.raises(openai.APIStatusError, match="stop admitting or preempt") as caught:
            client.completions.create(model="alpha", prompt="dog", max_tokens=4000, stream=stream)
        assert caught.value.status_code == 503
        assert running.rows()["serve-mlx/alpha"].reserved == row.reserved  # nothing held
    small = client.completions.create(model="alpha", prompt="dog", max_tokens=4)
    assert small.usage is not None and small.usage.completion_tokens > 0  # what fits runs


def test_unknown_model_is_a_404_listing_the_served_models(running: Running) -> None:
    with pytest.raises(openai.NotFoundError, match="served models: alpha, beta"):
        running.client.completions.create(model="gamma", prompt="hi", max_tokens=4)


def test_idle_model_unloads_after_keep_alive_and_reloads(
    model_dirs: list[str], ledger_dir: Path
) -> None:
    running = Running(MultiModelServer(model_dirs[:1], keep_alive_s=0.2, budget="1GiB"))
    try:
        wait_for(lambda: running.rows()["serve-mlx/alpha"].reserved == 0, "weights to unload")
        assert [m.model_dump()["loaded"] for m in running.client.models.list().data] == [False]
        answer = running.client.completions.create(model="alpha", prompt="dog", max_tokens=4)
        assert answer.choices[0].finish_reason in {"length", "stop"}
    finally:
        running.stop()


def test_a_model_unloaded_when_its_request_ends_still_answers_the_request(
    model_dirs: list[str], ledger_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # keep_alive 0 unloads the model as soon as its last request ends, which can be
    # before the answer is written (the CI flake of 2026-12-05: a 500, the tokenizer
    # gone). Here the answer waits until the model is gone, every time
    running = Running(MultiModelServer(model_dirs[:1], keep_alive_s=3600, budget="1GiB"))
    served = running.server.models["alpha"]
    admit = MultiModelServer.admit

    def admit_then_unload(self: MultiModelServer, *args: Any, **kwargs: Any) -> Any:
        admitted = admit(self, *args, **kwargs)
        wait_for(lambda: served.tokenizer is None, "keep_alive 0 to unload alpha")
        return admitted

    monkeypatch.setattr(MultiModelServer, "admit", admit_then_unload)
    try:
        for stream in (False, True):
            answer = running.client.completions.create(
                model="alpha", prompt="dog", max_tokens=2, stream=stream,
                extra_body={"keep_alive": 0},
            )  # fmt: skip
            chunks = list(answer) if stream else [answer]
            assert chunks[-1].choices[0].finish_reason in {"length", "stop"}
            assert served.model is None
    finally:
        running.stop()


def test_budget_too_small_for_a_model_is_refused_at_start(
    model_dirs: list[str], ledger_dir: Path
) -> None:
    with pytest.raises(ModelDoesNotFit, match=r"needs \d+ bytes of weights, but the budget"):
        MultiModelServer(model_dirs, budget="64KiB")
    ledger = Ledger.open("mlx-0", create=False)  # it exists; no row of the refused server
    try:
        assert ledger.rows() == []
    finally:
        ledger.close()


def test_a_folder_that_is_not_a_model_is_refused(tmp_path: Path, ledger_dir: Path) -> None:
    with pytest.raises(InvalidArgument, match="not an mlx-lm model folder"):
        MultiModelServer([str(tmp_path)])


# ------------------------------------------------- regressions of issue 24's defects
def post(running: Running, path: str, body: Any) -> httpx.Response:
    """A raw POST (the openai client would refuse to send some of these bodies)."""
    url = str(running.client.base_url).rstrip("/") + path
    if not isinstance(body, bytes):  # ASCII JSON: httpx's own would not encode a lone surrogate
        body = json.dumps(body).encode()
    return httpx.post(url, content=body, headers={"Content-Type": "application/json"}, timeout=60)


def test_requests_without_a_seed_sample_different_text(running: Running) -> None:
    texts = [
        running.client.completions.create(
            model="alpha", prompt="dog", max_tokens=16, temperature=50
        )
        .choices[0]
        .text
        for _ in range(3)
    ]
    assert len(set(texts)) == 3, texts


def test_the_same_seed_samples_the_same_text_and_another_seed_another(running: Running) -> None:
    def sample(seed: int) -> str:
        answer = running.client.completions.create(
            model="alpha", prompt="dog", max_tokens=16, temperature=50, seed=seed
        )
        return answer.choices[0].text

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def streamed(running: Running, **request: Any) -> str:
    return "".join(
        chunk.choices[0].text for chunk in running.client.completions.create(stream=True, **request)
    )


def test_streamed_text_equals_the_whole_text(running: Running) -> None:
    prompts = ["dog", "the quick brown fox", "memory", "pages are charged", "a", "cache"]
    requests: list[dict[str, Any]] = [
        {"prompt": prompt, "max_tokens": 24}
        for prompt in prompts  # greedy
    ] + [{"prompt": "dog", "max_tokens": 32, "temperature": 50, "seed": s} for s in range(14)]
    whole_texts = []
    for request in requests:
        whole = running.client.completions.create(model="alpha", **request).choices[0].text
        assert streamed(running, model="alpha", **request) == whole, request
        whole_texts.append(whole)
    # the case that broke: tokens that split a multi-byte character were sampled
    assert any(any(ord(c) > 127 and c != "\ufffd" for c in text) for text in whole_texts)


def test_a_character_split_across_tokens_streams_whole(model_dirs: list[str]) -> None:
    import mlx_lm

    from kvcached.engines.mlx_lm.sampling import TokenStep
    from kvcached.engines.mlx_lm.serve import _pieces

    _, tokenizer = mlx_lm.load(model_dirs[0])
    text = "naïve 日本 ok"
    tokens = list(tokenizer.encode(text))
    assert len(tokens) > len(text)  # byte-level: ï and 日本 span several tokens each
    reasons = [None] * (len(tokens) - 1) + ["length"]
    steps = [TokenStep(t, r) for t, r in zip(tokens, reasons, strict=True)]
    pieces = list(_pieces(tokenizer, iter(steps)))
    assert "".join(piece.text for piece in pieces) == text
    assert all("\ufffd" not in piece.text for piece in pieces)
    assert pieces[-1].finish == "length"


BAD_BODIES: list[tuple[str, Any, int, str | None]] = [
    # (path, body, status, param)
    ("/completions", {"model": "alpha", "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/completions", {"model": "alpha", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/completions", {"model": "alpha", "prompt": "hi", "max_tokens": True}, 400, "max_tokens"),
    ("/completions", {"model": "alpha", "prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ("/completions", {"model": "alpha", "prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("/completions", {"model": "alpha", "prompt": 5}, 400, "prompt"),
    ("/completions", {"model": "alpha", "prompt": ""}, 400, "prompt"),
    ("/completions", {"model": "alpha"}, 400, "prompt"),
    ("/completions", {"prompt": "hi"}, 400, "model"),
    ("/completions", {"model": 5, "prompt": "hi"}, 400, "model"),
    ("/completions", {"model": "gamma", "prompt": "hi"}, 404, "model"),
    ("/completions", [1, 2], 400, None),
    ("/completions", b"{not json", 400, None),
    ("/chat/completions", {"model": "beta", "messages": [5]}, 400, "messages[0]"),
    ("/chat/completions", {"model": "beta", "messages": [{"role": "user"}]}, 400, "messages[0]"),
    (
        "/chat/completions",
        {"model": "beta", "messages": [{"content": "hi"}]},
        400,
        "messages[0].role",
    ),
    ("/chat/completions", {"model": "beta", "messages": []}, 400, "messages"),
    ("/chat/completions", {"model": "beta", "messages": "hi"}, 400, "messages"),
    (
        "/chat/completions",
        {"model": "beta", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "messages[0].content",
    ),
    (
        "/chat/completions",
        {"model": "beta", "messages": [{"role": "user", "content": "hi"}], "seed": 1.5},
        400,
        "seed",
    ),
    # a lone surrogate, valid JSON but no character: the tokenizer raised, a 500
    ("/completions", {"model": "alpha", "prompt": "hi \ud800"}, 400, "prompt"),
    (
        "/chat/completions",
        {"model": "beta", "messages": [{"role": "user", "content": "\udc00"}]},
        400,
        "messages[0].content",
    ),
    (
        "/chat/completions",
        {
            "model": "beta",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}],
        },
        400,
        "messages[0].content",
    ),
]


def test_bad_input_is_an_openai_error_never_a_500(running: Running) -> None:
    for path, body, status, param in BAD_BODIES:
        answer = post(running, path, body)
        assert answer.status_code == status, (body, answer.text)
        error = answer.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, body
        assert error["type"] == "invalid_request_error" and error["param"] == param, body
        assert error["message"], body


def test_chat_content_parts_are_flattened_to_text(running: Running) -> None:
    seen: list[Any] = []
    beta = running.server.models["beta"]
    template = beta.tokenizer.apply_chat_template

    def spy(messages: Any, **kwargs: Any) -> Any:
        seen.append(messages)
        return template(messages, **kwargs)

    beta.tokenizer.apply_chat_template = spy
    parts = [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]
    answer = post(
        running,
        "/chat/completions",
        {"model": "beta", "messages": [{"role": "user", "content": parts}], "max_tokens": 2},
    )
    assert answer.status_code == 200, answer.text
    assert seen == [[{"role": "user", "content": "hello\nthere"}]]


def test_a_prompt_longer_than_the_context_is_a_400(tmp_path: Path, ledger_dir: Path) -> None:
    short = build_model(tmp_path / "short", "llama", seed=3, context=64)
    running = Running(MultiModelServer([str(short)], keep_alive_s=3600, budget="1GiB"))
    try:
        too_long = {"model": "short", "prompt": "x" * 70, "max_tokens": 4}
        answer = post(running, "/completions", too_long)
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["code"] == "context_length_exceeded"
        # the prompt fits but prompt + max_tokens does not
        answer = post(running, "/completions", {**too_long, "prompt": "x" * 40, "max_tokens": 40})
        assert answer.status_code == 400 and "context length of 64" in answer.text
        # without max_tokens, the default is cut to what the context leaves
        fits = post(running, "/completions", {"model": "short", "prompt": "x" * 60})
        assert fits.status_code == 200 and fits.json()["usage"]["completion_tokens"] <= 4
    finally:
        running.stop()


class SlowPrefill:
    """A model whose prefill steps (more than one token) are logged and slowed."""

    def __init__(self, model: Any, events: list[str], delay_s: float) -> None:
        self.model, self.events, self.delay_s = model, events, delay_s

    def __call__(self, tokens: Any, cache: Any = None, **kwargs: Any) -> Any:
        if tokens.shape[1] > 1:
            self.events.append("alpha prefill step")
            time.sleep(self.delay_s)
        return self.model(tokens, cache=cache, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def test_a_long_prefill_on_one_model_lets_another_model_answer(running: Running) -> None:
    events: list[str] = []
    alpha = running.server.models["alpha"]
    alpha.model = SlowPrefill(alpha.model, events, delay_s=0.01)
    running.server.prefill_chunk = 32
    long_prompt = "the quick brown fox " * 75  # 1,500 tokens: 47 chunks
    done: list[Any] = []
    worker = threading.Thread(
        target=lambda: done.append(
            running.client.completions.create(model="alpha", prompt=long_prompt, max_tokens=1)
        )
    )
    worker.start()
    wait_for(lambda: events, "alpha's prefill to start")
    running.client.completions.create(model="beta", prompt="dog", max_tokens=3)
    events.append("beta answered")
    worker.join(timeout=120)
    assert done and done[0].usage.prompt_tokens == 1500
    assert "alpha prefill step" in events[events.index("beta answered") :], (
        "beta waited for the whole of alpha's prefill"
    )


def test_stopping_the_server_ends_a_long_prefill_between_chunks(running: Running) -> None:
    events: list[str] = []
    alpha = running.server.models["alpha"]
    alpha.model = SlowPrefill(alpha.model, events, delay_s=0.01)
    running.server.prefill_chunk = 32
    client = running.client.with_options(max_retries=0)
    errors: list[BaseException] = []

    def request() -> None:
        try:
            client.completions.create(model="alpha", prompt="fox " * 375, max_tokens=1)
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=request)
    worker.start()
    wait_for(lambda: events, "alpha's prefill to start")
    running.server.stop()
    worker.join(timeout=120)
    assert len(events) < 47  # it did not prefill to the end
    assert isinstance(errors[0], openai.APIStatusError) and errors[0].status_code == 503
    assert "shutting down" in str(errors[0])


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_hangs_up_during_the_prefill_stops_it(
    running: Running, stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Defect 4's other half: a client gone before its first token (a read timeout, a
    closed tab) must not keep its model prefilling a prompt nobody waits for."""
    events: list[str] = []
    alpha = running.server.models["alpha"]
    alpha.model = SlowPrefill(alpha.model, events, delay_s=0.02)
    running.server.prefill_chunk = 32
    body = {"model": "alpha", "prompt": "the quick brown fox " * 75, "max_tokens": 1,
            "stream": stream}  # fmt: skip
    base = httpx.URL(str(running.client.base_url))
    caplog.set_level("INFO", logger="kvcached")
    payload = json.dumps(body).encode()
    head = (
        f"POST {base.path.rstrip('/')}/completions HTTP/1.1\r\nHost: {base.host}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    with socket.create_connection((base.host, base.port)) as client:
        client.sendall(head.encode() + payload)
        wait_for(lambda: events, "alpha's prefill to start")
    # hung up after its first chunk (1,500 tokens: 47 chunks of 20 ms)
    wait_for(lambda: not alpha.active, "alpha's request to end")
    assert len(events) < 47, f"all {len(events)} prefill chunks ran for a client that left"
    wait_for(lambda: "status=499" in caplog.text, "the request logged as the client's 499")
    # the model serves the next request as before
    out = running.client.completions.create(model="alpha", prompt="dog", max_tokens=3)
    assert out.usage is not None and out.usage.completion_tokens == 3


def test_a_budget_an_existing_ledger_ignores_is_warned_once(
    model_dirs: list[str], ledger_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    MultiModelServer(model_dirs, budget="1GiB", preload=False).close()
    with caplog.at_level("WARNING"):
        MultiModelServer(model_dirs, budget="1GiB", preload=False).close()  # the same: quiet
        assert not caplog.records
        MultiModelServer(model_dirs, budget="2GiB", preload=False).close()
    warnings = [r.getMessage() for r in caplog.records if "--budget 2GiB" in r.getMessage()]
    assert len(warnings) == 1, caplog.text  # two models, one warning
    assert "is ignored" in warnings[0] and "kvctl budget" in warnings[0]


def test_a_model_listed_unloaded_holds_no_charge(
    running: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlx.core as mx

    seen: list[tuple[bool, int]] = []
    clear_cache = mx.clear_cache

    def probe() -> None:  # mid-unload: what a listing shows against what is charged
        listed = {m.id: m.model_dump()["loaded"] for m in running.client.models.list().data}
        seen.append((listed["alpha"], running.rows()["serve-mlx/alpha"].reserved))
        clear_cache()

    monkeypatch.setattr(mx, "clear_cache", probe)
    assert running.server.models["alpha"].unload()
    monkeypatch.undo()
    assert seen and all(loaded or reserved == 0 for loaded, reserved in seen), seen
    assert running.rows()["serve-mlx/alpha"].reserved == 0
    assert [m.model_dump()["loaded"] for m in running.client.models.list().data] == [False, True]


def test_unloading_gives_freed_memory_back_to_the_os(
    running: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvcached.engines.mlx_lm import serve

    if sys.platform.startswith("linux") and "glibc" in platform.libc_ver()[0]:
        assert serve.release_free_memory()  # the real malloc_trim(0) ran
    calls: list[str] = []
    monkeypatch.setattr(serve, "release_free_memory", lambda: calls.append("trim") or True)
    assert running.server.models["beta"].unload()
    assert calls == ["trim"]
