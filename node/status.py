"""The node's local HTTP status endpoint and its dashboard.

Routes (all read-only, all delegating to `Telemetry`):

    /healthz   "ok"; no token, so liveness probes work
    /status    JSON: round, phase, peers, latest metrics, rejections, traffic
    /peers     JSON graph: nodes, directed edges, who-chose-whom counts
    /metrics   Prometheus text format 0.0.4
    /history   JSON metric series for the dashboard's curves
    /          the dashboard: one self-contained HTML page (no CDN)

With a token, every data route needs `Authorization: Bearer <token>`. The
dashboard page itself holds no data, so it is served without one: a browser
opening `/#token=...` cannot send a header for the page, and the page's script
passes the token (read from the URL fragment, which never reaches the server)
on each data request.
"""

from __future__ import annotations

import hmac
import importlib.resources
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from node.prometheus import CONTENT_TYPE as PROMETHEUS_CONTENT_TYPE
from node.telemetry import Telemetry
from p2pfl.config import is_loopback

logger = logging.getLogger(__name__)

TELEMETRY_KEY = web.AppKey("telemetry", Telemetry)
NODE_NAME_KEY = web.AppKey("node_name", str)
PROTOCOL_KEY = web.AppKey("protocol_name", str)
DASHBOARD_KEY = web.AppKey("dashboard_html", str)
TOKEN_REQUIRED_KEY = web.AppKey("token_required", bool)

# The page may talk only to the server it came from; inline script and style only.
DASHBOARD_CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)
PUBLIC_PATHS = frozenset({"/healthz", "/"})

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def load_dashboard_html() -> str:
    return importlib.resources.files("node").joinpath("dashboard.html").read_text("utf-8")


def bearer_auth_middleware(
    token: str,
) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """401 unless `Authorization: Bearer <token>` (constant-time compare)."""
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def require_token(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in PUBLIC_PATHS:
            return await handler(request)
        offered = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(offered, expected):
            return web.json_response(
                {"error": "unauthorized", "detail": "send Authorization: Bearer <status token>"},
                status=401,
                headers={"WWW-Authenticate": 'Bearer realm="p2pfl-node"'},
            )
        return await handler(request)

    return require_token


async def healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def status(request: web.Request) -> web.Response:
    app = request.app
    return _no_store(
        web.json_response(app[TELEMETRY_KEY].status_json(app[NODE_NAME_KEY], app[PROTOCOL_KEY]))
    )


async def peers(request: web.Request) -> web.Response:
    return _no_store(web.json_response(request.app[TELEMETRY_KEY].peer_graph()))


async def history(request: web.Request) -> web.Response:
    return _no_store(web.json_response(request.app[TELEMETRY_KEY].metrics_history()))


async def metrics(request: web.Request) -> web.Response:
    text = request.app[TELEMETRY_KEY].prometheus_text(request.app[NODE_NAME_KEY])
    response = web.Response(body=text.encode("utf-8"))
    # Set verbatim: aiohttp's content_type= would drop the version parameter.
    response.headers["Content-Type"] = PROMETHEUS_CONTENT_TYPE
    return _no_store(response)


async def dashboard(request: web.Request) -> web.Response:
    response = web.Response(text=request.app[DASHBOARD_KEY], content_type="text/html")
    response.headers["Content-Security-Policy"] = DASHBOARD_CSP
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "no-referrer"
    return _no_store(response)


def _no_store(response: web.Response) -> web.Response:
    response.headers["Cache-Control"] = "no-store"
    return response


def create_status_app(
    telemetry: Telemetry, *, node_name: str, protocol_name: str, token: str | None
) -> web.Application:
    """Assemble the status application; every route is listed here."""
    middlewares = [bearer_auth_middleware(token)] if token else []
    app = web.Application(middlewares=middlewares)
    app[TELEMETRY_KEY] = telemetry
    app[NODE_NAME_KEY] = node_name
    app[PROTOCOL_KEY] = protocol_name
    app[DASHBOARD_KEY] = load_dashboard_html()
    app[TOKEN_REQUIRED_KEY] = bool(token)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/status", status)
    app.router.add_get("/peers", peers)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/history", history)
    app.router.add_get("/", dashboard)
    return app


async def start_status_server(
    app: web.Application, host: str, port: int
) -> tuple[web.AppRunner, int]:
    """Serve `app` on host:port (0 = any free port); returns the runner and the bound port.

    Refuses a non-loopback address without a token (config.StatusSection checks
    the same; this is the second lock on the door). Stop with `await runner.cleanup()`.
    """
    if not is_loopback(host) and not app.get(TOKEN_REQUIRED_KEY, False):
        raise ValueError(
            f"status endpoint on non-loopback address {host!r} needs a bearer token; "
            "create the app with token=... or bind to 127.0.0.1"
        )
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    bound_port = port
    for address in runner.addresses:
        if isinstance(address, tuple) and len(address) >= 2:
            bound_port = int(address[1])
            break
    logger.info("status endpoint listening on http://%s:%d/", host, bound_port)
    return runner, bound_port
