"""The HTTP surface of `kvcached serve`: one OpenAI endpoint in front of many engines.

The router is a Starlette application over a `state.Models`. It reads each request's
body once, checks the few fields it must understand to route it (`model`, `stream`,
the token caps, `messages` or `prompt`), and hands the body's bytes unchanged to the
engine that serves that model, through one shared `httpx.AsyncClient`. Everything else
in the body (sampling, tools, logprobs, response formats) is the engine's to judge: the
router re-encodes nothing, so an engine sees what the client sent, byte for byte, and
answers with its own status, body and content type, which go back as they came.

Why check anything at all, when the engine validates too: a body the router cannot
route (not JSON, no `model`) has no engine to go to, and a few mistakes are cheaper to
refuse here than after a sleeping model was woken for them (an empty `messages`, a
`max_tokens` of a billion). Each refusal is a 400 in OpenAI's error shape naming the
field (`param`), and the server keeps serving. An unknown model is a 404 listing the
models served; a model that cannot serve now (`state.ModelUnavailable`: its queue is
full, its wait ran out, it failed for good) is a 503 with `Retry-After`.

Note [one exchange]: a routed request is one `_Exchange`, the response object the
endpoint returns. Its whole life, from waiting in the model's queue
(`ModelHandle.serving`) through the engine's answer to the last byte sent, runs inside
the response's ASGI call, beside a task that listens for the client's disconnect. A
client that goes away cancels the exchange wherever it is: a held request leaves the
queue, a running one closes its upstream connection, which is how vLLM and SGLang learn
that a request was abandoned (they abort it and free its KV). Cleanup (closing the
upstream response, leaving `serving()`) runs shielded from that cancellation, so it is
never skipped halfway.

Note [streams]: a streamed answer (`"stream": true`, an engine answering 200 with
`text/event-stream`) is relayed chunk by chunk as the engine's socket delivers it,
never gathered. The router holds back only an incomplete server-sent event at a chunk's
end (an engine writes whole events, so in practice nothing), so that, should the engine
die mid-stream, the client receives whole events followed by one final
`data: {"error": {...}}` event and the end of the stream, never half an event and never
a hang. The time to the first chunk is the model's time to first token
(`ModelStats.record_ttft`), measured from the moment the router received the request,
so it includes queueing and waking, as the user experiences it.

An engine that dies during a request that is not streamed (its connection refused,
reset or closed early) gives a 503 saying that the model's engine stopped and is being
restarted; the supervisor restarts it. With `api_key`, every route but `/health` and
the dashboard's page (`PUBLIC_PATHS`) wants `Authorization: Bearer KEY` (a 401 in
OpenAI's shape otherwise), and that header never travels to an engine.

What it costs (benchmarks/serve_router_overhead.py, results in
benchmarks/results/serve-router-overhead-cpu.jsonl, a 2-core VM): about 1.2 ms per
non-streamed request and 16 µs per streamed token (the router's CPU time per token
too). A stream paced like a decoding engine, every process asleep between two
tokens, sees each token about 150 µs later than straight from the engine, 40 µs of it
any extra process hop's; most of the rest is the cold path through httpx's layers
(httpcore, h11, anyio) per chunk, which a leaner reader of the engine's socket could
shorten if it ever mattered next to an engine's tens of milliseconds per token.

Routes: `GET /v1/models`, `POST /v1/chat/completions`, `POST /v1/completions`,
`GET /health`, `GET /api/state` (the `ServeSnapshot` as JSON), plus `extra_routes`
(the dashboard's and `/metrics`), which sit behind the same key.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import math
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import anyio
import httpx
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from kvcached.apps.serve.state import ModelHandle, Models, ModelUnavailable, UnknownModel

#: the routes the router forwards, at the same paths on every engine
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
#: the largest `max_tokens` / `max_completion_tokens` the router passes on; no model
#: has a context this long, and a larger number is a mistake, not a wish
MAX_TOKENS_CAP = 1 << 20
#: paths answered without the API key: the health probe (load balancers and
#: supervisors call it) and the dashboard's page, which holds no data (a browser cannot
#: send a header when it opens a page; the page sends its `?key=` on as a bearer token
#: to `/api/state`, which stays guarded, like `/metrics`)
PUBLIC_PATHS = frozenset({"/health", "/dashboard"})
#: connections the router keeps to the engines, all models together, and how many of
#: them stay open while idle; a request beyond the first number waits for a connection
MAX_UPSTREAM_CONNECTIONS = 1024
MAX_IDLE_UPSTREAM_CONNECTIONS = 256
#: seconds to connect to an engine on 127.0.0.1 (it is up, or it is not)
CONNECT_TIMEOUT_S = 10.0
#: seconds a client is told to wait after its model's engine stopped under it
ENGINE_STOPPED_RETRY_AFTER_S = 1
#: an incomplete event longer than this is relayed as it is (Note [streams]): an
#: upstream that never ends its events is not held in memory
MAX_HELD_EVENT_BYTES = 1 << 16
#: request headers that describe the client's connection to us, not the request, and
#: `authorization` (the router's key is no engine's business)
_NOT_FORWARDED = frozenset(
    {
        b"host",
        b"authorization",
        b"content-length",
        b"connection",
        b"keep-alive",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"accept-encoding",
        b"expect",
        b"cookie",
    }
)
_EVENT_ENDS = (b"\n\n", b"\r\n\r\n", b"\r\r")


def error_body(
    message: str,
    kind: str = "invalid_request_error",
    *,
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    """OpenAI's error object: `{"error": {"message", "type", "param", "code"}}`."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(
    status: int,
    message: str,
    kind: str = "invalid_request_error",
    *,
    param: str | None = None,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    """An error answer in OpenAI's shape."""
    body = error_body(message, kind, param=param, code=code)
    return JSONResponse(body, status_code=status, headers=headers)


def retry_after(seconds: float) -> str:
    """`Retry-After`'s value: whole seconds, rounded up, never negative."""
    if not math.isfinite(seconds):
        return "1"
    return str(max(0, math.ceil(seconds)))


class BadRequest(Exception):
    """A body the router refuses (HTTP 400); `param` names the field, None for the body."""

    def __init__(self, message: str, param: str | None = None) -> None:
        self.message = message
        self.param = param
        super().__init__(message)


def parse_body(raw: bytes, *, chat: bool) -> tuple[dict[str, Any], bool]:
    """The body as a JSON object and whether it asks for a stream; `BadRequest` naming
    the first field the router cannot accept. Fields it does not route on are left to
    the engine."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest(
            f"the request body must be a JSON object, not {_json_kind(body)}; "
            'send {"model": ..., ' + ('"messages": [...]}' if chat else '"prompt": ...}')
        )
    model = body.get("model")
    if not isinstance(model, str) or not model:
        got = "missing" if "model" not in body else f"{_json_kind(model)} {model!r}"
        raise BadRequest(
            f"'model' must be the name of a served model (a non-empty string); got {got}",
            "model",
        )
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest(
            f"'stream' must be true or false; got {_json_kind(stream)} {stream!r}", "stream"
        )
    for param in ("max_tokens", "max_completion_tokens"):
        value = body.get(param)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            raise BadRequest(
                f"'{param}' must be an integer from 1 to {MAX_TOKENS_CAP}; "
                f"got {_json_kind(value)} {value!r}",
                param,
            )
        if not 1 <= value <= MAX_TOKENS_CAP:
            raise BadRequest(
                f"'{param}' must be an integer from 1 to {MAX_TOKENS_CAP}; got {value}", param
            )
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            got = "missing" if "messages" not in body else _json_kind(messages)
            if isinstance(messages, list):
                got = "an empty list"
            raise BadRequest(
                f"'messages' must be a non-empty list of message objects; got {got}",
                "messages",
            )
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise BadRequest(
                    f"'messages[{i}]' must be an object with 'role' and 'content'; "
                    f"got {_json_kind(message)}",
                    f"messages[{i}]",
                )
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str | list):
            got = "missing" if prompt is None else _json_kind(prompt)
            raise BadRequest(
                f"'prompt' must be a string, a list of strings or a list of token ids; got {got}",
                "prompt",
            )
    return body, bool(stream)


def _json_kind(value: object) -> str:
    """How JSON would name `value`'s type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    return "an object"


def _events_end(chunk: bytes) -> int:
    """Where the last complete server-sent event in `chunk` ends (0: none does)."""
    if chunk.endswith(b"\n\n"):  # what engines write: whole events
        return len(chunk)
    end = 0
    for sep in _EVENT_ENDS:
        at = chunk.rfind(sep)
        if at >= 0:
            end = max(end, at + len(sep))
    return end


def _forwarded_headers(scope: Scope) -> list[tuple[bytes, bytes]]:
    """The client's request headers an engine may see (not its key, not hop-by-hop),
    asking the engine for an uncompressed answer, which the router relays as it is."""
    headers = [(k, v) for k, v in scope["headers"] if k not in _NOT_FORWARDED]
    headers.append((b"accept-encoding", b"identity"))
    return headers


class _Upstream:
    """The one HTTP client to every engine, made in the event loop that serves, on first
    use (or at the application's start), closed when the application stops."""

    def __init__(self) -> None:
        self._client: httpx.AsyncClient | None = None

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                # no read or write timeout: an answer takes as long as it generates;
                # no pool timeout: past MAX_UPSTREAM_CONNECTIONS a request waits its turn
                timeout=httpx.Timeout(CONNECT_TIMEOUT_S, read=None, write=None, pool=None),
                limits=httpx.Limits(
                    max_connections=MAX_UPSTREAM_CONNECTIONS,
                    max_keepalive_connections=MAX_IDLE_UPSTREAM_CONNECTIONS,
                ),
                # engines listen on 127.0.0.1: no proxy from the environment applies
                trust_env=False,
            )
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()


def _engine_stopped(model: str) -> bytes:
    return json.dumps(
        error_body(
            f"the engine for model {model!r} stopped while answering this request; "
            "it is being restarted, retry shortly",
            "server_error",
            code="engine_stopped",
        )
    ).encode()


class _Exchange(Response):
    """One routed request, from the model's queue to the last byte (Note [one exchange])."""

    def __init__(
        self,
        upstream: _Upstream,
        handle: ModelHandle,
        path: str,
        body: bytes,
        stream: bool,
        started: float,
    ) -> None:
        self.upstream = upstream
        self.handle = handle
        self.path = path
        self.payload = body
        self.stream = stream
        self.started = started
        self.status_code = 0  # set once the answer starts
        self.background = None
        self.disconnected = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as group:

            async def watch() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                self.disconnected = True
                group.cancel_scope.cancel()

            group.start_soon(watch)
            try:
                await self._exchange(scope, send)
            finally:
                group.cancel_scope.cancel()

    async def _exchange(self, scope: Scope, send: Send) -> None:
        handle, stats = self.handle, self.handle.stats
        ok = False
        try:
            async with contextlib.AsyncExitStack() as cleanup:
                try:
                    base_url = await cleanup.enter_async_context(_shielded_exit(handle))
                except ModelUnavailable as exc:
                    headers = {"Retry-After": retry_after(exc.retry_after)}
                    await _send_json(send, 503, _unavailable_body(exc), headers)
                    return
                client = self.upstream.client
                request = client.build_request(
                    "POST",
                    base_url + self.path,
                    content=self.payload,
                    headers=_forwarded_headers(scope),
                )
                try:
                    answer = await client.send(request, stream=True)
                except httpx.TransportError:
                    await self._stopped(send)
                    return
                cleanup.push_async_callback(_shielded, answer.aclose)
                content_type = answer.headers.get("content-type", "application/json")
                if (
                    self.stream
                    and answer.status_code == 200
                    and content_type.startswith("text/event-stream")
                ):
                    ok = await self._relay(answer, content_type, send)
                    return
                try:
                    content = await answer.aread()
                except httpx.TransportError:
                    await self._stopped(send)
                    return
                kind = [(b"content-type", content_type.encode("latin-1"))]
                await _send_whole(send, answer.status_code, content, kind)
                ok = answer.status_code < 400
        except OSError:  # a send to the client failed (a server of ASGI 2.4): it has gone
            self.disconnected = True
        finally:
            if not ok and not self.disconnected:
                stats.errors_total += 1
            stats.record_finished()

    async def _stopped(self, send: Send) -> None:
        headers = [
            (b"content-type", b"application/json"),
            (b"retry-after", str(ENGINE_STOPPED_RETRY_AFTER_S).encode()),
        ]
        await _send_whole(send, 503, _engine_stopped(self.handle.name), headers)

    async def _relay(self, answer: httpx.Response, content_type: str, send: Send) -> bool:
        """Relay the engine's events as they come (Note [streams]); False when the
        engine died before the stream's end."""
        self.status_code = 200
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", content_type.encode("latin-1")),
                    (b"cache-control", b"no-cache"),
                    (b"x-accel-buffering", b"no"),
                ],
            }
        )
        held = b""
        first = True
        # the router asked for no compression; aiter_raw skips httpx's decoding layers,
        # unless the engine compressed all the same (and the client was not told so)
        encoded = answer.headers.get("content-encoding", "identity") != "identity"
        chunks = answer.aiter_bytes() if encoded else answer.aiter_raw()
        try:
            async for chunk in chunks:
                if first and chunk:
                    first = False
                    self.handle.stats.record_ttft(time.monotonic() - self.started)
                if held:
                    chunk = held + chunk
                end = _events_end(chunk)
                if end == 0 and len(chunk) <= MAX_HELD_EVENT_BYTES:
                    held = chunk
                    continue
                if end == 0:
                    end = len(chunk)
                held = chunk[end:]
                await send({"type": "http.response.body", "body": chunk[:end], "more_body": True})
        except httpx.TransportError:
            # the engine died: drop its last, incomplete event, say so, end the stream
            event = b"data: " + _engine_stopped(self.handle.name) + b"\n\n"
            await send({"type": "http.response.body", "body": event, "more_body": False})
            return False
        await send({"type": "http.response.body", "body": held, "more_body": False})
        return True


@contextlib.asynccontextmanager
async def _shielded_exit(handle: ModelHandle) -> AsyncIterator[str]:
    """`handle.serving()`, its exit shielded from a client's cancellation."""
    serving = handle.serving()
    base_url = await serving.__aenter__()
    try:
        yield base_url
    except BaseException as exc:
        with anyio.CancelScope(shield=True):
            if not await serving.__aexit__(type(exc), exc, exc.__traceback__):
                raise
    else:
        with anyio.CancelScope(shield=True):
            await serving.__aexit__(None, None, None)


async def _shielded(close: Callable[[], Any]) -> None:
    with anyio.CancelScope(shield=True):
        await close()


def _unavailable_body(exc: ModelUnavailable) -> dict[str, Any]:
    return error_body(str(exc), "server_error", param="model", code="model_unavailable")


async def _send_json(
    send: Send, status: int, body: dict[str, Any], headers: dict[str, str] | None = None
) -> None:
    raw = [(b"content-type", b"application/json")]
    raw += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    await _send_whole(send, status, json.dumps(body).encode(), raw)


async def _send_whole(
    send: Send, status: int, content: bytes, headers: list[tuple[bytes, bytes]]
) -> None:
    headers = [*headers, (b"content-length", str(len(content)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": content, "more_body": False})


class _BearerKey:
    """ASGI middleware: every HTTP route but `PUBLIC_PATHS` wants `Bearer KEY`."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self.expected = f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                given = value
                break
        if hmac.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        message = (
            "a valid API key is required: send 'Authorization: Bearer KEY' with the key "
            "this server was started with (api_key / KVCACHED_SERVE_API_KEY)"
            if not given
            else "the API key given is not this server's"
        )
        body = error_body(message, "invalid_request_error", code="invalid_api_key")
        await _send_json(send, 401, body, {"WWW-Authenticate": "Bearer"})


def build_router(
    models: Models,
    *,
    api_key: str | None = None,
    extra_routes: Sequence[BaseRoute] | None = None,
) -> Starlette:
    """The Starlette application serving `models` (module docstring).

    `api_key`: when given, every route but `PUBLIC_PATHS` needs `Authorization: Bearer KEY`.
    `extra_routes`: more routes (the dashboard, `/metrics`), after the router's own and
    behind the same key; `app.state.models` is `models` for their handlers.
    """
    upstream = _Upstream()
    created = int(time.time())

    async def list_models(_: Request) -> Response:
        data = []
        for name in models.names():
            handle = models.handle(name)
            data.append(
                {
                    "id": name,
                    "object": "model",
                    "created": created,
                    "owned_by": "kvcached",
                    "state": handle.state.value,
                }
            )
        return JSONResponse({"object": "list", "data": data})

    async def route(request: Request, chat: bool) -> Response:
        started = time.monotonic()
        raw = await request.body()
        try:
            body, stream = parse_body(raw, chat=chat)
        except BadRequest as exc:
            return error_response(400, exc.message, param=exc.param)
        try:
            handle = models.handle(body["model"])
        except UnknownModel as exc:
            return error_response(
                404, str(exc), "invalid_request_error", param="model", code="model_not_found"
            )
        handle.stats.requests_total += 1
        path = CHAT_PATH if chat else COMPLETIONS_PATH
        return _Exchange(upstream, handle, path, raw, stream, started)

    async def chat_completions(request: Request) -> Response:
        return await route(request, chat=True)

    async def completions(request: Request) -> Response:
        return await route(request, chat=False)

    async def health(_: Request) -> Response:
        states = {name: models.handle(name).state.value for name in models.names()}
        return JSONResponse({"status": "ok", "models": states})

    async def api_state(_: Request) -> Response:
        return JSONResponse(models.snapshot())

    async def http_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), kind, headers=exc.headers)

    async def internal_error(_: Request, exc: Exception) -> Response:
        # a bug of ours, never bad input (parse_body refuses that first); Starlette
        # re-raises after this answer, so uvicorn logs the traceback
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await upstream.aclose()

    routes: list[BaseRoute] = [
        Route("/v1/models", list_models, methods=["GET"]),
        Route(CHAT_PATH, chat_completions, methods=["POST"]),
        Route(COMPLETIONS_PATH, completions, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/api/state", api_state, methods=["GET"]),
        *(extra_routes or ()),
    ]
    handlers: dict[Any, Callable[[Request, Exception], Any]] = {
        HTTPException: http_error,
        Exception: internal_error,
    }
    app = Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)
    app.state.models = models
    if api_key:
        app.add_middleware(_BearerKey, key=api_key)
    return app


__all__ = [
    "MAX_TOKENS_CAP",
    "PUBLIC_PATHS",
    "BadRequest",
    "build_router",
    "error_body",
    "error_response",
    "parse_body",
    "retry_after",
]
