"""An outbound-only site's end of a relay (issue 31): `RelayTunnel`.

A site whose roster card has `address: null` accepts no inbound connection. It
keeps one WebSocket to each relay its card names (`via`), proves who it is
on the upgrade request (node/relay_handshake.py), and then takes the frames the
relay streams down that connection (node/relay_wire.py: DATA pieces, then END
or ABORT). Each frame opens a `FrameFeed` that this node's own message
endpoint reads in process (node/transport.py MessageServer.receive), as it
reads a direct POST's body: so the frame meets exactly the checks a direct POST
meets (signature, clock, replay, decryption, queues, spool), verified while it
streams, and the site sends the relay a REPLY with that endpoint's status and
body. An acknowledgement means this site spooled the message, never just that
the relay took it.

Bounds: at most `max_concurrent` frames in progress (a frame past that is
answered `queue_full` by the reader itself, at once: it never waits on a
handler that may be waiting on it, only on its own drain, so a relay that
reads no answers stalls it instead of growing our write buffer; an answer not
sent within REPLY_TIMEOUT_S closes the connection), and at most 2 x
max_message_bytes of pieces received and not yet read by their handlers, as
the transport reserves for uploads: past that the tunnel stops reading, which
backs the relay's sends up to the senders. A frame leaves the table of open
frames when its handler is done; later pieces of its id are dropped.
Nothing a relay sends ends the tunnel: a bad handshake (one deadline, bounded
size) or message is one failed connection, dialled again. A lost connection is
dialled again with exponential backoff and full jitter
(transport.backoff_base_s .. backoff_max_s) until the node stops; frames still
arriving are dropped (their handlers refuse them `truncated`), the relay's
pending forwards fail there (502 relay_lost), and their senders send again,
through this relay or another.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import ssl
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import aiohttp

from node.relay_handshake import HandshakeRefused, only_to, open_relay_socket
from node.relay_wire import (
    ABORT,
    AUTH_TIMEOUT_S,
    END,
    RelayWireError,
    pack_reply,
    send_message,
    unpack_forward,
)
from node.transport import MessageServer, answer_bytes
from p2pfl.config import SiteConfig, TransportSection, parse_hostport
from p2pfl.config.site import RELAY_NEEDS_ENCRYPTION
from p2pfl.errors import UserError
from p2pfl.secure.identity import LocalIdentity, Roster

log = logging.getLogger(__name__)

# Room for the stream id and the WebSocket framing above the largest frame.
WS_OVERHEAD = 64 * 1024
# A connection that lasted this long resets the backoff (one closed at once does not).
STEADY_S = 10.0
# A REPLY not sent within this (plus its size at MIN_REPLY_BYTES_PER_S): the
# relay reads nothing, so the connection is closed and dialled again.
REPLY_TIMEOUT_S = 30.0
MIN_REPLY_BYTES_PER_S = 64 * 1024


def _url(address: str, path: str, tls: bool, scheme: str = "http") -> str:
    host, port = parse_hostport(address)
    host = f"[{host}]" if ":" in host else host
    return f"{scheme}{'s' if tls else ''}://{host}:{port}{path}"


class FrameFeed:
    """The bytes of one frame a relay streams down, read by this node's message
    endpoint as it reads a request body (readexactly, readany, read, at_eof).
    `release(n)` is told of every byte taken out (or dropped), so the tunnel
    can bound what it holds."""

    def __init__(self, release: Callable[[int], None]) -> None:
        self._release = release
        self._pieces: deque[memoryview] = deque()
        self._eof = False
        self._failed = False
        self._closed = False  # its handler is done: later pieces are dropped
        self._ready = asyncio.Event()

    # -- the tunnel's side
    def feed(self, piece: memoryview) -> bool:
        """Queue a piece (False: dropped, the handler is done or the frame over)."""
        if self._closed or self._eof or self._failed:
            return False
        if len(piece):
            self._pieces.append(piece)
        self._ready.set()
        return True

    def end(self) -> None:
        self._eof = True
        self._ready.set()

    def abort(self) -> None:
        """The frame will not complete: the handler's next read fails (`truncated`)."""
        self._failed = True
        self._drop()
        self._ready.set()

    def close(self) -> None:
        """The handler is done: whatever it did not read is dropped."""
        self._closed = True
        self._drop()

    def _drop(self) -> None:
        while self._pieces:
            self._release(len(self._pieces.popleft()))

    # -- the handler's side
    async def _wait(self) -> None:
        while not self._pieces and not self._eof and not self._failed:
            self._ready.clear()
            await self._ready.wait()
        if self._failed:
            raise ConnectionResetError("the relay aborted the frame")

    async def readany(self) -> memoryview | bytes:
        await self._wait()
        if not self._pieces:
            return b""
        piece = self._pieces.popleft()
        self._release(len(piece))
        return piece

    async def read(self, n: int = -1) -> memoryview | bytes:
        await self._wait()
        if not self._pieces:
            return b""
        piece = self._pieces[0]
        if n < 0 or n >= len(piece):
            return await self.readany()
        self._pieces[0] = piece[n:]
        self._release(n)
        return piece[:n]

    async def readexactly(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            try:
                await self._wait()
            except ConnectionResetError:
                raise asyncio.IncompleteReadError(bytes(out), n) from None
            if not self._pieces:
                raise asyncio.IncompleteReadError(bytes(out), n)
            out += await self.read(n - len(out))
        return bytes(out)

    def at_eof(self) -> bool:
        return self._eof and not self._pieces


class RelayTunnel:
    """One site's connection to one relay: connect, authenticate, answer forwards."""

    def __init__(
        self,
        *,
        site: str,
        relay: str,
        address: str,
        federation: str,
        identity: LocalIdentity,
        endpoint: MessageServer,
        cfg: TransportSection,
        max_message_bytes: int,
        relay_ssl: ssl.SSLContext | None = None,
        max_concurrent: int = 64,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.site = site
        self.relay = relay
        self.address = address
        self.federation = federation
        self.identity = identity
        self.url = _url(address, "", relay_ssl is not None)
        self.endpoint = endpoint  # this node's own message endpoint, read in process
        self.cfg = cfg
        self.max_message_bytes = max_message_bytes
        self.relay_ssl = relay_ssl
        self.on_change = on_change
        self.max_concurrent = max_concurrent
        # Bytes received and not yet read by their handlers: at most what the
        # transport reserves for uploads (2 x max_message_bytes), whatever a relay
        # sends; one piece is always taken when nothing is held.
        self._budget = 2 * max_message_bytes
        self._held = 0
        self._freed = asyncio.Event()
        self._rng = random.Random()
        self._task: asyncio.Task[None] | None = None
        self._forwards: set[asyncio.Task[None]] = set()
        # What /status shows (node's `relays` key).
        self.connected = False
        self.since: float | None = None  # epoch seconds of the current connection
        self.connects = 0
        self.forwarded = 0  # frames answered
        self.bytes_in = 0
        self.bytes_out = 0
        self.dropped = 0  # pieces of no open frame (one a handler finished, or unknown)
        self.ws: aiohttp.ClientWebSocketResponse | None = None  # the current connection
        self.last_error = ""

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name=f"{self.site}:relay-{self.relay}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        for task in list(self._forwards):
            task.cancel()
        if self._forwards:
            await asyncio.gather(*self._forwards, return_exceptions=True)

    def snapshot(self) -> dict[str, Any]:
        return {
            "address": self.address,
            "connected": self.connected,
            "since": self.since,
            "connects": self.connects,
            "forwarded": self.forwarded,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "dropped_pieces": self.dropped,
            "last_error": self.last_error or None,
        }

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    async def run(self) -> None:
        """Connect, serve, and dial again with backoff and full jitter, until cancelled."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.cfg.connect_timeout_s)
        # its relay's host and port only: no redirect elsewhere (relay_handshake.only_to);
        # and none of its cookies kept, so a relay cannot grow our memory dial after dial
        async with aiohttp.ClientSession(
            timeout=timeout,
            middlewares=(only_to(self.url),),
            cookie_jar=aiohttp.DummyCookieJar(),
        ) as relay_session:
            failures = 0
            while True:
                began = time.monotonic()
                try:
                    await self._serve_once(relay_session)
                    self.last_error = "connection closed"
                    if time.monotonic() - began > STEADY_S:
                        failures = 0  # it was up a while: the next dial is quick
                except asyncio.CancelledError:
                    raise
                except HandshakeRefused as exc:
                    self.last_error = str(exc)
                    log.error("%s: relay %s refused us: %s", self.site, self.relay, exc)
                except (aiohttp.ClientError, OSError, TimeoutError, RelayWireError) as exc:
                    self.last_error = f"{type(exc).__name__}: {exc}"[:200]
                    log.debug("%s: relay %s: %s", self.site, self.relay, self.last_error)
                except Exception as exc:  # noqa: BLE001 - whatever a relay sends, we dial again
                    self.last_error = f"{type(exc).__name__}: {exc}"[:200]
                    log.warning("%s: relay %s: %s", self.site, self.relay, self.last_error)
                finally:
                    if self.connected:
                        self.connected = False
                        self.since = None
                        log.warning("%s: relay %s connection lost", self.site, self.relay)
                        self._changed()
                cap = min(self.cfg.backoff_max_s, self.cfg.backoff_base_s * (2**failures))
                failures = min(failures + 1, 30)
                await asyncio.sleep(self._rng.uniform(0, cap))

    # ------------------------------------------------------------------ one connection
    async def _serve_once(self, relay_session: aiohttp.ClientSession) -> None:
        heartbeat = max(1.0, self.cfg.suspect_after_s)
        # one deadline for the whole handshake (the challenge, then the upgrade):
        # a relay that trickles its answers cannot hold us in it
        async with asyncio.timeout(2 * AUTH_TIMEOUT_S):
            ws = await open_relay_socket(
                relay_session,
                self.url,
                identity=self.identity,
                relay=self.relay,
                federation=self.federation,
                ssl_context=self.relay_ssl if self.relay_ssl is not None else False,
                heartbeat=heartbeat,
                max_msg_size=self.max_message_bytes + WS_OVERHEAD,
                autoping=True,
            )
        feeds: dict[int, FrameFeed] = {}  # frames of this connection still arriving
        self.ws = ws
        try:
            async with ws:
                self.connected = True
                self.since = round(time.time(), 3)
                self.connects += 1
                log.info("%s: connected to relay %s at %s", self.site, self.relay, self.address)
                self._changed()
                await self._read(ws, feeds)
        finally:
            self.ws = None
            for feed in feeds.values():
                feed.abort()  # the connection is gone: they will not complete

    async def _read(self, ws: aiohttp.ClientWebSocketResponse, feeds: dict[int, FrameFeed]) -> None:
        """Take the relay's FORWARD pieces, each to its frame's feed; a new id
        opens a frame (ids only grow: a lower one belongs to a frame done with)."""
        last_id = -1
        async for msg in ws:
            if msg.type != aiohttp.WSMsgType.BINARY:
                if msg.type in (aiohttp.WSMsgType.ERROR, aiohttp.WSMsgType.CLOSE):
                    break
                continue  # nothing but FORWARDs is expected now: ignored
            stream_id, kind, piece = unpack_forward(msg.data)
            self.bytes_in += len(piece)
            feed = feeds.get(stream_id)
            if feed is None:
                if stream_id <= last_id or kind == ABORT:
                    self.dropped += 1  # the tail of a frame its handler finished
                    continue
                last_id = stream_id
                if len(self._forwards) >= self.max_concurrent:
                    # answered here, by the reader itself: a relay that sends new ids
                    # and reads no answer stalls this reader on its own drain (bounded
                    # by REPLY_TIMEOUT_S), it cannot grow our write buffer
                    if not await self._reply(ws, stream_id, *_failed("queue_full")):
                        break
                    continue
                feed = feeds[stream_id] = FrameFeed(self._release)
                task = asyncio.create_task(self._deliver(ws, stream_id, feed, feeds))
                self._forwards.add(task)
                task.add_done_callback(self._forwards.discard)
            if kind == ABORT:
                del feeds[stream_id]
                feed.abort()
                continue
            size = len(piece)
            while self._held and self._held + size > self._budget:
                self._freed.clear()  # past the byte budget: stop reading (backpressure)
                await self._freed.wait()
            if feed.feed(piece):
                self._held += size
            else:
                self.dropped += 1
            if kind == END:
                del feeds[stream_id]
                feed.end()

    def _release(self, size: int) -> None:
        self._held -= size
        self._freed.set()

    async def _reply(
        self, ws: aiohttp.ClientWebSocketResponse, stream_id: int, status: int, body: bytes
    ) -> bool:
        """REPLY to a frame: False if it could not be sent within REPLY_TIMEOUT_S
        (a relay that reads nothing: the connection is closed and dialled again)."""
        try:
            async with asyncio.timeout(REPLY_TIMEOUT_S + len(body) / MIN_REPLY_BYTES_PER_S):
                await send_message(ws, pack_reply(stream_id, status, body))
        except TimeoutError:
            log.warning("%s: relay %s reads no answers; reconnecting", self.site, self.relay)
            task = asyncio.get_running_loop().create_task(ws.close())
            self._forwards.add(task)
            task.add_done_callback(self._forwards.discard)
            return False
        except (ConnectionError, aiohttp.ClientError, RuntimeError):
            return False
        self.bytes_out += len(body)
        return True

    async def _deliver(
        self,
        ws: aiohttp.ClientWebSocketResponse,
        stream_id: int,
        feed: FrameFeed,
        feeds: dict[int, FrameFeed],
    ) -> None:
        """Our own endpoint reads the frame as it arrives; REPLY with its answer.
        The frame leaves `feeds` when its handler is done, whatever the relay
        sends after (pieces of an id done with are dropped)."""
        try:
            if self.endpoint.isolated:  # fault plan: a partition, as a direct POST finds it
                status, body = _failed("relay_lost")
            else:
                try:
                    response = await self.endpoint.receive(feed, None)
                    status, body = response.status, await answer_bytes(response)
                except Exception:  # noqa: BLE001 - what aiohttp answers a direct POST with
                    log.exception("%s: relayed frame: the message handler failed", self.site)
                    status, body = 500, json.dumps({"reason": "handler_error"}).encode()
            if await self._reply(ws, stream_id, status, body):
                self.forwarded += 1
        finally:
            feed.close()  # what its handler did not read is dropped
            if feeds.get(stream_id) is feed:
                del feeds[stream_id]


def _failed(reason: str) -> tuple[int, bytes]:
    return 502, json.dumps({"reason": reason}).encode()


class SiteRelays:
    """A node's relay parts (issue 31): the tunnels of an outbound-only site (one
    per relay in its card's `via`), or, with `relay.serve: true`, the relay
    routes (node/relay.py) on this site's own peer port."""

    def __init__(
        self,
        *,
        cfg: SiteConfig,
        roster: Roster,
        identity: LocalIdentity,
        client_ssl: ssl.SSLContext | None,
        publish_to: Callable[[dict[str, Any]], None],
    ) -> None:
        # A relay forwards ciphertext only: refused here as at `check` (p2pfl/config/site.py).
        if not cfg.wire.encryption and (cfg.relay.serve or any(c.via for c in roster.cards())):
            raise UserError("wire.encryption: " + " — ".join(RELAY_NEEDS_ENCRYPTION))
        self.cfg = cfg
        self.name = cfg.node.name
        self.roster = roster
        self.identity = identity
        self.client_ssl = client_ssl
        self.publish_to = publish_to
        self.tunnels: list[RelayTunnel] = []
        self.server: Any = None  # node/relay.py RelayServer, with relay.serve: true
        self._endpoint: MessageServer | None = None  # this site's message endpoint, once it listens
        self._closing: set[asyncio.Task[None]] = set()  # tunnels a roster reload closes

    def mount(self, peer_server: MessageServer) -> None:
        """relay.serve: this site is the roster's relay whose address is its own."""
        if not self.cfg.relay.serve:
            return
        from node.relay import RelayServer
        from p2pfl.config.relay import RelaySettings

        own = self.roster[self.name].address
        names = sorted(r for r, address in self.roster.relays.items() if address == own)
        if not names:
            raise UserError(
                f"relay.serve: true, but the roster's `relays:` lists no relay at this site's "
                f"address {own} — add {{name: RELAY, address: {own}}} or set relay.serve: false"
            )
        self.server = RelayServer(
            names[0],
            self.cfg.federation.id,
            self.roster,
            RelaySettings(),
            max_message_bytes=self.cfg.wire.max_message_bytes,
            clock_skew_s=self.cfg.wire.clock_skew_s,
        )
        peer_server.extra_routes.append(self.server.add_routes)
        log.info("%s: relaying for outbound-only sites as %s", self.name, names[0])

    def start_tunnels(self, endpoint: MessageServer | None) -> bool:
        """An outbound-only site: a tunnel per relay, once its own message
        `endpoint` (where they hand what they receive) listens (None: it does
        not). True when any started, or this site relays."""
        if endpoint is not None:
            self._endpoint = endpoint
            for relay in self.roster[self.name].card.via:
                self._open(relay)
        self.publish()
        return bool(self.tunnels) or self.server is not None

    def _open(self, relay: str) -> None:
        assert self._endpoint is not None
        tunnel = RelayTunnel(
            site=self.name,
            relay=relay,
            address=self.roster.relays[relay],
            federation=self.cfg.federation.id,
            identity=self.identity,
            endpoint=self._endpoint,
            cfg=self.cfg.transport,
            max_message_bytes=self.cfg.wire.max_message_bytes,
            relay_ssl=self.client_ssl,
            on_change=self.publish,
        )
        tunnel.start()
        self.tunnels.append(tunnel)

    def _follow_via(self) -> None:
        """SIGHUP: tunnels follow this site's own card: a relay no longer in its
        `via`, or whose address changed, is closed; a new one is dialled. Only
        once the message endpoint listens (`start_tunnels` ran)."""
        if self._endpoint is None or self.name not in self.roster:
            return
        want = {r: self.roster.relays[r] for r in self.roster[self.name].card.via}
        keep: list[RelayTunnel] = []
        for tunnel in self.tunnels:
            if want.get(tunnel.relay) == tunnel.address:
                keep.append(tunnel)
                continue
            log.info("%s: roster reload: closing the tunnel to %s", self.name, tunnel.relay)
            task = asyncio.get_running_loop().create_task(tunnel.stop())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        self.tunnels = keep
        for relay in want.keys() - {t.relay for t in keep}:
            log.info("%s: roster reload: dialling %s", self.name, relay)
            self._open(relay)
        self.publish()

    async def wait_reachable(self, timeout: float) -> bool:
        """Until one of this site's tunnels is connected (at most `timeout` s):
        an outbound-only site is reachable only through a relay, so it announces
        itself to its peers (heartbeats) only then; otherwise they would count it
        alive, fail to reach it and open their breakers. True at once for a site
        that needs no tunnel."""
        if not self.tunnels:
            return True
        deadline = time.monotonic() + timeout
        while not any(t.connected for t in self.tunnels):
            if time.monotonic() >= deadline:
                log.warning(
                    "%s: no relay connected after %.0f s (%s); announcing this site anyway",
                    self.name,
                    timeout,
                    ", ".join(t.relay for t in self.tunnels),
                )
                return False
            await asyncio.sleep(0.1)
        return True

    def publish(self) -> None:
        """/status `relays`: each relay this site connects to, or the one it is."""
        relays: dict[str, Any] = {t.relay: t.snapshot() for t in self.tunnels}
        if self.server is not None:
            snapshot = self.server.snapshot()
            relays[str(snapshot.get("relay", "relay"))] = {"serving": True, **snapshot}
        self.publish_to(relays)

    def set_roster(self, roster: Roster) -> None:
        """SIGHUP: the relay this site serves follows the new roster, and so do
        this site's tunnels (its card's `via` and the relays' addresses)."""
        self.roster = roster
        if self.server is not None:
            self.server.set_roster(roster)
        self._follow_via()

    async def stop(self) -> None:
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
        for tunnel in self.tunnels:
            with contextlib.suppress(Exception):
                await tunnel.stop()
        self.tunnels.clear()
        if self.server is not None:
            with contextlib.suppress(Exception):
                await self.server.close()
