"""`kvcached serve` as a whole process (`app.run`): supervisor, router and uvicorn in one
loop over the stand-in engine (tests/serve_fake_engine.py); a signal stops everything,
exit 0, no engine left; a taken port fails before any engine starts; a crash of the
server still stops the engines."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_harness import ledger_rows, process_exists  # tests/, on sys.path under pytest

from kvcached.apps.serve import app
from kvcached.apps.serve.config import ModelSpec, ServeConfig
from kvcached.apps.serve.launchers import Launcher
from kvcached.apps.serve.state import ModelState
from kvcached.apps.serve.supervisor import group_alive

MiB = 1 << 20
FAKE_ENGINE = Path(__file__).with_name("serve_fake_engine.py")
FAKE = Launcher(
    engine="fake",
    argv=(str(FAKE_ENGINE), "--name", "{name}", "--host", "{host}", "--port", "{port}"),
    owned=("--name", "--host", "--port"),
)

#: the `kvcached serve` process of a test: the config as JSON in argv[1]
SERVE_SCRIPT = f"""
import json, sys
from kvcached.apps.serve.app import run
from kvcached.apps.serve.config import ServeConfig
from kvcached.apps.serve.launchers import Launcher
fake = Launcher(engine="fake", argv={FAKE.argv!r}, owned={FAKE.owned!r})
config = ServeConfig.model_validate(json.loads(sys.argv[1]))
sys.exit(run(config, launchers={{"vllm": fake}}, log_level="warning"))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def config_data(tmp_path: Path, port: int) -> dict[str, Any]:
    folder = tmp_path / "model"  # the stand-in engine reads nothing from it
    folder.mkdir(exist_ok=True)
    return {
        "models": [{"name": "m", "engine": "vllm", "path": str(folder)}],
        "port": port,
        "budget": 64 * MiB,
        "log_dir": str(tmp_path / "logs"),
        "ledger_dir": str(tmp_path / "ledger"),
        "start_timeout": 30.0,
    }


def rows(tmp_path: Path) -> dict[str, Any]:
    return ledger_rows(tmp_path, 64 * MiB)


def wait_for(condition: Callable[[], Any], what: str, timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = condition()
        if got:
            return got
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.05)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_serve_runs_until_a_signal_then_stops_every_engine(
    tmp_path: Path,
    ledger_dir: Path,
    sigint_as_in_a_terminal: Callable[[], None],
    sig: signal.Signals,
) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE_SCRIPT, json.dumps(config_data(tmp_path, port))],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=sigint_as_in_a_terminal,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        url = f"http://127.0.0.1:{port}"
        assert first.startswith(f"kvcached serve: OpenAI API at {url}/v1"), first
        banner = [proc.stdout.readline() for _ in range(2)]
        assert any(line.split()[:2] == ["m", "vllm"] for line in banner), banner
        with httpx.Client(base_url=url, timeout=30) as client:
            r = client.post(
                "/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 2},
            )  # fmt: skip
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == " m-0 m-1"
            assert client.get("/v1/models").json()["data"][0]["state"] == "awake"
            assert client.get("/dashboard").status_code == 200
            assert "kvcached_serve_requests_total" in client.get("/metrics").text
        engine_pid = rows(tmp_path)["m"].pid
        assert process_exists(engine_pid)
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == 0, proc.stderr.read() if proc.stderr else ""
        wait_for(lambda: not process_exists(engine_pid), "the engine to be gone", timeout=10)
        assert rows(tmp_path) == {}
        with socket.socket() as s:  # the router's port is free again (for a server that,
            # as uvicorn does, reuses an address closed connections leave in TIME_WAIT)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_server_killed_outright_takes_its_engines_with_it(
    tmp_path: Path, ledger_dir: Path
) -> None:
    """SIGKILL runs no cleanup: the engines must still not outlive the server (each is
    started with a parent-death signal), or they would hold their memory for good."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE_SCRIPT, json.dumps(config_data(tmp_path, port))],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith("kvcached serve: OpenAI API at")
        engine_pid = wait_for(lambda: getattr(rows(tmp_path).get("m"), "pid", None), "a row")
        assert group_alive(engine_pid)
        proc.kill()
        proc.wait()
        wait_for(lambda: not group_alive(engine_pid), "the engine to stop", timeout=20)
        wait_for(lambda: rows(tmp_path) == {}, "its row to be reclaimed", timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_taken_port_fails_before_any_engine_starts(
    tmp_path: Path, ledger_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = ServeConfig.model_validate(config_data(tmp_path, port))
        started = time.monotonic()
        assert app.run(config, launchers={"vllm": FAKE}) == 1
        assert time.monotonic() - started < 5
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "port" in err
    assert not (tmp_path / "logs").exists()  # no engine was started


def test_a_crash_of_the_server_still_stops_the_engines(
    tmp_path: Path, ledger_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, int] = {}

    class Crashing:
        """A server that waits until the engine serves, then crashes."""

        def __init__(self, models: Any) -> None:
            self.models = models
            self.should_exit = False
            self.force_exit = False
            self.started = True

        async def serve(self, sockets: Any = None) -> None:
            handle = self.models.handle("m")
            while handle.state is not ModelState.AWAKE:
                await asyncio.sleep(0.05)
            seen["pid"] = rows(tmp_path)["m"].pid
            raise RuntimeError("boom")

    def crashing_server(application: Any, config: Any, log_level: str) -> Crashing:
        return Crashing(application.state.models)

    monkeypatch.setattr(app, "_server", crashing_server)
    config = ServeConfig.model_validate(config_data(tmp_path, free_port()))
    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(asyncio.wait_for(app.serve(config, launchers={"vllm": FAKE}), 60))
    assert not process_exists(seen["pid"])
    assert rows(tmp_path) == {}


def test_the_banner_names_the_url_and_every_model(tmp_path: Path) -> None:
    (tmp_path / "qwen").mkdir()
    config = ServeConfig(
        models=[
            ModelSpec(name="qwen", engine="vllm", path=str(tmp_path / "qwen")),
            ModelSpec(name="tiny", engine="mlx", path="mlx-community/tiny", preload=False),
        ],
        host="0.0.0.0",
        port=9000,
        api_key="k",
        budget=64 * MiB,
        log_dir=tmp_path / "logs",
    )

    class States:
        def handle(self, name: object) -> Any:
            class H:
                state = ModelState.LOADING if name == "qwen" else ModelState.STOPPED

            return H()

    text = app.banner(config, States(), app._url(config.host, 9000), dashboard=True)  # type: ignore[arg-type]
    assert "http://127.0.0.1:9000/v1" in text and "every address" in text
    assert "http://127.0.0.1:9000/dashboard" in text and "Bearer" in text
    assert f"qwen  vllm   {tmp_path / 'qwen'}  (loading)" in text
    assert "tiny  mlx    mlx-community/tiny  (stopped, starts on its first request)" in text


def test_an_engine_that_dies_mid_stream_ends_the_stream_with_an_error(
    tmp_path: Path, ledger_dir: Path
) -> None:
    data = config_data(tmp_path, free_port())
    data["models"][0]["args"] = ["--token-delay", "0.02"]
    data["models"][0]["env"] = {"FAKE_CRASH_AFTER_TOKENS": "3"}  # dies making its 3rd token
    config = ServeConfig.model_validate(data)

    async def body() -> None:
        ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        server = asyncio.ensure_future(
            app.serve(config, on_ready=ready.set_result, launchers={"vllm": FAKE})
        )
        try:
            url = await asyncio.wait_for(ready, 30)
            chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                    "stream": True, "max_tokens": 10}  # fmt: skip
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                async with client.stream("POST", "/v1/chat/completions", json=chat) as r:
                    assert r.status_code == 200
                    text = (await r.aread()).decode()
                events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
                assert [json.loads(e)["choices"][0]["delta"]["content"] for e in events[:2]] == [
                    " m-0",
                    " m-1",
                ]
                error = json.loads(events[-1])["error"]
                assert error["code"] == "engine_stopped" and "'m'" in error["message"]
                assert "[DONE]" not in text
                state = (await client.get("/api/state")).json()["models"][0]
                assert state["errors_total"] == 1 and state["requests_total"] == 1
        finally:
            server.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await server
        assert rows(tmp_path) == {}  # cancelled, serve still stopped the engine

    asyncio.run(asyncio.wait_for(body(), 90))
