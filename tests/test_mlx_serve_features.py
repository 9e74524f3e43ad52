"""`serve-mlx`'s generation options, model sources, and making room, over HTTP through
the `openai` client (httpx for Ollama-style routes): what mlx_lm.server and Ollama
users expect (issue 24)."""

from __future__ import annotations

import math
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("openai")
pytest.importorskip("uvicorn")

import httpx
from mlx_serving import Running, tiny_models, wait_for

from kvcached.engines.mlx_lm.sampling import StopText
from kvcached.engines.mlx_lm.serve import MultiModelServer, banner
from kvcached.engines.mlx_lm.tiny import build_model
from kvcached.errors import InvalidArgument


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return tiny_models(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def running(model_dirs: list[str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVCACHED_LEDGER_DIR", str(tmp_path_factory.mktemp("ledger")))
        instance = Running(MultiModelServer(model_dirs, keep_alive_s=3600, budget="1GiB"))
        yield instance
        instance.stop()


EXTRA = ("top_k", "min_p", "repetition_penalty")


def text_of(running: Running, stream: bool = False, **request: Any) -> tuple[str, str | None]:
    """(text, finish_reason) of a completion, whole or streamed."""
    request = {"model": "alpha", "prompt": "the quick brown fox", "max_tokens": 24, **request}
    extra = {k: request.pop(k) for k in EXTRA if k in request}  # not the openai client's
    request["extra_body"] = {**request.get("extra_body", {}), **extra}
    if not stream:
        choice = running.client.completions.create(**request).choices[0]
        return choice.text, choice.finish_reason
    chunks = list(running.client.completions.create(stream=True, **request))
    return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason


# ------------------------------------------------------------ generation options
def test_stop_text_holds_back_what_could_become_a_stop_string() -> None:
    cut = StopText(["END", "xyz"])
    assert cut.feed("abcE") == "abc"  # "E" may start "END"
    assert cut.feed("N") == ""
    assert cut.feed("Dtail") == "" and cut.stopped
    cut = StopText(["END"])
    assert cut.feed("aEN") == "a" and cut.feed("x") == "ENx" and cut.flush() == ""
    assert cut.feed("tail E") == "tail " and cut.flush() == "E"


def test_a_stop_string_ends_the_text_before_it_whole_and_streamed(running: Running) -> None:
    full, _ = text_of(running)
    stop = next(full[i : i + 2] for i in range(3, len(full)) if full[i : i + 2].strip())
    expected = full[: full.index(stop)]
    for stream in (False, True):
        assert text_of(running, stream, stop=stop) == (expected, "stop"), stream
        assert text_of(running, stream, stop=[stop, "never here"]) == (expected, "stop")
    answer = running.client.completions.create(
        model="alpha", prompt="the quick brown fox", max_tokens=24, stop=stop
    )
    assert answer.usage is not None and answer.usage.completion_tokens < 24  # it stopped


def test_sampling_options_change_what_is_picked(running: Running) -> None:
    greedy, _ = text_of(running)
    assert text_of(running, temperature=50, top_k=1, seed=3)[0] == greedy  # top-1 is argmax
    assert text_of(running, temperature=50, min_p=1.0, seed=4)[0] == greedy
    assert text_of(running, temperature=50, top_p=1e-6, seed=5)[0] == greedy
    hot = {"temperature": 50, "top_p": 0.9, "top_k": 50, "min_p": 0.01}
    assert text_of(running, **hot, seed=6) == text_of(running, **hot, seed=6)  # seeded
    penalised, _ = text_of(running, extra_body={"repetition_penalty": 5.0})
    assert penalised != greedy and greedy.startswith("$$$")  # it repeats; penalised not
    assert not penalised.startswith("$$$")
    assert text_of(running, frequency_penalty=2.0)[0] != greedy


def test_logprobs_in_openai_shape_for_completions(running: Running) -> None:
    answer = running.client.completions.create(
        model="alpha", prompt="memory", max_tokens=6, logprobs=3
    )
    logprobs = answer.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens and logprobs.token_logprobs
    assert logprobs.top_logprobs is not None and logprobs.text_offset is not None
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 6
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert len(top) == 3 and chosen <= 0
        assert math.isclose(chosen, max(top.values()), abs_tol=1e-5)  # greedy picks the top
    plain = running.client.completions.create(model="alpha", prompt="memory", max_tokens=6)
    assert plain.choices[0].logprobs is None


def test_logprobs_in_openai_shape_for_chat_whole_and_streamed(running: Running) -> None:
    request: dict[str, Any] = {
        "model": "beta", "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 5, "logprobs": True, "top_logprobs": 2,
    }  # fmt: skip
    whole = running.client.chat.completions.create(**request)
    content = whole.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 5
    for entry in content:
        assert entry.logprob <= 0 and entry.bytes and len(entry.top_logprobs) == 2
        assert math.isclose(entry.logprob, entry.top_logprobs[0].logprob, abs_tol=1e-5)
    chunks = list(running.client.chat.completions.create(stream=True, **request))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content or []]  # fmt: skip
    assert [e.token for e in streamed] == [e.token for e in content]


def test_stream_options_include_usage_ends_with_a_usage_chunk(running: Running) -> None:
    chunks = list(
        running.client.chat.completions.create(
            model="beta",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 4
    assert all(c.usage is None for c in chunks[:-1])
    plain = list(running.client.completions.create(model="alpha", prompt="a", max_tokens=2,
                                                   stream=True))  # fmt: skip
    assert all(c.choices for c in plain)


def test_no_max_tokens_generates_up_to_the_context_length(tmp_path: Path, ledger_dir: Path) -> None:
    short = build_model(tmp_path / "short", "llama", seed=3, context=48)
    running = Running(MultiModelServer([str(short)], keep_alive_s=3600, budget="1GiB"))
    try:
        answer = running.client.completions.create(model="short", prompt="the quick brown fox")
        usage, choice = answer.usage, answer.choices[0]
        assert usage is not None and usage.total_tokens <= 48
        if choice.finish_reason == "length":  # not cut at 16 or 256: all the room left
            assert usage.total_tokens == 48
        assert usage.completion_tokens > 16
    finally:
        running.stop()


def test_a_chat_template_override_per_model(
    model_dirs: list[str], tmp_path: Path, ledger_dir: Path
) -> None:
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    server = MultiModelServer(
        model_dirs, budget="1GiB", chat_templates=[f"beta={template}"], preload=False
    )
    running = Running(server)
    try:
        messages: Any = [{"role": "user", "content": "hello"}]
        for name in ("alpha", "beta"):
            served = server.models[name]
            served.ensure_loaded()
            answer = running.client.chat.completions.create(
                model=name, messages=messages, max_tokens=1
            )
            expected = served.tokenizer.encode("[hello]", add_special_tokens=False)
            assert answer.usage is not None
            assert (answer.usage.prompt_tokens == len(expected)) == (name == "beta"), name
    finally:
        running.stop()
    with pytest.raises(InvalidArgument, match="no model is named 'gamma'"):
        MultiModelServer(model_dirs, chat_templates=["gamma=x.jinja"], preload=False)


BAD_OPTIONS: list[tuple[dict[str, Any], str | None]] = [
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"stop": [""]}, "stop"),
    ({"stop": 5}, "stop"),
    ({"stop": ["a"] * 17}, "stop"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"n": 2}, "n"),
    ({"stream_options": {"include_usage": True}}, None),
    ({"keep_alive": "soon"}, "keep_alive"),
    ({"keep_alive": True}, "keep_alive"),
]


def test_bad_generation_options_are_400s_naming_the_field(running: Running) -> None:
    for options, param in BAD_OPTIONS:
        answer = running.post("/v1/completions", {"model": "alpha", "prompt": "hi", **options})
        assert answer.status_code == 400, (options, answer.text)
        error = answer.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param, options
    chat = {"model": "beta", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}
    answer = running.post("/v1/chat/completions", chat)
    assert answer.status_code == 400 and "top_logprobs needs logprobs" in answer.text


# -------------------------------------------------------------- models by name
def test_models_by_name_and_from_the_hf_cache_offline(
    model_dirs: list[str], tmp_path: Path, ledger_dir: Path
) -> None:
    cache = tmp_path / "hub"
    snapshot = cache / "models--org--tiny" / "snapshots" / "0123abcd"
    shutil.copytree(model_dirs[1], snapshot)
    (cache / "models--org--tiny" / "refs").mkdir()
    (cache / "models--org--tiny" / "refs" / "main").write_text("0123abcd")
    server = MultiModelServer(
        [f"mine={model_dirs[0]}", "org/tiny"], hf_cache=cache, budget="1GiB", preload=False
    )
    try:
        assert list(server.models) == ["mine", "tiny"]
        assert server.lookup("org/tiny") is server.models["tiny"]  # as mlx_lm.server's clients
        assert server.models["tiny"].path == str(snapshot)
    finally:
        server.close()
    with pytest.raises(InvalidArgument, match=rf"not in the Hugging Face cache \({cache}\)"):
        MultiModelServer(["org/absent"], hf_cache=cache, preload=False)


def test_the_banner_and_one_log_line_per_request(
    running: Running, caplog: pytest.LogCaptureFixture
) -> None:
    text = banner(running.server, running.url)
    assert running.url + "/v1" in text and "alpha" in text and "beta" in text
    with caplog.at_level("INFO", logger="kvcached.serve_mlx"):
        running.client.completions.create(model="alpha", prompt="dog", max_tokens=3)
        list(running.client.completions.create(model="beta", prompt="dog", max_tokens=2,
                                               stream=True))  # fmt: skip
        running.post("/v1/completions", {"model": "alpha", "prompt": "hi", "top_p": 9})
    lines = [r.getMessage() for r in caplog.records if "status=" in r.getMessage()]
    assert len(lines) == 3, lines
    assert "model=alpha status=200 prompt_tokens=" in lines[0] and "gen_tokens=3" in lines[0]
    assert "model=beta status=200" in lines[1] and "gen_tokens=2" in lines[1]
    assert "status=400" in lines[2]


# ------------------------------------------------ load on demand and make room
def loaded(running: Running) -> list[str]:
    return [m["name"] for m in running.get("/api/ps").json()["models"]]


def test_a_model_that_does_not_fit_unloads_the_least_recently_used(
    model_dirs: list[str], ledger_dir: Path
) -> None:
    running = Running(MultiModelServer(model_dirs, budget="1MiB", keep_alive_s=3600))
    try:
        assert loaded(running) == ["alpha"]  # beta did not fit beside it: loads on demand
        answer = running.client.completions.create(model="beta", prompt="dog", max_tokens=2)
        assert answer.usage is not None and answer.usage.completion_tokens == 2
        assert loaded(running) == ["beta"]
        running.client.completions.create(model="alpha", prompt="dog", max_tokens=2)
        assert loaded(running) == ["alpha"]
    finally:
        running.stop()


class Slow:
    """A model whose every step takes 20 ms more."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        time.sleep(0.02)
        return self.model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def test_requests_wait_in_a_bounded_queue_then_503_with_retry_after(
    model_dirs: list[str], ledger_dir: Path
) -> None:
    server = MultiModelServer(model_dirs, budget="1MiB", keep_alive_s=3600, queue_timeout_s=0.3)
    running = Running(server)
    try:
        alpha = server.models["alpha"]
        alpha.model = Slow(alpha.model)  # each step 20 ms: it stays busy while we look
        busy = running.client.completions.create(
            model="alpha", prompt="dog", max_tokens=100, stream=True
        )
        next(iter(busy))  # alpha runs (and holds the budget) while nobody reads
        answer = running.post("/v1/completions", {"model": "beta", "prompt": "a", "max_tokens": 2})
        assert answer.status_code == 503 and answer.headers["Retry-After"].isdigit()
        assert answer.json()["error"]["code"] == "server_busy"
        server.queue_timeout_s, server.max_queue = 60, 1
        waited: list[httpx.Response] = []
        waiter = threading.Thread(target=lambda: waited.append(
            running.post("/v1/completions", {"model": "beta", "prompt": "a", "max_tokens": 2})
        ))  # fmt: skip
        waiter.start()
        wait_for(lambda: server.models["beta"].waiting == 1, "beta's request to queue")
        full = running.post("/v1/completions", {"model": "beta", "prompt": "a", "max_tokens": 2})
        assert full.status_code == 503 and "the queue holds 1" in full.text
        assert "Retry-After" in full.headers
        busy.close()  # alpha's request ends: beta loads in its place
        waiter.join(timeout=60)
        assert waited and waited[0].status_code == 200, waited
        assert loaded(running) == ["beta"]
    finally:
        running.stop()


def test_keep_alive_per_request_unload_now_ps_and_health(running: Running) -> None:
    assert running.get("/health").json()["status"] == "ok"
    running.client.completions.create(
        model="alpha", prompt="dog", max_tokens=2, extra_body={"keep_alive": -1}
    )
    row = next(m for m in running.get("/api/ps").json()["models"] if m["name"] == "alpha")
    assert row["keep_alive"] == -1 and row["expires_at"] is None
    assert row["size"] == row["weight_bytes"] > 0 and row["kv_bytes"] == 0
    running.client.completions.create(
        model="alpha", prompt="dog", max_tokens=2, extra_body={"keep_alive": "5m"}
    )
    row = next(m for m in running.get("/api/ps").json()["models"] if m["name"] == "alpha")
    assert row["keep_alive"] == 300 and row["expires_at"] is not None
    running.client.completions.create(
        model="alpha", prompt="dog", max_tokens=2, extra_body={"keep_alive": 0}
    )
    wait_for(lambda: "alpha" not in loaded(running), "keep_alive 0 to unload alpha")
    assert running.post("/api/unload", {"model": "beta"}).json() == {
        "model": "beta", "status": "unloaded"
    }  # fmt: skip
    assert loaded(running) == []
    assert running.post("/api/unload", {"model": "beta"}).json()["status"] == "not_loaded"
    assert running.post("/api/unload", {"model": "gamma"}).status_code == 404
    assert running.get("/health").json() == {"status": "ok", "models": 2, "loaded": 0}
    answer = running.client.completions.create(model="beta", prompt="dog", max_tokens=2)
    assert answer.choices[0].finish_reason == "length"  # loads again on demand


# ------------------------------------------------------------- trying it out
def test_make_tiny_model_writes_a_model_serve_mlx_serves(tmp_path: Path, ledger_dir: Path) -> None:
    from typer.testing import CliRunner

    from kvcached.apps.cli import app

    made = CliRunner().invoke(app, ["make-tiny-model", str(tmp_path / "tiny"), "--arch", "llama"])
    assert made.exit_code == 0, made.output
    assert f"kvcached serve-mlx {tmp_path / 'tiny'}" in made.output
    server = MultiModelServer([f"try={tmp_path / 'tiny'}"], budget="1GiB")
    try:
        assert server.models["try"].loaded
    finally:
        server.close()


def test_serve_mlx_options_reach_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from kvcached.apps.cli import app
    from kvcached.engines.mlx_lm import serve as serve_module

    seen: dict[str, Any] = {}
    monkeypatch.setattr(serve_module, "serve", lambda models, **kw: seen.update(kw, models=models))
    args = ["serve-mlx", "a=/m/a", "org/b", "--keep-alive", "5m", "--max-loaded-models", "1",
            "--max-queue", "3", "--queue-timeout", "9", "--max-tokens", "512",
            "--chat-template", "a=t.jinja", "--log-level", "debug", "--max-batch", "4",
            "--prompt-cache", "8"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert seen == {
        "models": ["a=/m/a", "org/b"], "host": "127.0.0.1", "port": 8080,
        "log_level": "debug", "keep_alive_s": 300.0, "budget": None, "max_loaded": 1,
        "max_queue": 3, "queue_timeout_s": 9.0, "max_tokens": 512,
        "chat_templates": ["a=t.jinja"], "max_batch": 4, "prompt_cache_size": 8,
    }  # fmt: skip
    forever = CliRunner().invoke(app, ["serve-mlx", "x", "--keep-alive", "-1"])
    assert forever.exit_code == 0 and seen["keep_alive_s"] == math.inf
