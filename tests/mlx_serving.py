"""What the serve-mlx tests share: tiny models, the server behind uvicorn on an
ephemeral port of 127.0.0.1, and a bounded wait (not a test module: no tests here)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import uvicorn

from kvcached.engines.mlx_lm.serve import MultiModelServer, build_app
from kvcached.engines.mlx_lm.tiny import build_model
from kvcached.ledger import Ledger


def tiny_models(root: Path) -> list[str]:
    """Two tiny random models of different architectures: alpha (Qwen3), beta (Llama)."""
    return [
        str(build_model(root / "alpha", "qwen3", seed=1)),
        str(build_model(root / "beta", "llama", seed=2)),
    ]


class Running:
    """A MultiModelServer behind uvicorn on an ephemeral port of 127.0.0.1, with an
    `openai` client that never retries (a test sees each answer as the server gave it)
    and httpx helpers for the routes that are not OpenAI's."""

    def __init__(self, server: MultiModelServer) -> None:
        self.server = server
        config = uvicorn.Config(build_app(server), host="127.0.0.1", port=0, log_level="error")
        self.http = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.http.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.http.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        port = self.http.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0)

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, timeout=60)

    def post(self, path: str, body: Any) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=60)

    def rows(self) -> dict[str, Any]:
        """The device ledger's rows by name (serve-mlx/<model>)."""
        pool = next(iter(self.server.models.values())).pool
        ledger = Ledger.open(pool.ledger.key)
        try:
            return {r.name: r for r in ledger.rows()}
        finally:
            ledger.close()

    def stop(self) -> None:
        self.http.should_exit = True
        self.thread.join(timeout=30)
        self.server.close()


def wait_for(condition: Any, what: str) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.05)
