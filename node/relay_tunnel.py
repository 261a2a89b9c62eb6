"""An outbound-only site's end of a relay (issue 31): `RelayTunnel`.

A site whose roster card has `address: null` accepts no inbound connection. It
keeps one WebSocket to each relay its card names (`via`), proves who it is
on the upgrade request (node/relay_handshake.py), and then answers every FORWARD
the relay sends down that connection: it POSTs the frame, byte for byte, to
its OWN message endpoint on loopback and sends the relay a REPLY with that
endpoint's status and body. So the frame meets exactly the checks a direct
POST meets (signature, clock, replay, decryption, queues, spool), and the
answer the sender gets is the final receiver's own: an acknowledgement means
this site spooled the message, never just that the relay took it.

Forwards run concurrently (each its own task, at most `max_concurrent` at a
time, holding at most 2 x max_message_bytes of frames, as the transport
reserves for uploads: past that the tunnel stops reading, which backs the
relay's bounded queue up to the senders). Nothing a relay sends ends the
tunnel: a bad handshake (one deadline, bounded size) or message is one failed
connection, dialled again. A lost connection is dialled again with exponential
backoff and full jitter (transport.backoff_base_s .. backoff_max_s) until the
node stops; the relay's pending forwards fail there (502 relay_lost) and
their senders send again, through this relay or another.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import ssl
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from node.relay_handshake import HandshakeRefused, only_to, open_relay_socket
from node.relay_wire import AUTH_TIMEOUT_S, RelayWireError, pack_reply, unpack_forward
from node.tls import client_ssl_context
from node.transport import MESSAGE_PATH, MessageServer
from p2pfl.config import SiteConfig, TransportSection, parse_hostport
from p2pfl.config.site import RELAY_NEEDS_ENCRYPTION
from p2pfl.errors import UserError
from p2pfl.secure.identity import LocalIdentity, Roster

log = logging.getLogger(__name__)

# Room for the stream id and the WebSocket framing above the largest frame.
WS_OVERHEAD = 64 * 1024
# The longest a forwarded frame may wait for this node's own answer: a request
# the node holds open (a pull) is answered within its protocol's round timeout.
LOCAL_ANSWER_TIMEOUT_S = 600.0
# A connection that lasted this long resets the backoff (one closed at once does not).
STEADY_S = 10.0


def _url(address: str, path: str, tls: bool, scheme: str = "http") -> str:
    host, port = parse_hostport(address)
    host = f"[{host}]" if ":" in host else host
    return f"{scheme}{'s' if tls else ''}://{host}:{port}{path}"


def local_endpoint(host: str, port: int, tls: bool) -> str:
    """This node's own message endpoint as seen from this host (`host`: the one
    node.listen names): loopback when it listens on every address, else there."""
    if host in ("0.0.0.0", "", "::", "localhost"):
        host = "127.0.0.1"
    host = f"[{host}]" if ":" in host else host
    return f"http{'s' if tls else ''}://{host}:{port}{MESSAGE_PATH}"


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
        local_url: str,
        cfg: TransportSection,
        max_message_bytes: int,
        relay_ssl: ssl.SSLContext | None = None,
        local_ssl: ssl.SSLContext | None = None,
        max_concurrent: int = 64,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.site = site
        self.relay = relay
        self.address = address
        self.federation = federation
        self.identity = identity
        self.url = _url(address, "", relay_ssl is not None)
        self.local_url = local_url
        self.cfg = cfg
        self.max_message_bytes = max_message_bytes
        self.relay_ssl = relay_ssl
        self.local_ssl = local_ssl
        self.on_change = on_change
        self._slots = asyncio.Semaphore(max_concurrent)
        # Frame bytes held while our own endpoint answers: at most what the
        # transport reserves for uploads (2 x max_message_bytes), whatever a relay
        # sends; one frame is always taken when nothing is held.
        self._budget = 2 * max_message_bytes
        self._held = 0
        self._freed = asyncio.Event()
        self._send_lock = asyncio.Lock()
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
            "last_error": self.last_error or None,
        }

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    async def run(self) -> None:
        """Connect, serve, and dial again with backoff and full jitter, until cancelled."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.cfg.connect_timeout_s)
        local = aiohttp.TCPConnector(limit=0, ssl=self.local_ssl or False)
        async with (
            # its relay's host and port only: no redirect elsewhere (relay_handshake.only_to);
            # and none of its cookies kept, so a relay cannot grow our memory dial after dial
            aiohttp.ClientSession(
                timeout=timeout,
                middlewares=(only_to(self.url),),
                cookie_jar=aiohttp.DummyCookieJar(),
            ) as relay_session,
            aiohttp.ClientSession(connector=local, auto_decompress=False) as local_session,
        ):
            failures = 0
            while True:
                began = time.monotonic()
                try:
                    await self._serve_once(relay_session, local_session)
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
    async def _serve_once(
        self, relay_session: aiohttp.ClientSession, local_session: aiohttp.ClientSession
    ) -> None:
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
        async with ws:
            self.connected = True
            self.since = round(time.time(), 3)
            self.connects += 1
            log.info("%s: connected to relay %s at %s", self.site, self.relay, self.address)
            self._changed()
            async for msg in ws:
                if msg.type != aiohttp.WSMsgType.BINARY:
                    if msg.type in (aiohttp.WSMsgType.ERROR, aiohttp.WSMsgType.CLOSE):
                        break
                    continue  # nothing but FORWARDs is expected now: ignored
                stream_id, frame = unpack_forward(msg.data)
                self.bytes_in += len(frame)
                size = len(msg.data)
                while self._held and self._held + size > self._budget:
                    self._freed.clear()  # past the byte budget: stop reading (backpressure)
                    await self._freed.wait()
                self._held += size
                try:
                    await self._slots.acquire()  # past max_concurrent: stop reading too
                except BaseException:
                    self._release(size)
                    raise
                task = asyncio.create_task(self._forward(ws, local_session, stream_id, frame, size))
                self._forwards.add(task)
                task.add_done_callback(self._forwards.discard)

    def _release(self, size: int) -> None:
        self._held -= size
        self._freed.set()

    async def _forward(
        self,
        ws: aiohttp.ClientWebSocketResponse,
        session: aiohttp.ClientSession,
        stream_id: int,
        frame: memoryview,
        size: int,
    ) -> None:
        """POST one forwarded frame to our own endpoint; REPLY with its answer."""
        try:
            status, body = await self._post_local(session, frame)
            with contextlib.suppress(ConnectionError, aiohttp.ClientError, RuntimeError):
                async with self._send_lock:
                    await ws.send_bytes(pack_reply(stream_id, status, body))
                self.forwarded += 1
                self.bytes_out += len(body)
        finally:
            del frame  # its bytes are free once the budget says so
            self._release(size)
            self._slots.release()

    async def _post_local(
        self, session: aiohttp.ClientSession, frame: memoryview
    ) -> tuple[int, bytes]:
        timeout = aiohttp.ClientTimeout(
            total=LOCAL_ANSWER_TIMEOUT_S, sock_connect=self.cfg.connect_timeout_s
        )
        try:
            async with session.post(
                self.local_url,
                data=frame,
                timeout=timeout,
                headers={"Content-Type": "application/octet-stream"},
            ) as resp:
                if resp.content_length is not None and resp.content_length > self.max_message_bytes:
                    return _failed("oversize")
                chunks: list[bytes] = []
                size = 0
                while chunk := await resp.content.readany():
                    size += len(chunk)
                    if size > self.max_message_bytes:
                        return _failed("oversize")
                    chunks.append(chunk)
                return resp.status, b"".join(chunks)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            # Our own endpoint did not answer (stopping, or overloaded): the
            # sender may send again, through this relay or another.
            log.warning("%s: relayed frame not answered locally: %s", self.site, exc)
            return _failed("relay_lost")


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
        self._local_url: str | None = None  # this site's own message endpoint, once it listens
        self._local_ssl: ssl.SSLContext | None = None
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

    def start_tunnels(self, peer_port: int | None) -> bool:
        """An outbound-only site: a tunnel per relay, once its own message endpoint
        (where they hand what they receive) listens. True when any started."""
        if peer_port is not None:
            tls = self.cfg.transport.tls
            self._local_ssl = None
            if tls:  # our own endpoint on loopback: the federation's CA, not the host name
                self._local_ssl = client_ssl_context(str(tls.cert), str(tls.key), str(tls.ca))
                self._local_ssl.check_hostname = False
            host, _ = parse_hostport(self.cfg.node.listen)
            self._local_url = local_endpoint(host, peer_port, tls is not None)
            for relay in self.roster[self.name].card.via:
                self._open(relay)
        self.publish()
        return bool(self.tunnels) or self.server is not None

    def _open(self, relay: str) -> None:
        assert self._local_url is not None
        tunnel = RelayTunnel(
            site=self.name,
            relay=relay,
            address=self.roster.relays[relay],
            federation=self.cfg.federation.id,
            identity=self.identity,
            local_url=self._local_url,
            cfg=self.cfg.transport,
            max_message_bytes=self.cfg.wire.max_message_bytes,
            relay_ssl=self.client_ssl,
            local_ssl=self._local_ssl,
            on_change=self.publish,
        )
        tunnel.start()
        self.tunnels.append(tunnel)

    def _follow_via(self) -> None:
        """SIGHUP: tunnels follow this site's own card: a relay no longer in its
        `via`, or whose address changed, is closed; a new one is dialled. Only
        once the message endpoint listens (`start_tunnels` ran)."""
        if self._local_url is None or self.name not in self.roster:
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
