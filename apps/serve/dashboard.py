"""The live dashboard (`GET /dashboard`) and the Prometheus endpoint (`GET /metrics`).

Both read `Models.snapshot()`, the one shape `/api/state` serves too, so the page, the
JSON and the series can never disagree about a model. The page is one static file,
`dashboard.html`, shipped as package data: plain JavaScript and inline SVG, no framework
and nothing fetched from a CDN (the machines this runs on are often closed off from the
internet). It polls `api/state` once a second, relative to its own address, so it works
behind a proxy that mounts the server under a prefix; a `?key=` in the page's address
is sent on as a bearer token, for servers started with an API key. The page itself holds
no data, so it is served without a key; what it shows comes from `/api/state`, which the
router guards.

Note [dashboard content policy]: model names and engine details reach the page from the
configuration and from engine errors. The page writes them with `textContent` only, and
the response carries a Content-Security-Policy that allows no script but the page's own
(by hash, computed here when the file is read), no connection but to this server and
no framing, so a string that slipped through as markup still could not run. Editing the
HTML needs nothing more: the hashes follow the file.

`dashboard_routes(models)` hands both routes to the router (`build_router(...,
extra_routes=...)`); `/api/state` itself is the router's.
"""

from __future__ import annotations

import base64
import hashlib
import re
from importlib import resources

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

from kvcached.apps.serve import metrics
from kvcached.apps.serve.state import Models
from kvcached.errors import KVCachedError

#: the page, package data of `_PACKAGE` (pyproject.toml, [tool.setuptools.package-data])
PAGE = "dashboard.html"
_PACKAGE = "kvcached.apps.serve"

_INLINE = {
    "script-src": re.compile(r"<script>(.*?)</script>", re.DOTALL),
    "style-src": re.compile(r"<style>(.*?)</style>", re.DOTALL),
}


def page_html() -> str:
    """The dashboard page as shipped in this package."""
    try:
        return resources.files(_PACKAGE).joinpath(PAGE).read_text(encoding="utf-8")
    except OSError as exc:
        raise KVCachedError(
            f"the dashboard page {PAGE} is missing from {_PACKAGE} ({exc}); "
            "reinstall kvcached (the wheel ships it as package data)"
        ) from exc


def content_policy(html: str) -> str:
    """The Content-Security-Policy of `html`: its own inline scripts and styles by hash,
    connections to this server only (Note [dashboard content policy])."""
    directives = ["default-src 'none'", "connect-src 'self'", "img-src 'self' data:"]
    for directive, pattern in _INLINE.items():
        hashes = [
            "'sha256-{}'".format(
                base64.b64encode(hashlib.sha256(body.encode("utf-8")).digest()).decode()
            )
            for body in pattern.findall(html)
        ]
        directives.append(" ".join([directive, *hashes]) if hashes else f"{directive} 'none'")
    directives += ["base-uri 'none'", "form-action 'none'", "frame-ancestors 'none'"]
    return "; ".join(directives)


def dashboard_routes(models: Models) -> list[Route]:
    """`GET /dashboard` (the page) and `GET /metrics` (Prometheus) over `models`.

    The page is read and its policy computed here, once: a broken install fails at
    start-up, not at the first visit. Raises `KVCachedError` when the page is missing
    or prometheus_client is not installed."""
    html = page_html()
    page_headers = {
        "Cache-Control": "no-store",
        "Content-Security-Policy": content_policy(html),
        # the address may carry ?key=: never hand it to another site
        "Referrer-Policy": "no-referrer",
        "X-Content-Type-Options": "nosniff",
    }
    scraped = metrics.registry(models)

    async def dashboard(request: Request) -> Response:
        return HTMLResponse(html, headers=page_headers)

    async def prometheus(request: Request) -> Response:
        body, content_type = metrics.exposition(scraped, request.headers.get("accept"))
        return Response(body, headers={"Content-Type": content_type, "Cache-Control": "no-store"})

    return [
        Route("/dashboard", dashboard, methods=["GET"], name="dashboard"),
        Route("/metrics", prometheus, methods=["GET"], name="metrics"),
    ]
