"""The node's local HTTP status endpoint and its dashboard.

Routes (all read-only, all delegating to `Telemetry`):

    /healthz   "ok"; no token, so liveness probes work
    /status    JSON: round, phase, peers, latest metrics, rejections, traffic,
               and how the protocol merges its neighbours' models (`exchange`:
               asynchronous or not, the staleness bound and weighting)
    /peers     JSON graph: nodes, directed edges, who-chose-whom counts
    /metrics   Prometheus text format 0.0.4
    /history   JSON metric series for the dashboard's curves
    /          the dashboard: one self-contained HTML page (no CDN)

With a token, every data route needs `Authorization: Bearer <token>`. The
dashboard page itself holds no data, so it is served without one: a browser
opening `/#token=...` cannot send a header for the page, and the page's script
passes the token (read from the URL fragment, which never reaches the server)
on each data request. A node always has a token (`status_token`): the
configured one, or a random one it keeps in STATE/status.token.

Against DNS rebinding and cross-site requests (as Jupyter guards its server),
every route but /healthz answers 403 `{"reason": "bad_host"}` unless the Host
header names this node: localhost, 127.0.0.1, [::1] (any port), `status.host`,
a name in `status.allowed_hosts`, or, when bound to every interface (0.0.0.0,
::), any IP address. A rebinding page's requests carry the attacker's own name
as Host; an IP-literal Host means the browser really went to that address. A
data route also answers 403 `{"reason": "bad_origin"}` to a request whose
Origin is not the Host it was sent to, or that the browser marks cross-site
(Sec-Fetch-Site). Both refusals are counted with the message rejections.
/healthz stays open to any Host and needs no token: probes send the pod's IP
or a Service name, and its answer is the constant "ok".

The port holds at most STATUS_MAX_CONNECTIONS connections, each closed when
its request's headers take longer than STATUS_HEADER_TIMEOUT_S or it idles
STATUS_KEEPALIVE_S (node/listen.py; counted as rejections too): silent
connections held the node's file descriptors for an hour before.
"""

from __future__ import annotations

import hmac
import importlib.resources
import ipaddress
import logging
import os
import re
import secrets
import stat
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

from aiohttp import web
from yarl import URL

from node.listen import ConnectionGate, bound_port, serve_app
from node.prometheus import CONTENT_TYPE as PROMETHEUS_CONTENT_TYPE
from node.telemetry import Telemetry
from p2pfl.config import ConfigError, SiteConfig, is_loopback
from p2pfl.files import create_exclusive
from p2pfl.secure.identity import key_file_problem

logger = logging.getLogger(__name__)

TELEMETRY_KEY = web.AppKey("telemetry", Telemetry)
NODE_NAME_KEY = web.AppKey("node_name", str)
PROTOCOL_KEY = web.AppKey("protocol_name", str)
DASHBOARD_KEY = web.AppKey("dashboard_html", str)
TOKEN_REQUIRED_KEY = web.AppKey("token_required", bool)
EXCHANGE_KEY = web.AppKey("exchange_settings", dict)

# The page may talk only to the server it came from; inline script and style only.
DASHBOARD_CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)
PUBLIC_PATHS = frozenset({"/healthz", "/"})  # no token
ANY_HOST_PATHS = frozenset({"/healthz"})  # no Host check either
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})
# A browser's Sec-Fetch-Site for a request another site's page made.
CROSS_SITE = frozenset({"cross-site", "same-site"})
STATUS_TOKEN_FILE = "status.token"  # under the state directory
MIN_TOKEN_CHARS = 16  # as status.token
MAX_TOKEN_CHARS = 512
TOKEN_TEXT = re.compile(r"[\x21-\x7e]+")  # printable ASCII, no whitespace
BAD_HOST = "bad_host"
BAD_ORIGIN = "bad_origin"
# Connections to the status port (node/listen.py): a dashboard polls every 2 s
# on one or two, Prometheus scrapes on one.
STATUS_MAX_CONNECTIONS = 64
STATUS_HEADER_TIMEOUT_S = 10.0
STATUS_KEEPALIVE_S = 15.0
# ASCII digits only: str.isdigit() is True for "²" and "١٢" too, which int()
# refuses (a 500 with a traceback) or reads as 12.
PORT_DIGITS = re.compile(r"[0-9]{1,5}")

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


def _split_host(value: str) -> tuple[str, int | None] | None:
    """'Name:8000' -> ('name', 8000); '[::1]:80' -> ('::1', 80); None if malformed."""
    value = value.strip().lower()
    if value.startswith("["):
        name, bracket, rest = value[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            return None
        port_text = rest[1:]
    elif value.count(":") > 1:  # a bare IPv6 address: no port
        name, port_text = value, ""
    else:
        name, _, port_text = value.partition(":")
    if port_text and not (PORT_DIGITS.fullmatch(port_text) and int(port_text) < 65536):
        return None
    name = name.rstrip(".")
    return (name, int(port_text) if port_text else None) if name else None


class HostGuard:
    """Which Host (and Origin) headers this endpoint answers."""

    def __init__(self, bind_host: str = "127.0.0.1", allowed_hosts: Iterable[str] = ()) -> None:
        bind = bind_host.strip("[]").lower()
        self.any_ip = bind in WILDCARD_HOSTS
        self.names = LOOPBACK_NAMES | {bind} | {h.strip("[]").lower() for h in allowed_hosts}

    def allows(self, host_header: str | None) -> bool:
        """True for a Host header naming this node; a missing one (no browser
        omits it) is allowed."""
        if host_header is None:
            return True
        parsed = _split_host(host_header)
        if parsed is None:
            return False
        name = parsed[0]
        if name in self.names:
            return True
        try:
            address = ipaddress.ip_address(name)
        except ValueError:
            return False
        return address.is_loopback or self.any_ip

    @staticmethod
    def same_origin(origin: str, host_header: str | None, scheme: str = "http") -> bool:
        """True when `origin` (an Origin header) is the server the request was sent to
        (`host_header`, over `scheme`)."""
        try:
            url = URL(origin)
        except ValueError:
            return False
        if url.scheme != scheme or not url.host or host_header is None:
            return False
        sent_to = _split_host(host_header)
        if sent_to is None:
            return False
        default_port = 443 if url.scheme == "https" else 80
        return (url.host.strip("[]").lower().rstrip("."), url.port or default_port) == (
            sent_to[0],
            sent_to[1] or default_port,
        )


def _refuse(request: web.Request, reason: str, detail: str) -> web.Response:
    request.app[TELEMETRY_KEY].record_rejection(reason)
    return web.json_response({"reason": reason, "detail": detail}, status=403)


def host_guard_middleware(
    guard: HostGuard,
) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """403 bad_host for a Host header that does not name this node (DNS
    rebinding), 403 bad_origin for a data request from another origin (CSRF)."""

    @web.middleware
    async def check_host(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in ANY_HOST_PATHS:
            return await handler(request)
        host = request.headers.get("Host")
        if not guard.allows(host):
            return _refuse(
                request,
                BAD_HOST,
                "the Host header does not name this node: open it as http://127.0.0.1:PORT/ "
                "or add the name to status.allowed_hosts",
            )
        if request.path not in PUBLIC_PATHS:
            origin = request.headers.get("Origin")
            fetch_site = request.headers.get("Sec-Fetch-Site", "").lower()
            if (origin is not None and not guard.same_origin(origin, host, request.scheme)) or (
                fetch_site in CROSS_SITE
            ):
                return _refuse(request, BAD_ORIGIN, "requests from other origins are refused")
        return await handler(request)

    return check_host


# ----------------------------------------------------------------------------- token


class TokenFileError(Exception):
    """A token file this process keeps itself that it will not use: the
    message says what is wrong with it."""


OWN_TOKEN_FIX = (
    "delete it (a new one is made at the next start), chmod 600 it if only you could "
    "read it, or set status.token_file"
)


def token_problem(token: str) -> str | None:
    """What makes `token` no plausible bearer token (None: nothing): a token
    is 16 to 512 printable ASCII characters without whitespace, as
    `secrets.token_urlsafe` and base64 write them."""
    if len(token) < MIN_TOKEN_CHARS:
        return f"has fewer than {MIN_TOKEN_CHARS} characters"
    if len(token) > MAX_TOKEN_CHARS:
        return f"has more than {MAX_TOKEN_CHARS} characters"
    if not TOKEN_TEXT.fullmatch(token):
        return "holds characters other than printable ASCII without whitespace"
    return None


def read_own_token(path: Path) -> str:
    """The token in a file this process made (0600) and keeps itself (a node's
    STATE/status.token, a relay's status.token): refused (TokenFileError) if
    it is a link, not a plain file, readable or writable by others, or holds
    no plausible token: then someone else made, replaced or exposed it, and
    the token may be known. (A status.token_file the operator names outside
    the state dir, often a mounted secret and a link, is read by
    `read_named_token`; one inside it is the node's own: `inside`.)"""
    if path.is_symlink():
        raise TokenFileError(f"{path} is a symbolic link")
    if not stat.S_ISREG(os.lstat(path).st_mode):  # a FIFO would block the open
        raise TokenFileError(f"{path} is not a plain file")
    # no link swapped in since (O_NOFOLLOW), nor a FIFO (O_NONBLOCK; then S_ISREG)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as fh:
        found = os.fstat(fh.fileno())
        mode = found.st_mode
        if not stat.S_ISREG(mode):
            raise TokenFileError(f"{path} is not a plain file")
        if mode & 0o077:
            raise TokenFileError(f"{path} has mode {stat.S_IMODE(mode):o}: others may read it")
        if found.st_uid != os.getuid():  # planted in a folder someone else made first
            raise TokenFileError(f"{path} belongs to uid {found.st_uid}, not to this account")
        raw = fh.read(2 * MAX_TOKEN_CHARS)
    try:
        token = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        raise TokenFileError(f"the token in {path} is not ASCII text") from None
    problem = token_problem(token)
    if problem is not None:
        raise TokenFileError(f"the token in {path} {problem}")
    return token


NAMED_TOKEN_FIX = (
    "`chmod 600` it as the node's user (0440 for a mounted secret's group), and write a new "
    "token into it if others could read it"
)


def read_named_token(path: Path) -> str:
    """The token in a file the operator names outside the node's own folder (a
    mounted secret): refused (TokenFileError) if others may read or write it,
    its group may write it, it belongs to another account than this one or
    root, or it is no plain file, as a private key is
    (p2pfl/secure/identity.py `key_file_problem`: links and group read stay
    allowed). It was read whatever its mode (a key review: a 0644 token file
    served as the bearer token)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as fh:
        problem = key_file_problem(os.fstat(fh.fileno()))
        if problem is not None:
            raise TokenFileError(f"{path} {problem}")
        raw = fh.read(2 * MAX_TOKEN_CHARS)
    return raw.decode("utf-8").strip()


def inside(path: Path, folder: Path) -> bool:
    """Whether `path` names a file in `folder` (the node's state dir): then it
    is the node's own, and read as `read_own_token` reads it (a second review:
    provision's `status.token_file: state/status.token` skipped every check)."""
    try:
        inner, outer = os.path.abspath(path), os.path.abspath(folder)
        return os.path.commonpath([inner, outer]) == outer
    except (OSError, ValueError):
        return False


def load_or_create_token(path: Path) -> str:
    """The token kept in `path`, created (random, 0600) the first time, and
    read back as `read_own_token` reads it. Two processes starting at once on
    one folder get the same token: the file is created only where absent,
    never replaced (p2pfl/files.py create_exclusive)."""
    if not os.path.lexists(path):
        create_exclusive(path, (secrets.token_urlsafe(32) + "\n").encode(), mode=0o600)
    return read_own_token(path)


def _warn_if_others_read(config_path: Path) -> None:
    """An inline status.token is as private as the site.yaml that holds it: say
    so loudly where other accounts may read that file (the systemd unit's
    ConfigurationDirectoryMode 0755 leaves a site.yaml there at 0644 under the
    usual umask: a review, 2026-11-28). A warning, not a refusal: a Kubernetes
    ConfigMap is mounted 0644 in a pod where no other account runs."""
    try:
        mode = config_path.stat().st_mode
    except OSError:
        return  # "<config>", a config made in code
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        logger.warning(
            "%s holds status.token inline and other accounts may read it (mode %04o): "
            "move the token to status.token_file (chmod 600), or chmod 600 %s",
            config_path,
            stat.S_IMODE(mode),
            config_path,
        )


def status_token(cfg: SiteConfig, config_path: Path | str = "<config>") -> str:
    """The status token of a site: status.token, else status.token_file, else
    STATE/status.token (created with a random token on the first start, then reused)."""
    if cfg.status.token:
        problem = token_problem(cfg.status.token)
        if problem is not None:
            raise ConfigError(config_path, "status.token", f"the token {problem}", OWN_TOKEN_FIX)
        _warn_if_others_read(Path(config_path))
        return cfg.status.token
    state = Path(cfg.node.state_dir)
    if cfg.status.token_file and not inside(Path(cfg.status.token_file), state):
        field, path = "status.token_file", Path(cfg.status.token_file)
        try:
            token = read_named_token(path)
        except TokenFileError as exc:
            raise ConfigError(config_path, field, str(exc), NAMED_TOKEN_FIX) from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(
                config_path, field, f"cannot read {path}: {exc}", "write the token into it"
            ) from None
    else:  # the node's own file: provision's state/status.token, or the default
        field = "status.token_file" if cfg.status.token_file else "node.state_dir"
        path = Path(cfg.status.token_file) if cfg.status.token_file else state / STATUS_TOKEN_FILE
        try:
            return load_or_create_token(path)
        except TokenFileError as exc:
            raise ConfigError(config_path, field, str(exc), OWN_TOKEN_FIX) from None
        except OSError as exc:
            raise ConfigError(
                config_path,
                field,
                f"cannot keep the status token in {path}: {exc}",
                "make the state directory writable, or set status.token_file",
            ) from None
    problem = token_problem(token)
    if problem is not None:
        raise ConfigError(
            config_path,
            field,
            f"the status token in {path} {problem}",
            "write a random token (e.g. `head -c 32 /dev/urandom | base64`) into it",
        )
    return token


def dashboard_url(host: str, port: int, token: str | None) -> str:
    """The dashboard's address for a browser on this machine, token in the fragment."""
    shown = "127.0.0.1" if host in WILDCARD_HOSTS else host
    shown = f"[{shown}]" if ":" in shown else shown
    return f"http://{shown}:{port}/" + (f"#token={token}" if token else "")


def token_location(cfg: SiteConfig, config_path: Path | str = "<config>") -> str:
    """Where a site's status token is, in words: never the token itself."""
    if cfg.status.token:
        return f"status.token in {config_path}"
    if cfg.status.token_file:
        return str(cfg.status.token_file)
    return f"{Path(cfg.node.state_dir) / STATUS_TOKEN_FILE} (readable by this user only)"


def dashboard_banner(
    name: str, host: str, port: int, token: str, where: str, *, terminal: bool
) -> str:
    """The line a node prints on stderr at start. With the token in the URL
    only when stderr is a terminal (an operator opens it from there): under
    systemd, docker or Kubernetes stderr goes to the journal and to log
    collectors, which others read; there the line says where the token is."""
    if terminal:
        return f"{name}: dashboard {dashboard_url(host, port, token)}"
    return f"{name}: dashboard {dashboard_url(host, port, None)} (token in {where})"


async def healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def status(request: web.Request) -> web.Response:
    app = request.app
    document = app[TELEMETRY_KEY].status_json(app[NODE_NAME_KEY], app[PROTOCOL_KEY])
    document["exchange"] = app.get(EXCHANGE_KEY) or None
    return _no_store(web.json_response(document))


def exchange_settings(params: Any) -> dict[str, Any]:
    """How a protocol merges its neighbours' models, as /status shows it:
    synchronous pulls (a newer model accepted up to `max_staleness` rounds) or
    asynchronous ones (protocols/async_exchange.py: the freshest model, not
    merged past `staleness_bound` rounds behind, weighted by FedAsync's
    (t - tau + 1)^-a). A chained protocol's fine-tuning stage under `finetune`.
    Empty for a protocol without a model exchange (FedSGDP2P, FedER, probe)."""
    if not hasattr(params, "asynchronous"):
        return {}
    out: dict[str, Any] = {"asynchronous": bool(params.asynchronous)}
    if params.asynchronous:
        a = float(params.staleness_exponent)
        out.update(
            staleness_bound=int(params.staleness_bound),
            staleness_weighting="polynomial",
            staleness_exponent=a,
            staleness_function=f"(t - tau + 1)^-{a:g}",
        )
    else:
        out["max_staleness"] = int(params.max_staleness)
    finetune = exchange_settings(getattr(params, "finetune", None))
    if finetune:
        out["finetune"] = finetune
    return out


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
    telemetry: Telemetry,
    *,
    node_name: str,
    protocol_name: str,
    token: str | None,
    host: str = "127.0.0.1",
    allowed_hosts: Iterable[str] = (),
    exchange: dict[str, Any] | None = None,
) -> web.Application:
    """Assemble the status application; every route is listed here. `host` is the
    address it will be bound to, `allowed_hosts` further names it may be reached by;
    `exchange` what /status shows of the protocol's merging (`exchange_settings`)."""
    middlewares = [host_guard_middleware(HostGuard(host, allowed_hosts))]
    if token:
        middlewares.append(bearer_auth_middleware(token))
    app = web.Application(middlewares=middlewares)
    app[TELEMETRY_KEY] = telemetry
    app[NODE_NAME_KEY] = node_name
    app[PROTOCOL_KEY] = protocol_name
    app[DASHBOARD_KEY] = load_dashboard_html()
    app[TOKEN_REQUIRED_KEY] = bool(token)
    app[EXCHANGE_KEY] = dict(exchange or {})
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/status", status)
    app.router.add_get("/peers", peers)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/history", history)
    app.router.add_get("/", dashboard)
    return app


def config_status_app(
    cfg: SiteConfig, telemetry: Telemetry, config_path: Path | str = "<config>"
) -> tuple[web.Application, str]:
    """The status app of a site as its config says (a token always), and the token."""
    token = status_token(cfg, config_path)
    app = create_status_app(
        telemetry,
        node_name=cfg.node.name,
        protocol_name=cfg.protocol.name,
        token=token,
        host=cfg.status.host,
        allowed_hosts=cfg.status.allowed_hosts,
        exchange=exchange_settings(cfg.protocol),
    )
    return app, token


async def start_status_server(
    app: web.Application,
    host: str,
    port: int,
    *,
    on_refused: Callable[[str], None] | None = None,
    max_connections: int = STATUS_MAX_CONNECTIONS,
    header_timeout_s: float = STATUS_HEADER_TIMEOUT_S,
    keepalive_s: float = STATUS_KEEPALIVE_S,
) -> tuple[web.AppRunner, int]:
    """Serve `app` on host:port (0 = any free port); returns the runner and the bound port.

    At most `max_connections` at once, each closed when its request's headers
    take longer than `header_timeout_s` or it idles `keepalive_s`
    (node/listen.py); a connection refused so is counted by `on_refused`
    (default: the app's telemetry, as its other refusals). Refuses a
    non-loopback address without a token (config.StatusSection checks the
    same; this is the second lock on the door). Stop with `await runner.cleanup()`.
    """
    if not is_loopback(host) and not app.get(TOKEN_REQUIRED_KEY, False):
        raise ValueError(
            f"status endpoint on non-loopback address {host!r} needs a bearer token; "
            "create the app with token=... or bind to 127.0.0.1"
        )
    if on_refused is None:
        telemetry = app.get(TELEMETRY_KEY)
        on_refused = telemetry.record_rejection if telemetry is not None else lambda reason: None
    gate = ConnectionGate(max_connections, header_timeout_s, on_refused)
    # no keep-alive at all: a local client cannot hold the 64 places with
    # /healthz every few seconds (a second review did; the dashboard polls every 2 s)
    runner = await serve_app(
        app, host, port, gate=gate, keepalive_s=keepalive_s, close_after=lambda response: True
    )
    port = bound_port(runner, port)
    logger.info("status endpoint listening on http://%s:%d/", host, port)
    return runner, port
