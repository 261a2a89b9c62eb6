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

With TLS, a connection counts (and its header deadline runs) from the end of
its handshake: a handshake that fails tells the application nothing, so one
counted from the accept would hold a place until its deadline, and a
stranger's failed handshakes could keep the port full. A handshake itself is
given `header_timeout_s` (asyncio's default is 60 s).
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
    `header_timeout_s` to deliver its first request's headers; beyond either
    it is closed, and `on_refused(reason)` counts it."""

    def __init__(
        self, limit: int, header_timeout_s: float, on_refused: Callable[[str], None]
    ) -> None:
        self.limit = descriptor_budget(limit)
        self.header_timeout_s = header_timeout_s
        self.on_refused = on_refused
        self.open = 0
        # aiohttp's handler of each counted connection still waiting for its
        # first request's headers -> its _Gated, oldest first
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
        return lambda: _Gated(self, server())

    def admit(self, gated: _Gated) -> bool:
        """Count a connection just made (after its TLS handshake, if any); False
        when the port is full and no connection gives up its place to it."""
        if self.open >= self.limit and not self._evict_oldest():
            self.on_refused(CONNECTION_LIMIT)
            return False
        self.open += 1
        self._waiting[gated.inner] = gated
        return True

    def _evict_oldest(self) -> bool:
        """Make room for a new connection by closing the one that has waited
        longest for its first request's headers: an honest client sends them
        at once, so a flood of connections that send nothing pushes out its
        own, not theirs. False when every place holds a request or a
        keep-alive connection."""
        oldest = next(iter(self._waiting.values()), None)
        if oldest is None:
            return False
        self.on_refused(CONNECTION_LIMIT)
        oldest.close()
        return True

    def release(self, gated: _Gated) -> None:
        self._waiting.pop(gated.inner, None)
        self.open -= 1


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

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
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
