"""Peer transport over aiohttp: the message endpoint (server) and what both sides share.

Server: `POST /p2pfl/v1/message` streams the body. It reads the frame prefix,
header and signature first and verifies them (size limit, sender, signature,
clock, replay) before it reads a single payload byte; then it reads the payload
into one buffer, grown as the bytes arrive (never allocated for the size the
header declares before they do), while hashing it, and hands the verified
frame to the node.
Anything rejected gets a 4xx (a 503 when this node cannot store what it
must before accepting) with a JSON body `{"reason": CODE}`.

Uploads in progress reserve their payload bytes: at most 2 x max_message_bytes
in all and one max_message_bytes per sender (`too_many_uploads`), and a payload
must arrive within read_idle_timeout_s + its size at min_upload_bytes_per_s
(`upload_too_slow`), so one stalling peer holds at most half, for a bounded
time. A copy of an id still arriving or handled is refused `in_progress` (sent
again later); only an id this node is done with is `replayed` (node/outbound.py
counts that as delivered).

The client, which sends to this endpoint, is node/transport_client.py. With
TLS configured the server only listens with TLS: no plaintext fallback. With
`transport.link_mbit` set, the payload bytes of requests and replies go out
through the node's one emulated uplink (node/link.py, `ChunksPayload`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.payload import Payload

from node.link import Uplink, uplink_for
from node.listen import ConnectionGate, bound_port, serve_app
from p2pfl.config import TransportSection
from p2pfl.secure.wire import PREFIX_LEN, SIG_LEN, Header, WireCodec, WireError

log = logging.getLogger(__name__)

MESSAGE_PATH = "/p2pfl/v1/message"
READ_CHUNK = 1 << 20
# How long a client keeps an idle connection to a peer (node/transport_client.py),
# and a server (10 s more: a server that closes first races a request the
# client sends on it, which then fails and is retried).
CLIENT_KEEPALIVE_S = 30.0
SERVER_KEEPALIVE_S = CLIENT_KEEPALIVE_S + 10.0
# Payloads at least this large are opened (decrypted, decoded, checked finite)
# in a worker thread, not on the event loop: pushes, requests and heartbeats
# (node/inbound.py) and answers to this node's requests (node/outbound.py).
# 16 KiB: a payload just under the former 256 KiB, a msgpack list of ~262,000
# fixints inside the decoding budget, held the loop 0.1-0.25 s per heartbeat
# (wire review); one under 16 KiB costs at most a few milliseconds there.
OFF_LOOP_BYTES = 16 * 1024

# HTTP status per rejection reason (4xx: the sender's problem, do not retry blindly).
STATUS_FOR_REASON = {
    "oversize": 413,
    "undecodable_header": 400,
    "unsupported_version": 400,
    "wrong_federation": 403,
    "unknown_sender": 403,
    "wrong_recipient": 421,
    "bad_signature": 401,
    "stale_timestamp": 401,
    "replayed": 409,  # this node finished with that id: the sender may count it delivered
    "id_taken": 409,  # another sender used that id first: not acknowledged, not taken
    "in_progress": 409,  # a copy of that id is still arriving or being handled: ask again later
    "before_restart": 425,  # maybe a replay from before our restart: send again, freshly stamped
    "below_replay_floor": 425,  # stamped at or below the evicted ids' floor: send again, fresh
    "encryption_required": 403,
    "digest_mismatch": 400,
    "decryption_failed": 400,
    "payload_schema": 422,
    "rate_limited": 429,
    "queue_full": 503,
    "not_ready": 404,
    "no_handler": 404,
    "peer_failed": 410,  # its protocol failed: it will never have what was asked
    "handler_error": 500,
    "truncated": 400,
    "storage_error": 503,
    "unknown_kind": 404,  # no protocol of this node sends or serves that kind
    "push_not_accepted": 404,  # a kind this node serves and requests, never reads as a push
    "encoding_not_accepted": 415,  # a body sent with a Content-Encoding (gzip, ...): not inflated
    "too_many_held": 429,  # the peer already has transport.max_held_per_peer requests held open
    "too_many_uploads": 429,  # the peer's uploads in progress already reserve its share
    "heartbeat_oversize": 413,  # larger than an honest heartbeat can be (node/inbound.py)
    "upload_too_slow": 408,  # slower than transport.min_upload_bytes_per_s
    "answer_too_slow": 408,  # (counted only) an answer its requester did not read in time
}
# Refusals after which the message had no effect and its honest sender may send
# the very same frame again: its replay reservation is given back (WireCodec.release).
RELEASE_REASONS = frozenset(
    ("truncated", "digest_mismatch", "queue_full", "rate_limited", "storage_error")
    + ("too_many_held", "too_many_uploads", "upload_too_slow")
    # (node/inbound.py: a push whose id another sender's journaled push had;
    # kept reserved, its sender's next copy would be acknowledged `replayed`)
    + ("id_taken",)
)


class Rejection(Exception):
    """A refusal decided after the frame was verified (queue full, no handler, ...)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass
class IncomingFrame:
    """A frame whose header and payload digest are verified; payload not yet opened."""

    header: Header
    frame: bytearray  # the whole frame (prefix + header + signature + payload)
    payload_offset: int
    digest: bytes

    @property
    def payload(self) -> memoryview:
        return memoryview(self.frame)[self.payload_offset :]


# A node-side handler: returns (status, body bytes or None). Raises WireError to reject.
FrameHandler = Callable[
    [IncomingFrame], Awaitable[tuple[int, bytes | list[bytes | memoryview] | None]]
]
RejectHook = Callable[[str, str | None], None]


class ChunksPayload(Payload):
    """Sends a frame's chunks without joining them (no extra copy of the tensors).

    This is where a node's payload bytes go out, requests and replies alike:
    with an `uplink` (transport.link_mbit, node/link.py) they go out at its rate."""

    def __init__(
        self,
        chunks: list[bytes | memoryview],
        uplink: Uplink | None = None,
        sent: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(b"", content_type="application/octet-stream")
        self._chunks = chunks
        self._size = sum(len(c) for c in chunks)
        self._uplink = uplink
        self._sent = sent  # called once its last byte is written (node/transport_client.py)

    async def write(self, writer: Any) -> None:
        if self._uplink is None:
            for chunk in self._chunks:
                await writer.write(chunk)
        else:
            async for piece in self._uplink.slices(self._chunks):
                await writer.write(piece)
        if self._sent is not None:
            self._sent()

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        raise TypeError("binary frame")

    async def collect(self) -> bytes:
        """The bytes, joined, at the uplink's pace: an answer that goes back
        down a relay tunnel instead of over this node's own HTTP connection."""
        if self._uplink is None:
            return b"".join(self._chunks)
        return b"".join([bytes(piece) async for piece in self._uplink.slices(self._chunks)])


async def answer_bytes(response: web.Response) -> bytes:
    """The body of an answer MessageServer.receive made, as bytes."""
    body = response.body
    if isinstance(body, ChunksPayload):
        return await body.collect()
    if body is None:
        return b""
    if isinstance(body, bytes | bytearray | memoryview):
        return bytes(body)
    raise TypeError(f"unexpected answer body {type(body).__name__}")


def content_encoding(request: web.BaseRequest) -> str | None:
    """The request's Content-Encoding unless it is none or `identity`: such a
    body is refused before it is read (`encoding_not_accepted`). aiohttp's
    server inflated gzip bodies by default: ~64 KiB on the wire became 64 MiB
    read and hashed here, or streamed down a site's tunnel by a relay (~1,000x,
    wire review finding 7). The runners also turn inflation off
    (`auto_decompress=False`), so what is read is never more than what came."""
    codings = [
        coding.strip().lower()
        for value in request.headers.getall("Content-Encoding", [])
        for coding in value.split(",")
    ]
    foreign = [c for c in codings if c not in ("", "identity")]
    return ",".join(foreign)[:40] if foreign else None


def _reject(reason: str, detail: str = "", ack: str | None = None) -> web.Response:
    body = {"reason": reason, "detail": detail[:200]}
    if ack is not None:
        body["ack"] = ack  # `replayed`, `id_taken`: the receiver's signed word (wire.py)
    return web.json_response(body, status=STATUS_FOR_REASON.get(reason, 400))


class TokenBucket:
    def __init__(self, rate: float, burst: float) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.stamp = time.monotonic()

    def _refill(self) -> None:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now

    def ready(self) -> bool:
        """Would take() succeed? (Takes nothing.)"""
        self._refill()
        return self.tokens >= 1.0

    def take(self) -> bool:
        self._refill()
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


async def serve_peer_port(
    app: web.Application,
    host: str,
    port: int,
    gate: ConnectionGate,
    ssl_context: ssl.SSLContext | None,
) -> web.AppRunner:
    """A site's peer port, or a relay's listen port (which peers reach the
    same way): the gate's cap and header deadline, a keep-alive a little
    longer than the client pool's, handlers cancelled when their client
    leaves, and no body inflated (a gzip body is refused, unread)."""
    return await serve_app(
        app,
        host,
        port,
        gate=gate,
        keepalive_s=SERVER_KEEPALIVE_S,
        ssl_context=ssl_context,
        backlog=512,
        handler_cancellation=True,
        auto_decompress=False,
    )


class MessageServer:
    """The receiving side of the transport."""

    def __init__(
        self,
        codec: WireCodec,
        cfg: TransportSection,
        on_frame: FrameHandler,
        on_reject: RejectHook,
        *,
        uplink: Uplink | None = None,
        check_header: Callable[[Header], None] | None = None,
    ) -> None:
        self.codec = codec
        self.cfg = cfg
        # The node's own refusals of a verified header (Rejection), before its
        # payload is read: a heartbeat larger than an honest one (node/inbound.py).
        self.check_header = check_header
        # replies go out through the node's uplink, shared with its client
        self.uplink = uplink if uplink is not None else uplink_for(cfg)
        self.on_frame = on_frame
        self.on_reject = on_reject
        self._buckets: dict[str, TokenBucket] = {}
        self.runner: web.AppRunner | None = None
        self.port: int | None = None
        # Payload bytes reserved by uploads in progress: bounded, so peers that
        # announce big frames and then stall cannot pin unbounded memory; and
        # per sender, so one of them cannot take it all.
        self.reserved_bytes = 0
        self.reserve_limit = 2 * codec.max_message_bytes
        self.sender_reserve_limit = codec.max_message_bytes
        self._reserved_by: dict[str, int] = {}
        # Ids whose frame is being received or handled now: a copy of one is
        # `in_progress`, not `replayed` (which tells the sender it was delivered).
        self._in_flight: set[tuple[str, bytes]] = set()  # (sender, id): ids are the sender's
        self.isolated = False  # fault plan (node/faults.py): a partition, no answers at all
        # More routes on the peer port: a site that also relays (issue 31, node/relay.py).
        self.extra_routes: list[Callable[[web.Application], None]] = []

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.codec.max_message_bytes)
        app.router.add_post(MESSAGE_PATH, self.handle)
        for add_routes in self.extra_routes:
            add_routes(app)
        return app

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None) -> int:
        """Listen: at most transport.max_connections at once, each with
        read_idle_timeout_s to send its request's headers (node/listen.py)."""
        gate = ConnectionGate(
            self.cfg.max_connections,
            self.cfg.read_idle_timeout_s,
            lambda reason: self.on_reject(reason, None),
            per_source=self.cfg.max_connections_per_source,
        )
        self.runner = await serve_peer_port(self.app(), host, port, gate, ssl_context)
        self.port = bound_port(self.runner, port)
        return self.port

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    def _refuse(
        self,
        reason: str,
        detail: str = "",
        sender: str | None = None,
        header: Header | None = None,
        ack: str | None = None,
    ) -> web.Response:
        """Count and answer a refusal; `header`: a verified one, whose replay
        reservation is given back when the sender may retry (RELEASE_REASONS)."""
        if header is not None and reason in RELEASE_REASONS:
            self.codec.release(header)
        self.on_reject(reason, sender)
        return _reject(reason, detail, ack)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if self.isolated and request.transport is not None:
            request.transport.abort()  # simulated partition: no answer at all
            raise web.HTTPServiceUnavailable()
        if encoding := content_encoding(request):
            return self._refuse("encoding_not_accepted", encoding)
        response = await self.receive(request.content, request.content_length)
        return await self._answer(request, response)

    async def _answer(self, request: web.Request, response: web.Response) -> web.Response:
        """Write the answer here, under a deadline: read_idle_timeout_s + its size
        at min_upload_bytes_per_s, as the relay does (`answer_too_slow`). A peer
        that asks for a model on many connections and never reads the answers
        held a sealed copy of the model per connection for as long as it kept
        them open; now its connection is aborted and the copy dropped."""
        body = response.body
        size = body.size if isinstance(body, Payload) else len(body or b"")
        limit = self.cfg.read_idle_timeout_s + (size or 0) / self.cfg.min_upload_bytes_per_s
        try:
            async with asyncio.timeout(limit):
                await response.prepare(request)
                await response.write_eof()
        except TimeoutError:
            self.on_reject("answer_too_slow", None)
            if request.transport is not None:
                request.transport.abort()  # drops the unsent bytes (close() would flush them)
        except (ConnectionResetError, aiohttp.ClientConnectionError):
            pass  # the requester hung up: nothing to write to, as when aiohttp writes it
        return response  # aiohttp finds it written, or the connection gone

    async def receive(self, stream: Any, length: int | None) -> web.Response:
        """One frame from `stream` (aiohttp's StreamReader, or a relay tunnel's
        FrameFeed: readexactly, readany, read, at_eof), `length` its declared
        size if known: every check of a POST, and the answer to send back."""
        if length is not None and length > self.codec.max_message_bytes:
            return self._refuse("oversize", f"{length} bytes")
        idle = self.cfg.read_idle_timeout_s
        sender: str | None = None
        claimed: Header | None = None
        try:
            prefix = await asyncio.wait_for(stream.readexactly(PREFIX_LEN), idle)
            header_len = self.codec.header_length(prefix)
            rest = await asyncio.wait_for(stream.readexactly(header_len + SIG_LEN), idle)
            header_bytes, signature = rest[:header_len], rest[header_len:]
            claimed = Header.unpack(header_bytes)
            sender = claimed.sender[:64]
            # A sender over its rate is refused before the costly signature check;
            # only verified messages take tokens, so a forger cannot drain a bucket.
            bucket = self._buckets.get(claimed.sender)
            if bucket is not None and not bucket.ready():
                return self._refuse("rate_limited", "", sender)
            header = self.codec.verify_header(
                header_bytes, signature, total_len=length, header=claimed
            )
        except WireError as exc:
            if (
                exc.reason == "replayed"
                and claimed is not None
                and (claimed.sender, claimed.msg_id) in self._in_flight
            ):
                # signature verified: a copy of a frame still arriving or being handled
                return self._refuse("in_progress", exc.detail, sender)
            if exc.reason in ("replayed", "id_taken") and claimed is not None:
                # raised only after the signature verified: the sender's own
                # message, done with here (or another's id: never taken under
                # it); signed, so no relay can say so for us
                ack = self.codec.sign_ack(claimed, exc.reason)
                return self._refuse(exc.reason, exc.detail, sender, ack=ack)
            return self._refuse(exc.reason, exc.detail, sender)
        except (asyncio.IncompleteReadError, ConnectionResetError, aiohttp.ClientPayloadError):
            return self._refuse("truncated", "frame ended early", sender)
        except TimeoutError:
            return self._refuse("truncated", f"no bytes for {idle:g} s", sender)
        self._in_flight.add((header.sender, header.msg_id))
        try:
            return await self._admit(stream, prefix, rest, header)
        except asyncio.CancelledError:
            # The connection went away before this node acted on the frame (no
            # await is left once the handler has): its sender may send it again.
            self.codec.release(header)
            raise
        finally:
            self._in_flight.discard((header.sender, header.msg_id))

    async def _admit(
        self, stream: aiohttp.StreamReader, prefix: bytes, rest: bytes, header: Header
    ) -> web.StreamResponse:
        """A verified header whose id is reserved: rate, reservation, payload, handler."""
        sender = header.sender
        bucket = self._buckets.get(sender)
        if bucket is None:
            bucket = self._buckets[sender] = TokenBucket(
                self.cfg.rate_limit_per_s, max(10.0, self.cfg.rate_limit_per_s)
            )
        if not bucket.take():
            return self._refuse("rate_limited", "", sender, header)
        if self.check_header is not None:
            try:
                self.check_header(header)
            except Rejection as exc:
                return self._refuse(exc.reason, exc.detail, sender, header)
        size = header.payload_len
        if self.reserved_bytes + size > self.reserve_limit:
            return self._refuse("queue_full", "too many large uploads in progress", sender, header)
        mine = self._reserved_by.get(sender, 0)
        if mine + size > self.sender_reserve_limit:
            return self._refuse(
                "too_many_uploads",
                f"{mine} bytes of uploads from {sender} in progress",
                sender,
                header,
            )
        self.reserved_bytes += size
        self._reserved_by[sender] = mine + size
        try:
            received = await self._receive(stream, prefix, rest, header)
        finally:
            # Reserved while the payload streams in, not while the node holds the
            # request open: held requests are capped per peer instead (node/inbound.py).
            self.reserved_bytes -= size
            self._reserved_by[sender] -= size
            if not self._reserved_by[sender]:
                del self._reserved_by[sender]
        if isinstance(received, web.Response):
            return received
        try:
            status, body = await self.on_frame(received)
        except (WireError, Rejection) as exc:
            ack = self.codec.sign_ack(header, exc.reason) if exc.reason == "id_taken" else None
            return self._refuse(exc.reason, exc.detail, sender, header, ack)
        except Exception as exc:  # noqa: BLE001 - a verified peer's frame: refused, counted
            # A case the checks missed (a decoder's RuntimeError once made a 500
            # with a logged traceback and nothing counted): one line, a reason.
            log.warning("%s from %s: handling failed: %r", header.kind[:64], sender, exc)
            return self._refuse("handler_error", type(exc).__name__, sender, header)
        if body is None:  # taken: acknowledged with this node's signature (p2pfl/secure/wire.py)
            return web.json_response(
                {"ok": True, "ack": self.codec.sign_ack(header, "ok")}, status=status
            )
        if isinstance(body, list) or self.uplink is not None:
            chunks = body if isinstance(body, list) else [body]
            return web.Response(
                body=ChunksPayload(chunks, self.uplink),
                status=status,
                content_type="application/octet-stream",
            )
        return web.Response(body=body, status=status, content_type="application/octet-stream")

    @staticmethod
    def _wait(idle: float, deadline: float) -> float:
        """How long the next read may wait: the idle timeout, or less near the deadline."""
        return max(0.0, min(idle, deadline - time.monotonic()))

    async def _receive(
        self,
        stream: aiohttp.StreamReader,
        prefix: bytes,
        rest: bytes,
        header: Header,
    ) -> IncomingFrame | web.Response:
        """Read the payload of a verified header into one buffer, hashing as it
        comes: the verified frame, or the refusal to answer. Each read waits at
        most read_idle_timeout_s, and the whole payload at most that plus its
        size at min_upload_bytes_per_s (`upload_too_slow`)."""
        idle = self.cfg.read_idle_timeout_s
        deadline = time.monotonic() + idle + header.payload_len / self.cfg.min_upload_bytes_per_s
        offset = PREFIX_LEN + len(rest)
        end = offset + header.payload_len
        # Grown as the bytes arrive, never allocated for the declared size up
        # front: bytearray(512 MiB) zero-filled half a gigabyte on the event loop
        # (0.3-1 s) for a 216-byte header, as often as a peer sent one (wire
        # review, finding 6). The declared size still bounds it (below).
        frame = bytearray(prefix)
        frame += rest
        digest = hashlib.sha256()
        pos = offset
        try:
            while pos < end:
                chunk = await asyncio.wait_for(stream.readany(), self._wait(idle, deadline))
                if not chunk:
                    return self._refuse(
                        "truncated",
                        f"payload ended at {pos - offset} of {header.payload_len} bytes",
                        header.sender,
                        header,
                    )
                n = len(chunk)
                if pos + n > end:
                    return self._refuse(
                        "digest_mismatch",
                        "payload longer than the header says",
                        header.sender,
                        header,
                    )
                frame += chunk
                digest.update(chunk)
                pos += n
            if not stream.at_eof() and await asyncio.wait_for(
                stream.read(1), self._wait(idle, deadline)
            ):
                return self._refuse(
                    "digest_mismatch", "payload longer than the header says", header.sender, header
                )
        except (aiohttp.ClientPayloadError, ConnectionResetError, asyncio.IncompleteReadError):
            return self._refuse("truncated", "connection closed mid-payload", header.sender, header)
        except TimeoutError:
            if time.monotonic() >= deadline - 1e-3:
                return self._refuse(
                    "upload_too_slow",
                    f"{pos - offset} of {header.payload_len} bytes by the deadline",
                    header.sender,
                    header,
                )
            return self._refuse(
                "truncated",
                f"payload stalled for {idle:g} s at byte {pos - offset}",
                header.sender,
                header,
            )
        incoming = IncomingFrame(header, frame, offset, digest.digest())
        if incoming.digest != header.payload_sha256:
            return self._refuse("digest_mismatch", "", header.sender, header)
        return incoming
