"""`kvcached serve-mlx MODEL [MODEL ...]`: several mlx-lm models behind one OpenAI API.

One process, one HTTP endpoint (`/v1/models`, `/v1/completions`,
`/v1/chat/completions`, streaming as server-sent events), dispatching on the request's
`model`. Each model is one `KVPool`, so one ledger row (`serve-mlx/<model>`), shown by
`kvctl list` and `kvtop` and bounded by `kvctl limit`; the row is charged the model's
weights while they are loaded and each request's KV while it runs, so all models share
the device budget. A request's KV is one run per layer sized to its prompt plus
`max_tokens` and returned when it ends: an idle model holds no KV. A model idle longer
than the keep-alive (`--keep-alive`, seconds; Ollama's idea) unloads its weights and
reloads them on its next request.

Errors are answers, never hangs: an unknown model is a 404 listing the models served; a
model whose weights the budget cannot hold is refused at start-up (and a reload that
no longer fits is a 503 naming the budget); a request whose KV the ledger refuses is a
503 saying so, with nothing held.

Why not `mlx_lm.server`: it keeps one resident model, swaps models per request, builds
its own caches, and runs on the standard library's `http.server`. Here the HTTP layer
is Starlette under uvicorn: both maintained by the encode project, widely deployed,
with streaming responses built in and a server that shuts down cleanly from a test.

Note [one MLX lock]: MLX work runs in worker threads, one step at a time under one
lock (MLX's graph evaluation is not meant to be driven from several threads at once).
The lock is handed over first come, first served (`FairLock`), so a thread that
releases it cannot take it straight back while another model waits: requests to
different models interleave step by step. A prompt is prefilled in chunks of
`prefill_chunk` tokens (512), one step each, so a long prompt on one model delays
another model's step by one chunk, not by the whole prefill; a cancelled request (its
client went away) or a server shutting down stops between chunks and between tokens.

Each request samples from its own random key (`seed` when given: same seed, same
text), since MLX's global random state starts from the same seed in every new thread.
Text goes out through mlx-lm's streaming detokenizer (`tokenizer.detokenizer`), the
same one for streamed and whole answers, so both carry the same text and a character
split across tokens goes out once it is complete. Bodies are validated by
`protocol.py` and every error is OpenAI's error object; the KV a request needs must fit
the model's context length (`max_position_embeddings`), else a 400.

Unloading frees the weights, refunds them to the ledger row, then marks the model
unloaded (a listing never shows an unloaded model still charged), and hands freed heap
back to the operating system (glibc's `malloc_trim`), which otherwise keeps it.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import gc
import json
import logging
import queue
import secrets
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcached.engines.mlx_lm.pool import KVPool
from kvcached.errors import InvalidArgument, KVCachedError, OutOfMemory

log = logging.getLogger("kvcached.serve_mlx")

DEFAULT_KEEP_ALIVE_S = 300.0
DEFAULT_MAX_TOKENS = 256
#: Prompt tokens per prefill step (Note [one MLX lock]).
DEFAULT_PREFILL_CHUNK = 512
#: config.json keys that hold a model's context length, the first present wins.
_CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "seq_length", "n_ctx")


class FairLock:
    """A lock handed to its waiters in the order they asked (Note [one MLX lock]).

    `threading.Lock` lets the releasing thread take it again before a waiter wakes, so
    one request's back-to-back steps would starve every other model's."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._held = False
        self._waiters: deque[threading.Lock] = deque()  # one closed gate per waiter

    def acquire(self) -> None:
        with self._mutex:
            if not self._held:
                self._held = True
                return
            gate = threading.Lock()
            gate.acquire()
            self._waiters.append(gate)
        try:
            gate.acquire()  # opened by `release`, which hands the lock over held
        except BaseException:  # interrupted while waiting (Ctrl-C in the main thread)
            with self._mutex:
                handed_over = gate not in self._waiters
                if not handed_over:
                    self._waiters.remove(gate)
            if handed_over:
                self.release()
            raise

    def release(self) -> None:
        with self._mutex:
            if self._waiters:
                self._waiters.popleft().release()  # stays held, by the next in line
            else:
                self._held = False

    def __enter__(self) -> FairLock:
        self.acquire()
        return self

    def __exit__(self, *_: object) -> None:
        self.release()


#: One MLX evaluation at a time, across every model of the process.
_MLX_LOCK = FairLock()


class ModelDoesNotFit(OutOfMemory):
    """The budget (or the model's limit) cannot hold the model's weights."""


class ShuttingDown(KVCachedError):
    """The server stopped while the request ran."""


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    trim = getattr(libc, "malloc_trim", None)  # glibc only (musl has none)
    if trim is None:
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim  # type: ignore[no-any-return]


def release_free_memory() -> bool:
    """Hand the C heap's free memory back to the operating system (glibc's
    `malloc_trim(0)`); False where the C library has no such call (macOS, musl)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def context_length(path: str) -> int | None:
    """The context length a model folder's config.json declares, if any."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for key in _CONTEXT_KEYS:
        value = config.get(key) if isinstance(config, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


@dataclass
class ServedModel:
    """One model: its folder, its ledger row (pool), and its weights while loaded.

    `loaded` is what listings show: it turns false only once the weights' bytes are
    refunded, and true only once they are charged."""

    name: str
    path: str
    pool: KVPool
    model: Any = None
    tokenizer: Any = None
    weight_bytes: int = 0
    loaded: bool = False
    context_length: int | None = None
    active: int = 0
    last_used: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def ensure_loaded(self) -> None:
        """Load the weights (charging them to the row) unless they are loaded."""
        with self.lock:
            self._load_locked()

    def acquire(self) -> None:
        """Load if needed and count one running request, atomically: the keep-alive
        reaper never unloads a model between its load and its use."""
        with self.lock:
            self._load_locked()
            self.active += 1

    def done(self) -> None:
        with self.lock:
            self.active -= 1
            self.last_used = time.monotonic()

    def _load_locked(self) -> None:
        if self.model is not None:
            return
        import mlx.core as mx
        import mlx_lm
        from mlx import utils

        load: Any = mlx_lm.load
        flatten: Any = utils.tree_flatten
        with _MLX_LOCK:
            model, tokenizer = load(self.path)
            nbytes = sum(int(v.nbytes) for _, v in flatten(model.parameters()))
        if not self.pool.account.try_charge(nbytes):
            del model
            gc.collect()
            mx.clear_cache()
            totals = self.pool.ledger.totals()
            raise ModelDoesNotFit(
                f"model {self.name!r} needs {nbytes} bytes of weights, but the budget "
                f"has {totals.free} of {totals.budget} bytes free (raise "
                "KVCACHED_BUDGET or `kvctl budget`, or the model's `kvctl limit`)"
            )
        self.model, self.tokenizer, self.weight_bytes = model, tokenizer, nbytes
        self.loaded = True

    def unload(self) -> bool:
        """Drop the weights if no request runs; True when they were dropped. In this
        order: free them, refund them, then say unloaded."""
        with self.lock:
            if self.model is None or self.active:
                return False
            import mlx.core as mx

            self.model = self.tokenizer = None
            gc.collect()
            mx.clear_cache()
            self.pool.account.refund(self.weight_bytes)
            self.weight_bytes = 0
            self.loaded = False
        release_free_memory()
        return True


class Sampler:
    """Picks each token of one request: greedy at temperature 0, else from the
    temperature-scaled distribution with the request's own random key (from `seed`, or
    fresh randomness), split at every token."""

    def __init__(self, temperature: float, seed: int | None) -> None:
        import mlx.core as mx

        self.temperature = temperature
        self._key = mx.random.key(secrets.randbits(64) if seed is None else seed % 2**64)

    def __call__(self, logprobs: Any) -> Any:
        import mlx.core as mx

        if self.temperature == 0:
            return mx.argmax(logprobs, axis=-1)
        self._key, key = mx.random.split(self._key)
        return mx.random.categorical(logprobs * (1 / self.temperature), key=key)


class MultiModelServer:
    """The models, the keep-alive reaper, and the generation loop (no HTTP here)."""

    def __init__(
        self,
        paths: list[str],
        *,
        keep_alive_s: float = DEFAULT_KEEP_ALIVE_S,
        budget: str | None = None,
        preload: bool = True,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    ) -> None:
        if not paths:
            raise InvalidArgument("serve-mlx needs at least one model folder")
        if not isinstance(prefill_chunk, int) or prefill_chunk <= 0:
            raise InvalidArgument(f"prefill_chunk must be a positive int, got {prefill_chunk!r}")
        self.keep_alive_s = keep_alive_s
        self.prefill_chunk = prefill_chunk
        self.models: dict[str, ServedModel] = {}
        self._stop = threading.Event()
        self._workers: set[threading.Thread] = set()
        try:
            for path in paths:
                name = Path(path).name
                if not (Path(path) / "config.json").is_file():
                    raise InvalidArgument(
                        f"{path!r} is not an mlx-lm model folder (no config.json); pass "
                        "local model folders"
                    )
                if name in self.models:
                    raise InvalidArgument(f"two models are named {name!r}; rename a folder")
                # An existing ledger keeps its budget; the first row's open says so, once.
                source = f"--budget {budget}" if budget is not None and not self.models else None
                pool = KVPool(
                    f"serve-mlx/{name}", budget=budget, budget_source=source, engine="mlx-lm"
                )
                self.models[name] = ServedModel(
                    name, path, pool, context_length=context_length(path)
                )
            if preload:
                for served in self.models.values():
                    served.ensure_loaded()
        except BaseException:
            self.close()
            raise
        self._reaper = threading.Thread(target=self._reap, name="serve-mlx-keepalive", daemon=True)
        self._reaper.start()

    def lookup(self, name: Any) -> ServedModel:
        served = self.models.get(name) if isinstance(name, str) else None
        if served is None:
            raise LookupError(
                f"model {name!r} is not served here; served models: {', '.join(self.models)}"
            )
        return served

    def generate(
        self, served: ServedModel, prompt: list[int], max_tokens: int, sampler: Sampler
    ) -> Iterator[tuple[int, str | None]]:
        """Yield (token, finish_reason or None) for one request; KV released at the end.

        The request runs in a thread of its own from start to end: mlx-lm's generator
        enters an MLX stream context, which must be left in the thread that entered
        it, while an HTTP stream is consumed from whichever worker thread is free.
        Raises ShuttingDown when the server stops first."""
        if self._stop.is_set():
            raise ShuttingDown("the server is shutting down")
        served.acquire()
        out: queue.Queue[tuple[int, str | None] | BaseException | None] = queue.Queue(16)
        cancelled = threading.Event()
        worker = threading.Thread(
            target=self._run_request,
            args=(served, prompt, max_tokens, sampler, out, cancelled),
            name=f"serve-mlx-{served.name}",
            daemon=True,
        )
        self._workers.add(worker)
        worker.start()
        try:
            while True:
                item = out.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            cancelled.set()
            while worker.is_alive():  # let it see the flag: unblock a full queue
                with contextlib.suppress(queue.Empty):
                    while True:
                        out.get_nowait()
                worker.join(timeout=0.01)
            self._workers.discard(worker)

    def _run_request(
        self,
        served: ServedModel,
        prompt: list[int],
        max_tokens: int,
        sampler: Sampler,
        out: queue.Queue[tuple[int, str | None] | BaseException | None],
        cancelled: threading.Event,
    ) -> None:
        import mlx.core as mx
        from mlx_lm.generate import generate_step

        def stopped() -> bool:
            if self._stop.is_set():
                raise ShuttingDown("the server is shutting down")
            return cancelled.is_set()

        cache = served.pool.make_cache(served.model, capacity=len(prompt) + max_tokens)
        steps: Any = None
        try:
            tokens = mx.array(prompt)
            if self._prefill(served, tokens[:-1], cache, stopped):
                eos = set(getattr(served.tokenizer, "eos_token_ids", []) or [])
                steps = generate_step(
                    tokens[-1:], served.model, prompt_cache=cache, max_tokens=max_tokens,
                    sampler=sampler,
                )  # fmt: skip
                for count in range(1, max_tokens + 1):
                    if stopped():
                        break
                    with _MLX_LOCK:
                        item = next(steps, None)
                    if item is None:
                        break
                    token = int(item[0])
                    if token in eos:
                        out.put((token, "stop"))
                        break
                    out.put((token, "length" if count == max_tokens else None))
            out.put(None)
        except BaseException as exc:
            out.put(exc)
        finally:
            if steps is not None:
                steps.close()  # leaves its MLX stream context in this thread
            with _MLX_LOCK:
                served.pool.release(cache)
                del cache
                mx.clear_cache()
            served.done()

    def _prefill(
        self, served: ServedModel, tokens: Any, cache: list[Any], stopped: Callable[[], bool]
    ) -> bool:
        """Run `tokens` through the model into `cache`, `prefill_chunk` tokens per step
        under the MLX lock (Note [one MLX lock]); False when stopped between chunks."""
        import mlx.core as mx
        from mlx_lm.generate import generation_stream

        for start in range(0, len(tokens), self.prefill_chunk):
            if stopped():
                return False
            chunk = tokens[start : start + self.prefill_chunk]
            with _MLX_LOCK, mx.stream(generation_stream):
                served.model(chunk[None], cache=cache)
                mx.eval([c.state for c in cache])
                mx.clear_cache()
        return True

    def _reap(self) -> None:
        while not self._stop.wait(min(1.0, max(self.keep_alive_s / 4, 0.05))):
            now = time.monotonic()
            for served in self.models.values():
                idle = served.model is not None and not served.active
                if idle and now - served.last_used >= self.keep_alive_s:
                    served.unload()

    def stop(self) -> None:
        """Stop generating: running requests end at their next chunk or token with
        ShuttingDown, new ones are refused. `close` calls it; so does a Ctrl-C."""
        self._stop.set()

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop, wait for running requests to end, unload and drop every row."""
        self.stop()
        deadline = time.monotonic() + timeout_s
        for worker in list(self._workers):
            worker.join(max(0.0, deadline - time.monotonic()))
        for served in self.models.values():
            served.unload()
            served.pool.close()


# ---------------------------------------------------------------------- HTTP
def _error(
    status: int,
    message: str,
    kind: str = "invalid_request_error",
    *,
    param: str | None = None,
    code: str | None = None,
) -> Any:
    from starlette.responses import JSONResponse

    from kvcached.engines.mlx_lm.protocol import error_body

    return JSONResponse(error_body(message, kind, param=param, code=code), status_code=status)


def _unavailable(exc: KVCachedError) -> Any:
    """A 503: the budget refused (weights or KV), or the server is stopping."""
    code = "shutting_down" if isinstance(exc, ShuttingDown) else "insufficient_budget"
    return _error(503, str(exc), "server_error", code=code)


def _sse(events: Iterator[dict[str, Any]]) -> Iterator[str]:
    for event in events:
        yield f"data: {json.dumps(event)}\n\n"
    yield "data: [DONE]\n\n"


def build_app(server: MultiModelServer) -> Any:
    """The Starlette application over `server`."""
    from pydantic import ValidationError
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    from kvcached.engines.mlx_lm.protocol import (
        ChatRequest,
        CompletionRequest,
        validation_error_body,
    )

    async def models(_: Request) -> Any:
        data = [
            {"id": name, "object": "model", "owned_by": "kvcached", "loaded": s.loaded}
            for name, s in server.models.items()
        ]
        return JSONResponse({"object": "list", "data": data})

    async def complete(request: Request, chat: bool) -> Any:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the request body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        try:
            req = (ChatRequest if chat else CompletionRequest).model_validate(body)
        except ValidationError as exc:
            return JSONResponse(validation_error_body(exc), status_code=400)
        try:
            served = server.lookup(req.model)
        except LookupError as exc:
            return _error(404, str(exc), param="model", code="model_not_found")
        try:
            await run_in_threadpool(served.ensure_loaded)
        except ModelDoesNotFit as exc:
            return _unavailable(exc)
        try:
            prompt = _prompt_tokens(served, req)
        except PromptRefused as exc:
            return _error(400, str(exc), param="messages" if chat else "prompt")
        asked = req.max_tokens
        if isinstance(req, ChatRequest) and req.max_completion_tokens is not None:
            asked = req.max_completion_tokens
        max_tokens = _max_tokens(served, len(prompt), asked)
        if isinstance(max_tokens, str):
            return _error(400, max_tokens, param="messages" if chat else "prompt",
                          code="context_length_exceeded")  # fmt: skip
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:16]}"
        sampler = Sampler(req.temperature or 0.0, req.seed)
        try:
            tokens = server.generate(served, prompt, max_tokens, sampler)
        except ShuttingDown as exc:
            return _unavailable(exc)
        if req.stream:
            first = await run_in_threadpool(_first, tokens)
            if isinstance(first, KVCachedError):
                return _unavailable(first)
            events = _stream_events(served, rid, chat, first, tokens)
            return StreamingResponse(_sse(events), media_type="text/event-stream")
        try:
            generated = await run_in_threadpool(list, tokens)
        except (OutOfMemory, ShuttingDown) as exc:  # KV refused, a reload that no longer fits
            return _unavailable(exc)
        ids = [t for t, _ in generated]
        reason = generated[-1][1] if generated else "length"
        detokenizer = served.tokenizer.detokenizer
        for token, why in generated:
            if why != "stop":
                detokenizer.add_token(token)
        detokenizer.finalize()
        usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(ids),
            "total_tokens": len(prompt) + len(ids),
        }
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason or "length"}
        if chat:
            choice["message"] = {"role": "assistant", "content": detokenizer.text}
        else:
            choice["text"] = detokenizer.text
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": served.name,
                "choices": [choice],
                "usage": usage,
            }
        )

    async def completions(request: Request) -> Any:
        return await complete(request, chat=False)

    async def chat_completions(request: Request) -> Any:
        return await complete(request, chat=True)

    async def http_error(_: Request, exc: Exception) -> Any:
        assert isinstance(exc, HTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(exc.status_code, str(exc.detail), kind)

    async def internal_error(_: Request, exc: Exception) -> Any:
        # A bug of ours, never bad input (protocol.py refuses that first). Starlette
        # re-raises after this answer, so uvicorn logs the traceback.
        return _error(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")

    app = Starlette(
        routes=[
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        ],
        exception_handlers={HTTPException: http_error, Exception: internal_error},
    )
    app.state.server = server
    return app


class PromptRefused(ValueError):
    """The prompt cannot be made into tokens (the chat template refused the messages)."""


def _first(tokens: Iterator[tuple[int, str | None]]) -> Any:
    """The first token, or the OutOfMemory / ShuttingDown that stopped it (before any
    byte is sent)."""
    try:
        return next(tokens, None)
    except KVCachedError as exc:
        return exc


def _prompt_tokens(served: ServedModel, req: Any) -> list[int]:
    from kvcached.engines.mlx_lm.protocol import ChatRequest

    tokenizer = served.tokenizer
    if not isinstance(req, ChatRequest):
        return list(tokenizer.encode(req.prompt))
    from jinja2 import TemplateError

    messages = [{"role": m.role, "content": m.content or ""} for m in req.messages]
    try:
        tokens = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    except (TemplateError, ValueError, TypeError) as exc:
        raise PromptRefused(f"the model's chat template refused the messages: {exc}") from None
    if not tokens:
        raise PromptRefused("the messages make an empty prompt")
    return tokens


def _max_tokens(served: ServedModel, prompt_tokens: int, asked: int | None) -> int | str:
    """The tokens to generate: `asked`, else the default, within the context length;
    a message saying why when the prompt (and `asked`) do not fit."""
    limit = served.context_length
    if limit is None:
        return DEFAULT_MAX_TOKENS if asked is None else asked
    if asked is None:
        if prompt_tokens < limit:
            return min(DEFAULT_MAX_TOKENS, limit - prompt_tokens)
        asked = 1
    if prompt_tokens + asked <= limit:
        return asked
    return (
        f"model {served.name!r} has a context length of {limit} tokens, but "
        f"{prompt_tokens + asked} were requested ({prompt_tokens} of prompt, {asked} to "
        "generate): shorten the prompt or lower max_tokens"
    )


def _stream_events(
    served: ServedModel,
    rid: str,
    chat: bool,
    first: tuple[int, str | None] | None,
    tokens: Iterator[tuple[int, str | None]],
) -> Iterator[dict[str, Any]]:
    created = int(time.time())
    kind = "chat.completion.chunk" if chat else "text_completion"

    def event(text: str, reason: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason}
        if chat:
            choice["delta"] = {"content": text} if text else {}
        else:
            choice["text"] = text
        return {"id": rid, "object": kind, "created": created, "model": served.name,
                "choices": [choice]}  # fmt: skip

    if chat:
        yield {**event("", None), "choices": [{"index": 0, "delta": {"role": "assistant"},
                                               "finish_reason": None}]}  # fmt: skip
    items = [] if first is None else [first]
    pieces = _text_pieces(served.tokenizer, _chain(items, tokens))
    for piece, reason in pieces:
        yield event(piece, reason)
        if reason is not None:
            return


def _text_pieces(
    tokenizer: Any, tokens: Iterator[tuple[int, str | None]]
) -> Iterator[tuple[str, str | None]]:
    """(new text, finish_reason) per token, through the tokenizer's streaming
    detokenizer: a character split across tokens goes out whole, once complete; the
    last piece (a finish reason, or the end) carries what was held back."""
    detokenizer = tokenizer.detokenizer
    reason: str | None = None
    for token, reason in tokens:
        if reason != "stop":
            detokenizer.add_token(token)
        if reason is None:
            yield detokenizer.last_segment, None
        else:
            break
    detokenizer.finalize()
    yield detokenizer.last_segment, reason or "length"


def _chain(
    head: list[tuple[int, str | None]], tail: Iterator[tuple[int, str | None]]
) -> Iterator[tuple[int, str | None]]:
    yield from head
    try:
        yield from tail
    except KVCachedError:
        return


def serve(
    paths: list[str],
    *,
    host: str = "127.0.0.1",
    port: int = 8080,
    keep_alive_s: float = DEFAULT_KEEP_ALIVE_S,
    budget: str | None = None,
) -> None:
    """Run the server until interrupted (the `kvcached serve-mlx` command). The first
    Ctrl-C stops generation at once (between prefill chunks and tokens), so uvicorn's
    wait for open connections is short."""
    import uvicorn

    server = MultiModelServer(paths, keep_alive_s=keep_alive_s, budget=budget)

    class Uvicorn(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            server.stop()
            super().handle_exit(sig, frame)

    try:
        config = uvicorn.Config(build_app(server), host=host, port=port, log_level="warning")
        Uvicorn(config).run()
    finally:
        server.close()
