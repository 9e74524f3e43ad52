"""Running `kvcached serve`: the supervisor, the router and uvicorn in one event loop.

`run(config)` is what the command calls; `serve(config)` is the same as a coroutine,
for a program (or a test) that has an event loop of its own. Both do, in order:

1. Bind the listening socket, before anything starts: a port that is taken is an error
   at once, not after every engine has loaded for a minute.
2. `Supervisor(config).start()`: the ledger opened with the config's budget, the policy
   loop running, the preloaded engines starting (in the background: requests that come
   before an engine is healthy are held by `ModelHandle.serving`, not refused).
3. The router (`router.build_router`) with the dashboard's and `/metrics`' routes
   (`dashboard.dashboard_routes`), under a `uvicorn.Server` in the same loop, serving
   the socket of step 1; a banner names the URL and the models once it listens.

Note [stopping]: SIGINT (Ctrl-C) and SIGTERM are this module's, not uvicorn's.
uvicorn's own handlers re-raise the signal once its server has stopped, which would
kill the process before the engines are stopped; here the first signal asks uvicorn
to exit (it stops accepting, and gives the requests in flight `SHUTDOWN_GRACE_S` to
finish, then cancels them, which closes their engine requests), and then the supervisor
stops every engine, whatever happened before: a `finally` runs `Supervisor.stop()`
after a signal, after a crash of the supervisor or the server, and after a
cancellation, so no engine process outlives `kvcached serve`. A second signal while
stopping makes uvicorn drop the requests in flight at once; the engines are still
stopped (the supervisor escalates to SIGKILL after its own grace period). `run`
returns 0 after a signal, 1 (with the reason on stderr) when the server could not
start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from kvcached.errors import KVCachedError

if TYPE_CHECKING:
    import uvicorn
    from starlette.routing import BaseRoute

    from kvcached.apps.serve.config import ServeConfig
    from kvcached.apps.serve.launchers import Launcher
    from kvcached.apps.serve.state import Models

log = logging.getLogger("kvcached.serve")

__all__ = ["SHUTDOWN_GRACE_S", "ServeError", "run", "serve"]

#: seconds the requests in flight have to finish once a stop is asked for
SHUTDOWN_GRACE_S = 10.0
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class ServeError(KVCachedError):
    """`kvcached serve` could not start (the message says why and what to change)."""


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket on `host`:`port` (not yet listening); `ServeError` naming the
    address when it is taken or not this machine's."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ServeError(f"cannot listen on host {host!r}: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ServeError(
            f"cannot listen on {host}:{port}: {exc.strerror}; choose another port "
            "(`port:` in the file, or --port) or stop what is using it"
        ) from None
    sock.set_inheritable(False)  # the engines the supervisor starts must not hold it
    return sock


def _extra_routes(models: Models) -> list[BaseRoute]:
    """The dashboard's and `/metrics`' routes; none (with a warning) when they cannot be
    served here (prometheus_client missing, the page not installed)."""
    from kvcached.apps.serve.dashboard import dashboard_routes

    try:
        return list(dashboard_routes(models))
    except KVCachedError as exc:
        log.warning("the dashboard and /metrics are off: %s", exc)
        return []


def _url(host: str, port: int) -> str:
    shown = {"0.0.0.0": "127.0.0.1", "::": "[::1]", "": "127.0.0.1"}.get(host)
    if shown is None:
        shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


def banner(config: ServeConfig, models: Models, url: str, dashboard: bool) -> str:
    """What `kvcached serve` prints once it listens: where, and which models."""
    lines = [f"kvcached serve: OpenAI API at {url}/v1"]
    if config.host in ("0.0.0.0", "::", ""):
        lines[0] += " (listening on every address of this machine)"
    if dashboard:
        lines.append(f"  dashboard {url}/dashboard   metrics {url}/metrics")
    if config.api_key:
        lines.append("  clients must send 'Authorization: Bearer <api_key>'")
    width = max(len(spec.name) for spec in config.models)
    for spec in config.models:
        state = models.handle(spec.name).state.value
        when = "" if spec.preload else ", starts on its first request"
        lines.append(f"  {spec.name:<{width}}  {spec.engine:<6} {spec.path}  ({state}{when})")
    lines.append(f"  engine logs in {config.log_dir}/; Ctrl-C stops every engine")
    return "\n".join(lines)


class _Signals:
    """Note [stopping]: the first SIGINT/SIGTERM asks the server to exit, a second one
    asks it to drop what is in flight."""

    def __init__(self) -> None:
        self.server: uvicorn.Server | None = None
        self.asked = asyncio.Event()

    def __call__(self, sig: signal.Signals) -> None:
        if self.asked.is_set():
            log.warning("%s again: dropping the requests in flight", sig.name)
            if self.server is not None:
                self.server.force_exit = True
            return
        log.info("%s: stopping (requests in flight have %.0f s)", sig.name, SHUTDOWN_GRACE_S)
        self.asked.set()
        if self.server is not None:
            self.server.should_exit = True

    @contextlib.contextmanager
    def installed(self, loop: asyncio.AbstractEventLoop) -> Iterator[None]:
        added = []
        try:
            for sig in _STOP_SIGNALS:
                try:
                    loop.add_signal_handler(sig, self, sig)
                except (NotImplementedError, RuntimeError, ValueError):
                    continue  # not the main thread, or no signals here: the caller stops us
                added.append(sig)
            yield
        finally:
            for sig in added:
                loop.remove_signal_handler(sig)


def _server(app: Any, config: ServeConfig, log_level: str) -> uvicorn.Server:
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:  # Note [stopping]: they are ours
            yield

    settings = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=log_level,
        timeout_graceful_shutdown=int(SHUTDOWN_GRACE_S),
        # the server behind a proxy still names the client in its access log
        proxy_headers=True,
    )
    return Server(settings)


async def serve(
    config: ServeConfig,
    *,
    log_level: str = "info",
    on_ready: Callable[[str], None] | None = None,
    launchers: Mapping[str, Launcher] | None = None,
) -> None:
    """Run `kvcached serve` for `config` until SIGINT/SIGTERM (or cancellation); every
    engine is stopped before it returns (Note [stopping]).

    `log_level`: uvicorn's (critical, error, warning, info, debug, trace).
    `on_ready(url)`: called once the server listens (default: print the banner).
    `launchers`: launchers by engine over `launchers.LAUNCHERS` (tests run a stand-in
    engine this way). `ServeError` when it cannot start."""
    from kvcached.apps.serve.router import build_router
    from kvcached.apps.serve.supervisor import Supervisor

    sock = _bind(config.host, config.port)
    port = sock.getsockname()[1]
    url = _url(config.host, port)
    signals = _Signals()
    try:
        supervisor = Supervisor(config, launchers=launchers)
    except BaseException:
        sock.close()
        raise
    try:
        with signals.installed(asyncio.get_running_loop()):
            try:
                await supervisor.start()
                extra = _extra_routes(supervisor)
                app = build_router(supervisor, api_key=config.api_key, extra_routes=extra)
                server = _server(app, config, log_level)
                signals.server = server
                if signals.asked.is_set():
                    return
                ready = asyncio.ensure_future(_when_started(server))
                ready.add_done_callback(
                    lambda done: _announce(done, on_ready, config, supervisor, url, bool(extra))
                )
                try:
                    await server.serve(sockets=[sock])
                finally:
                    ready.cancel()
            finally:
                log.info("stopping every engine")
                await supervisor.stop()
    finally:
        sock.close()


async def _when_started(server: uvicorn.Server) -> None:
    while not server.started:
        await asyncio.sleep(0.02)


def _announce(
    done: asyncio.Future[None],
    on_ready: Callable[[str], None] | None,
    config: ServeConfig,
    models: Models,
    url: str,
    dashboard: bool,
) -> None:
    if done.cancelled() or done.exception() is not None:
        return
    if on_ready is not None:
        on_ready(url)
    else:
        print(banner(config, models, url, dashboard), flush=True)


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop when it is installed (as uvicorn picks it), else asyncio's; the
    router overhead benchmark runs its processes on the same."""
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def run(
    config: ServeConfig,
    *,
    log_level: str = "info",
    launchers: Mapping[str, Launcher] | None = None,
) -> int:
    """`kvcached serve`: serve `config` until SIGINT/SIGTERM; the exit status (0 after a
    signal, 1 when it could not start, the reason on stderr). Arguments as `serve`'s."""
    level = getattr(logging, log_level.upper(), logging.INFO)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kvcached").setLevel(level)
    try:
        if sys.version_info >= (3, 11):
            with asyncio.Runner(loop_factory=loop_factory()) as runner:
                runner.run(serve(config, log_level=log_level, launchers=launchers))
        else:  # pragma: no cover - Python 3.10
            asyncio.run(serve(config, log_level=log_level, launchers=launchers))
    except KVCachedError as exc:
        print(f"kvcached serve: {exc}", file=sys.stderr)
        return 1
    return 0
