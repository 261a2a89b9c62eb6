"""The node's HTTP ports (peer, status, relay): how many connections each
holds, and for how long one may idle.

Each open connection holds one of the process's file descriptors. aiohttp
keeps an idle one for an hour by default (keepalive_timeout 3630 s) and sets
no deadline on a request's headers, so in the review 150 connections per port
that sent half a request line and then nothing held 300 descriptors; at the
process's limit the node could no longer write its checkpoints nor answer
/healthz, and asyncio logged a traceback per failed accept (57,026 lines in
20 s; node/logsetup.py now says it once a minute). Here, per port:

- at most `limit` connections at once (`ConnectionGate`, never more than half
  the process's descriptor limit). One more takes the place of the connection
  that has waited longest for its first request's headers, or, when every
  place holds a request or a keep-alive connection, it is closed as soon as
  it is made; either is counted `connection_limit`;
- a connection must deliver its first request's headers within
  `header_timeout_s`, else it is closed, counted `headers_too_slow`;
- an idle keep-alive connection is closed after `keepalive_s`, and so is one
  that starts a next request and does not finish its headers by then
  (aiohttp's keep-alive timer); every answer of the status port closes its
  connection (`close_after`), so a local client cannot hold its places with
  a cheap request before each keep-alive runs out (a second review did). On
  the peer and relay ports the same holds only up to `max_connections`
  (16384 by default, at most half the descriptor limit): closing after each
  refusal there cost honest peers their connection on every `not_ready` and
  `rate_limited`, and broke pipelined floods' accounting. A request's body has its own limits
  (node/transport.py); a request being answered, a request held open and a
  relay's WebSocket are not idle.

- at most `per_source` of those places per source address (an IPv6 source
  by its /64, the block one host is usually given; loopback sources are not
  capped: a local federation's nodes all come from 127.0.0.1). One more from
  that source takes the place of that source's own connection that has waited
  longest for its headers, else it is closed at once; either is counted
  `source_connection_limit`. So one address that holds its places with slow
  requests or keep-alive connections holds at most `per_source` of them, not
  the port: other sources still get in.

With TLS, a connection counts (and its header deadline runs) from the end of
its handshake: a handshake that fails tells the application nothing, so one
counted from the accept would hold a place until its deadline, and a
stranger's failed handshakes could keep the port full. A handshake itself is
given `header_timeout_s` (asyncio's default is 60 s).
"""

from __future__ import annotations

import asyncio
import ipaddress
import resource
from collections.abc import Callable
from typing import Any

from aiohttp import web

CONNECTION_LIMIT = "connection_limit"
SOURCE_CONNECTION_LIMIT = "source_connection_limit"
HEADERS_TOO_SLOW = "headers_too_slow"


NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # RFC 6052: an IPv4 client behind a translator


def source_of(peername: Any, *, loopback_exempt: bool = True) -> str | None:
    """The key a connection's source address is capped under: the IPv4
    address (also for an IPv4-mapped or NAT64 IPv6 address, which carries
    one), an IPv6 address's /64 (the block one host is usually given; a
    link-local one with its interface), or None (not capped) for loopback
    sources when `loopback_exempt`, and for anything that is not an IP
    address (a Unix socket)."""
    if not isinstance(peername, tuple) or not peername or not isinstance(peername[0], str):
        return None
    address, _, scope = peername[0].partition("%")
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return None
    # loopback as received: ::1, 127.0.0.0/8, or IPv4-mapped 127.x (a NAT64
    # address never comes from this host)
    if loopback_exempt and (
        ip.is_loopback
        or (
            isinstance(ip, ipaddress.IPv6Address)
            and bool(ip.ipv4_mapped and ip.ipv4_mapped.is_loopback)
        )
    ):
        return None
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        elif ip in NAT64:  # only the well-known /96 prefix is unpacked
            ip = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if isinstance(ip, ipaddress.IPv6Address):
        block = f"{int(ip) >> 64:016x}/64"  # the /64, without building a network object
        return f"{block}%{scope}" if ip.is_link_local and scope else block
    return str(ip)


def descriptor_budget(limit: int) -> int:
    """`limit`, or half the process's file-descriptor limit if that is lower
    (an interactive shell's is often 1024): whatever a port holds, the node
    keeps descriptors for its files and its other port."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return limit
    return max(1, min(limit, soft // 2))


class ConnectionGate:
    """At most `limit` connections at once on one port, at most `per_source`
    of them from one source address (None: no such cap), each given
    `header_timeout_s` to deliver its first request's headers; beyond either
    it is closed, and `on_refused(reason)` counts it."""

    def __init__(
        self,
        limit: int,
        header_timeout_s: float,
        on_refused: Callable[[str], None],
        *,
        per_source: int | None = None,
        loopback_exempt: bool = True,
    ) -> None:
        self.limit = descriptor_budget(limit)
        self.per_source = per_source
        self.loopback_exempt = loopback_exempt
        self.header_timeout_s = header_timeout_s
        self.on_refused = on_refused
        self.open = 0
        # aiohttp's handler of each counted connection still waiting for its
        # first request's headers -> its _Gated, oldest first
        self._waiting: dict[Any, _Gated] = {}
        self.by_source: dict[str, int] = {}  # source -> places it holds
        self._waiting_by_source: dict[str, dict[Any, _Gated]] = {}  # the same, per source

    def serve(self, server: web.Server) -> Callable[[], asyncio.Protocol]:
        """The protocol factory to listen with, in place of `server` itself."""
        make_request = server.request_factory

        def request_factory(message: Any, payload: Any, protocol: Any, *args: Any) -> Any:
            # aiohttp parsed a request's headers on that connection
            gated = self._waiting.pop(protocol, None)
            if gated is not None:
                self._unwait(gated)
                gated.headers_in()
            return make_request(message, payload, protocol, *args)

        server.request_factory = request_factory  # read by each handler it makes
        return lambda: _Gated(self, server())

    def admit(self, gated: _Gated) -> bool:
        """Count a connection just made (after its TLS handshake, if any); False
        when its source, or the port, is full and no connection gives up its
        place to it."""
        source = gated.source
        if (
            source is not None
            and self.per_source is not None
            and self.by_source.get(source, 0) >= self.per_source
            and not self._evict_oldest(source)
        ):
            self.on_refused(SOURCE_CONNECTION_LIMIT)
            return False
        if self.open >= self.limit and not self._evict_oldest():
            self.on_refused(CONNECTION_LIMIT)
            return False
        self.open += 1
        self._waiting[gated.inner] = gated
        if source is not None:
            self.by_source[source] = self.by_source.get(source, 0) + 1
            self._waiting_by_source.setdefault(source, {})[gated.inner] = gated
        return True

    def _unwait(self, gated: _Gated) -> None:
        waiting = self._waiting_by_source.get(gated.source or "")
        if waiting is not None:
            waiting.pop(gated.inner, None)
            if not waiting:
                del self._waiting_by_source[gated.source or ""]

    def _evict_oldest(self, source: str | None = None) -> bool:
        """Make room for a new connection by closing the one that has waited
        longest for its first request's headers (of `source`, if given): an
        honest client sends them at once, so a flood of connections that send
        nothing pushes out its own, not theirs. False when every place (of
        that source) holds a request or a keep-alive connection."""
        queue = self._waiting if source is None else self._waiting_by_source.get(source, {})
        oldest = next(iter(queue.values()), None)
        if oldest is None:
            return False
        self.on_refused(CONNECTION_LIMIT if source is None else SOURCE_CONNECTION_LIMIT)
        oldest.close()
        return True

    def release(self, gated: _Gated) -> None:
        self._waiting.pop(gated.inner, None)
        self._unwait(gated)
        self.open -= 1
        source = gated.source
        if source is not None:
            left = self.by_source.get(source, 0) - 1
            if left > 0:
                self.by_source[source] = left
            else:
                self.by_source.pop(source, None)


class _Gated(asyncio.Protocol):
    """aiohttp's protocol of one connection, passed everything the transport
    says; counted while open, cut off when its first request's headers do not
    come in time."""

    def __init__(self, gate: ConnectionGate, inner: Any) -> None:
        self.gate = gate
        self.inner = inner
        self.transport: asyncio.Transport | None = None
        self.counted = False  # holds one of the gate's places
        self.told = False  # aiohttp's protocol was told of the connection
        self.headers = False  # its first request's headers are in
        self.timer: asyncio.TimerHandle | None = None
        self.source: str | None = None  # the key its source address is capped under

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.source = source_of(
            transport.get_extra_info("peername"), loopback_exempt=self.gate.loopback_exempt
        )
        if not self.gate.admit(self):
            transport.abort()  # type: ignore[attr-defined]
            return
        self.counted = True
        self.timer = asyncio.get_running_loop().call_later(
            self.gate.header_timeout_s, self._too_slow
        )
        self.told = True
        self.inner.connection_made(transport)

    def headers_in(self) -> None:
        self.headers = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _too_slow(self) -> None:
        # Once more round the loop first: after a stall of the event loop, the
        # headers may be in, their request made by the step of aiohttp's task
        # that data_received (run just before this) woke for the next round.
        self.timer = None
        asyncio.get_running_loop().call_soon(self._cut_if_still_waiting)

    def _cut_if_still_waiting(self) -> None:
        if not self.headers and self.counted:
            self.gate.on_refused(HEADERS_TOO_SLOW)
            self.close()

    def close(self) -> None:
        """Abort the connection and give its place up now (its connection_lost
        comes later)."""
        self.headers_in()
        if self.counted:
            self.counted = False
            self.gate.release(self)
        if self.transport is not None:
            self.transport.abort()

    def connection_lost(self, exc: BaseException | None) -> None:
        self.headers_in()
        if self.counted:
            self.counted = False
            self.gate.release(self)
        if self.told:
            self.inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


class GatedSite(web.TCPSite):
    """A TCPSite that listens through a ConnectionGate, and gives a TLS
    handshake the gate's header deadline (asyncio's default is 60 s)."""

    def __init__(self, runner: web.BaseRunner, *args: Any, gate: ConnectionGate, **kw: Any):
        super().__init__(runner, *args, **kw)
        self.gate = gate

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            self.gate.serve(server),
            self._host,
            self._port,
            ssl=self._ssl_context,
            backlog=self._backlog,
            reuse_address=self._reuse_address,
            reuse_port=self._reuse_port,
            ssl_handshake_timeout=self.gate.header_timeout_s if self._ssl_context else None,
        )


async def serve_app(
    app: web.Application,
    host: str,
    port: int,
    *,
    gate: ConnectionGate,
    keepalive_s: float,
    ssl_context: Any = None,
    backlog: int = 128,
    close_after: Callable[[web.StreamResponse], bool] | None = None,
    **runner_options: Any,
) -> web.AppRunner:
    """Serve `app` on host:port (0: any free port) through `gate`; the runner
    (its `addresses` name the bound port; stop with `await runner.cleanup()`).
    A response `close_after` accepts closes its connection (no keep-alive): a
    place of the gate is not held by a client that sends a cheap request before
    each keep-alive runs out (a second review held every place of a port, and
    /healthz with them, that way)."""
    if close_after is not None:

        async def closing(request: web.Request, response: web.StreamResponse) -> None:
            if close_after(response):
                response.force_close()

        app.on_response_prepare.append(closing)
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=keepalive_s, **runner_options)
    await runner.setup()
    site = GatedSite(runner, host, port, ssl_context=ssl_context, backlog=backlog, gate=gate)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    return runner


def bound_port(runner: web.AppRunner, default: int) -> int:
    """The port `runner` listens on (`default` if it names none)."""
    for address in runner.addresses:
        if isinstance(address, tuple) and len(address) >= 2:
            return int(address[1])
    return default
