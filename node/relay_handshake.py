"""How a site proves who it is to a relay before it gets a WebSocket (issue 31).

The first relay handshake ran inside the WebSocket: the relay accepted the
upgrade, sent a challenge and waited for the signed answer. aiohttp fixes a
WebSocket's largest message at `prepare()`, so every stranger awaiting
authentication could make the relay buffer one message of up to
max_message_bytes (512 MiB by default). Now nothing is accepted before the
proof (node/relay_wire.py describes the exchange):

1. `GET RELAY_CHALLENGE_PATH` -> a nonce: the issue time (the relay's monotonic
   clock), 16 random bytes and an HMAC-SHA256 tag of both under a key made at
   the relay's start and never stored. The relay can tell its own nonces from
   any other (another relay's, one before a restart: `bad_nonce`) and their age
   (`nonce_expired` past auth_timeout_s) without keeping them. It does keep
   each outstanding nonce with the address that asked for it, until it is used
   or expires (`auth_timeout`, counted): these are the handshake slots, at most
   max_handshakes_per_host per host (429 too_many_handshakes) and
   max_handshakes in all, so the record is bounded. A host is an IPv4
   address, or an IPv6 /64: an IPv6 host is given a /64 and may use any
   address of it (RFC 4291 2.5.4, RFC 8981), so counted per address one host
   took every slot. A full pool refuses no one: it gives up the oldest
   challenge of the host holding most slots (`handshake_evicted`, counted),
   so strangers on a few addresses renewing their challenges cannot keep
   every site out (they did, with 429 for all), and a site, which uses its
   challenge at once, holds one slot, never the most. Behind a proxy every
   client is one address: max_handshakes_per_host set to max_handshakes turns
   its 429 off, and the pool's oldest goes. A nonce is removed at its first
   use, whatever the outcome, so an upgrade request seen on the wire cannot
   be replayed (`nonce_replayed`) to take over a site's tunnel.
2. The upgrade request carries the proof in three headers of bounded length
   (`auth_malformed` otherwise): the site's name, the nonce and its Ed25519
   signature over auth_message(federation, relay, site, nonce). `Gatekeeper.admit`
   checks them with no await, before the relay calls `prepare()`; only then
   does the site get a WebSocket, sized for frames. A refusal is an HTTP 4xx
   with the reason in its JSON body and REFUSAL_HEADER.

So a stranger never holds more of the relay than one bounded HTTP request
(aiohttp's header limits; behind an upgrade request aiohttp stops reading once
64 KiB wait, and a refused one closes the connection) and one slot for
auth_timeout_s.

`SiteLink` and `SiteStats` are what an admitted connection then is to the
relay (node/relay.py). `open_relay_socket` is the site's side
(node/relay_tunnel.py, the tests and bench.attacks speak it through this one
function). A site signs only a nonce shaped as a relay's (lowercase hex), and
asks nothing but its relay's host and port: no redirect is followed, from the
challenge or (through `only_to`, as aiohttp's ws_connect always follows them)
from the upgrade, so neither a relay nor, without TLS, anyone on the path can
send the site to another address of its own network, nor from HTTPS to HTTP.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import ipaddress
import json
import re
import secrets
import ssl
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web
from aiohttp.client_middlewares import ClientHandlerType, ClientMiddlewareType

from node.relay_admission import TOO_MANY_CONNECTIONS
from node.relay_wire import (
    AUTH_STATUS_FOR_REASON,
    AUTH_TIMEOUT,
    HANDSHAKE_EVICTED,
    MAX_CHALLENGE_BYTES,
    NONCE_HEADER,
    REFUSAL_HEADER,
    RELAY_CHALLENGE_PATH,
    RELAY_CONNECT_PATH,
    RELAY_PROTOCOL,
    RELAY_STATUS_FOR_REASON,
    SIGNATURE_HEADER,
    SITE_HEADER,
    auth_message,
)
from node.transport import STATUS_FOR_REASON
from p2pfl.config import RelaySettings
from p2pfl.secure.identity import Card, LocalIdentity, Roster

REPLY_OVERHEAD = 64 * 1024  # a REPLY's id and status, and a refusal's JSON, beside a frame
_ISSUED = struct.Struct(">Q")  # the nonce's issue time, monotonic ns
_RANDOM = 16
_TAG = 16
NONCE_HEX = 2 * (_ISSUED.size + _RANDOM + _TAG)
MAX_SITE_CHARS = 64
SIGNATURE_B64 = 88  # base64 of an Ed25519 signature (64 bytes)
# What a site signs as a relay's nonce: lowercase hex of 8..128 bytes (ours: NONCE_HEX).
NONCE_SHAPE = re.compile(r"(?:[0-9a-f]{2}){8,128}")


def host_key(host: str) -> str:
    """Whose handshake slot a client at `host` takes: an IPv4 address (an
    IPv4-mapped IPv6 one too), or an IPv6 address's /64, the least one host is
    given; anything else (no address known: "") as it is."""
    try:
        addr = ipaddress.ip_address(host.split("%", 1)[0])  # no zone: fe80::1%eth0
    except ValueError:
        return host
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            return str(addr.ipv4_mapped)
        return str(ipaddress.IPv6Network((addr, 64), strict=False))
    return str(addr)


@dataclass
class SiteStats:
    """Counters of one site, kept across its reconnections. `in`: frames this
    site sent through the relay; `out`: frames forwarded down to it; `replies`:
    the answers it sent back."""

    messages_in: int = 0
    bytes_in: int = 0
    messages_out: int = 0
    bytes_out: int = 0
    replies: int = 0
    reply_bytes: int = 0
    connects: int = 0


@dataclass
class SiteLink:
    """One authenticated site connection and the forwards waiting on it."""

    name: str
    card: Card
    ws: web.WebSocketResponse
    since: float = field(default_factory=time.time)
    waiting: dict[int, asyncio.Future[tuple[int, bytes] | None]] = field(default_factory=dict)
    pending: int = 0  # frames forwarded (or being read) and not yet answered
    pending_bytes: int = 0  # frame bytes held in memory for it
    by_sender: dict[str, int] = field(default_factory=dict)  # its pending frames per sender
    bytes_by_sender: dict[str, int] = field(default_factory=dict)  # pending_bytes per sender
    closed: bool = False
    transport: asyncio.BaseTransport | None = None  # its TCP (or TLS) connection
    # per gate (a sender, or its copies: node/relay_admission.py): its frames
    # being sent down or awaiting their answers (`send_turn`)
    sent_by_gate: dict[str, int] = field(default_factory=dict)
    _room: dict[str, asyncio.Event] = field(default_factory=dict)  # a gate's waiters

    async def close(self, code: int, why: str, settings: RelaySettings) -> None:
        """Close the WebSocket, and abort its connection if that takes more than
        twice the WebSocket's own wait for the site's close frame (`upgrade`):
        aiohttp's close waits for the site to take the close
        frame with no deadline, so a site that reads nothing kept a replaced
        connection open for good (its reader still took up to one message of
        max_message_bytes; a review kept several such connections of one site
        open), and a relay's shutdown waited on it."""
        try:
            async with asyncio.timeout(2 * close_wait_s(settings)):
                await self.ws.close(code=code, message=why[:100].encode())
        except (TimeoutError, ConnectionError, RuntimeError):
            pass
        finally:
            if self.transport is not None:  # (closing too: close() waits to flush what it
                self.transport.abort()  # does not read; abort drops it)

    def unhold(self, sender: str, nbytes: int) -> None:
        """`nbytes` of a frame of `sender` are no longer held for this site."""
        self.pending_bytes -= nbytes
        left = self.bytes_by_sender.get(sender, 0) - nbytes
        if left > 0:
            self.bytes_by_sender[sender] = left
        else:
            self.bytes_by_sender.pop(sender, None)

    async def send_turn(self, gate: str, limit: int, wait_s: float) -> bool:
        """Wait until fewer than `limit` frames of `gate` (node/relay.py: the
        sender's, or its copies' to this site) are being sent down or awaiting
        their answers here (or the connection is gone), then count one more
        (`sent_done` gives it back): False if that took over `wait_s`. The
        caller still holds its place in that gate (node/relay_admission.py)
        while it waits; freed once its frame is sent, that place no longer
        bounded how many of a flooder's frames waited at their recipient."""
        if self.sent_by_gate.get(gate, 0) >= limit and not self.closed:
            try:
                async with asyncio.timeout(wait_s):
                    while self.sent_by_gate.get(gate, 0) >= limit and not self.closed:
                        await self._room.setdefault(gate, asyncio.Event()).wait()
            except TimeoutError:
                return False
        self.sent_by_gate[gate] = self.sent_by_gate.get(gate, 0) + 1
        return True

    def sent_done(self, gate: str) -> None:
        """A frame `send_turn` counted is answered, refused or dropped."""
        left = self.sent_by_gate.get(gate, 0) - 1
        if left > 0:
            self.sent_by_gate[gate] = left
        else:
            self.sent_by_gate.pop(gate, None)
        if (room := self._room.pop(gate, None)) is not None:
            room.set()  # its waiters look again

    def fail(self) -> None:
        """The connection is gone: every waiting forward answers relay_lost."""
        self.closed = True
        for future in self.waiting.values():
            if not future.done():
                future.set_result(None)
        for room in self._room.values():  # (and a frame waiting for its turn goes on
            room.set()  # to find the connection closed)
        self._room.clear()


def close_wait_s(settings: RelaySettings) -> float:
    """How long a site's WebSocket waits for the site's close frame."""
    return min(10.0, settings.auth_timeout_s)


class HandshakeRefused(Exception):
    """The relay refused us, or spoke something that is not the handshake."""


class Gatekeeper:
    """The relay's side: issues nonces and admits an upgrade whose proof holds.
    `count(reason, who)` counts a refusal (RelayServer._count)."""

    def __init__(
        self,
        relay: str,
        federation: str,
        settings: RelaySettings,
        count: Callable[[str, str | None], None],
    ) -> None:
        self.relay = relay
        self.federation = federation
        self.settings = settings
        self._count = count
        self._key = secrets.token_bytes(32)  # this process only: nonces die with it
        self._outstanding: dict[bytes, tuple[str, int]] = {}  # nonce -> (host, expiry ns)
        self._by_host: dict[str, int] = {}
        self._sweep: asyncio.TimerHandle | None = None

    @property
    def window_ns(self) -> int:
        return int(self.settings.auth_timeout_s * 1e9)

    def in_progress(self) -> int:
        """Outstanding challenges (handshake slots held), expired ones dropped."""
        self._expire()
        return len(self._outstanding)

    def sweep_later(self) -> None:
        """Count (auth_timeout) and free unused challenges when they expire: one
        timer, set again for the oldest left, not one per challenge asked for
        (strangers may ask for thousands a second)."""
        if self._sweep is not None:
            return
        oldest = next(iter(self._outstanding.values()), None)
        if oldest is not None:
            delay = max(0.0, (oldest[1] - time.monotonic_ns()) / 1e9) + 0.01
            self._sweep = asyncio.get_running_loop().call_later(delay, self._swept)

    def _swept(self) -> None:
        self._sweep = None
        self._expire()
        self.sweep_later()

    def close(self) -> None:
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None

    def _expire(self) -> None:
        now = time.monotonic_ns()
        # in issue order, and all share one window: the expired ones come first
        for nonce, (host, expiry) in list(self._outstanding.items()):
            if expiry > now:
                break
            self._release(nonce, host)
            self._count(AUTH_TIMEOUT, host)

    def _release(self, nonce: bytes, host: str) -> None:
        del self._outstanding[nonce]
        left = self._by_host[host] - 1
        if left:
            self._by_host[host] = left
        else:
            del self._by_host[host]

    def _evict(self) -> None:
        """The pool is full: the oldest challenge of the host(s) holding most goes."""
        most = max(self._by_host.values())
        nonce, (host, _) = next(  # in issue order: the oldest first
            (n, held) for n, held in self._outstanding.items() if self._by_host[held[0]] == most
        )
        self._release(nonce, host)
        self._count(HANDSHAKE_EVICTED, host)

    def _tag(self, body: bytes) -> bytes:
        return hmac.new(self._key, body, hashlib.sha256).digest()[:_TAG]

    def issue(self, host: str) -> str | tuple[str, str]:
        """A fresh nonce (hex) for a client at `host`, or (reason, detail)."""
        host = host_key(host)
        self._expire()
        per_host = self.settings.max_handshakes_per_host
        # (per_host >= max_handshakes, behind a proxy where every client is one
        # address: no 429, the pool gives up its oldest below instead)
        if per_host < self.settings.max_handshakes and self._by_host.get(host, 0) >= per_host:
            return "too_many_handshakes", "too many in progress from this host"
        if len(self._outstanding) >= self.settings.max_handshakes:
            self._evict()
        now = time.monotonic_ns()
        body = _ISSUED.pack(now) + secrets.token_bytes(_RANDOM)
        nonce = body + self._tag(body)
        self._outstanding[nonce] = (host, now + self.window_ns)
        self._by_host[host] = self._by_host.get(host, 0) + 1
        return nonce.hex()

    def challenge(self, nonce_hex: str) -> dict[str, Any]:
        return {
            "type": "challenge",
            "relay": self.relay,
            "federation": self.federation,
            "protocol": RELAY_PROTOCOL,
            "nonce": nonce_hex,
            "expires_in_s": self.settings.auth_timeout_s,
        }

    def admit(self, request: web.Request, roster: Roster) -> Card | tuple[str, str, str | None]:
        """The card of the site whose proof in `request`'s headers holds, or
        (reason, detail, claimed site). No await: nothing of the request but
        its headers is read, and nothing is accepted before this answers."""
        fields = []
        for name, limit in (
            (SITE_HEADER, MAX_SITE_CHARS),
            (NONCE_HEADER, NONCE_HEX),
            (SIGNATURE_HEADER, SIGNATURE_B64),
        ):
            values = request.headers.getall(name, [])
            if len(values) != 1 or not 0 < len(values[0]) <= limit:
                return "auth_malformed", f"{name}: one value of at most {limit} characters", None
            fields.append(values[0])
        site, nonce_hex, signature_b64 = fields
        try:
            nonce = bytes.fromhex(nonce_hex)
            signature = base64.b64decode(signature_b64, validate=True)
        except (ValueError, binascii.Error):
            return "auth_malformed", "nonce or signature does not decode", site
        if len(nonce) != NONCE_HEX // 2 or nonce.hex() != nonce_hex or len(signature) != 64:
            return "auth_malformed", "nonce (lowercase hex) or signature of the wrong shape", site
        body, tag = nonce[:-_TAG], nonce[-_TAG:]
        if not hmac.compare_digest(tag, self._tag(body)):
            return "bad_nonce", "not a nonce of this relay process", site
        (issued,) = _ISSUED.unpack_from(body)
        if time.monotonic_ns() - issued >= self.window_ns:
            self._expire()
            return "nonce_expired", f"older than {self.settings.auth_timeout_s:g} s", site
        held = self._outstanding.get(nonce)
        if held is None:
            return "nonce_replayed", "used already (or its slot given up to a newer one)", site
        self._release(nonce, held[0])  # one use, whatever comes of it
        entry = roster.sites.get(site)
        if entry is None:
            return "unknown_site", repr(site), site
        if not entry.verify(signature, auth_message(self.federation, self.relay, site, nonce_hex)):
            return "bad_signature", f"not {site!r}'s signature over this nonce", site
        if self.relay not in entry.card.via:
            return "not_via_this_relay", f"{site!r}'s card does not name {self.relay!r}", site
        return entry.card

    async def upgrade(
        self, request: web.Request, roster: Roster, max_message_bytes: int
    ) -> tuple[Card, web.WebSocketResponse] | web.StreamResponse:
        """The admitted site's card and its WebSocket (sized for frames of
        max_message_bytes), or the answer to a refused or vanished upgrade."""
        card = self.admit(request, roster)  # before prepare(): no WebSocket yet
        if not isinstance(card, Card):
            reason, detail, site = card
            self._count(reason, site)
            return refused_upgrade(reason, detail)
        # ping after 2/3 of the idle timeout without a byte, close after 1/3 more without a pong
        ws = web.WebSocketResponse(
            heartbeat=self.settings.idle_timeout_s * 2 / 3,
            max_msg_size=max_message_bytes + REPLY_OVERHEAD,  # an authenticated site only
            compress=False,  # ciphertext does not compress
            timeout=close_wait_s(self.settings),  # for the peer's close frame
        )
        try:
            await ws.prepare(request)
        except ConnectionError:  # it went away mid-upgrade: counted, no traceback
            self._count("handshake_lost", card.name)
            return ws
        return card, ws


# HTTP status of every refusal a relay answers; the transport's where they mean the same.
REFUSAL_STATUS = {
    **STATUS_FOR_REASON,
    **RELAY_STATUS_FOR_REASON,
    **AUTH_STATUS_FOR_REASON,
    "relay_closing": 503,  # the relay is shutting down: try the site's next relay
    "reply_malformed": 502,  # the recipient answered with a status that is not a final one
    TOO_MANY_CONNECTIONS: 429,  # the sender's queue is full (node/relay_admission.py)
}
PROTOCOL_ERROR = "reply_malformed"  # a site sent something that is not a REPLY: closed


def refusal(reason: str, detail: str = "") -> web.Response:
    """A refusal as node/transport.py answers one: JSON {"reason", "detail"}."""
    return web.json_response(
        {"reason": reason, "detail": detail[:200]}, status=REFUSAL_STATUS.get(reason, 400)
    )


def refused_upgrade(reason: str, detail: str = "") -> web.Response:
    """A refused upgrade: the HTTP status of `reason`, JSON body, the reason in
    REFUSAL_HEADER (a WebSocket client sees the headers, not the body); the
    connection is closed after it."""
    response = web.json_response(
        {"reason": reason, "detail": detail[:200]},
        status=AUTH_STATUS_FOR_REASON.get(reason, 503),
        headers={REFUSAL_HEADER: reason},
    )
    response.force_close()  # whatever the client sent behind its upgrade request is not read
    return response


def proof_headers(
    identity: LocalIdentity, federation: str, relay: str, nonce_hex: str, site: str | None = None
) -> dict[str, str]:
    """The upgrade request's proof: `identity` signs as `site` (default: itself)."""
    site = site or identity.name
    signature = identity.sign(auth_message(federation, relay, site, nonce_hex))
    return {
        SITE_HEADER: site,
        NONCE_HEADER: nonce_hex,
        SIGNATURE_HEADER: base64.b64encode(signature).decode("ascii"),
    }


async def fetch_challenge(
    session: aiohttp.ClientSession, base_url: str, ssl_context: ssl.SSLContext | bool
) -> dict[str, Any]:
    """The relay's challenge, read to MAX_CHALLENGE_BYTES at most; HandshakeRefused
    for a refusal or anything that is not a challenge."""
    url = base_url + RELAY_CHALLENGE_PATH
    async with session.get(url, ssl=ssl_context, allow_redirects=False) as resp:  # a 3xx: refused
        body = b""
        while len(body) <= MAX_CHALLENGE_BYTES and (chunk := await resp.content.readany()):
            body += chunk
        if resp.status != 200:
            raise HandshakeRefused(resp.headers.get(REFUSAL_HEADER, f"HTTP {resp.status}")[:64])
    if len(body) > MAX_CHALLENGE_BYTES:
        raise HandshakeRefused(f"challenge longer than {MAX_CHALLENGE_BYTES} bytes")
    try:
        challenge = json.loads(body)
    except (ValueError, RecursionError):
        raise HandshakeRefused("challenge is not JSON") from None
    if (
        not isinstance(challenge, dict)
        or challenge.get("type") != "challenge"
        or not isinstance(challenge.get("nonce"), str)
        or not NONCE_SHAPE.fullmatch(challenge["nonce"])  # we sign nothing but a nonce
    ):
        raise HandshakeRefused("malformed challenge")
    return challenge


def only_to(base_url: str) -> ClientMiddlewareType:
    """A client middleware (aiohttp runs it for each hop of a redirect) that
    lets a session ask `base_url`'s host and port, with its TLS or without,
    and nothing else: ws_connect follows redirects and has no option not to."""
    target = urlsplit(base_url)
    tls = target.scheme in ("https", "wss")
    allowed = (target.hostname, target.port or (443 if tls else 80), tls)

    async def middleware(
        request: aiohttp.ClientRequest, handler: ClientHandlerType
    ) -> aiohttp.ClientResponse:
        url = request.url
        if (url.host, url.port, url.scheme in ("https", "wss")) != allowed:
            raise HandshakeRefused(f"redirected to {url.scheme}://{url.host}:{url.port}"[:64])
        return await handler(request)

    return middleware


async def open_relay_socket(
    session: aiohttp.ClientSession,
    base_url: str,
    *,
    identity: LocalIdentity,
    relay: str,
    federation: str,
    ssl_context: ssl.SSLContext | bool = False,
    claim: str | None = None,
    sign_for: str | None = None,
    **ws_options: Any,
) -> aiohttp.ClientWebSocketResponse:
    """A site's authenticated WebSocket to `relay` at `base_url` (http[s]://HOST:PORT).
    A relay that calls itself by another name or federation than the roster's
    is refused here (our signature, bound to both, would be refused there).
    `claim` and `sign_for` (the site named, the relay signed for) exist for the
    attack tests. HandshakeRefused names the relay's reason."""
    challenge = await fetch_challenge(session, base_url, ssl_context)
    if challenge.get("relay") != relay or challenge.get("federation") != federation:
        raise HandshakeRefused(
            f"it calls itself {challenge.get('relay')!r} of federation "
            f"{challenge.get('federation')!r}, expected {relay!r} of {federation!r}"
        )
    if challenge.get("protocol") != RELAY_PROTOCOL:
        raise HandshakeRefused(
            f"it speaks relay protocol {challenge.get('protocol')!r}, this site "
            f"{RELAY_PROTOCOL}: run the same p2pfl-node version on the relay and its sites"
        )
    headers = proof_headers(identity, federation, sign_for or relay, challenge["nonce"], claim)
    ws_url = "ws" + base_url.removeprefix("http") + RELAY_CONNECT_PATH
    try:
        return await session.ws_connect(ws_url, headers=headers, ssl=ssl_context, **ws_options)
    except aiohttp.WSServerHandshakeError as exc:
        reason = (exc.headers or {}).get(REFUSAL_HEADER) if exc.headers else None
        raise HandshakeRefused(str(reason or f"HTTP {exc.status}")[:64]) from None
