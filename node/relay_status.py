"""The standalone relay process (`p2pfl-node relay --config relay.yaml`) and its
status endpoint.

`run_relay` binds `relay.listen` (with TLS only when `transport.tls` is set,
the same mutual TLS as the sites' peer port: node/tls.py) and the status app on
status.host:port:

    /healthz   "ok"; no token, any Host (liveness probes)
    /status    JSON: RelayServer.snapshot() (sites, counters, refusals by reason)
    /metrics   Prometheus text format 0.0.4 (prometheus-client, node/prometheus.py)

The data routes need `Authorization: Bearer <token>` and a Host header naming
this endpoint (node/status.py HostGuard, against DNS rebinding), as a node's
do. The token is status.token, else the one in status.token_file, else the one
in `status.token` beside relay.yaml, which the relay creates (random, mode
0600) on its first start and reuses: its path is logged, the token itself is
never printed nor logged. It is the one file a relay writes. SIGHUP reloads
the roster (RelayServer.set_roster); SIGINT and SIGTERM stop it cleanly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from pathlib import Path

from aiohttp import web

from node.faults import FaultPlan
from node.listen import ConnectionGate, bound_port
from node.logsetup import JsonFormatter, quiet_network_noise
from node.prometheus import CONTENT_TYPE as PROMETHEUS_CONTENT_TYPE
from node.prometheus import Exposition
from node.relay import RelayServer
from node.resources import freeze_startup_heap
from node.status import (
    ANY_HOST_PATHS,
    NAMED_TOKEN_FIX,
    OWN_TOKEN_FIX,
    STATUS_TOKEN_FILE,
    Handler,
    HostGuard,
    TokenFileError,
    bearer_auth_middleware,
    inside,
    load_or_create_token,
    read_named_token,
    start_status_server,
    token_problem,
)
from node.tls import server_ssl_context
from node.transport import serve_peer_port
from p2pfl.config import ConfigError, RelayConfig, parse_hostport
from p2pfl.errors import UserError
from p2pfl.secure.identity import IdentityError, Roster

log = logging.getLogger(__name__)

RELAY_KEY = web.AppKey("relay", RelayServer)


def relay_status_token(cfg: RelayConfig, config_path: Path | str) -> tuple[str, Path | None]:
    """(token, the file it is kept in or None): status.token, else the file
    status.token_file names, else STATUS_TOKEN_FILE beside the relay.yaml at
    `config_path`, created with a random token (0600) the first time."""
    if cfg.status.token:
        return cfg.status.token, None
    own_folder = None if str(config_path).startswith("<") else Path(config_path).parent
    if cfg.status.token_file is not None and (
        own_folder is None or not inside(Path(cfg.status.token_file), own_folder)
    ):
        field, path, create = "status.token_file", Path(cfg.status.token_file), False
        fix = "write the token into it"
    elif cfg.status.token_file is not None:  # in the relay's own folder: its own file
        field, path, create = "status.token_file", Path(cfg.status.token_file), True
        fix = "make the relay's folder writable, or set status.token_file"
    elif str(config_path).startswith("<"):  # no relay.yaml to keep it beside
        raise ConfigError(
            config_path, "status.token", "no status token", "set status.token or token_file"
        )
    else:
        field, path, create = "status", Path(config_path).parent / STATUS_TOKEN_FILE, True
        fix = "make the relay's folder writable, or set status.token_file"
    try:
        if create:  # its own file: node/status.py read_own_token's checks
            return load_or_create_token(path), path
        token = read_named_token(path)  # the operator's file: a mounted secret's checks
    except TokenFileError as exc:
        raise ConfigError(
            config_path, field, str(exc), OWN_TOKEN_FIX if create else NAMED_TOKEN_FIX
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(config_path, field, f"cannot read {path}: {exc}", fix) from None
    problem = token_problem(token)
    if problem is not None:
        raise ConfigError(
            config_path,
            field,
            f"the token in {path} {problem}",
            "write a random token (e.g. `head -c 32 /dev/urandom | base64`) into it",
        )
    return token, path


def _host_guard(guard: HostGuard, server: RelayServer) -> object:
    @web.middleware
    async def check_host(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in ANY_HOST_PATHS:
            return await handler(request)
        host = request.headers.get("Host")
        origin = request.headers.get("Origin")
        if not guard.allows(host):
            reason = "bad_host"
        elif origin is not None and not guard.same_origin(origin, host, request.scheme):
            reason = "bad_origin"
        else:
            return await handler(request)
        server._count(reason)
        return web.json_response({"reason": reason}, status=403)

    return check_host


async def _healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _status(request: web.Request) -> web.Response:
    response = web.json_response(request.app[RELAY_KEY].snapshot())
    response.headers["Cache-Control"] = "no-store"
    return response


def relay_metrics_text(server: RelayServer) -> str:
    """One scrape of the relay's counters in the Prometheus text format."""
    snap = server.snapshot()
    sites = snap["sites"]
    out = Exposition({"relay": server.name})
    out.gauge(
        "p2pfl_relay_uptime_seconds",
        "Seconds since the relay started.",
        [],
        [({}, snap["uptime_s"])],
    )
    out.gauge(
        "p2pfl_relay_site_connected",
        "1 while the site holds an authenticated connection to this relay.",
        ["site"],
        [({"site": n}, float(s["connected"])) for n, s in sites.items()],
    )
    out.gauge(
        "p2pfl_relay_pending",
        "Frames forwarded to the site and not yet answered.",
        ["site"],
        [({"site": n}, s["pending"]) for n, s in sites.items()],
    )
    for what, help_text in (("messages", "Frames"), ("bytes", "Frame bytes")):
        out.counter(
            f"p2pfl_relay_{what}_total",
            f"{help_text} through the relay: direction in = sent by the site, out = to the site.",
            ["site", "direction"],
            [
                ({"site": n, "direction": d}, s[f"{what}_{d}"])
                for n, s in sites.items()
                for d in ("in", "out")
            ],
        )
    out.counter(
        "p2pfl_relay_reply_bytes_total",
        "Bytes of the answers the site sent back through the relay.",
        ["site"],
        [({"site": n}, s["reply_bytes"]) for n, s in sites.items()],
    )
    out.counter(
        "p2pfl_relay_refusals_total",
        "Messages and connections the relay refused, by reason.",
        ["reason"],
        [({"reason": r}, n) for r, n in snap["refusals"].items()],
    )
    return out.render()


async def _metrics(request: web.Request) -> web.Response:
    response = web.Response(body=relay_metrics_text(request.app[RELAY_KEY]).encode("utf-8"))
    response.headers["Content-Type"] = PROMETHEUS_CONTENT_TYPE
    response.headers["Cache-Control"] = "no-store"
    return response


def create_relay_status_app(
    server: RelayServer, *, token: str, host: str = "127.0.0.1", allowed_hosts: list[str] = ()
) -> web.Application:
    """The relay's status app: /healthz open, /status and /metrics behind the token."""
    app = web.Application(
        middlewares=[
            _host_guard(HostGuard(host, allowed_hosts), server),  # type: ignore[list-item]
            bearer_auth_middleware(token),
        ]
    )
    app[RELAY_KEY] = server
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/status", _status)
    app.router.add_get("/metrics", _metrics)
    return app


class RelayProcess:
    """A RelayServer on its own port, with its status app: `p2pfl-node relay`."""

    def __init__(self, cfg: RelayConfig, roster: Roster, config_path: Path | str = "<config>"):
        if cfg.relay.name not in roster.relays:
            raise ConfigError(
                config_path,
                "relay.name",
                f"relay {cfg.relay.name!r} is not in the roster's relays: {cfg.federation.roster}",
                "add it there with its HOST:PORT (`relays: [{name, address}]`)",
            )
        self.cfg = cfg
        self.config_path = config_path
        self.server = RelayServer(
            cfg.relay.name,
            cfg.federation.id,
            roster,
            cfg.relay,
            max_message_bytes=cfg.wire.max_message_bytes,
            clock_skew_s=cfg.wire.clock_skew_s,
            faults=FaultPlan.from_env(),  # drills only: P2PFL_FAULTS (node/faults.py)
        )
        self.token, self.token_file = (
            relay_status_token(cfg, config_path) if cfg.status.enabled else ("", None)
        )
        self._runner: web.AppRunner | None = None
        self._status_runner: web.AppRunner | None = None
        self.port: int | None = None
        self.status_port: int | None = None

    async def start(self) -> None:
        cfg = self.cfg
        host, port = parse_hostport(cfg.relay.listen)
        tls = cfg.transport.tls
        ssl_context = server_ssl_context(str(tls.cert), str(tls.key), str(tls.ca)) if tls else None
        app = web.Application(client_max_size=cfg.wire.max_message_bytes)
        self.server.add_routes(app)
        # as a site's peer port: a cap, a header deadline, a short keep-alive (node/listen.py)
        gate = ConnectionGate(
            cfg.transport.max_connections,
            cfg.relay.read_idle_timeout_s,
            self.server._count,
            per_source=cfg.transport.max_connections_per_source,
        )
        try:
            self._runner = await serve_peer_port(app, host, port, gate, ssl_context)
        except OSError as exc:
            raise UserError(
                f"{self.config_path}: relay.listen {cfg.relay.listen}: cannot bind "
                f"({exc.strerror}) — stop the process using that port or choose another one"
            ) from None
        self.port = bound_port(self._runner, port)
        scheme = "https" if ssl_context else "http"
        via = [c.name for c in self.server.roster.cards() if cfg.relay.name in c.via]
        log.info(
            "RELAY %s: listening on %s://%s:%d for federation %r (sites via this relay: %s)",
            cfg.relay.name,
            scheme,
            host,
            self.port,
            cfg.federation.id,
            ", ".join(via) or "none",
        )
        if cfg.status.enabled:
            status_app = create_relay_status_app(
                self.server,
                token=self.token,
                host=cfg.status.host,
                allowed_hosts=cfg.status.allowed_hosts,
            )
            try:
                self._status_runner, self.status_port = await start_status_server(
                    status_app, cfg.status.host, cfg.status.port, on_refused=self.server._count
                )
            except OSError as exc:
                await self.stop()
                raise UserError(
                    f"{self.config_path}: status.port {cfg.status.port}: cannot bind "
                    f"({exc.strerror}) — choose another port or set status.enabled: false"
                ) from None
            if self.token_file is not None:  # where it is, never the token itself
                log.info("RELAY %s: status token in %s", cfg.relay.name, self.token_file)

    def reload_roster(self) -> None:
        try:
            roster = Roster.load(Path(self.cfg.federation.roster))
        except IdentityError as exc:
            log.error("RELAY %s: roster not reloaded: %s", self.cfg.relay.name, exc)
            return
        self.server.set_roster(roster)
        log.info("RELAY %s: roster reloaded (%d sites)", self.cfg.relay.name, len(roster.names()))

    async def stop(self) -> None:
        await self.server.close()
        for runner in (self._status_runner, self._runner):
            if runner is not None:
                await runner.cleanup()
        self._runner = self._status_runner = None


async def run_relay(
    cfg: RelayConfig, stop: asyncio.Event, config_path: Path | str = "<config>"
) -> None:
    """Run a relay until `stop` is set; SIGHUP (where the loop allows) reloads the roster."""
    relay = RelayProcess(cfg, Roster.load(Path(cfg.federation.roster)), config_path)
    await relay.start()
    log.debug("start-up heap frozen: %d objects", freeze_startup_heap())
    loop = asyncio.get_running_loop()
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not main thread
        loop.add_signal_handler(signal.SIGHUP, relay.reload_roster)
    try:
        await stop.wait()
    finally:
        await relay.stop()
        log.info("RELAY %s: stopped", cfg.relay.name)


def configure_relay_logging(cfg: RelayConfig, level: str | None = None) -> None:
    """Logs go to stderr only: a relay writes no log file (its one file is its status token)."""
    fmt: logging.Formatter = (
        JsonFormatter()
        if cfg.logging.format == "json"
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.setLevel(level or cfg.logging.level)
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = logging.StreamHandler()
    handler.setFormatter(fmt)
    root.addHandler(handler)
    quiet_network_noise()


def serve_relay(cfg: RelayConfig, config_path: Path | str, level: str | None = None) -> int:
    """The body of `p2pfl-node relay`: run until SIGINT or SIGTERM, then close cleanly."""
    configure_relay_logging(cfg, level)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await run_relay(cfg, stop, config_path)

    asyncio.run(main())
    return 0
