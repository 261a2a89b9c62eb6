"""A relay: forwards frames to sites that accept no inbound connection (issue 31).

A site whose roster card has `address: null` and `via: [relay, ...]` keeps one
outbound WebSocket to each of its relays (node/relay_tunnel.py). A peer POSTs
the very frame it would have sent directly to the relay's RELAY_MESSAGE_PATH;
the relay forwards it down the recipient's WebSocket and answers the POST with
the recipient's own answer (node/relay_wire.py says what travels).

What a relay can and cannot do: it reads only the clear, signed header of a
frame, to route it. The payload is encrypted to the recipient and covered by
the signed digest, so a relay can neither read nor alter it (the receiver's
WireCodec refuses a changed byte, `digest_mismatch`), nor forge a frame (it
holds no site's key). It can delay or drop frames, which the senders' retries
and the receivers' exactly-once handling already absorb. It keeps no replay
state for delivery (the final receiver does; it remembers the ids it forwarded
only so that copies wait apart from their sender's frames:
node/relay_admission.py `Forwarded`), no keys, and writes nothing but its
status token to disk (node/relay_status.py).

Checks on a POST, in this order, each a refusal `{"reason": CODE}` counted by
reason: the frame's prefix and header (bounded reads, idle timeout), version,
federation, sender on the roster, its signature, timestamp within the clock
skew, `encrypted` (a relay never carries plaintext: `encryption_required`),
size; the sender's turn (node/relay_admission.py: over its rate or its
share, a signed frame waits in its sender's own queue, reads paused:
`rate_limited`, `too_many_connections`; a copy of a frame forwarded already
waits in that sender's queue of copies to that recipient); recipient connected
here (`not_connected` 503: try its next relay; a stranger cannot learn who is
connected), the sender's token (a forger cannot drain a bucket), the
recipient's pending frames and bytes (`queue_full` 503; one sender holds at most half of a recipient's slots, and
of its bytes beyond its first frame), then the payload itself (exactly its
length, its signed SHA-256, within read_idle_timeout_s + its size at
min_upload_bytes_per_s: `upload_too_slow`). The frame is streamed down to the
recipient as its bytes arrive (cut-through, node/relay_wire.py): the relay
holds one piece of it at a time, and sends its last piece (END) only once the
length and digest hold, else ABORT, so the site never takes a frame the relay
saw fail (and checks the digest itself besides).
The answer goes back under the same deadline, the frame's slot held until it
is written: a sender that does not read it has its connection aborted
(`answer_too_slow`), so no unread answer stays in memory. Timeouts are
`asyncio.timeout` scopes (3.11's `wait_for` makes each read a task).

Connections: a site proves who it is on the WebSocket upgrade request itself,
before any WebSocket exists (node/relay_handshake.py: nonces, handshake slots).
A second connection of a site replaces the first, whose pending forwards
answer 502 `relay_lost`; a connection the relay closes is aborted if the close
takes longer than twice the WebSocket's wait for a close frame (SiteLink.close). Idle connections are cut by the WebSocket heartbeat
(a ping, then no pong: idle_timeout_s in all). The routes (`add_routes`) are
mounted by `p2pfl-node relay` (node/relay_status.py) or a site with relay.serve.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import struct
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import WSCloseCode, WSMsgType, web

from node.faults import FaultPlan
from node.relay_admission import TOO_MANY_CONNECTIONS, Admission, Forwarded, repeat_key
from node.relay_handshake import (
    PROTOCOL_ERROR,
    Gatekeeper,
    SiteLink,
    SiteStats,
    refusal,
    refused_upgrade,
)
from node.relay_wire import (
    ABORT,
    DATA,
    END,
    RELAY_CHALLENGE_PATH,
    RELAY_CONNECT_PATH,
    RELAY_MESSAGE_PATH,
    RelayWireError,
    encrypted_frame,
    pack_forward,
    send_message,
    unpack_reply,
)
from node.transport import content_encoding
from p2pfl.config import RelaySettings
from p2pfl.secure.identity import Roster
from p2pfl.secure.wire import MAGIC, MAX_HEADER, PREFIX_LEN, SIG_LEN, VERSION, Header, WireError

log = logging.getLogger(__name__)


class RelayServer:
    """The relay's routes and state (see the module docstring)."""

    def __init__(
        self,
        name: str,
        federation: str,
        roster: Roster,
        settings: RelaySettings,
        *,
        max_message_bytes: int,
        clock_skew_s: float,
        faults: FaultPlan | None = None,
    ) -> None:
        self.name = name
        self.faults = faults  # a drill's kill (node/faults.py, phase `forward`)
        self.federation = federation
        self.roster = roster
        self.settings = settings
        self.max_message_bytes = max_message_bytes
        self.clock_skew_ms = int(clock_skew_s * 1000)
        self.started = time.time()
        self.links: dict[str, SiteLink] = {}
        self.stats: dict[str, SiteStats] = {}
        self.refusals: dict[str, int] = {}
        self.admission = Admission(settings)
        self.forwarded = Forwarded(self.clock_skew_ms)  # copies wait apart (relay_admission)
        self._ids = itertools.count(1)
        self._sent: dict[int, int] = {}  # frame bytes sent down, per stream in progress
        self.gate = Gatekeeper(name, federation, settings, self._count)
        self._closing = False
        self._tasks: set[asyncio.Task[Any]] = set()

    # ------------------------------------------------------------------ routes
    def add_routes(self, app: web.Application) -> None:
        app.router.add_get(RELAY_CHALLENGE_PATH, self.handle_challenge)
        app.router.add_get(RELAY_CONNECT_PATH, self.handle_connect)
        app.router.add_post(RELAY_MESSAGE_PATH, self.handle_message)

    def _count(self, reason: str, who: str | None = None) -> None:
        """Count a refusal; its first occurrence, and every power of ten, is
        logged, so a flood of them cannot flood the log."""
        n = self.refusals[reason] = self.refusals.get(reason, 0) + 1
        if str(n).rstrip("0") == "1":  # 1, 10, 100, ...
            log.warning("RELAY %s: refused %s (%d so far; last from %r)", self.name, reason, n, who)

    def _refuse(self, reason: str, detail: str = "", who: str | None = None) -> web.Response:
        self._count(reason, who)
        return refusal(reason, detail)

    def _stats(self, site: str) -> SiteStats:
        return self.stats.get(site) or self.stats.setdefault(site, SiteStats())

    # ------------------------------------------------------------------ connect
    @property
    def _handshakes(self) -> int:
        """Handshakes in progress: challenges issued, not yet used or expired."""
        return self.gate.in_progress()

    def _refuse_upgrade(
        self, reason: str, detail: str = "", who: str | None = None
    ) -> web.Response:
        self._count(reason, who)
        return refused_upgrade(reason, detail)

    async def handle_challenge(self, request: web.Request) -> web.Response:
        if self._closing:
            return self._refuse_upgrade("relay_closing")
        host = request.remote or ""
        nonce = self.gate.issue(host)
        if isinstance(nonce, tuple):
            return self._refuse_upgrade(*nonce, who=host)
        self.gate.sweep_later()  # so an unused one is counted when it expires
        response = web.json_response(self.gate.challenge(nonce))
        response.headers["Cache-Control"] = "no-store"
        return response

    async def handle_connect(self, request: web.Request) -> web.StreamResponse:
        if self._closing:
            return self._refuse_upgrade("relay_closing")
        accepted = await self.gate.upgrade(request, self.roster, self.max_message_bytes)
        if not isinstance(accepted, tuple):
            return accepted  # refused, or gone mid-upgrade: counted
        card, ws = accepted
        link = SiteLink(card.name, card, ws, transport=request.transport)
        previous = self.links.get(card.name)
        self.links[card.name] = link
        self._stats(card.name).connects += 1
        names = (self.name, card.name)
        if previous is not None:
            log.info("RELAY %s: %s connected again; closing its previous connection", *names)
            self._disconnect(previous, "replaced by a newer connection")
        peer = request.transport.get_extra_info("peername") if request.transport else None
        log.info("RELAY %s: site %s connected from %s", self.name, card.name, peer)
        try:
            async for msg in ws:
                if msg.type != WSMsgType.BINARY or not self._on_reply(link, msg.data):
                    if msg.type != WSMsgType.ERROR:
                        self._count(PROTOCOL_ERROR, card.name)
                    break
        finally:
            self._drop(link, "connection closed")
        if not ws.closed:
            await link.close(WSCloseCode.PROTOCOL_ERROR, "protocol error", self.settings)
        return ws

    def _on_reply(self, link: SiteLink, data: bytes) -> bool:
        """Hand a REPLY to the forward waiting for it; False if it does not parse."""
        try:
            stream_id, status, body = unpack_reply(data)
        except RelayWireError:
            return False
        future = link.waiting.get(stream_id)
        if future is not None and not future.done():  # else: its POST gave up already
            future.set_result((status, body))
        stats = self._stats(link.name)
        stats.replies += 1
        stats.reply_bytes += len(body)
        return True

    def _drop(self, link: SiteLink, why: str) -> None:
        """Forget a closed connection (no await: runs in `finally` when cancelled)."""
        link.fail()
        if self.links.get(link.name) is link:
            del self.links[link.name]
            log.info("RELAY %s: site %s disconnected (%s)", self.name, link.name, why)

    def _disconnect(self, link: SiteLink, why: str) -> None:
        self._drop(link, why)
        task = asyncio.get_running_loop().create_task(
            link.close(WSCloseCode.GOING_AWAY, why, self.settings)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ message
    def _precheck(
        self, header: Header, header_bytes: bytes, signature: bytes, length: int | None
    ) -> tuple[str, str] | None:
        """The checks before the sender's turn: version, federation, sender on
        the roster, its signature, then what else its signed header alone
        decides (clock, encryption, size). Only a frame its sender signed waits
        in that sender's queue: a stranger claiming a site's name is refused here
        and can never take that site's places at the relay; nor does a copy of
        an old frame wait there only to be refused `stale_timestamp` (a review)."""
        if header.version != VERSION:
            return "unsupported_version", f"version {header.version}"
        if header.federation != self.federation:
            return "wrong_federation", repr(header.federation[:64])
        sender = self.roster.sites.get(header.sender)
        if sender is None:
            return "unknown_sender", repr(header.sender[:64])
        if not sender.verify(signature, header_bytes):
            return "bad_signature", f"from {header.sender!r}"
        skew = int(time.time() * 1000) - header.timestamp_ms
        if abs(skew) > self.clock_skew_ms:
            return "stale_timestamp", f"{skew / 1000:.0f} s off this relay's clock"
        if not header.encrypted:
            return "encryption_required", "a relay forwards encrypted payloads only"
        frame_len = PREFIX_LEN + len(header_bytes) + SIG_LEN + header.payload_len
        if frame_len > self.max_message_bytes:
            return "oversize", f"{frame_len} bytes"
        if length is not None and length != frame_len:
            return "digest_mismatch", "frame length does not match the header"
        return None

    def _check(self, header: Header, head: int, gate: str) -> tuple[str, str] | SiteLink:
        """The rest of the checks, in the module docstring's order, once the
        turn of `gate` (the sender's, or its copies' to this recipient) came
        (no await in between: its token is still there): the recipient's
        connection, or (reason, detail). Only after the signature: a stranger
        must not learn who is connected here."""
        link = self.links.get(header.recipient)
        if link is None or header.recipient not in self.roster:
            return "not_connected", f"{header.recipient[:64]!r} has no connection to this relay"
        frame_len = PREFIX_LEN + head + SIG_LEN + header.payload_len
        if not self.admission.take(gate):
            return "rate_limited", f"over {self.settings.rate_limit_per_s:g} frames/s"
        limit = self.settings.max_pending_per_site
        max_bytes = self.settings.max_pending_bytes_per_site
        mine = link.bytes_by_sender.get(header.sender, 0)
        if (
            link.pending >= limit
            or link.by_sender.get(header.sender, 0) >= max(1, limit // 2)
            or link.pending_bytes + frame_len > max_bytes
            # one sender holds at most half of the bytes too (beyond its first frame):
            # a sender that stalls its payloads cannot fill a recipient's queue alone
            or (mine and mine + frame_len > max_bytes // 2)
        ):
            return "queue_full", f"{link.pending} frames to {header.recipient!r} in flight"
        return link

    async def handle_message(self, request: web.Request) -> web.StreamResponse:
        if self._closing:
            return self._refuse("relay_closing")
        if encoding := content_encoding(request):  # never inflated, never streamed on
            return self._refuse("encoding_not_accepted", encoding)
        length = request.content_length
        if length is not None and length > self.max_message_bytes:
            return self._refuse("oversize", f"{length} bytes")
        stream = request.content
        idle = self.settings.read_idle_timeout_s
        try:
            async with asyncio.timeout(idle):  # the prefix, then the header: small
                prefix = await stream.readexactly(PREFIX_LEN)
                (header_len,) = struct.unpack(">I", prefix[4:8])
                if prefix[:4] != MAGIC or not 0 < header_len <= MAX_HEADER:
                    return self._refuse("undecodable_header", "not a P2FL frame")
                rest = await stream.readexactly(header_len + SIG_LEN)
            header = Header.unpack(rest[:header_len])
        except WireError as exc:
            return self._refuse(exc.reason, exc.detail)
        except (asyncio.IncompleteReadError, ConnectionResetError, aiohttp.ClientPayloadError):
            return self._refuse("truncated", "frame ended early")
        except TimeoutError:
            return self._refuse("truncated", f"no bytes for {idle:g} s")
        who = header.sender[:64]
        if failed := self._precheck(header, rest[:header_len], rest[header_len:], length):
            return self._refuse(*failed, who=who)
        # A copy of a frame forwarded already waits apart from its sender's
        # other frames (node/relay_admission.py Forwarded): whoever replays it
        # holds places of that sender to that recipient only.
        gate = header.sender
        if self.forwarded.seen(header.sender, header.msg_id):
            gate = repeat_key(header.sender, header.recipient)
        if isinstance(turn := await self.admission.enter(gate), str):  # waited
            response = self._refuse(turn, self.admission.why(turn), who)
            if turn == TOO_MANY_CONNECTIONS:
                response.force_close()  # this sender has connections enough
            return response
        leave = turn.once()  # when streamed (`_forward`), or however it ends
        try:
            checked = self._check(header, header_len, gate)
            if isinstance(checked, tuple):
                return self._refuse(*checked, who=who)
            self.forwarded.add(header.sender, header.msg_id, header.timestamp_ms)
            if self.faults is not None:  # a drill's kill records what was forwarded
                self.faults.on_progress(
                    header.round,
                    "forward",
                    own=False,
                    state=lambda: {
                        "forwarded": self.snapshot()["forwarded"],
                        "refusals": sum(self.refusals.values()),
                    },
                )
            return await self._forward(checked, request, prefix + rest, header, leave, gate)
        finally:
            leave()  # its place at the relay is free

    async def _forward(
        self,
        link: SiteLink,
        request: web.Request,
        head: bytes,
        header: Header,
        streamed: Callable[[], None],
        gate: str,
    ) -> web.StreamResponse:
        """Stream a checked frame down the recipient's connection as its bytes
        arrive (node/relay_wire.py: DATA pieces, END once the payload's length
        and signed SHA-256 hold, else ABORT) and answer with the recipient's
        answer. The frame's slot and bytes are counted from before the first
        payload byte is read until the answer is written (a sender that does
        not read its answers uses up its own slots); the relay holds only the
        piece in hand, never the whole frame."""
        sender = header.sender
        frame_len = len(head) + header.payload_len
        link.pending += 1
        link.pending_bytes += frame_len
        link.by_sender[sender] = link.by_sender.get(sender, 0) + 1
        link.bytes_by_sender[sender] = link.bytes_by_sender.get(sender, 0) + frame_len
        held_bytes = frame_len
        future: asyncio.Future[tuple[int, bytes] | None] = (
            asyncio.get_running_loop().create_future()
        )
        stream_id, sending = -1, False
        try:
            # no more of its gate's frames at one site than it has places, one more waiting
            # in its place, as long as in its queue (node/relay_admission.py, send_turn)
            most, wait_s = self.admission.max_active, self.admission.wait_s
            if not (sending := await link.send_turn(gate, most, wait_s)):
                return self._refuse("queue_full", f"{sender}'s frames to {link.name!r}", sender)
            stream_id = next(self._ids)  # after the wait: a site opens only growing ids
            link.waiting[stream_id] = future
            try:
                failure = await self._stream(link, request.content, stream_id, head, header, future)
            except asyncio.CancelledError:  # the sender's connection went away mid-upload
                self._abort_later(link, stream_id, future)
                raise
            if failure is not None:
                self._abort_later(link, stream_id, future)  # the site drops what it has
                return self._refuse(*failure, who=sender)
            link.unhold(sender, held_bytes)
            held_bytes = 0
            # Sent: waiting for the answer (a request its site holds open until
            # its model is ready) holds no place of its sender's, only the
            # recipient's slot; 8 such held requests, one per site, kept every
            # other frame of their sender waiting, then rate_limited (rv_net review).
            streamed()
            # the bytes that went down: the whole frame, or less when the site
            # answered (refused it on its header) before the relay sent it all
            self._account(sender, link.name, self._sent.get(stream_id, 0))
            try:
                async with asyncio.timeout(self.settings.forward_timeout_s):
                    answer = await future
            except TimeoutError:
                return self._refuse("relay_lost", "no answer within forward_timeout_s", sender)
            if answer is None:
                return self._refuse("relay_lost", "the recipient disconnected", sender)
            status, body = answer
            if not 200 <= status <= 599 or status in (204, 205, 304):  # a body must follow
                return self._refuse(
                    "reply_malformed", f"status {status} from {link.name!r}", sender
                )
            if status == 200 and body[:4] == MAGIC and not encrypted_frame(body):
                return self._refuse("plaintext_answer", f"from {link.name!r}", sender)
            return await self._answer(request, status, body, sender)
        finally:
            if sending:
                link.sent_done(gate)
            self._sent.pop(stream_id, None)
            link.waiting.pop(stream_id, None)
            link.pending -= 1
            link.unhold(sender, held_bytes)
            link.by_sender[sender] -= 1
            if not link.by_sender[sender]:
                del link.by_sender[sender]

    async def _send_piece(self, link: SiteLink, stream_id: int, kind: int, piece: Any) -> bool:
        """One FORWARD piece down the recipient's connection: False if it failed.
        A site that stops reading stalls the drain: forward_timeout_s at most.
        Every forward to a site waits on one drain future of its connection
        (aiohttp's): node/relay_wire.py send_message keeps a sender's handler
        cancelled there (its connection gone) from cutting the others'."""
        if link.closed:
            return False
        try:
            async with asyncio.timeout(self.settings.forward_timeout_s):
                await send_message(link.ws, pack_forward(stream_id, kind, piece))
        except (ConnectionError, RuntimeError, aiohttp.ClientError, TimeoutError):
            return False
        if len(piece):  # (an ABORT carries none: no entry made after the frame is done)
            self._sent[stream_id] = self._sent.get(stream_id, 0) + len(piece)
        return True

    def _abort_later(self, link: SiteLink, stream_id: int, answered: asyncio.Future[Any]) -> None:
        """ABORT a frame that will not complete, unless the site answered it
        already: a detached send (the path may be cancelled: the sender's
        connection went away mid-upload), so the site drops the frame at once
        instead of waiting out its idle timeout with its id, bytes and slot held."""
        if link.closed or answered.done():
            return
        task = asyncio.get_running_loop().create_task(self._send_piece(link, stream_id, ABORT, b""))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _stream(
        self,
        link: SiteLink,
        stream: aiohttp.StreamReader,
        stream_id: int,
        head: bytes,
        header: Header,
        answered: asyncio.Future[tuple[int, bytes] | None],
    ) -> tuple[str, str] | None:
        """Send the frame's head, then its payload piece by piece as it comes,
        hashing it; the last piece goes as END only if the payload is exactly
        its length and matches the signed SHA-256. None when the whole frame
        went (or the site answered early, which ends the stream: it refused
        the frame on its header), or the refusal (truncated, digest_mismatch,
        upload_too_slow, relay_lost) to answer; the caller then sends ABORT."""
        lost = "relay_lost", "the recipient's connection failed"
        if not await self._send_piece(link, stream_id, DATA, head):
            return lost
        idle = self.settings.read_idle_timeout_s
        deadline = (
            time.monotonic() + idle + header.payload_len / self.settings.min_upload_bytes_per_s
        )
        digest = hashlib.sha256()
        got, size = 0, header.payload_len
        last: bytes = b""  # the piece that goes with END
        longer = "digest_mismatch", "payload longer than the header says"
        try:
            while got < size:
                if answered.done():
                    return None  # the site answered already: it takes no more of this frame
                async with asyncio.timeout(_wait(idle, deadline)):
                    chunk = await stream.readany()
                if not chunk:
                    return "truncated", f"payload ended at {got} bytes"
                if got + len(chunk) > size:
                    return longer
                got += len(chunk)
                digest.update(chunk)
                if got == size:
                    last = chunk
                elif not await self._send_piece(link, stream_id, DATA, chunk):
                    return lost
                else:
                    await asyncio.sleep(0)  # let the site's early answer, if any, arrive
            if not stream.at_eof():
                async with asyncio.timeout(_wait(idle, deadline)):
                    if await stream.read(1):
                        return longer
        except (aiohttp.ClientPayloadError, ConnectionResetError, asyncio.IncompleteReadError):
            return "truncated", "connection closed mid-payload"
        except TimeoutError:
            if time.monotonic() >= deadline - 1e-3:
                return "upload_too_slow", f"{got} of {size} bytes by the deadline"
            return "truncated", f"payload stalled for {idle:g} s"
        if digest.digest() != header.payload_sha256:
            return "digest_mismatch", "payload SHA-256 differs from the signed header"
        return None if await self._send_piece(link, stream_id, END, last) else lost

    async def _answer(
        self, request: web.Request, status: int, body: bytes, sender: str
    ) -> web.StreamResponse:
        """Write the recipient's answer; a sender that does not take it within
        read_idle_timeout_s + its size at min_upload_bytes_per_s has its connection
        aborted, so an unread answer is not held in memory for ever."""
        kind = "application/json" if body[:1] == b"{" else "application/octet-stream"
        response = web.Response(body=body, status=status, content_type=kind)
        settings = self.settings
        limit = settings.read_idle_timeout_s + len(body) / settings.min_upload_bytes_per_s
        try:
            async with asyncio.timeout(limit):
                await response.prepare(request)
                await response.write_eof()
        except TimeoutError:
            self._count("answer_too_slow", sender)
            if request.transport is not None:
                request.transport.abort()  # drops the unsent bytes (close() would flush them)
        return response  # aiohttp finds the connection gone and writes nothing more

    def _account(self, sender: str, recipient: str, nbytes: int) -> None:
        out = self._stats(recipient)
        out.messages_out += 1
        out.bytes_out += nbytes
        into = self._stats(sender)
        into.messages_in += 1
        into.bytes_in += nbytes

    # ------------------------------------------------------------------ operations
    def set_roster(self, roster: Roster) -> None:
        """A reloaded roster (SIGHUP): a site no longer listed, or whose card
        changed (keys, via), is disconnected; it authenticates again if it may."""
        self.admission.forget(self.roster.sites, roster.sites)  # cards compared: first
        self.forwarded.forget(roster.sites)
        self.roster = roster
        for link in list(self.links.values()):
            entry = roster.sites.get(link.name)
            if entry is None or entry.card != link.card:
                self._disconnect(link, "roster changed")

    async def close(self) -> None:
        """Refuse what comes, close every site connection; waiting forwards
        answer 502 relay_lost."""
        self._closing = True
        self.gate.close()
        for link in list(self.links.values()):
            self._disconnect(link, "relay shutting down")
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def snapshot(self) -> dict[str, Any]:
        """The /status body: sites, counters and refusals by reason."""
        names = {c.name for c in self.roster.cards() if self.name in c.via}
        sites = {}
        for name in sorted(names | set(self.stats) | set(self.links)):
            link = self.links.get(name)
            stats = self.stats.get(name, SiteStats())
            sites[name] = {
                "connected": link is not None,
                "since": round(link.since, 3) if link else None,
                "pending": link.pending if link else 0,
                "pending_bytes": link.pending_bytes if link else 0,
                **vars(stats),
                **self.admission.row(name),  # its frames waiting for its rate
            }
        return {
            "relay": self.name,
            "federation": self.federation,
            "uptime_s": round(time.time() - self.started, 3),
            "connected": sorted(self.links),
            "sites": sites,
            "forwarded": {
                "messages": sum(s.messages_out for s in self.stats.values()),
                "bytes": sum(s.bytes_out for s in self.stats.values()),
                "reply_bytes": sum(s.reply_bytes for s in self.stats.values()),
            },
            "refusals": dict(sorted(self.refusals.items())),
        }


def _wait(idle: float, deadline: float) -> float:
    """How long the next read may wait: the idle timeout, or less near the deadline."""
    return max(0.0, min(idle, deadline - time.monotonic()))
