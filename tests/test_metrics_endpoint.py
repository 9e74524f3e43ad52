"""The metrics endpoint of KVCACHED_METRICS_PORT: one per process, asked for by every cache.

There used to be two guards for it, one in cache.py (by pid) and one in metrics.py (by
server object), which disagreed: a taken port was tried again by every later cache,
and a forked child inherited the parent's server object, so it never asked for one of
its own and a `stop_process_server()` there would wait on a thread the child does not
have. Now metrics.py holds the only guard (Note [one endpoint per process]).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcached import metrics
from kvcached.backends.host import HostBackend
from kvcached.cache import KVCache
from kvcached.config import reload_settings
from kvcached.layout import LayerSpec

LAYERS = [LayerSpec(num_kv_heads=2, head_dim=64)]
QUIET = {"pool_low": 0, "pool_high": 0, "release_delay": 0.0, "background": False}


@pytest.fixture
def backend(ledger_dir: Path) -> Iterator[HostBackend]:
    with HostBackend(budget="64MiB") as instance:
        yield instance


@pytest.fixture
def port(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """A free port, set as KVCACHED_METRICS_PORT; this process's endpoint stopped after."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free: int = probe.getsockname()[1]
    monkeypatch.setenv("KVCACHED_METRICS_PORT", str(free))
    monkeypatch.setenv("KVCACHED_METRICS_ADDR", "127.0.0.1")
    reload_settings()
    metrics.stop_process_server()
    yield free
    metrics.stop_process_server()


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        body: str = response.read().decode()
        return body


def test_a_taken_port_is_tried_once_per_process_not_once_per_cache(
    backend: HostBackend, port: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvcached.metrics")
    with socket.socket() as holder:  # another process serves the port already
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", port))
        holder.listen()
        for name in ("first", "second", "third"):
            with KVCache(LAYERS, block_size=16, name=name, backend=backend, **QUIET):
                pass
    taken = [r for r in caplog.records if "is taken" in r.getMessage()]
    assert [r.getMessage() for r in taken] == [
        f"metrics port {port} is taken; another process serves it"
    ]
    assert metrics.start_process_server() is None  # asked once: not asked again


def test_every_cache_shares_the_one_endpoint(backend: HostBackend, port: int) -> None:
    with KVCache(LAYERS, block_size=16, name="one", backend=backend, **QUIET):
        server = metrics.start_process_server()
        assert server is not None and server.port == port
        with KVCache(LAYERS, block_size=16, name="two", backend=backend, **QUIET):
            assert metrics.start_process_server() is server
            body = _scrape(port)
    assert 'name="one"' in body and 'name="two"' in body


def test_a_port_set_after_a_first_cache_is_still_served(
    backend: HostBackend, port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unset variable is not an attempt: the next cache, once it is set, serves."""
    monkeypatch.delenv("KVCACHED_METRICS_PORT")
    reload_settings()
    with KVCache(LAYERS, block_size=16, name="early", backend=backend, **QUIET):
        assert metrics.start_process_server() is None
        monkeypatch.setenv("KVCACHED_METRICS_PORT", str(port))
        reload_settings()
        with KVCache(LAYERS, block_size=16, name="late", backend=backend, **QUIET):
            assert 'name="late"' in _scrape(port)


def test_a_forked_child_forgets_the_parents_endpoint_and_asks_for_its_own(
    backend: HostBackend, port: int
) -> None:
    with KVCache(LAYERS, block_size=16, name="parent", backend=backend, **QUIET):
        served = metrics.start_process_server()
        assert served is not None
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child
            os.close(read_end)
            try:
                inherited = metrics._process_server
                again = metrics.start_process_server()  # the parent holds the port
                metrics.stop_process_server()  # nothing of the parent's to stop: no hang
                report = {"inherited": inherited is not None, "again": again is not None}
            except BaseException as exc:
                report = {"crashed": repr(exc)}
            os.write(write_end, json.dumps(report).encode())
            os._exit(0)
        os.close(write_end)
        with os.fdopen(read_end, "rb") as pipe:
            child = json.loads(pipe.read())
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        assert child == {"inherited": False, "again": False}
        assert 'name="parent"' in _scrape(port)  # the parent's endpoint still serves
        assert metrics.start_process_server() is served
