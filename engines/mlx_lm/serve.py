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
MLX work runs in worker threads, one decode step at a time under one lock (MLX's graph
evaluation is not meant to be driven from several threads at once); requests to
different models interleave step by step.
"""

from __future__ import annotations

import contextlib
import gc
import json
import queue
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcached.engines.mlx_lm.pool import KVPool
from kvcached.errors import InvalidArgument, KVCachedError, OutOfMemory

DEFAULT_KEEP_ALIVE_S = 300.0
DEFAULT_MAX_TOKENS = 256

#: One MLX evaluation at a time, across every model of the process.
_MLX_LOCK = threading.Lock()


class ModelDoesNotFit(OutOfMemory):
    """The budget (or the model's limit) cannot hold the model's weights."""


@dataclass
class ServedModel:
    """One model: its folder, its ledger row (pool), and its weights while loaded."""

    name: str
    path: str
    pool: KVPool
    model: Any = None
    tokenizer: Any = None
    weight_bytes: int = 0
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

    def unload(self) -> bool:
        """Drop the weights if no request runs; True when they were dropped."""
        with self.lock:
            if self.model is None or self.active:
                return False
            import mlx.core as mx

            self.model = self.tokenizer = None
            gc.collect()
            mx.clear_cache()
            self.pool.account.refund(self.weight_bytes)
            self.weight_bytes = 0
            return True


class MultiModelServer:
    """The models, the keep-alive reaper, and the generation loop (no HTTP here)."""

    def __init__(
        self,
        paths: list[str],
        *,
        keep_alive_s: float = DEFAULT_KEEP_ALIVE_S,
        budget: str | None = None,
        preload: bool = True,
    ) -> None:
        if not paths:
            raise InvalidArgument("serve-mlx needs at least one model folder")
        self.keep_alive_s = keep_alive_s
        self.models: dict[str, ServedModel] = {}
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
                pool = KVPool(f"serve-mlx/{name}", budget=budget, engine="mlx-lm")
                self.models[name] = ServedModel(name, path, pool)
            if preload:
                for served in self.models.values():
                    served.ensure_loaded()
        except BaseException:
            self.close()
            raise
        self._stop = threading.Event()
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
        self, served: ServedModel, prompt: list[int], max_tokens: int, temperature: float
    ) -> Iterator[tuple[int, str | None]]:
        """Yield (token, finish_reason or None) for one request; KV released at the end.

        The request runs in a thread of its own from start to end: mlx-lm's generator
        enters an MLX stream context, which must be left in the thread that entered
        it, while an HTTP stream is consumed from whichever worker thread is free."""
        served.acquire()
        out: queue.Queue[tuple[int, str | None] | BaseException | None] = queue.Queue(16)
        cancelled = threading.Event()
        worker = threading.Thread(
            target=self._run_request,
            args=(served, prompt, max_tokens, temperature, out, cancelled),
            name=f"serve-mlx-{served.name}",
            daemon=True,
        )
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
                    out.get(timeout=0.05)

    def _run_request(
        self,
        served: ServedModel,
        prompt: list[int],
        max_tokens: int,
        temperature: float,
        out: queue.Queue[tuple[int, str | None] | BaseException | None],
        cancelled: threading.Event,
    ) -> None:
        import mlx.core as mx
        from mlx_lm.generate import generate_step
        from mlx_lm.sample_utils import make_sampler

        cache = served.pool.make_cache(served.model, capacity=len(prompt) + max_tokens)
        try:
            eos = set(getattr(served.tokenizer, "eos_token_ids", []) or [])
            steps = generate_step(
                mx.array(prompt),
                served.model,
                prompt_cache=cache,
                max_tokens=max_tokens,
                sampler=make_sampler(temp=temperature),
            )
            for count in range(1, max_tokens + 1):
                if cancelled.is_set():
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
            steps.close()
            out.put(None)
        except BaseException as exc:
            out.put(exc)
        finally:
            with _MLX_LOCK:
                served.pool.release(cache)
                del cache
                mx.clear_cache()
            served.done()

    def _reap(self) -> None:
        while not self._stop.wait(min(1.0, max(self.keep_alive_s / 4, 0.05))):
            now = time.monotonic()
            for served in self.models.values():
                idle = served.model is not None and not served.active
                if idle and now - served.last_used >= self.keep_alive_s:
                    served.unload()

    def close(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
        for served in self.models.values():
            served.unload()
            served.pool.close()


# ---------------------------------------------------------------------- HTTP
def _error(status: int, message: str, kind: str) -> Any:
    from starlette.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status)


def _sse(events: Iterator[dict[str, Any]]) -> Iterator[str]:
    for event in events:
        yield f"data: {json.dumps(event)}\n\n"
    yield "data: [DONE]\n\n"


def build_app(server: MultiModelServer) -> Any:
    """The Starlette application over `server`."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def models(_: Request) -> Any:
        data = [
            {"id": name, "object": "model", "owned_by": "kvcached", "loaded": s.model is not None}
            for name, s in server.models.items()
        ]
        return JSONResponse({"object": "list", "data": data})

    async def complete(request: Request, chat: bool) -> Any:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the request body is not JSON", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object", "invalid_request_error")
        try:
            served = server.lookup(body.get("model"))
        except LookupError as exc:
            return _error(404, str(exc), "model_not_found")
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens")
        max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
        temperature = body.get("temperature") or 0.0
        if not isinstance(max_tokens, int) or max_tokens <= 0:
            return _error(400, f"max_tokens must be a positive int, got {max_tokens!r}", "invalid")
        try:
            await run_in_threadpool(served.ensure_loaded)
            prompt = _prompt_tokens(served, body, chat)
        except ModelDoesNotFit as exc:
            return _error(503, str(exc), "insufficient_budget")
        except (ValueError, KeyError, TypeError) as exc:
            return _error(400, f"bad request: {exc}", "invalid_request_error")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:16]}"
        tokens = server.generate(served, prompt, max_tokens, float(temperature))
        if body.get("stream"):
            first = await run_in_threadpool(_first, tokens)
            if isinstance(first, Exception):
                return _error(503, str(first), "insufficient_budget")
            events = _stream_events(served, rid, chat, first, tokens)
            return StreamingResponse(_sse(events), media_type="text/event-stream")
        try:
            generated = await run_in_threadpool(list, tokens)
        except OutOfMemory as exc:  # KV refused, or a reload that no longer fits
            return _error(503, str(exc), "insufficient_budget")
        ids = [t for t, _ in generated]
        reason = generated[-1][1] if generated else "length"
        text = served.tokenizer.decode([t for t, r in generated if r != "stop"])
        usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(ids),
            "total_tokens": len(prompt) + len(ids),
        }
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason or "length"}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
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

    app = Starlette(
        routes=[
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        ]
    )
    app.state.server = server
    return app


def _first(tokens: Iterator[tuple[int, str | None]]) -> Any:
    """The first token, or the OutOfMemory that stopped it (before any byte is sent)."""
    try:
        return next(tokens, None)
    except OutOfMemory as exc:
        return exc


def _prompt_tokens(served: ServedModel, body: dict[str, Any], chat: bool) -> list[int]:
    tokenizer = served.tokenizer
    if chat:
        messages = body["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise ValueError("prompt must be a non-empty string")
    return list(tokenizer.encode(prompt))


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
    done: list[int] = []
    sent = ""
    for token, reason in _chain(items, tokens):
        if reason != "stop":
            done.append(token)
        text = served.tokenizer.decode(done)
        piece, sent = text[len(sent) :], text
        yield event(piece, reason)
        if reason is not None:
            return
    yield event("", "length")


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
    """Run the server until interrupted (the `kvcached serve-mlx` command)."""
    import uvicorn

    server = MultiModelServer(paths, keep_alive_s=keep_alive_s, budget=budget)
    try:
        uvicorn.run(build_app(server), host=host, port=port, log_level="warning")
    finally:
        server.close()
