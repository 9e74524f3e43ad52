"""Prometheus metrics of the ledger (optional: ``pip install prometheus_client``).

The collector reads the ledger at scrape time, so the numbers are never older than the
scrape and nothing runs between scrapes. It exports every instance of every device
ledger of this user, not only the exporting process's own: one endpoint per machine is
enough, and when several instances are started with the same KVCACHED_METRICS_PORT the
first one serves it and the others, finding the port taken, carry on without one.

Gauges, in bytes (labels: ``ledger`` everywhere; ``name``, ``engine``, ``pid`` per
instance):

    kvcached_ledger_budget_bytes          the device budget
    kvcached_ledger_reserved_bytes        sum of reserved over instances
    kvcached_ledger_used_bytes            sum of used over instances
    kvcached_ledger_instances             registered instances
    kvcached_instance_reserved_bytes      physical bytes the instance holds
    kvcached_instance_used_bytes          bytes holding live blocks
    kvcached_instance_limit_bytes         its limit (absent when it has none)
    kvcached_instance_peak_reserved_bytes highest reserved since it registered
    kvcached_instance_refused_charges     charges refused (limit or budget reached)

The endpoint binds to 127.0.0.1 unless told otherwise (KVCACHED_METRICS_ADDR): instance
names and sizes are not for the whole network by default.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from kvcached import forksafe
from kvcached.errors import KVCachedError
from kvcached.ledger import Ledger, LedgerError, existing_keys
from kvcached.lifetime import Closeable

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

log = logging.getLogger(__name__)

_INSTANCE_LABELS = ("ledger", "name", "engine", "pid")


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise KVCachedError(
            "metrics need prometheus_client: pip install prometheus_client"
        ) from None
    return prometheus_client


class LedgerCollector:
    """A prometheus_client collector of device ledgers: `keys`, or with None every
    ledger of this user in the ledger folder (looked up again at each scrape).

    Ledgers that do not exist yet are skipped (and looked for again at the next
    scrape), so an exporter can start before the first instance."""

    def __init__(
        self, keys: Sequence[str] | None = None, directory: str | os.PathLike[str] | None = None
    ) -> None:
        self.keys = None if keys is None else list(keys)
        self.directory = directory
        self._ledgers: dict[str, Ledger] = {}
        self._lock = threading.Lock()

    def _ledger(self, key: str) -> Ledger | None:
        ledger = self._ledgers.get(key)
        if ledger is None:
            try:
                ledger = Ledger.open(key, create=False, directory=self.directory)
            except LedgerError as exc:
                log.debug("metrics: skipping ledger %s: %s", key, exc)
                return None
            self._ledgers[key] = ledger
        return ledger

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import GaugeMetricFamily

        def gauge(name: str, doc: str, labels: Sequence[str]) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=list(labels))

        budget = gauge("kvcached_ledger_budget_bytes", "Device budget.", ["ledger"])
        total_reserved = gauge(
            "kvcached_ledger_reserved_bytes", "Reserved bytes, all instances.", ["ledger"]
        )
        total_used = gauge("kvcached_ledger_used_bytes", "Used bytes, all instances.", ["ledger"])
        instances = gauge("kvcached_ledger_instances", "Registered instances.", ["ledger"])
        reserved = gauge(
            "kvcached_instance_reserved_bytes",
            "Physical bytes the instance holds, empty pages included.",
            _INSTANCE_LABELS,
        )
        used = gauge(
            "kvcached_instance_used_bytes", "Bytes holding live KV blocks.", _INSTANCE_LABELS
        )
        limit = gauge("kvcached_instance_limit_bytes", "The instance's limit.", _INSTANCE_LABELS)
        peak = gauge(
            "kvcached_instance_peak_reserved_bytes",
            "Highest reserved since the instance registered.",
            _INSTANCE_LABELS,
        )
        refused = gauge(
            "kvcached_instance_refused_charges",
            "Charges refused because the limit or the budget was reached.",
            _INSTANCE_LABELS,
        )
        with self._lock:
            keys = existing_keys(self.directory) if self.keys is None else self.keys
            for key in keys:
                ledger = self._ledger(key)
                if ledger is None:
                    continue
                try:
                    totals, rows = ledger.snapshot()
                except KVCachedError as exc:
                    log.warning("metrics: cannot read ledger %s: %s", key, exc)
                    continue
                budget.add_metric([key], totals.budget)
                total_reserved.add_metric([key], totals.reserved)
                total_used.add_metric([key], totals.used)
                instances.add_metric([key], totals.instances)
                for row in rows:
                    labels = [key, row.name, row.engine, str(row.pid)]
                    reserved.add_metric(labels, row.reserved)
                    used.add_metric(labels, row.used)
                    peak.add_metric(labels, row.peak)
                    refused.add_metric(labels, row.denied)
                    if row.limit is not None:
                        limit.add_metric(labels, row.limit)
        yield from (budget, total_reserved, total_used, instances)
        yield from (reserved, used, limit, peak, refused)

    def close(self) -> None:
        with self._lock:
            for ledger in self._ledgers.values():
                ledger.close()
            self._ledgers.clear()


class MetricsServer(Closeable):
    """A running metrics endpoint; `close()` stops it (idempotent)."""

    def __init__(self, server: Any, thread: threading.Thread, collector: LedgerCollector) -> None:
        self._closed = False
        self._server = server
        self._thread = thread
        self.collector = collector
        self.addr: str = server.server_address[0]
        self.port: int = server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://{self.addr}:{self.port}/metrics"

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
        self.collector.close()


def serve(
    keys: Sequence[str] | None = None,
    *,
    port: int,
    addr: str = "127.0.0.1",
    directory: str | os.PathLike[str] | None = None,
) -> MetricsServer:
    """Serve the ledgers `keys` (None: every ledger of this user in the ledger folder)
    at http://addr:port/metrics in a daemon thread. Port 0
    picks a free port (see `MetricsServer.port`). OSError when the port is taken."""
    prometheus_client = _prometheus()
    registry = prometheus_client.CollectorRegistry(auto_describe=True)
    collector = LedgerCollector(keys, directory)
    registry.register(collector)
    server, thread = prometheus_client.start_http_server(port, addr=addr, registry=registry)
    return MetricsServer(server, thread, collector)


def start_from_settings() -> MetricsServer | None:
    """Start the endpoint if KVCACHED_METRICS_PORT is set. It exports every ledger of
    this user, so any one process serves all devices. None when the variable is unset,
    the port is taken (another instance serves it already), the address cannot be
    bound (logged as a warning naming KVCACHED_METRICS_ADDR) or prometheus_client is
    missing."""
    from kvcached.config import settings

    config = settings()
    if config.metrics_port is None:
        return None
    try:
        return serve(None, port=config.metrics_port, addr=config.metrics_addr)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            log.info("metrics port %d is taken; another process serves it", config.metrics_port)
        else:
            log.warning(
                "KVCACHED_METRICS_PORT=%d: cannot serve metrics on KVCACHED_METRICS_ADDR=%s: %s",
                config.metrics_port,
                config.metrics_addr,
                exc,
            )
    except KVCachedError as exc:
        log.warning("KVCACHED_METRICS_PORT is set but %s", exc)
    return None


# Note [one endpoint per process]. Every `KVCache` asks for the endpoint (it cannot know
# whether another one of this process did already); the first ask starts it, or tries
# to: a port taken by another process, an address that cannot be bound or a missing
# prometheus_client is not tried again by the next cache, which would only log the
# same refusal once per instance. A forked child inherits the parent's server object
# but not its thread: the fork hook below forgets it (closing it would wait on that
# thread forever), so the child's first cache asks afresh and finds the port taken.
_process_server: MetricsServer | None = None
_process_asked = False  # this process asked for its endpoint (and got _process_server)
_process_lock = threading.Lock()


def start_process_server() -> MetricsServer | None:
    """The endpoint of KVCACHED_METRICS_PORT for this process: started on the first call
    (every `KVCache` calls it), tried once (Note [one endpoint per process]), and
    running until the process exits or `stop_process_server()`. None while the variable
    is unset (a later call, once it is set, starts it) or when the start failed."""
    global _process_server, _process_asked
    from kvcached.config import settings

    if settings().metrics_port is None:
        return None
    with _process_lock:
        if not _process_asked:
            _process_asked = True
            _process_server = start_from_settings()
        return _process_server


def stop_process_server() -> None:
    """Stop the endpoint `start_process_server` started, if any, and let a later call
    start it again (tests use it)."""
    global _process_server, _process_asked
    with _process_lock:
        server, _process_server, _process_asked = _process_server, None, False
    if server is not None:
        server.close()


def _forget_parents_server(parent: int) -> None:
    global _process_server, _process_asked, _process_lock
    _process_lock = threading.Lock()
    _process_server, _process_asked = None, False


forksafe.register(
    "kvcached.metrics", forksafe.Stage.ENDPOINTS, after_in_child=_forget_parents_server
)
