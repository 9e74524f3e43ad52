"""Prometheus series of `kvcached serve`, read from the same snapshot as the dashboard.

`ServeCollector` calls `Models.snapshot()` once per scrape and turns that one snapshot
into every family below, so a scrape is never older than itself, its series agree with
one another (a model's state and its KV bytes are from the same moment), and nothing
runs between scrapes. It is registered in a `CollectorRegistry` of its own, never in
prometheus_client's global one: two servers in one process (as in the tests) must not
export each other's models, and the global registry's process and GC series describe
the router process, not the engines.

The names follow the ledger's exporter (`kvcached.metrics`): the `kvcached_` prefix,
sizes in `_bytes`, times in `_seconds`. The label is `model`, the name clients send in
`model` (the ledger names the same engine's row after it: its `kvcached_instance_*`
series carry it as `name`, so the two join on `model = name`).

Gauges, per model (label ``model``) unless said::

    kvcached_serve_budget_bytes             the device budget (no label)
    kvcached_serve_max_awake                models allowed awake at once (absent: no cap)
    kvcached_serve_kv_reserved_bytes        KV bytes the model's engine holds
    kvcached_serve_kv_used_bytes            KV bytes holding live blocks
    kvcached_serve_kv_limit_bytes           the model's KV limit (absent: up to the budget)
    kvcached_serve_kv_min_bytes             the bytes guaranteed to it when busy
    kvcached_serve_weights_bytes            its weights' size (absent: not known)
    kvcached_serve_model_state              1 for its current state, 0 for the others
                                            (labels ``model``, ``state``: every state,
                                            so a query never meets a missing series)
    kvcached_serve_in_flight                requests being served
    kvcached_serve_queued                   requests held until it can serve them
    kvcached_serve_requests_per_second      finished over the last seconds
    kvcached_serve_ttft_seconds             time to first token, labels ``model`` and
                                            ``quantile`` ("0.5", "0.99"); absent until
                                            a first sample
    kvcached_serve_last_wake_seconds        how long its last wake took (absent: never)
    kvcached_serve_idle_seconds             since its last request (absent: never used)

Counters, per model::

    kvcached_serve_requests_total           requests routed to it
    kvcached_serve_errors_total             of those, ended by an error
    kvcached_serve_wakes_total              times it woke from asleep or stopped
    kvcached_serve_restarts_total           times its engine was restarted after dying

The TTFT quantiles are computed by the router over its recent samples (`ModelStats`),
so they are gauges with a ``quantile`` label, as a summary's quantiles are; there is no
sum or count of TTFTs to make them a real summary, and `requests_total` already counts.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from kvcached.apps.serve.state import Models, ModelState
from kvcached.errors import KVCachedError

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics_core import Metric

_STATES = tuple(state.value for state in ModelState)


class ServeCollector:
    """A prometheus_client collector of one server's models: one `snapshot()` a scrape."""

    def __init__(self, models: Models) -> None:
        self.models = models

    def describe(self) -> list[Metric]:
        # Without it the registry would call collect() (and so snapshot()) at
        # registration, to learn the names; nothing here needs name-clash checks.
        return []

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        snapshot = self.models.snapshot()

        def gauge(name: str, doc: str, labels: Sequence[str] = ("model",)) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"kvcached_serve_{name}", doc, labels=labels)

        def counter(name: str, doc: str) -> CounterMetricFamily:
            # prometheus_client adds the `_total` suffix of the exposition itself
            return CounterMetricFamily(f"kvcached_serve_{name}", doc, labels=("model",))

        budget = gauge("budget_bytes", "The device budget all models share.", ())
        budget.add_metric([], snapshot["budget"])
        max_awake = gauge("max_awake", "Models allowed awake at once.", ())
        if snapshot["max_awake"] is not None:
            max_awake.add_metric([], snapshot["max_awake"])

        reserved = gauge("kv_reserved_bytes", "KV bytes the model's engine holds.")
        used = gauge("kv_used_bytes", "KV bytes holding live blocks.")
        limit = gauge("kv_limit_bytes", "The model's KV limit (absent: up to the budget).")
        floor = gauge("kv_min_bytes", "KV bytes guaranteed to the model when busy.")
        weights = gauge("weights_bytes", "Size of the model's weights.")
        state = gauge(
            "model_state", "1 for the model's current state, 0 for the others.", ["model", "state"]
        )
        in_flight = gauge("in_flight", "Requests being served.")
        queued = gauge("queued", "Requests held until the model can serve them.")
        rate = gauge("requests_per_second", "Requests finished per second, recently.")
        ttft = gauge(
            "ttft_seconds", "Time to first token over recent requests.", ["model", "quantile"]
        )
        last_wake = gauge("last_wake_seconds", "How long the model's last wake took.")
        idle = gauge("idle_seconds", "Seconds since the model's last request.")
        requests = counter("requests", "Requests routed to the model.")
        errors = counter("errors", "Requests to the model that ended in an error.")
        wakes = counter("wakes", "Times the model woke from asleep or stopped.")
        restarts = counter("restarts", "Times the model's engine was restarted after dying.")

        for row in snapshot["models"]:
            name = [row["name"]]
            reserved.add_metric(name, row["kv_reserved"])
            used.add_metric(name, row["kv_used"])
            if row["limit_bytes"] is not None:
                limit.add_metric(name, row["limit_bytes"])
            floor.add_metric(name, row["min_bytes"])
            if row["weights_bytes"] is not None:
                weights.add_metric(name, row["weights_bytes"])
            for value in _STATES:
                state.add_metric([row["name"], value], 1.0 if row["state"] == value else 0.0)
            in_flight.add_metric(name, row["in_flight"])
            queued.add_metric(name, row["queued"])
            rate.add_metric(name, row["requests_per_s"])
            for quantile, seconds in (("0.5", row["ttft_p50_s"]), ("0.99", row["ttft_p99_s"])):
                if seconds is not None:
                    ttft.add_metric([row["name"], quantile], seconds)
            if row["last_wake_s"] is not None:
                last_wake.add_metric(name, row["last_wake_s"])
            if row["idle_s"] is not None:
                idle.add_metric(name, row["idle_s"])
            requests.add_metric(name, row["requests_total"])
            errors.add_metric(name, row["errors_total"])
            wakes.add_metric(name, row["wakes_total"])
            restarts.add_metric(name, row["restarts_total"])

        yield from (budget, max_awake, reserved, used, limit, floor, weights, state)
        yield from (in_flight, queued, rate, ttft, last_wake, idle)
        yield from (requests, errors, wakes, restarts)


def registry(models: Models) -> CollectorRegistry:
    """A registry of its own holding one `ServeCollector` of `models`. Raises
    `KVCachedError` when prometheus_client is not installed."""
    try:
        from prometheus_client import CollectorRegistry
    except ImportError:
        raise KVCachedError(
            "kvcached serve's /metrics needs prometheus_client: pip install prometheus_client"
        ) from None

    own = CollectorRegistry(auto_describe=False)
    own.register(ServeCollector(models))
    return own


def exposition(own: CollectorRegistry, accept: str | None) -> tuple[bytes, str]:
    """`own` scraped now, in the format the scraper's `Accept` header asks for (the
    Prometheus text format, or OpenMetrics when asked), and that format's content type."""
    from prometheus_client.exposition import choose_encoder

    encoder, content_type = choose_encoder(accept or "")
    return encoder(own), content_type
