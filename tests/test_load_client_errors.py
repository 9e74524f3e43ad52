"""The load client of benchmarks/serve_multi_model.py (used by serve_latency.py too) says
where a failed request broke: a connection that closed before the answer began, a
stream the server began and cut before any token, or one cut mid-stream. A bare
`ReadError` at overload was all the H100 and H200 runs kept; which of the three it was
tells the client's connection reuse from the server ending a request."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from serve_multi_model import Result, _one

httpx = pytest.importorskip("httpx")

CHUNK = b'data: {"choices": [{"text": "x"}]}\n\n'


class _CutStream(httpx.AsyncByteStream):
    """An answer body that sends `chunks` and then breaks as a closed socket does."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk
        raise httpx.ReadError("peer closed the connection")


def _ask(handler: Callable[[httpx.Request], httpx.Response]) -> Result:
    async def go() -> Result:
        transport = httpx.MockTransport(handler)
        async with httpx.AsyncClient(transport=transport) as client:
            return await _one(client, "http://server", "m", [1, 2, 3], 4, 5.0)

    return asyncio.run(go())


def test_a_connection_closed_before_the_answer_says_so() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadError("", request=request)

    result = _ask(handler)
    assert not result.ok
    assert result.error == "ReadError before the answer's headers: "


def test_a_stream_cut_before_its_first_token_says_the_answer_had_begun() -> None:
    result = _ask(lambda request: httpx.Response(200, stream=_CutStream([])))
    assert not result.ok
    assert result.error is not None
    assert result.error.startswith("ReadError after the headers, before the first token")


def test_a_stream_cut_after_tokens_says_mid_stream() -> None:
    result = _ask(lambda request: httpx.Response(200, stream=_CutStream([CHUNK, CHUNK])))
    assert not result.ok
    assert result.error is not None and result.error.startswith("ReadError mid-stream")


def test_a_whole_stream_is_a_served_request() -> None:
    body = CHUNK * 3 + b"data: [DONE]\n\n"
    result = _ask(lambda request: httpx.Response(200, content=body))
    assert result.ok and result.tokens == 3 and result.error is None
