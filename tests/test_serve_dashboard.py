"""`kvcached serve`'s dashboard and `/metrics`, behind the real router, over a stand-in
`Models` whose snapshot each test sets.

`/metrics` is read with prometheus_client's own parser. The page is driven in a real
headless Chromium (Debian's, through Python playwright's bundled driver; never
`playwright install`, which downloads a browser): one browser for the module, a fresh
context per test. scripts/ensure-chromium.sh installs the browser as root; elsewhere
KVCACHED_SKIP_BROWSER_TESTS=1 skips the browser tests, and CI never sets it.
"""

from __future__ import annotations

import copy
import os
import shutil
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from kvcached.apps.serve import dashboard
from kvcached.apps.serve.router import build_router
from kvcached.apps.serve.state import (
    ModelState,
    ModelStats,
    ModelUnavailable,
    ServeSnapshot,
    UnknownModel,
)

ROOT = Path(__file__).resolve().parents[1]
GiB = 1 << 30
MiB = 1 << 20
KEY = "dashboard-test-key"
STATES = [state.value for state in ModelState]


def model_row(name: str, engine: str, state: str, **figures: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "name": name, "engine": engine, "state": state, "detail": "", "priority": 0,
        "min_bytes": 0, "limit_bytes": None, "kv_reserved": 0, "kv_used": 0,
        "weights_bytes": None, "in_flight": 0, "queued": 0, "requests_total": 0,
        "errors_total": 0, "requests_per_s": 0.0, "ttft_p50_s": None, "ttft_p99_s": None,
        "wakes_total": 0, "last_wake_s": None, "restarts_total": 0, "idle_s": None,
    }  # fmt: skip
    row.update(figures)
    return row


def three_models() -> ServeSnapshot:
    """Three models, each with different figures, and a short history of KV bytes."""
    now = time.time()
    models = [
        model_row(
            "llama-3-8b", "vllm", "awake", priority=2, min_bytes=1 * GiB,
            limit_bytes=4 * GiB, kv_reserved=3 * GiB, kv_used=2 * GiB,
            weights_bytes=16 * GiB, in_flight=3, queued=1, requests_total=120,
            errors_total=2, requests_per_s=4.5, ttft_p50_s=0.042, ttft_p99_s=0.31,
            wakes_total=5, last_wake_s=1.25, restarts_total=1, idle_s=0.0,
        ),
        model_row(
            "qwen/qwen2-1.5b", "sglang", "asleep", kv_reserved=0, weights_bytes=3 * GiB,
            requests_total=7, wakes_total=2, last_wake_s=0.8, idle_s=412.0,
        ),
        model_row(
            "tiny.mlx", "mlx", "loading", detail="starting: waiting for /health",
            kv_reserved=512 * MiB, kv_used=100 * MiB,
        ),
    ]  # fmt: skip
    history = [
        {"t": now - 30 + i * 10, "kv": {"llama-3-8b": (i + 1) * GiB, "tiny.mlx": 256 * MiB}}
        for i in range(3)
    ]
    return {"time": now, "budget": 8 * GiB, "max_awake": 2, "models": models,
            "history": history}  # fmt: skip


class StandInHandle:
    """A configured model that never serves (these tests send no completions)."""

    def __init__(self, owner: StandInModels, name: str) -> None:
        self.owner = owner
        self.name = name
        self.stats = ModelStats()

    def _row(self) -> dict[str, Any]:
        return next(m for m in self.owner.current["models"] if m["name"] == self.name)

    @property
    def engine(self) -> str:
        return str(self._row()["engine"])

    @property
    def state(self) -> ModelState:
        return ModelState(self._row()["state"])

    @asynccontextmanager
    async def serving(self, timeout: float | None = None) -> Any:
        raise ModelUnavailable(self.name, "a stand-in serves nothing")
        yield ""  # pragma: no cover


class StandInModels:
    """`state.Models` over a snapshot the test sets: `snapshot()` returns a copy of
    `current`, stamped with the time of the call, as the supervisor's is."""

    def __init__(self, snapshot: ServeSnapshot) -> None:
        self.lock = threading.Lock()
        self.current: dict[str, Any] = copy.deepcopy(dict(snapshot))
        self.calls = 0

    def names(self) -> list[str]:
        return [m["name"] for m in self.current["models"]]

    def handle(self, name: object) -> StandInHandle:
        if name not in self.names():
            raise UnknownModel(name, self.names())
        return StandInHandle(self, str(name))

    def snapshot(self) -> ServeSnapshot:
        with self.lock:
            self.calls += 1
            taken = copy.deepcopy(self.current)
        taken["time"] = time.time()
        return taken

    def update(self, name: str, **figures: Any) -> None:
        with self.lock:
            for row in self.current["models"]:
                if row["name"] == name:
                    row.update(figures)


def app_over(models: StandInModels, api_key: str | None = None) -> Any:
    return build_router(models, api_key=api_key, extra_routes=dashboard.dashboard_routes(models))


class Running:
    """An app behind uvicorn on an ephemeral port of 127.0.0.1, in a thread."""

    def __init__(self, app: Any) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        self.http = uvicorn.Server(uvicorn.Config(app, log_level="error", lifespan="on"))
        self.thread = threading.Thread(
            target=self.http.run, kwargs={"sockets": [listener]}, daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.http.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.http.should_exit = True
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "the server did not stop"


# ---- /metrics ----


def scrape(
    client: TestClient, **headers: str
) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Every sample of /metrics, by sample name, then by its sorted labels."""
    answer = client.get("/metrics", headers=headers)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"].startswith("text/plain; version=0.0.4")
    series: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(answer.text):
        for sample in family.samples:
            labels = tuple(sorted(sample.labels.items()))
            series.setdefault(sample.name, {})[labels] = sample.value
    return series


def by_model(series: dict[str, Any], name: str) -> dict[str, float]:
    return {dict(labels)["model"]: value for labels, value in series[name].items()}


def test_metrics_has_every_series_with_its_value() -> None:
    models = StandInModels(three_models())
    with TestClient(app_over(models)) as client:
        series = scrape(client)
    rows = {m["name"]: m for m in models.current["models"]}
    names = set(rows)

    assert series["kvcached_serve_budget_bytes"] == {(): 8 * GiB}
    assert series["kvcached_serve_max_awake"] == {(): 2}
    plain = {
        "kvcached_serve_kv_reserved_bytes": "kv_reserved",
        "kvcached_serve_kv_used_bytes": "kv_used",
        "kvcached_serve_kv_min_bytes": "min_bytes",
        "kvcached_serve_in_flight": "in_flight",
        "kvcached_serve_queued": "queued",
        "kvcached_serve_requests_per_second": "requests_per_s",
        "kvcached_serve_requests_total": "requests_total",
        "kvcached_serve_errors_total": "errors_total",
        "kvcached_serve_wakes_total": "wakes_total",
        "kvcached_serve_restarts_total": "restarts_total",
    }
    for metric, key in plain.items():
        assert by_model(series, metric) == {n: rows[n][key] for n in names}, metric
    # series whose figure can be unknown are absent for the models without one
    optional = {
        "kvcached_serve_kv_limit_bytes": "limit_bytes",
        "kvcached_serve_weights_bytes": "weights_bytes",
        "kvcached_serve_last_wake_seconds": "last_wake_s",
        "kvcached_serve_idle_seconds": "idle_s",
    }
    for metric, key in optional.items():
        expected = {n: rows[n][key] for n in names if rows[n][key] is not None}
        assert by_model(series, metric) == expected, metric
    assert series["kvcached_serve_ttft_seconds"] == {
        (("model", "llama-3-8b"), ("quantile", "0.5")): 0.042,
        (("model", "llama-3-8b"), ("quantile", "0.99")): 0.31,
    }
    # one state series per model and state, 1 for the state it is in
    states = series["kvcached_serve_model_state"]
    assert len(states) == len(names) * len(STATES)
    for labels, value in states.items():
        model, state = dict(labels)["model"], dict(labels)["state"]
        assert value == (1.0 if rows[model]["state"] == state else 0.0), labels
    # counters are typed as counters (a rate() over them must work)
    with TestClient(app_over(models)) as client:
        text = client.get("/metrics").text
    assert "# TYPE kvcached_serve_requests_total counter" in text
    assert "# TYPE kvcached_serve_kv_reserved_bytes gauge" in text


def test_metrics_are_read_at_scrape_time() -> None:
    models = StandInModels(three_models())
    with TestClient(app_over(models)) as client:
        before = models.calls
        first = scrape(client)
        models.update("qwen/qwen2-1.5b", state="waking", kv_reserved=GiB, requests_total=8)
        second = scrape(client)
    assert models.calls == before + 2  # one snapshot per scrape, none in between
    assert by_model(first, "kvcached_serve_kv_reserved_bytes")["qwen/qwen2-1.5b"] == 0
    assert by_model(second, "kvcached_serve_kv_reserved_bytes")["qwen/qwen2-1.5b"] == GiB
    assert by_model(second, "kvcached_serve_requests_total")["qwen/qwen2-1.5b"] == 8
    states = second["kvcached_serve_model_state"]
    assert states[(("model", "qwen/qwen2-1.5b"), ("state", "waking"))] == 1.0
    assert states[(("model", "qwen/qwen2-1.5b"), ("state", "asleep"))] == 0.0


def test_metrics_speak_openmetrics_when_asked() -> None:
    with TestClient(app_over(StandInModels(three_models()))) as client:
        answer = client.get("/metrics", headers={"Accept": "application/openmetrics-text"})
    assert answer.headers["content-type"].startswith("application/openmetrics-text")
    assert answer.text.rstrip().endswith("# EOF")
    assert 'kvcached_serve_requests_total{model="llama-3-8b"} 120' in answer.text


def test_metrics_and_state_need_the_key_and_the_page_does_not() -> None:
    with TestClient(app_over(StandInModels(three_models()), api_key=KEY)) as client:
        assert client.get("/metrics").status_code == 401
        assert client.get("/api/state").status_code == 401
        good = {"Authorization": f"Bearer {KEY}"}
        assert client.get("/metrics", headers=good).status_code == 200
        page = client.get("/dashboard")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert page.headers["referrer-policy"] == "no-referrer"
    policy = page.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy
    assert "script-src 'sha256-" in policy and "'unsafe-inline'" not in policy


def test_the_page_ships_as_package_data() -> None:
    """importlib.resources finds the page, and the packaging names it, so a wheel holds
    it too (test_packaging builds one; this is the fast check)."""
    import tomllib  # Python 3.11+, as CI runs; the rest of the module runs on 3.10 too

    html = dashboard.page_html()
    assert 'id="error-banner"' in html and "api/state" in html
    assert "http://" not in html.replace("http://www.w3.org/2000/svg", "")  # no CDN
    assert "https://" not in html
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    setuptools = project["tool"]["setuptools"]
    assert "kvcached.apps.serve" in setuptools["packages"]
    assert "dashboard.html" in setuptools["package-data"]["kvcached.apps.serve"]


# ---- the page, in a real browser ----

CHROMIUM_FLAGS = [
    # without these, Chromium on a closed network stalls on connections it cannot make
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium_path() -> str:
    """Debian's chromium, installed by scripts/ensure-chromium.sh when it is missing and
    this is root with apt-get; a clear failure otherwise, or a skip where the developer
    asked for one (KVCACHED_SKIP_BROWSER_TESTS)."""
    path = os.environ.get("KVCACHED_CHROMIUM", "/usr/bin/chromium")
    if os.access(path, os.X_OK):
        return path
    if os.environ.get("KVCACHED_SKIP_BROWSER_TESTS"):
        pytest.skip(f"{path} is missing and KVCACHED_SKIP_BROWSER_TESTS is set")
    if os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(
            ["bash", str(ROOT / "scripts" / "ensure-chromium.sh")], check=False, timeout=900
        )
        if os.access(path, os.X_OK):
            return path
    pytest.fail(
        f"the dashboard's browser tests need Chromium at {path}: run "
        "scripts/ensure-chromium.sh as root (apt-get install chromium), point "
        "KVCACHED_CHROMIUM at a Chromium binary, or set KVCACHED_SKIP_BROWSER_TESTS=1"
    )


def test_a_missing_browser_fails_clearly_unless_a_skip_was_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVCACHED_CHROMIUM", "/nonexistent/chromium")
    monkeypatch.delenv("KVCACHED_SKIP_BROWSER_TESTS", raising=False)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # not root: nothing gets installed
    with pytest.raises(pytest.fail.Exception, match="KVCACHED_SKIP_BROWSER_TESTS=1"):
        chromium_path()
    monkeypatch.setenv("KVCACHED_SKIP_BROWSER_TESTS", "1")
    with pytest.raises(pytest.skip.Exception, match="/nonexistent/chromium"):
        chromium_path()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    path = chromium_path()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=path, args=CHROMIUM_FLAGS)
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[StandInModels, Running]]:
    models = StandInModels(three_models())
    running = Running(app_over(models, api_key=KEY))
    try:
        yield models, running
    finally:
        running.stop()


@pytest.fixture
def page(browser: Any, served: tuple[StandInModels, Running]) -> Iterator[Any]:
    _, running = served
    context = browser.new_context(viewport={"width": 1600, "height": 1000})
    opened = context.new_page()
    errors: list[str] = []
    opened.on("pageerror", lambda exc: errors.append(str(exc)))
    opened.on(
        "console", lambda m: errors.append(m.text) if m.type == "error" else None
    )  # a script blocked by the content policy is reported here
    opened.goto(f"{running.url}/dashboard?key={KEY}")
    opened.wait_for_selector('body[data-status="ok"]', timeout=10_000)
    try:
        yield opened
    finally:
        context.close()
    assert errors == [], errors


def table(page: Any) -> dict[str, dict[str, str]]:
    """Each model row as the page shows it: its state hooks and every cell's text."""
    return page.evaluate(
        """() => Object.fromEntries(Array.from(document.querySelectorAll("tr[data-model]"))
             .map((tr) => [tr.dataset.model, Object.assign(
               {row_state: tr.dataset.state,
                badge_state: tr.querySelector(".badge").dataset.state,
                badge: tr.querySelector(".badge").textContent},
               Object.fromEntries(Array.from(tr.querySelectorAll("td[data-field]"))
                 .map((td) => [td.dataset.field, td.textContent.trim()])))]))"""
    )


def test_the_page_shows_every_model_with_its_state(
    page: Any, served: tuple[StandInModels, Running]
) -> None:
    models, _ = served
    shown = table(page)
    assert list(shown) == models.names()  # every model, in the configured order
    for row in models.current["models"]:
        cells = shown[row["name"]]
        assert cells["row_state"] == cells["badge_state"] == cells["badge"] == row["state"]
        assert cells["engine"] == row["engine"]
        assert cells["in_flight"] == str(row["in_flight"])
        assert cells["queued"] == str(row["queued"])
        assert cells["wakes"] == str(row["wakes_total"])
        assert cells["restarts"] == str(row["restarts_total"])
    llama = shown["llama-3-8b"]
    assert llama["kv"] == "3.00 GiB / 4.00 GiB"
    assert llama["kv_used"] == "2.00 GiB" and llama["weights"] == "16.0 GiB"
    assert llama["requests"] == "120 (2 failed)" and llama["requests_per_s"] == "4.50"
    assert llama["ttft_p50"] == "42 ms" and llama["ttft_p99"] == "310 ms"
    assert llama["last_wake"] == "1.25 s"
    assert "priority 2" in llama["name"] and "min 1.00 GiB" in llama["name"]
    assert shown["qwen/qwen2-1.5b"]["kv"] == "0 B / budget"
    assert shown["qwen/qwen2-1.5b"]["idle"] == "6 min 52 s"
    assert shown["tiny.mlx"]["ttft_p50"] == "\N{EN DASH}"  # the page's "not known"
    assert "waiting for /health" in shown["tiny.mlx"]["state"]
    assert page.text_content("#budget") == "8.00 GiB"
    assert page.text_content("#reserved") == "3.50 GiB (43.8%)"
    assert page.text_content("#awake") == "1 of 3 (at most 2)"
    assert page.is_hidden("#error-banner")


def test_a_state_change_reaches_the_page_within_seconds(
    page: Any, served: tuple[StandInModels, Running]
) -> None:
    models, _ = served
    changed = time.monotonic()
    # a detail that is markup must arrive as text (Note [dashboard content policy])
    markup = '<img src="x" id="injected">'
    models.update("qwen/qwen2-1.5b", state="waking", detail=markup, kv_reserved=GiB)
    try:
        page.wait_for_selector('tr[data-model="qwen/qwen2-1.5b"][data-state="waking"]',
                               timeout=5_000)  # fmt: skip
        took = time.monotonic() - changed
        shown = table(page)["qwen/qwen2-1.5b"]
        assert shown["badge"] == "waking" and markup in shown["state"]
        assert page.query_selector("#injected") is None
        assert took < 5.0
        models.update("qwen/qwen2-1.5b", state="failed", detail="engine exited with 1")
        page.wait_for_selector('tr[data-model="qwen/qwen2-1.5b"] .badge[data-state="failed"]',
                               timeout=5_000)  # fmt: skip
    finally:
        models.update("qwen/qwen2-1.5b", state="asleep", detail="", kv_reserved=0)
    page.wait_for_selector('tr[data-model="qwen/qwen2-1.5b"][data-state="asleep"]',
                           timeout=5_000)  # fmt: skip


def test_the_chart_has_one_series_per_model_and_the_budget(
    page: Any, served: tuple[StandInModels, Running]
) -> None:
    models, _ = served
    # the page adds a point of its own at every poll to the server's history
    page.wait_for_function(
        """() => { const d = document.querySelector('path.series').getAttribute('d');
                   return d.split('L').length >= 2 * 5; }""",
        timeout=10_000,
    )  # fmt: skip
    series = page.evaluate(
        """() => Array.from(document.querySelectorAll('#chart path.series')).map((p) => ({
             model: p.dataset.model, d: p.getAttribute('d'), fill: p.getAttribute('fill'),
             height: p.getBBox().height}))"""
    )
    assert [s["model"] for s in series] == models.names()
    assert all(s["d"].startswith("M") and s["d"].endswith("Z") for s in series)
    assert len({s["fill"] for s in series}) == len(series)  # one colour each
    heights = {s["model"]: s["height"] for s in series}
    assert heights["llama-3-8b"] > 10 and heights["tiny.mlx"] > 0
    assert page.query_selector('#chart line[data-series="budget"]') is not None
    legend = page.eval_on_selector_all("#legend [data-model]", "els => els.map(e => e.textContent)")
    assert legend == models.names()


def test_a_screenshot_of_the_page(page: Any, tmp_path: Path) -> None:
    shot = tmp_path / "dashboard.png"
    page.screenshot(path=str(shot), full_page=True)
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk comes first
    assert width == 1600 and height >= 400
    assert len(data) > 20_000  # a page of text and a chart, not a blank frame


def test_without_the_key_the_page_says_so(
    browser: Any, served: tuple[StandInModels, Running]
) -> None:
    _, running = served
    context = browser.new_context()
    try:
        opened = context.new_page()
        opened.goto(f"{running.url}/dashboard")
        opened.wait_for_selector("#error-banner:not([hidden])", timeout=10_000)
        assert "?key=" in opened.text_content("#error-banner")
        assert opened.query_selector("tr[data-model]") is None
    finally:
        context.close()


def test_a_server_that_goes_away_shows_the_error_banner(browser: Any) -> None:
    models = StandInModels(three_models())
    running = Running(app_over(models))
    context = browser.new_context()
    try:
        opened = context.new_page()
        opened.goto(f"{running.url}/dashboard")
        opened.wait_for_selector('tr[data-model="llama-3-8b"][data-state="awake"]',
                                 timeout=10_000)  # fmt: skip
        assert opened.is_hidden("#error-banner")
        running.stop()
        gone = time.monotonic()
        opened.wait_for_selector("#error-banner:not([hidden])", timeout=10_000)
        assert time.monotonic() - gone < 6
        banner = opened.text_content("#error-banner")
        assert "does not answer" in banner and "Last update" in banner
        assert opened.get_attribute("body", "data-status") == "error"
        # what was shown stays, marked stale, rather than a blank page
        assert len(opened.query_selector_all("tr[data-model]")) == 3
    finally:
        context.close()
        running.stop()
