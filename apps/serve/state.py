"""What the router, the supervisor, the policy and the dashboard of `kvcached serve` share.

A model's lifecycle is one `ModelState`; its counters are one `ModelStats`; a request that
cannot be served meets one of two errors (`UnknownModel`, 404; `ModelUnavailable`, 503
with `Retry-After`). The router sees each model only through the `ModelHandle` protocol
and the set of them through `Models`, so its tests run against a stand-in without any
engine process; `supervisor.EngineProcess` is the real handle.

The snapshot (`ModelSnapshot`, `ServeSnapshot`) is the one JSON shape behind
`/api/state`, the dashboard and `/metrics`: every figure they show is read from it.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol, TypedDict

from kvcached.errors import KVCachedError


class ModelState(str, Enum):
    """Where a model's engine process is in its life.

    stopped: no process (not preloaded yet, or slept with `unload`); starts on demand.
    loading: the process is starting; not yet healthy.
    awake: healthy and serving.
    sleeping: going to sleep (KV being trimmed, weights leaving the device).
    asleep: the process lives but holds no KV (and, for `weights`, no weights).
    waking: coming back from asleep (or from stopped, for `unload`).
    failed: the process died; being restarted with back-off, or given up (see `detail`).
    """

    STOPPED = "stopped"
    LOADING = "loading"
    AWAKE = "awake"
    SLEEPING = "sleeping"
    ASLEEP = "asleep"
    WAKING = "waking"
    FAILED = "failed"


class UnknownModel(KVCachedError):
    """A request named a model this server does not have (HTTP 404)."""

    def __init__(self, model: object, known: list[str]) -> None:
        self.model = model
        self.known = known
        listed = ", ".join(known) if known else "none"
        super().__init__(f"model {model!r} does not exist; the models served are: {listed}")


class ModelUnavailable(KVCachedError):
    """The model cannot serve this request now (HTTP 503, `Retry-After: retry_after`)."""

    def __init__(self, model: str, reason: str, retry_after: float = 1.0) -> None:
        self.model = model
        self.reason = reason
        self.retry_after = retry_after
        super().__init__(f"model {model!r} is unavailable: {reason}")


def nearest_rank(values: list[float], q: float) -> float | None:
    """The q-quantile (0..1) of `values` by the nearest-rank method; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q * len(ordered) + 0.5) - 1))]


#: the time-to-first-token samples a model keeps for its percentiles
TTFT_WINDOW = 2048


@dataclass
class ModelStats:
    """A model's counters, written by the router and the supervisor, read by the snapshot."""

    requests_total: int = 0
    errors_total: int = 0
    in_flight: int = 0
    queued: int = 0
    wakes_total: int = 0
    restarts_total: int = 0
    last_wake_s: float | None = None
    #: monotonic time of the last request's start or end (None: never used)
    last_used: float | None = None
    #: monotonic time of each finished request, for requests per second
    finished: deque[float] = field(default_factory=lambda: deque(maxlen=TTFT_WINDOW))
    ttft_s: deque[float] = field(default_factory=lambda: deque(maxlen=TTFT_WINDOW))
    wake_s: deque[float] = field(default_factory=lambda: deque(maxlen=256))

    def touch(self) -> None:
        self.last_used = time.monotonic()

    def record_ttft(self, seconds: float) -> None:
        self.ttft_s.append(seconds)

    def record_finished(self) -> None:
        now = time.monotonic()
        self.finished.append(now)
        self.last_used = now

    def record_wake(self, seconds: float) -> None:
        self.wakes_total += 1
        self.last_wake_s = seconds
        self.wake_s.append(seconds)

    def ttft_percentile(self, q: float) -> float | None:
        """The q-quantile (0..1) of the recent TTFTs, nearest rank; None without samples."""
        return nearest_rank(list(self.ttft_s), q)

    def requests_per_s(self, window_s: float = 10.0) -> float:
        """Requests finished per second over the last `window_s` seconds."""
        cutoff = time.monotonic() - window_s
        ordered = list(self.finished)
        return (len(ordered) - bisect.bisect_right(ordered, cutoff)) / window_s


class ModelSnapshot(TypedDict):
    """One model in `/api/state`; sizes in bytes, times in seconds."""

    name: str
    engine: str
    state: str
    detail: str
    priority: int
    min_bytes: int
    limit_bytes: int | None
    kv_reserved: int
    kv_used: int
    #: the memory its weights hold, as the engine logged it when it loaded them (vLLM's
    #: "Model loading took X GiB", serve-mlx's "loaded NAME (X of weights)":
    #: `launchers.Launcher.weights_log`); 0 with no process or with the weights asleep;
    #: None when the engine has not said (SGLang: no pattern yet). The ledger charges
    #: vLLM's and SGLang's KV only; serve-mlx charges its weights to its row too, so
    #: for an MLX model they are also part of `kv_reserved`.
    weights_bytes: int | None
    in_flight: int
    queued: int
    requests_total: int
    errors_total: int
    requests_per_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    wakes_total: int
    last_wake_s: float | None
    restarts_total: int
    idle_s: float | None
    #: the engine's own base URL and process id while it runs (else None): for kvctl,
    #: the tests and anyone who wants to talk to one engine directly
    endpoint: str | None
    pid: int | None


class ServeSnapshot(TypedDict):
    """`/api/state`: the whole server at one moment, plus a short history of KV bytes."""

    time: float
    budget: int
    max_awake: int | None
    models: list[ModelSnapshot]
    #: oldest first: {"t": unix seconds, "kv": {model: reserved bytes}}
    history: list[dict[str, object]]


class ModelHandle(Protocol):
    """One configured model as the router sees it."""

    @property
    def name(self) -> str: ...

    @property
    def engine(self) -> str: ...

    @property
    def state(self) -> ModelState: ...

    @property
    def stats(self) -> ModelStats: ...

    def serving(self, timeout: float | None = None) -> AbstractAsyncContextManager[str]:
        """Hold one request until the model can serve it; yields the engine's base URL
        (`http://127.0.0.1:PORT`). Starts or wakes the model as needed and counts the
        request in flight until the block ends. Raises `ModelUnavailable` when the
        model's queue is full, the wait passes `timeout` (default: the config's), or the
        model failed for good."""
        ...


class Models(Protocol):
    """Every configured model, by name, and the snapshot of them all."""

    def names(self) -> list[str]: ...

    def handle(self, name: object) -> ModelHandle:
        """The model called `name`; raises `UnknownModel` for any other value."""
        ...

    def snapshot(self) -> ServeSnapshot: ...
