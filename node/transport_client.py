"""Peer transport over aiohttp, the sending side (the endpoint it posts to is
node/transport.py).

Client: one pooled session for all peers; per-peer retries with exponential
backoff and full jitter; a per-peer circuit breaker so a dead peer costs one
fast failure instead of a timeout per message. With TLS configured the client
only speaks https: no plaintext fallback.

A peer that accepts no inbound connection (issue 31: roster `address: null`,
`via: [relay, ...]`) is reached through its relays: its link holds one URL per
relay (node/relay_wire.py RELAY_MESSAGE_PATH) and a failed attempt (unreachable,
timeout, 502/503) moves it to the next before the backoff, so a node fails over
between relays and then keeps using the one that works. The relay answers with
the final receiver's own answer, so an acknowledgement stays end to end; any
other answer is unsigned and may be the relay's own, so every answer but a 200
moves the link too, as does a 200 whose acknowledgement or frame does not
verify (`answer_refused`): a relay refusing or forging everything cannot hold
its peer's senders (rv_net review). An unsigned refusal from a relay that
answered 200 lately moves it only at the STAY_REFUSALS-th in a row (a
heartbeat's 200 does not end the row), and never
back to a relay that failed or refused lately (`PeerLink.refused`, rv_net2).

A 503 `queue_full` is the peer saying "later" (its inbox, or this sender's
share of it, is full), not a failure: it neither counts toward the breaker nor
moves a relayed link to its next relay, and it is not retried here but raised
to the caller, which knows how long its message may wait (node/outbound.py).

Answers are read with the limits requests are read with (`MessageClient`), and
a refusal's reason is read from its JSON body (`reason_of_response`): at most
`ERROR_BODY_LIMIT` bytes of it, a string reason only.
"""

from __future__ import annotations

import asyncio
import json
import random
import ssl
import time
from dataclasses import dataclass, field

import aiohttp

from node.link import Uplink, uplink_for
from node.relay_wire import RELAY_MESSAGE_PATH
from node.transport import CLIENT_KEEPALIVE_S, MESSAGE_PATH, ChunksPayload, RejectHook
from p2pfl.config import TransportSection, parse_hostport
from p2pfl.secure.wire import OutgoingMessage
from p2pfl.text import MAX_REASON_CHARS, one_line

# The most an answer to a push or a heartbeat may be: a few bytes of JSON.
ACK_LIMIT = 64 * 1024
# The most of an error answer (any status but 200) that is read and parsed: its
# JSON reason is a few bytes. A 128 MiB 404 body was read and json-parsed on
# the event loop and logged whole (wire review, finding 9); past this the
# connection is dropped and the answer keeps its status, without a reason.
ERROR_BODY_LIMIT = 4 * 1024
RETRYABLE = {429, 500, 502, 503, 504}
# Answers after which a relayed link tries its next relay: the relay is gone or
# unhealthy (500, 502 relay_lost, 504), or the peer is not connected to it (503
# not_connected). On a relayed link, every answer but a 200 does too (`post`):
# a refusal is unsigned, so it may be the relay's own.
FAILOVER = RETRYABLE - {429}
# Unsigned refusals a relayed link takes from a URL that answered 200 lately
# before it tries the next (PeerLink.refused).
STAY_REFUSALS = 3
# The reason of a 503 that is the peer's own "later" (its inbox, or the share of
# it a sender may hold, is full; a relay's frames in flight to it): raised to the
# caller at once (node/outbound.py sends a push again with backoff until its
# deadline), neither a breaker failure nor a failover. Counted as failures, one
# push refused 5 times opened the peer's circuit for breaker_reset_s, and the
# client's 5 tries in about 3 s were all the push got (review 4, R2).
LATER = "queue_full"
# Frames this node uploads to one relay at once (`MessageClient._relay_gate`):
# the relay holds 8 of a sender's frames being sent on and queues 32 more
# (node/relay_admission.py HONEST_CONNECTIONS); one more is refused
# `too_many_connections`.
RELAY_UPLOADS = 8
# Refusals the receiver signs (p2pfl/secure/wire.py ACK_OUTCOMES): `signed_refusal`.
SIGNED_REFUSALS = ("replayed", "id_taken")


class ResponseRefused(Exception):
    """A peer's answer this node would not read to the end (`oversize`, `truncated`)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class TransportError(Exception):
    def __init__(self, peer: str, reason: str, status: int | None = None) -> None:
        super().__init__(f"{peer}: {reason}")
        self.peer = peer
        self.reason = reason
        self.status = status


@dataclass
class Breaker:
    failures: int = 0
    open_until: float = 0.0

    def allow(self, now: float) -> bool:
        return now >= self.open_until

    def success(self) -> None:
        self.failures = 0
        self.open_until = 0.0

    def failure(self, now: float, threshold: int, reset_s: float) -> None:
        self.failures += 1
        if self.failures >= threshold:
            self.open_until = now + reset_s


@dataclass
class PeerLink:
    name: str
    urls: list[str]  # one for a reachable peer; one per relay for an outbound-only one
    breaker: Breaker = field(default_factory=Breaker)
    blocked: bool = False  # fault injection: drop everything to this peer
    current: int = 0  # the URL in use: the last that worked, or the next to try
    # URL -> when (monotonic) it last failed or refused: `refused` keeps the
    # link off it for a while
    faulted: dict[str, float] = field(default_factory=dict)
    worked: float = float("-inf")  # when the URL in use last answered 200
    refusals: int = 0  # unsigned refusals from the URL in use since

    @property
    def url(self) -> str:
        return self.urls[self.current % len(self.urls)]

    @property
    def relayed(self) -> bool:
        return self.urls[0].endswith(RELAY_MESSAGE_PATH)

    def set_urls(self, urls: list[str]) -> None:
        """New URLs; the one in use stays in use when it is still listed."""
        keep = self.url if self.urls else None
        self.urls = list(urls)
        self.current = self.urls.index(keep) if keep in self.urls else 0

    def fail_over(self, failed: str) -> None:
        """`failed` did not work: the next attempt goes to the next URL. Only once
        per failure of the URL in use: sends failing together on one relay must
        not step past the next one and back."""
        self.faulted[failed] = time.monotonic()
        if len(self.urls) > 1 and self.url == failed:
            self.current = (self.current + 1) % len(self.urls)
            self.worked, self.refusals = float("-inf"), 0

    def answered(self, url: str, *, probe: bool = False) -> None:
        """`url` answered 200 (its caller may still find it forged: `fail_over`).
        A heartbeat's (`probe`) says the relay works, but does not end a row of
        refusals: the heartbeat loop's 200s come between a node's other
        messages, and a relay that forwarded heartbeats and refused the rest,
        one message between two heartbeats, held the link for good (read-back
        review)."""
        if url == self.url:
            self.worked = time.monotonic()
            if not probe:
                self.refusals = 0

    def refused(self, failed: str, window_s: float) -> None:
        """An unsigned refusal from `failed` (a relay's word, or the peer's
        own: not_ready, queue_full, ...): the next URL, unless that one failed
        or refused within `window_s`, or `failed` answered 200 within it and
        has refused fewer than STAY_REFUSALS times since. Moved on every such
        answer, one honest not_ready through the good relay sent the link back
        to a relay that stalls, and the request waited there until it timed out
        (rv_net2 review); a relay that refuses everything is still left at once,
        one that passes heartbeats but refuses the rest after STAY_REFUSALS."""
        now = time.monotonic()
        following = self.urls[(self.current + 1) % len(self.urls)]
        if failed != self.url or following == failed:
            return
        self.refusals += 1
        if now - self.faulted.get(following, -window_s) < window_s or (
            now - self.worked < window_s and self.refusals < STAY_REFUSALS
        ):
            return
        self.fail_over(failed)


class MessageClient:
    """The sending side: one pooled session, retries, backoff with jitter, breakers.

    Answers are read with the limits requests are read with: at most
    `max_message_bytes` (refused up front from Content-Length, else as soon as
    the streamed body crosses it) and cut off after `read_idle_timeout_s`
    without a byte; such an answer is counted (`on_reject`) and not retried."""

    def __init__(
        self,
        cfg: TransportSection,
        ssl_context: ssl.SSLContext | None,
        *,
        max_message_bytes: int = 512 * 1024 * 1024,
        on_reject: RejectHook | None = None,
        uplink: Uplink | None = None,
    ) -> None:
        self.cfg = cfg
        # requests go out through the node's uplink, shared with its server
        self.uplink = uplink if uplink is not None else uplink_for(cfg)
        self.max_message_bytes = max_message_bytes
        self.on_reject = on_reject
        self.ssl_context = ssl_context
        self.links: dict[str, PeerLink] = {}
        self._session: aiohttp.ClientSession | None = None
        # An outbound-only peer's own pool of connections to its relays: with
        # one pool for all, a request held open at each of 8 peers behind one
        # relay (their models not ready yet) took all 8 connections to that
        # relay, and every other message through it (heartbeats included)
        # waited until it timed out (rv_net review).
        self._relayed: dict[str, aiohttp.ClientSession] = {}
        self._closing: set[asyncio.Task[None]] = set()  # pools of peers gone, closing
        # Per relay URL, the uploads to it in progress (RELAY_UPLOADS at most):
        # with a pool per peer, a heartbeat broadcast to 100 outbound-only
        # peers behind one relay reached it on 100 connections at once, and the
        # relay refused those past its 8 in hand and 32 queued
        # `too_many_connections` (read-back review). Held until the answer, or
        # for a request until its last byte is written: a request held open at
        # its site while the answer waits holds no place (the rv_net review's
        # starvation).
        self._relay_gates: dict[str, asyncio.Semaphore] = {}
        self._rng = random.Random()

    def _url(self, address: str, path: str) -> str:
        host, port = parse_hostport(address)
        host = f"[{host}]" if ":" in host else host
        scheme = "https" if self.ssl_context is not None else "http"
        return f"{scheme}://{host}:{port}{path}"

    def _link(self, name: str, urls: list[str]) -> None:
        link = self.links.get(name)
        if link is None:
            self.links[name] = PeerLink(name, urls)
        else:
            link.set_urls(urls)

    def set_peer(self, name: str, address: str) -> None:
        """A peer reached directly at its HOST:PORT."""
        self._link(name, [self._url(address, MESSAGE_PATH)])
        self._drop_pool(name)  # reached directly now: its relays' pool goes

    def set_relayed_peer(self, name: str, addresses: list[str]) -> None:
        """An outbound-only peer, reached through its relays (HOST:PORT each, in
        the roster's `via` order): a failed attempt moves to the next relay."""
        if not addresses:
            raise ValueError(f"{name}: an outbound-only peer needs at least one relay")
        self._link(name, [self._url(a, RELAY_MESSAGE_PATH) for a in addresses])

    def remove_peer(self, name: str) -> None:
        self.links.pop(name, None)
        self._drop_pool(name)

    def _drop_pool(self, name: str) -> None:
        """Close the pool of a peer no longer reached through relays (a roster
        reload removed it, or gave it an address): kept, each pool of a peer
        gone stayed open with its idle connections for the node's lifetime
        (rv_net2 review)."""
        own = self._relayed.pop(name, None)
        if own is None or own.closed:
            return
        try:
            task = asyncio.get_running_loop().create_task(own.close())
        except RuntimeError:  # no loop running: nothing was ever sent through it
            return
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def _new_session(self) -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(
            limit=64,
            limit_per_host=8,
            ssl=self.ssl_context if self.ssl_context is not None else False,
            keepalive_timeout=CLIENT_KEEPALIVE_S,
        )
        return aiohttp.ClientSession(connector=connector, auto_decompress=False)

    async def session(self, link: PeerLink | None = None) -> aiohttp.ClientSession:
        """The pooled session; a relayed `link`'s own (see `_relayed`)."""
        if link is not None and link.relayed and self.links.get(link.name) is link:
            own = self._relayed.get(link.name)
            if own is None or own.closed:
                own = self._relayed[link.name] = self._new_session()
            return own
        if self._session is None or self._session.closed:
            self._session = self._new_session()
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        for own in list(self._relayed.values()):
            await own.close()
        self._relayed.clear()
        await asyncio.gather(*self._closing)

    def answer_refused(self, peer: str, message: OutgoingMessage | None = None) -> None:
        """The answer to `message` through `peer`'s link was not `peer`'s own
        (its acknowledgement or its frame did not verify): a relayed link tries
        its next relay next, so a relay that forges answers cannot hold the
        link. Only if the relay that carried it is still the one in use
        (`carried_by`): the forged answers to two messages carried together
        moved the link to the next relay and then back to the forger (read-back
        review)."""
        link = self.links.get(peer)
        if link is not None and link.relayed:
            link.fail_over(_carrier(link, message))

    def carrier_suspect(self, peer: str, message: OutgoingMessage | None = None) -> None:
        """The last answer through `peer`'s link, though `peer`'s own signed
        word, says whoever carried the message may have misused it (`id_taken`:
        someone used its id first): a relayed link counts it as a refusal of
        that relay (`PeerLink.refused`). Else a relay that used every id it
        carried first held the link with the peer's own answers (rv_net2)."""
        link = self.links.get(peer)
        if link is not None and link.relayed:
            link.refused(_carrier(link, message), self.cfg.breaker_reset_s)

    def breaker_open(self, peer: str) -> bool:
        link = self.links.get(peer)
        return link is not None and not link.breaker.allow(time.monotonic())

    def heard_from(self, peer: str) -> None:
        """A verified heartbeat from `peer` came in: it is up, so an open breaker
        lets the next request through at once (half-open: its failure count is
        kept, so one more failure opens it again). Before, only this node's own
        heartbeat to the peer closed it: a peer back from a restart counted
        toward a quorum while requests to it were still refused `circuit_open`,
        and a round ran without its model (seen in a CI run)."""
        link = self.links.get(peer)
        if link is not None:
            link.breaker.open_until = 0.0

    async def post(
        self,
        peer: str,
        message: OutgoingMessage,
        *,
        timeout: float | None = None,
        retries: int | None = None,
        probe: bool = False,
        answer_limit: int | None = None,
        held: bool = False,
    ) -> tuple[int, bytes]:
        """POST a frame; returns (status, body) of the final attempt or raises TransportError.

        `probe` (heartbeats): go through even when the breaker is open; a success
        closes it. So heartbeats are the half-open probe and data waits for them.
        `answer_limit`: the most bytes the answer may have (ACK_LIMIT for a push
        or a heartbeat, whose answers are a few bytes of JSON); max_message_bytes
        by default (a request's answer carries a payload). `held` (requests):
        the receiver may hold it open before it answers, so its place among the
        uploads to a relay (RELAY_UPLOADS) is free once its last byte is written."""
        link = self.links.get(peer)
        if link is None:
            raise TransportError(peer, "unknown_peer")
        retries = self.cfg.retries if retries is None else retries
        total = timeout or self.cfg.request_timeout_s
        deadline = time.monotonic() + total
        attempt = 0
        last_reason = "unreachable"
        while True:
            now = time.monotonic()
            if not probe and not link.breaker.allow(now):
                raise TransportError(peer, "circuit_open")
            url = link.url
            try:
                status, body = await self._attempt(
                    link, url, message, max(0.05, deadline - now), answer_limit, held
                )
            except ResponseRefused as exc:
                if self.on_reject is not None:
                    self.on_reject(exc.reason, peer)
                link.breaker.failure(
                    time.monotonic(), self.cfg.breaker_failures, self.cfg.breaker_reset_s
                )
                raise TransportError(peer, exc.reason) from None
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                status, body = 0, b""
                last_reason = "timeout" if isinstance(exc, TimeoutError) else "unreachable"
            if status and status not in RETRYABLE:
                if status != 200 and link.relayed and not signed_refusal(status, body):
                    # Unsigned: maybe the relay's own word, not the peer's. The
                    # next message tries the next relay, so a relay that refuses
                    # everything (403, 404, ...) cannot keep its peer's senders
                    # off its other relays (rv_net review).
                    link.refused(url, self.cfg.breaker_reset_s)
                elif status == 200:
                    link.answered(url, probe=probe)
                link.breaker.success()
                message.carried_by = url
                return status, body
            if status:
                last_reason = _reason_of(body) or f"http_{status}"
            if status == 503 and last_reason == LATER:
                # "Later": from the peer, or from a relay whose own slots for it are
                # full (node/relay.py, node/relay_tunnel.py say it too, unsigned).
                # Not a breaker failure, nor a success that would close an open
                # breaker (a relay answering for a hung peer would keep it
                # closed); the next attempt goes to the next relay, if any, so a
                # congested relay does not hold the link (review 5); and not
                # retried here, the caller knows how long its message may wait.
                link.refused(url, self.cfg.breaker_reset_s)
                raise TransportError(peer, LATER, status)
            if not status or status in FAILOVER:
                link.fail_over(url)
            elif link.relayed:  # (429: maybe the relay's own)
                link.refused(url, self.cfg.breaker_reset_s)
            link.breaker.failure(
                time.monotonic(), self.cfg.breaker_failures, self.cfg.breaker_reset_s
            )
            attempt += 1
            if attempt > retries or time.monotonic() >= deadline:
                raise TransportError(peer, last_reason, status or None)
            # Exponential backoff with full jitter, bounded by the deadline.
            cap = min(self.cfg.backoff_max_s, self.cfg.backoff_base_s * (2 ** (attempt - 1)))
            await asyncio.sleep(
                min(self._rng.uniform(0, cap), max(0.0, deadline - time.monotonic()))
            )

    async def _attempt(
        self,
        link: PeerLink,
        url: str,
        message: OutgoingMessage,
        timeout: float,
        limit: int | None,
        held: bool = False,
    ) -> tuple[int, bytes]:
        if link.blocked:
            await asyncio.sleep(min(timeout, 0.05))
            raise aiohttp.ClientConnectionError("blocked by fault injection")
        session = await self.session(link)
        gate = self._relay_gate(url) if link.relayed else None
        if gate is not None:
            began = time.monotonic()
            await asyncio.wait_for(gate.acquire(), timeout)  # TimeoutError: as a slow relay
            timeout = max(0.05, timeout - (time.monotonic() - began))
        released = False

        def release() -> None:
            nonlocal released
            if gate is not None and not released:
                released = True
                gate.release()

        try:
            client_timeout = aiohttp.ClientTimeout(
                total=timeout, sock_connect=min(timeout, self.cfg.connect_timeout_s)
            )
            # A request's place (`held`) is free once its last byte is written
            # (its site may hold it open for long); anything else's once answered.
            payload = ChunksPayload(message.chunks, self.uplink, sent=release if held else None)
            async with session.post(url, data=payload, timeout=client_timeout) as resp:
                release()
                if resp.status == 200:
                    return resp.status, await self._read_body(resp, limit)
                try:  # a refusal: its status is the answer, its body a few bytes of reason
                    return resp.status, await self._read_body(resp, ERROR_BODY_LIMIT)
                except ResponseRefused as exc:
                    if self.on_reject is not None:
                        self.on_reject(exc.reason, link.name)
                    return resp.status, b""
        finally:
            release()

    def _relay_gate(self, url: str) -> asyncio.Semaphore:
        """The uploads to relay `url` in progress (RELAY_UPLOADS at most)."""
        gate = self._relay_gates.get(url)
        if gate is None:
            gate = self._relay_gates[url] = asyncio.Semaphore(RELAY_UPLOADS)
        return gate

    async def _read_body(self, resp: aiohttp.ClientResponse, limit: int | None) -> bytes:
        limit = self.max_message_bytes if limit is None else min(limit, self.max_message_bytes)
        if resp.content_length is not None and resp.content_length > limit:
            resp.close()
            raise ResponseRefused("oversize")
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                chunk = await asyncio.wait_for(resp.content.readany(), self.cfg.read_idle_timeout_s)
            except TimeoutError:
                resp.close()
                raise ResponseRefused("truncated") from None
            if not chunk:
                return b"".join(chunks)
            size += len(chunk)
            if size > limit:
                resp.close()  # drop the connection: not a byte more is read
                raise ResponseRefused("oversize")
            chunks.append(chunk)


def _reason_of(body: bytes) -> str | None:
    """The `reason` string of a refusal's JSON body, as one short printable
    line; None for anything else. A peer (or a relay, or anyone on a link
    without TLS) writes this body: b"[" * 60000 raised RecursionError out of
    json.loads and failed the protocol, a reason that was a 64 MiB list was
    logged whole, and one with newlines forged lines of node.log."""
    if len(body) > ERROR_BODY_LIMIT:
        return None
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):  # (UnicodeDecodeError is a ValueError)
        return None
    reason = obj.get("reason") if isinstance(obj, dict) else None
    return one_line(reason, MAX_REASON_CHARS) if isinstance(reason, str) and reason else None


def _carrier(link: PeerLink, message: OutgoingMessage | None) -> str:
    """The URL that carried `message`'s last answer (the one in use if unknown)."""
    return (message.carried_by if message is not None else None) or link.url


def signed_refusal(status: int, body: bytes) -> bool:
    """A 409 whose reason the receiver signs (`replayed`, `id_taken`): its
    caller verifies the signature (node/outbound.py) and moves the link on if
    it does not verify (`answer_refused`). Failed over at once, an honest one
    from the good relay sent the link back to the relay that had stolen the
    id, which stole the next one too (rv_net2 review)."""
    return status == 409 and _reason_of(body) in SIGNED_REFUSALS


def reason_of_response(status: int, body: bytes) -> str:
    return _reason_of(body) or f"http_{status}"
