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
  place holds a request, a keep-alive connection or a TLS handshake, it is
  closed as soon as it is accepted; either is counted `connection_limit`;
- a connection must deliver its first request's headers within
  `header_timeout_s` of being accepted (a TLS handshake included), else it is
  closed, counted `headers_too_slow`;
- an idle keep-alive connection is closed after `keepalive_s`, and so is one
  that starts a next request and does not finish its headers by then
  (aiohttp's keep-alive timer). A request's body has its own limits
  (node/transport.py); a request being answered, a request held open and a
  relay's WebSocket are not idle.

The gate counts from the accept, before a TLS handshake: a handshake that
never ends is given up after `header_timeout_s` (ssl_handshake_timeout), and
its place freed then.
"""

from __future__ import annotations

import asyncio
import resource
from collections.abc import Callable
from typing import Any

from aiohttp import web

CONNECTION_LIMIT = "connection_limit"
HEADERS_TOO_SLOW = "headers_too_slow"


def descriptor_budget(limit: int) -> int:
    """`limit`, or half the process's file-descriptor limit if that is lower
    (an interactive shell's is often 1024): whatever a port holds, the node
    keeps descriptors for its files and its other port."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return limit
    return max(1, min(limit, soft // 2))


class ConnectionGate:
    """At most `limit` connections at once on one port, each given
    `header_timeout_s` from its accept to deliver its first request's headers;
    beyond either it is closed, and `on_refused(reason)` counts it."""

    def __init__(
        self, limit: int, header_timeout_s: float, on_refused: Callable[[str], None]
    ) -> None:
        self.limit = descriptor_budget(limit)
        self.header_timeout_s = header_timeout_s
        self.on_refused = on_refused
        self.open = 0
        # aiohttp's handler of each open connection -> its _Gated, until its
        # first request's headers are in
        self._waiting: dict[Any, _Gated] = {}

    def serve(self, server: web.Server) -> Callable[[], asyncio.Protocol]:
        """The protocol factory to listen with, in place of `server` itself."""
        make_request = server.request_factory

        def request_factory(message: Any, payload: Any, protocol: Any, *args: Any) -> Any:
            # aiohttp parsed a request's headers on that connection
            gated = self._waiting.pop(protocol, None)
            if gated is not None:
                gated.headers_in()
            return make_request(message, payload, protocol, *args)

        server.request_factory = request_factory  # read by each handler it makes

        def factory() -> asyncio.Protocol:
            if self.open >= self.limit and not self._evict_oldest():
                self.on_refused(CONNECTION_LIMIT)
                return _Refused()
            handler = server()
            gated = _Gated(self, handler)
            self._waiting[handler] = gated
            return gated

        return factory

    def _evict_oldest(self) -> bool:
        """Make room for a new connection by closing the one that has waited
        longest for its first request's headers: an honest client sends them
        at once, so a flood of connections that send nothing pushes out its
        own, not theirs. False when every place is taken by a request, a
        keep-alive connection or a TLS handshake (its socket is not this
        gate's to close: asyncio gives it up at the deadline)."""
        for gated in self._waiting.values():
            if gated.transport is not None and gated.counted:
                self.on_refused(CONNECTION_LIMIT)
                gated.transport.abort()
                gated._uncount()  # its place is the new connection's
                return True
        return False

    def _release(self, gated: _Gated) -> None:
        self._waiting.pop(gated.inner, None)
        self.open -= 1


class _Refused(asyncio.Protocol):
    """A connection beyond the limit: closed at once, nothing read."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.abort()  # type: ignore[attr-defined]


class _Gated(asyncio.Protocol):
    """aiohttp's protocol of one connection, passed everything the transport
    says; counted while open, cut off when its first request's headers do not
    come in time."""

    def __init__(self, gate: ConnectionGate, inner: Any) -> None:
        self.gate = gate
        self.inner = inner
        self.transport: asyncio.Transport | None = None
        self.made = False  # aiohttp's protocol was told of the connection
        self.counted = True
        gate.open += 1
        self.timer: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(
            gate.header_timeout_s, self._too_slow
        )

    def headers_in(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _too_slow(self) -> None:
        self.timer = None
        self.gate.on_refused(HEADERS_TOO_SLOW)
        if self.transport is not None:
            self.transport.abort()  # connection_lost frees its place
        else:  # a TLS handshake still going on: asyncio gives it up at this deadline too
            self._uncount()

    def _uncount(self) -> None:
        if self.counted:
            self.counted = False
            self.gate._release(self)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if not self.counted:  # its handshake ended after its deadline
            transport.abort()  # type: ignore[attr-defined]
            return
        self.made = True
        self.inner.connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.headers_in()
        self._uncount()
        if self.made:
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
    **runner_options: Any,
) -> web.AppRunner:
    """Serve `app` on host:port (0: any free port) through `gate`; the runner
    (its `addresses` name the bound port; stop with `await runner.cleanup()`)."""
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
