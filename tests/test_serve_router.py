"""The router of `kvcached serve` against stand-ins: no engine process, real sockets.

The router runs under uvicorn on an ephemeral port, over a stand-in `Models` (below)
whose handles point at a stand-in engine: a small Starlette app under uvicorn that
answers OpenAI-shaped bodies and streams tokens, gated on events so a test can tell
"relayed as it came" from "gathered, then sent". The engines that die are raw sockets
(`DyingEngine`), which close a connection exactly where a test wants it closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvcached.apps.serve.router import MAX_TOKENS_CAP, build_router, parse_body
from kvcached.apps.serve.state import (
    ModelHandle,
    ModelState,
    ModelStats,
    ModelUnavailable,
    ServeSnapshot,
    UnknownModel,
)

KEY = "sk-test-key"


# --- stand-ins -------------------------------------------------------------------------


class FakeHandle:
    """A model as the router sees it: `serving()` yields `url`, or raises `unavailable`,
    or holds until `release` is set; it counts entries and exits."""

    def __init__(
        self,
        name: str,
        url: str,
        state: ModelState = ModelState.AWAKE,
        unavailable: ModelUnavailable | None = None,
        hold: threading.Event | None = None,
    ) -> None:
        self._name = name
        self.url = url
        self._state = state
        self._stats = ModelStats()
        self.unavailable = unavailable
        self.hold = hold
        self.entered = 0
        self.exited = 0

    @property
    def name(self) -> str:
        return self._name

    @property
    def engine(self) -> str:
        return "vllm"

    @property
    def state(self) -> ModelState:
        return self._state

    @property
    def stats(self) -> ModelStats:
        return self._stats

    @contextlib.asynccontextmanager
    async def serving(self, timeout: float | None = None) -> AsyncIterator[str]:
        self.entered += 1
        try:
            if self.unavailable is not None:
                raise self.unavailable
            self._stats.in_flight += 1
            try:
                while self.hold is not None and not self.hold.is_set():
                    await asyncio.sleep(0.005)
                yield self.url
            finally:
                self._stats.in_flight -= 1
        finally:
            self.exited += 1


class FakeModels:
    def __init__(self, handles: list[FakeHandle]) -> None:
        self.handles = {h.name: h for h in handles}

    def names(self) -> list[str]:
        return list(self.handles)

    def handle(self, name: object) -> ModelHandle:
        if not isinstance(name, str) or name not in self.handles:
            raise UnknownModel(name, self.names())
        return self.handles[name]

    def snapshot(self) -> ServeSnapshot:
        return {
            "time": 1.0,
            "budget": 1 << 30,
            "max_awake": None,
            "models": [],
            "history": [{"t": 1.0, "kv": {name: 0 for name in self.handles}}],
        }


class Served:
    """An ASGI app under uvicorn on an ephemeral port of 127.0.0.1, in a thread."""

    def __init__(self, app: Any) -> None:
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="critical")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "no start"
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


class Engine:
    """The stand-in engine. A body's `x_behaviour` picks what it does: "ok" (default),
    "teapot" (418, text/plain), "gate" (stream: wait for `gate` after the first token),
    "forever" (stream, or answer, only once the client has gone; `closed` is set when it
    has)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, bytes, dict[str, str]]] = []
        self.gate = threading.Event()
        self.first_sent = threading.Event()
        self.closed = threading.Event()

    def app(self) -> Starlette:
        async def answer(request: Request) -> Response:
            raw = await request.body()
            self.seen.append((request.url.path, raw, dict(request.headers)))
            body = json.loads(raw)
            behaviour = body.get("x_behaviour", "ok")
            chat = request.url.path.endswith("/chat/completions")
            if behaviour == "teapot":
                return Response(b"short and stout", status_code=418, media_type="text/plain")
            if behaviour == "forever" and not body.get("stream"):
                try:  # a long generation: the answer comes only once the client is gone
                    while not await request.is_disconnected():
                        await asyncio.sleep(0.01)
                finally:
                    self.closed.set()
                return Response(b"", status_code=499)
            if not body.get("stream"):
                return JSONResponse(whole_answer(body["model"], chat))
            tokens = 10**6 if behaviour == "forever" else int(body.get("x_tokens", 3))
            return StreamingResponse(
                self.events(body["model"], chat, tokens, behaviour),
                media_type="text/event-stream",
            )

        return Starlette(
            routes=[
                Route("/v1/chat/completions", answer, methods=["POST"]),
                Route("/v1/completions", answer, methods=["POST"]),
            ]
        )

    async def events(
        self, model: str, chat: bool, tokens: int, behaviour: str
    ) -> AsyncIterator[bytes]:
        try:
            for i in range(tokens):
                yield b"data: " + json.dumps(chunk(model, chat, f"tok{i} ")).encode() + b"\n\n"
                if i == 0 and behaviour == "gate":
                    self.first_sent.set()
                    while not self.gate.is_set():
                        await asyncio.sleep(0.005)
                if behaviour == "forever":
                    await asyncio.sleep(0.01)
            yield b"data: [DONE]\n\n"
        finally:
            if behaviour == "forever":
                self.closed.set()


def whole_answer(model: str, chat: bool) -> dict[str, Any]:
    usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    if chat:
        message = {"role": "assistant", "content": "hello"}
        choice = {"index": 0, "message": message, "finish_reason": "stop"}
        return {"id": "chatcmpl-1", "object": "chat.completion", "created": 0,
                "model": model, "choices": [choice], "usage": usage}  # fmt: skip
    choice = {"index": 0, "text": "hello", "finish_reason": "stop", "logprobs": None}
    return {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": model,
            "choices": [choice], "usage": usage}  # fmt: skip


def chunk(model: str, chat: bool, text: str) -> dict[str, Any]:
    if chat:
        choice = {"index": 0, "delta": {"content": text}, "finish_reason": None}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "finish_reason": None, "logprobs": None}
        kind = "text_completion"
    return {"id": "c-1", "object": kind, "created": 0, "model": model, "choices": [choice]}


class DyingEngine:
    """An engine that dies on every request: "close" reads the request and closes the
    connection; "midstream" starts a stream, sends one whole event and half of the next,
    then closes."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    got = conn.recv(65536)
                    if not got:
                        break
                    data += got
                if self.mode == "midstream":
                    event = b'data: {"choices": [{"index": 0, "delta": {"content": "a"}}]}\n\n'
                    half = b'data: {"choices": [{"ind'
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                        b"transfer-encoding: chunked\r\n\r\n"
                        + f"{len(event):x}\r\n".encode() + event + b"\r\n"
                        + f"{len(half):x}\r\n".encode() + half + b"\r\n"
                    )  # fmt: skip
                    time.sleep(0.05)

    def close(self) -> None:
        self.sock.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


# --- fixtures --------------------------------------------------------------------------


class World:
    def __init__(self) -> None:
        self.engine = Engine()
        self.engine_server = Served(self.engine.app())
        self.dies = DyingEngine("close")
        self.dies_midstream = DyingEngine("midstream")
        self.hold = threading.Event()
        url = self.engine_server.url
        self.models = FakeModels(
            [
                FakeHandle("alpha", url),
                FakeHandle("beta/2-chat:q4", url, state=ModelState.ASLEEP),
                FakeHandle(
                    "busy",
                    url,
                    state=ModelState.WAKING,
                    unavailable=ModelUnavailable("busy", "its queue is full", retry_after=2.5),
                ),
                FakeHandle("dead", self.dies.url, state=ModelState.FAILED),
                FakeHandle("dying", self.dies_midstream.url),
                FakeHandle("gone", f"http://127.0.0.1:{free_port()}"),
                FakeHandle("held", url, state=ModelState.LOADING, hold=self.hold),
            ]
        )
        self.router = Served(build_router(self.models))
        self.keyed = Served(build_router(self.models, api_key=KEY))
        self.http = httpx.Client(base_url=self.router.url, timeout=30)

    def handle(self, name: str) -> FakeHandle:
        return self.models.handles[name]

    def stop(self) -> None:
        self.http.close()
        self.keyed.stop()
        self.router.stop()
        self.engine_server.stop()
        self.dies.close()
        self.dies_midstream.close()


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    w = World()
    try:
        yield w
    finally:
        w.stop()


def chat_body(model: str = "alpha", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}


def wait_for(condition: Any, what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.01)


# --- 400s ------------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = '"messages": [{"role": "user", "content": "hi"}]'
BAD_BODIES = [
    (CHAT, b"{not json", None),
    (CHAT, b"", None),
    (CHAT, b"\xff\xfe", None),
    (CHAT, b'["model", "alpha"]', None),
    (CHAT, b'"alpha"', None),
    (CHAT, b"{" + MESSAGES.encode() + b"}", "model"),
    (CHAT, b'{"model": 7, ' + MESSAGES.encode() + b"}", "model"),
    (CHAT, b'{"model": "", ' + MESSAGES.encode() + b"}", "model"),
    (CHAT, b'{"model": null, ' + MESSAGES.encode() + b"}", "model"),
    (CHAT, b'{"model": "alpha", "stream": "yes", ' + MESSAGES.encode() + b"}", "stream"),
    (CHAT, b'{"model": "alpha", "stream": 1, ' + MESSAGES.encode() + b"}", "stream"),
    (CHAT, b'{"model": "alpha", "max_tokens": -1, ' + MESSAGES.encode() + b"}", "max_tokens"),
    (CHAT, b'{"model": "alpha", "max_tokens": 0, ' + MESSAGES.encode() + b"}", "max_tokens"),
    (
        CHAT,
        b'{"model": "alpha", "max_tokens": %d, ' % (MAX_TOKENS_CAP + 1) + MESSAGES.encode() + b"}",
        "max_tokens",
    ),
    (CHAT, b'{"model": "alpha", "max_tokens": "5", ' + MESSAGES.encode() + b"}", "max_tokens"),
    (CHAT, b'{"model": "alpha", "max_tokens": 2.5, ' + MESSAGES.encode() + b"}", "max_tokens"),
    (CHAT, b'{"model": "alpha", "max_tokens": true, ' + MESSAGES.encode() + b"}", "max_tokens"),
    (
        CHAT,
        b'{"model": "alpha", "max_completion_tokens": 1e30, ' + MESSAGES.encode() + b"}",
        "max_completion_tokens",
    ),
    (CHAT, b'{"model": "alpha", "messages": []}', "messages"),
    (CHAT, b'{"model": "alpha"}', "messages"),
    (CHAT, b'{"model": "alpha", "messages": "hi"}', "messages"),
    (CHAT, b'{"model": "alpha", "messages": ["hi"]}', "messages[0]"),
    (COMPLETIONS, b'{"model": "alpha"}', "prompt"),
    (COMPLETIONS, b'{"model": "alpha", "prompt": 5}', "prompt"),
    (COMPLETIONS, b'{"model": "alpha", "prompt": "x", "max_tokens": -3}', "max_tokens"),
]


@pytest.mark.parametrize(("path", "raw", "param"), BAD_BODIES)
def test_a_bad_body_is_a_400_naming_the_field(
    world: World, path: str, raw: bytes, param: str | None
) -> None:
    seen = len(world.engine.seen)
    r = world.http.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    if param is not None:
        assert f"'{param}'" in error["message"]
    assert len(world.engine.seen) == seen, "a refused body reached the engine"


def test_the_server_keeps_serving_after_bad_bodies(world: World) -> None:
    for path, raw, _ in BAD_BODIES:
        assert world.http.post(path, content=raw).status_code == 400
    r = world.http.post(CHAT, json=chat_body())
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"] == "hello"


def test_parse_body_accepts_what_openai_sends() -> None:
    body, stream = parse_body(
        json.dumps(chat_body(stream=True, max_tokens=MAX_TOKENS_CAP, max_completion_tokens=1))
        .encode(),
        chat=True,
    )  # fmt: skip
    assert stream is True and body["model"] == "alpha"
    _, stream = parse_body(b'{"model": "a", "prompt": [1, 2], "stream": null}', chat=False)
    assert stream is False


# --- 404, 503 --------------------------------------------------------------------------


def test_an_unknown_model_is_a_404_listing_the_models(world: World) -> None:
    r = world.http.post(CHAT, json=chat_body("gamma"))
    assert r.status_code == 404
    error = r.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "'gamma'" in error["message"]
    for name in world.models.names():
        assert name in error["message"]


def test_unavailable_is_a_503_with_retry_after(world: World) -> None:
    handle = world.handle("busy")
    errors = handle.stats.errors_total
    r = world.http.post(CHAT, json=chat_body("busy"))
    assert r.status_code == 503
    assert r.headers["retry-after"] == "3"  # 2.5 s, rounded up
    error = r.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "model_unavailable"
    assert "queue is full" in error["message"]
    assert handle.stats.errors_total == errors + 1


def test_an_unknown_route_answers_in_openai_shape(world: World) -> None:
    r = world.http.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = world.http.get(CHAT)
    assert r.status_code == 405 and "error" in r.json()


# --- passing through -------------------------------------------------------------------


def test_the_body_travels_byte_for_byte_and_the_key_stays_behind(world: World) -> None:
    raw = b'{"model":"alpha",  "messages":[{"role":"user","content":"h\\u00e9"}],"x_odd":[1,2.50]}'
    r = world.http.post(
        CHAT,
        content=raw,
        headers={"Authorization": "Bearer secret", "X-Request-Id": "r-1"},
    )
    assert r.status_code == 200
    path, seen, headers = world.engine.seen[-1]
    assert path == CHAT and seen == raw
    assert "authorization" not in headers
    assert headers["x-request-id"] == "r-1"


def test_the_engines_status_and_content_type_come_back_as_they_are(world: World) -> None:
    handle = world.handle("alpha")
    errors = handle.stats.errors_total
    r = world.http.post(
        COMPLETIONS, json={"model": "alpha", "prompt": "x", "x_behaviour": "teapot"}
    )
    assert r.status_code == 418
    assert r.headers["content-type"].startswith("text/plain")
    assert r.content == b"short and stout"
    assert handle.stats.errors_total == errors + 1


def test_counts_requests_and_ttft(world: World) -> None:
    stats = world.handle("alpha").stats
    requests, ttfts = stats.requests_total, len(stats.ttft_s)
    world.http.post(COMPLETIONS, json={"model": "alpha", "prompt": "x"})
    with world.http.stream("POST", CHAT, json=chat_body(stream=True)) as r:
        r.read()
    assert stats.requests_total == requests + 2
    assert len(stats.ttft_s) == ttfts + 1 and 0 < stats.ttft_s[-1] < 10
    assert stats.in_flight == 0


# --- streams ---------------------------------------------------------------------------


def test_a_stream_is_relayed_as_it_comes(world: World) -> None:
    engine = world.engine
    engine.gate.clear()
    engine.first_sent.clear()
    body = chat_body(stream=True, x_behaviour="gate", x_tokens=4)
    with world.http.stream("POST", CHAT, json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        pieces = r.iter_raw()
        first = next(pieces)
        # the engine is still waiting on the gate: this chunk came before it finished
        assert engine.first_sent.is_set() and not engine.gate.is_set()
        assert b"tok0" in first and b"tok1" not in first
        engine.gate.set()
        rest = b"".join(pieces)
    assert b"tok3" in rest and rest.endswith(b"data: [DONE]\n\n")


def test_a_client_that_goes_away_closes_the_upstream_request(world: World) -> None:
    engine = world.engine
    engine.closed.clear()
    handle = world.handle("alpha")
    body = chat_body(stream=True, x_behaviour="forever")
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", world.router.url + CHAT, json=body) as r,
    ):
        got = b""
        for piece in r.iter_raw():
            got += piece
            if got.count(b"data:") >= 3:
                break
        # still connected: the engine goes on (for 10**6 tokens). Checked before the
        # block ends, since leaving it closes the connection, and the close can reach
        # the engine before the next line of this thread runs
        assert not engine.closed.is_set()
    # the client's connection is closed here: the engine must see its request end
    wait_for(engine.closed.is_set, "the engine to see its request closed")
    wait_for(lambda: handle.stats.in_flight == 0, "the request to leave serving()")


def test_a_client_that_goes_away_closes_a_whole_answer_request_too(world: World) -> None:
    engine = world.engine
    engine.closed.clear()
    handle = world.handle("alpha")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            world.router.url + COMPLETIONS,
            json={"model": "alpha", "prompt": "x", "x_behaviour": "forever"},
            timeout=httpx.Timeout(30, read=0.3),
        )
    wait_for(engine.closed.is_set, "the engine to see its request closed")
    wait_for(lambda: handle.stats.in_flight == 0, "the request to leave serving()")


def test_a_client_that_goes_away_while_held_leaves_the_queue(world: World) -> None:
    handle = world.handle("held")
    world.hold.clear()
    entered, exited = handle.entered, handle.exited

    def ask() -> None:
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(world.router.url + CHAT, json=chat_body("held"), timeout=0.3)

    ask()  # times out while the model holds it
    wait_for(lambda: handle.exited == exited + 1, "the held request to leave the queue")
    assert handle.entered == entered + 1 and handle.stats.in_flight == 0


def test_an_engine_dying_mid_stream_ends_with_an_error_event(world: World) -> None:
    handle = world.handle("dying")
    errors = handle.stats.errors_total
    with world.http.stream("POST", CHAT, json=chat_body("dying", stream=True)) as r:
        assert r.status_code == 200
        text = r.read().decode()
    events = [e for e in text.split("\n\n") if e]
    assert len(events) == 2, text  # the whole event, then the error; the half one dropped
    assert json.loads(events[0].removeprefix("data: "))["choices"][0]["delta"]["content"] == "a"
    error = json.loads(events[1].removeprefix("data: "))["error"]
    assert error["code"] == "engine_stopped" and "'dying'" in error["message"]
    assert handle.stats.errors_total == errors + 1
    assert handle.stats.in_flight == 0


@pytest.mark.parametrize("model", ["dead", "gone"])
def test_an_engine_that_dies_or_is_gone_gives_a_503(world: World, model: str) -> None:
    r = world.http.post(CHAT, json=chat_body(model))
    assert r.status_code == 503
    assert r.headers["retry-after"] == "1"
    error = r.json()["error"]
    assert error["code"] == "engine_stopped"
    assert f"engine for model {model!r} stopped" in error["message"]
    # a stream asked of a dead engine fails the same way, before any event
    r = world.http.post(CHAT, json=chat_body(model, stream=True))
    assert r.status_code == 503


# --- listing, health, state, key -------------------------------------------------------


def test_models_lists_every_model_with_its_state(world: World) -> None:
    r = world.http.get("/v1/models")
    assert r.status_code == 200
    listed = r.json()
    assert listed["object"] == "list"
    states = {m["id"]: m["state"] for m in listed["data"]}
    assert states == {name: h.state.value for name, h in world.models.handles.items()}
    assert states["beta/2-chat:q4"] == "asleep"
    for m in listed["data"]:
        assert m["object"] == "model" and m["owned_by"] == "kvcached"
        assert isinstance(m["created"], int)


def test_health_and_api_state(world: World) -> None:
    r = world.http.get("/health")
    assert r.status_code == 200 and r.json()["models"]["alpha"] == "awake"
    assert world.http.get("/api/state").json() == json.loads(json.dumps(world.models.snapshot()))


def test_an_api_key_guards_every_route_but_health(world: World) -> None:
    url = world.keyed.url
    seen = len(world.engine.seen)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        for method, path in (("GET", "/v1/models"), ("POST", CHAT), ("GET", "/api/state")):
            r = httpx.request(method, url + path, json=chat_body(), headers=headers)
            assert r.status_code == 401, (headers, path)
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert r.headers["www-authenticate"] == "Bearer"
    assert len(world.engine.seen) == seen
    assert httpx.get(url + "/health").status_code == 200
    good = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(url + "/v1/models", headers=good).status_code == 200
    r = httpx.post(url + CHAT, json=chat_body(), headers=good)
    assert r.status_code == 200
    assert "authorization" not in world.engine.seen[-1][2]


def test_extra_routes_sit_behind_the_same_key() -> None:
    async def extra(_: Request) -> Response:
        return Response(b"extra")

    models = FakeModels([FakeHandle("alpha", "http://127.0.0.1:1")])
    served = Served(build_router(models, api_key=KEY, extra_routes=[Route("/extra", extra)]))
    try:
        assert httpx.get(served.url + "/extra").status_code == 401
        r = httpx.get(served.url + "/extra", headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and r.content == b"extra"
    finally:
        served.stop()


# --- through the openai client ---------------------------------------------------------


def test_the_openai_client_chats_and_streams(world: World) -> None:
    client = openai.OpenAI(base_url=world.keyed.url + "/v1", api_key=KEY, max_retries=0)
    answer = client.chat.completions.create(
        model="alpha", messages=[{"role": "user", "content": "hi"}], max_tokens=5
    )
    assert answer.choices[0].message.content == "hello"
    stream = client.chat.completions.create(
        model="alpha", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream)
    assert text == "tok0 tok1 tok2 "
    done = client.completions.create(model="alpha", prompt="x")
    assert done.choices[0].text == "hello"
    assert [m.id for m in client.models.list()] == world.models.names()
    with pytest.raises(openai.NotFoundError, match=r"model_not_found|does not exist"):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.APIError, match="stopped"):
        stream = client.chat.completions.create(
            model="dying", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        for _ in stream:
            pass
    bad = openai.OpenAI(base_url=world.keyed.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_many_requests_at_once_all_get_their_own_answer(world: World) -> None:
    async def body() -> list[str]:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=world.router.url, timeout=30, limits=limits) as c:

            async def streamed(i: int) -> str:
                ask = chat_body(stream=True, x_tokens=5, x_id=i)
                async with c.stream("POST", CHAT, json=ask) as r:
                    assert r.status_code == 200
                    return (await r.aread()).decode()

            async def whole(i: int) -> str:
                r = await c.post(COMPLETIONS, json={"model": "alpha", "prompt": "p" * i})
                assert r.status_code == 200
                return str(r.json()["choices"][0]["text"])

            jobs = [streamed(i) for i in range(40)] + [whole(i) for i in range(40)]
            return list(await asyncio.gather(*jobs))

    got = asyncio.run(asyncio.wait_for(body(), 60))
    for text in got[:40]:
        assert text.count("data: ") == 6 and "tok4" in text and text.endswith("[DONE]\n\n")
    assert got[40:] == ["hello"] * 40
    assert world.handle("alpha").stats.in_flight == 0


def test_a_large_body_travels_unchanged(world: World) -> None:
    raw = json.dumps({"model": "alpha", "prompt": "ab" * (1 << 19)}).encode()  # 1 MiB
    r = world.http.post(COMPLETIONS, content=raw)
    assert r.status_code == 200
    assert world.engine.seen[-1][1] == raw
