"""`serve-mlx` over HTTP on 127.0.0.1, driven through the `openai` client: two tiny
models, concurrent streams to both, their ledger rows while they run and after."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("openai")
pytest.importorskip("uvicorn")

import openai
import uvicorn

from kvcached.engines.mlx_lm.serve import ModelDoesNotFit, MultiModelServer, build_app
from kvcached.engines.mlx_lm.tiny import build_model
from kvcached.errors import InvalidArgument
from kvcached.ledger import Ledger


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root = tmp_path_factory.mktemp("models")
    return [
        str(build_model(root / "alpha", "qwen3", seed=1)),
        str(build_model(root / "beta", "llama", seed=2)),
    ]


@pytest.fixture
def ledger_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVCACHED_LEDGER_DIR", str(tmp_path))
    return tmp_path


class Running:
    """A MultiModelServer behind uvicorn on an ephemeral port of 127.0.0.1."""

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
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")

    def rows(self) -> dict[str, Any]:
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


@pytest.fixture
def running(model_dirs: list[str], ledger_dir: Path) -> Iterator[Running]:
    instance = Running(MultiModelServer(model_dirs, keep_alive_s=3600, budget="1GiB"))
    yield instance
    instance.stop()


def wait_for(condition: Any, what: str) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.05)


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

    from kvcached.kvctl import app as kvctl

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
