"""A stand-in engine for the tests of `kvcached serve`: OpenAI-shaped, tiny, deterministic.

Run as ``python tests/serve_fake_engine.py --port P --name NAME [options]``. It is what
the supervisor needs an engine to be, and nothing more: an HTTP server on 127.0.0.1
(Starlette under uvicorn, like serve-mlx) answering `GET /health`, `GET /v1/models`,
`POST /v1/completions` and `POST /v1/chat/completions` (whole or streamed as server-sent
events), with a ledger row of its own, so the supervisor's policy sees memory move.

* Tokens are deterministic: the i-th generated token of model NAME is ``" NAME-i"``;
  `--token-delay` seconds pass before each one (so a test can keep a request in
  flight), `max_tokens` (default `--tokens`) of them per answer.
* The row is named by KVCACHED_INSTANCE_NAME (else `--name`), in the ledger the vLLM
  adapter would use (`default_key()`: KVCACHED_BACKEND, else detection; host-cpu here)
  under KVCACHED_LEDGER_DIR, registered before the server answers (vLLM too registers
  while it starts), with KVCACHED_INSTANCE_LIMIT as its first limit. Each request
  charges `--bytes-per-request` before it starts (a 503 when the ledger refuses: the
  limit or the budget is reached) and moves them to a "prefix cache" of up to
  `--cache-bytes` when it ends; the cache is given back whenever the row's limit drops
  below what the row holds, the way kvcached's allocator trims towards a lowered
  limit. So `sleep: kv` (limit 0) empties the row, and waking restores it.
* `POST /sleep` and `POST /wake_up` count calls (vLLM's weights sleep, by name);
  `GET /stats` says how many requests, sleeps and wakes it saw, and its pid.
* Crashes on demand: `POST /crash` exits at once (`os._exit(3)`), FAKE_CRASH_AFTER_TOKENS=N
  exits after the N-th token generated; `--exit-at-start CODE` exits before it serves,
  `--start-delay S` waits S seconds before it binds its port (a slow model load).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

_CRASH_AFTER = int(os.environ.get("FAKE_CRASH_AFTER_TOKENS", "0") or 0)


class Engine:
    """The fake engine's state: its ledger account, its counters, its cache."""

    def __init__(self, args: argparse.Namespace) -> None:
        from kvcached.config import instance_limit, parse_size, settings
        from kvcached.ledger import Ledger, default_key

        self.name = args.name
        self.token_delay = float(args.token_delay)
        self.tokens = int(args.tokens)
        self.per_request = int(args.bytes_per_request)
        self.cache_cap = int(args.cache_bytes)
        budget_text = settings().budget
        budget = parse_size(budget_text) if budget_text else 1 << 30
        self.ledger = Ledger.open(default_key(), budget=budget)
        row = os.environ.get("KVCACHED_INSTANCE_NAME") or self.name
        self.account = self.ledger.register(row, "fake", instance_limit(self.ledger.budget))
        self.cached = 0  # bytes of the prefix cache: reserved, no request using them
        self.in_use = 0
        self.generated = 0
        self.counts = {"requests": 0, "refused": 0, "sleeps": 0, "wakes": 0}

    def admit(self) -> bool:
        """Charge one request's bytes (from the cache first); False when refused."""
        take = min(self.cached, self.per_request)
        if not self.account.try_charge(self.per_request - take):
            return False
        self.cached -= take
        self.in_use += self.per_request
        self.account.set_used(self.in_use)
        return True

    def finish(self) -> None:
        self.in_use -= self.per_request
        keep = min(self.per_request, max(0, self.cache_cap - self.cached))
        self.cached += keep
        self.account.refund(self.per_request - keep)
        self.account.set_used(self.in_use)
        self.trim()

    def trim(self) -> None:
        """Give cached bytes back while the row holds more than its limit."""
        limit = self.account.limit
        if limit is None or not self.cached:
            return
        over = self.account.reserved - limit
        if over > 0:
            give = min(over, self.cached)
            self.cached -= give
            self.account.refund(give)

    def token(self, i: int) -> str:
        self.generated += 1
        if _CRASH_AFTER and self.generated >= _CRASH_AFTER:
            print(f"fake engine {self.name}: crashing after {self.generated} tokens", flush=True)
            os._exit(7)
        return f" {self.name}-{i}"

    def close(self) -> None:
        self.account.close()
        self.ledger.close()


def build_app(engine: Engine) -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    async def trimmer() -> None:
        while True:
            engine.trim()
            await asyncio.sleep(0.05)

    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def models(_: Request) -> Response:
        listed = [{"id": engine.name, "object": "model", "owned_by": "fake"}]
        return JSONResponse({"object": "list", "data": listed})

    async def stats(_: Request) -> Response:
        return JSONResponse(
            {**engine.counts, "pid": os.getpid(), "cached": engine.cached, "in_use": engine.in_use}
        )

    async def sleep(_: Request) -> Response:
        engine.counts["sleeps"] += 1
        return JSONResponse({})

    async def wake_up(_: Request) -> Response:
        engine.counts["wakes"] += 1
        return JSONResponse({})

    async def crash(_: Request) -> Response:
        print(f"fake engine {engine.name}: told to crash", flush=True)
        os._exit(3)

    async def complete(request: Request, chat: bool) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the body is not JSON")
        if not isinstance(body, dict) or body.get("model") != engine.name:
            return _error(404, f"model {body.get('model')!r} is not served here")
        count = int(body.get("max_tokens") or engine.tokens)
        if not engine.admit():
            engine.counts["refused"] += 1
            return _error(503, "KV memory refused by the ledger (limit or budget reached)")
        engine.counts["requests"] += 1
        kind = "chat.completion" if chat else "text_completion"
        rid = f"fake-{uuid.uuid4().hex[:12]}"
        created = int(time.time())

        def choice(text: str, finish: str | None, stream: bool) -> dict[str, Any]:
            if not chat:
                return {"index": 0, "text": text, "finish_reason": finish}
            if stream:
                return {"index": 0, "delta": {"content": text}, "finish_reason": finish}
            message = {"role": "assistant", "content": text}
            return {"index": 0, "message": message, "finish_reason": finish}

        def usage() -> dict[str, int]:
            return {"prompt_tokens": 1, "completion_tokens": count, "total_tokens": count + 1}

        if not body.get("stream"):
            try:
                pieces = []
                for i in range(count):
                    await asyncio.sleep(engine.token_delay)
                    pieces.append(engine.token(i))
            finally:
                engine.finish()
            answer = {
                "id": rid, "object": kind, "created": created, "model": engine.name,
                "choices": [choice("".join(pieces), "length", False)], "usage": usage(),
            }  # fmt: skip
            return JSONResponse(answer)

        async def events() -> AsyncIterator[str]:
            head = {"id": rid, "object": f"{kind}.chunk" if chat else kind, "created": created}
            try:
                for i in range(count):
                    await asyncio.sleep(engine.token_delay)
                    finish = "length" if i == count - 1 else None
                    piece = choice(engine.token(i), finish, True)
                    chunk = {**head, "model": engine.name, "choices": [piece]}
                    yield f"data: {json.dumps(chunk)}\n\n"
                last = {**head, "model": engine.name, "choices": [], "usage": usage()}
                yield f"data: {json.dumps(last)}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                engine.finish()

        return StreamingResponse(events(), media_type="text/event-stream")

    async def completions(request: Request) -> Response:
        return await complete(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await complete(request, chat=True)

    @contextlib.asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        task = asyncio.get_running_loop().create_task(trimmer())
        yield
        task.cancel()
        # here, not after `run()`: uvicorn ends a SIGTERM-ed server by raising the
        # signal again once it has shut down, so nothing after `run()` would run
        engine.close()
        print(f"fake engine {engine.name}: stopped", flush=True)

    return Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/stats", stats, methods=["GET"]),
            Route("/sleep", sleep, methods=["POST"]),
            Route("/wake_up", wake_up, methods=["POST"]),
            Route("/crash", crash, methods=["POST"]),
        ],
        lifespan=lifespan,
    )


def _error(status: int, message: str) -> Any:
    from starlette.responses import JSONResponse

    body = {"error": {"message": message, "type": "fake_error", "param": None, "code": status}}
    return JSONResponse(body, status_code=status)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--token-delay", type=float, default=0.0)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--bytes-per-request", type=int, default=1 << 20)
    parser.add_argument("--cache-bytes", type=int, default=1 << 20)
    parser.add_argument("--start-delay", type=float, default=0.0)
    parser.add_argument("--exit-at-start", type=int, default=None)
    parser.add_argument("--weights-gib", type=float, default=0.25, help="logged as vLLM does")
    args = parser.parse_args(argv)
    if args.exit_at_start is not None:
        print(f"fake engine {args.name}: told to exit at start", file=sys.stderr, flush=True)
        return int(args.exit_at_start)
    import uvicorn

    engine = Engine(args)
    try:
        print(f"fake engine {args.name}: row {engine.account.name}", flush=True)
        # the line vLLM's model runner logs, for the supervisor's weights figure
        print(f"Model loading took {args.weights_gib:g} GiB and 0.01 seconds", flush=True)
        time.sleep(args.start_delay)
        config = uvicorn.Config(
            build_app(engine), host=args.host, port=args.port, log_level="warning",
            access_log=False, timeout_graceful_shutdown=2,
        )  # fmt: skip
        uvicorn.Server(config).run()
    finally:
        engine.close()  # idempotent
    return 0


if __name__ == "__main__":
    sys.exit(main())
