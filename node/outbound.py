"""What a node sends to its peers for the protocol: pushes and requests.

A push is written to the outbox before its first attempt and removed once the
peer acknowledged it; pushes a crash interrupted go out again after the restart
with their original message id, so the receiver's dedupe still applies.

A request is a long poll: `req:<kind>` carries the query and how long the peer
may hold it open; the peer answers `resp:<kind>` once its handler has
something, or "not_ready" at the end of the wait, and the request is asked
again (a fresh message each time) until its timeout.

A receiver that restarted refuses messages stamped at or before its replay
mark for this node (`before_restart`, 425; p2pfl/secure/wire.py): they may be
replays of what it accepted before. That refusal is never taken as delivered
(only 200, or 409 `replayed` for an id the receiver holds, is): a push is
encoded again with a fresh timestamp and its same id and sent again until its
deadline, a request is asked again, and an answer to our own request refused
for that reason after our restart is asked for again.

A 409 `in_progress` is not delivered either: the receiver is still reading or
handling a copy with that id (our own copy on a connection that broke, or one
an observer re-sent from the captured header). The push is sent again with
backoff until its deadline; a copy that never completes is given up by the
receiver (cut off, or `digest_mismatch`), and then ours is taken. So a push is
counted delivered only once the receiver acted on its id (issue 28, red-team
review: an observer could otherwise make a push vanish).

A 503 `queue_full` (the receiver's inbox for that kind is full, or this node
holds its share of it: node/inbound.py `sender_share`) is sent again the same
way, with backoff and the same id, until the push's deadline: the receiver
took nothing and says "later". Before, the entry was deleted after the
client's own 4 retries (about 3 s), each of which counted toward the peer's
circuit breaker, so one refused push opened it (review 4, R2); the client now
hands the refusal back at once, uncounted (node/transport_client.py).

A push counts as delivered only with the receiver's signed acknowledgement of
its id (p2pfl/secure/wire.py `sign_ack`): an answer 200 without one, from a
relay or anyone on the path, is refused `ack_unverified` and counted.

Heartbeats are the membership's (node/membership.py) and not counted here.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
import random
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from node.peers import PeerTable
from node.queues import Outbox, OutboxEntry, ReplayMarks
from node.telemetry import Telemetry
from node.telemetry_records import TrafficCounter
from node.transport import OFF_LOOP_BYTES
from node.transport_client import (
    ACK_LIMIT,
    MessageClient,
    TransportError,
    reason_of_response,
    signed_refusal,
)
from p2pfl.config import SiteConfig
from p2pfl.secure.wire import Delivered, OutgoingMessage, WireCodec, WireError
from protocols.base import PeerUnavailable

log = logging.getLogger(__name__)

REQUEST_PREFIX = "req:"
RESPONSE_PREFIX = "resp:"
# The key of an answer (a map) naming the id of the request it answers, as
# nodes of one interim version sent it: checked and removed if present. A key
# in the payload broke older requesters, whose strict schemas (secagg's
# extra="forbid") refused every such answer (rv_net2 review): the answer's own
# id names its request now (`answer_id`).
ANSWERS = "_answers"
ANSWER_CONTEXT = b"p2pfl-answer/v1\n"
# Ids of the answers to this node's recent requests, remembered (`Outbound._asked`).
ASKED_REMEMBERED = 16384


def answer_id(codec: WireCodec, peer: str, request_id: bytes) -> bytes:
    """The id the answer to request `request_id` carries, between this node
    and `peer` (either side): keyed with their pair's secret, so a relay that
    reads the request's id cannot take the answer's id first (`id_taken`), and
    older requesters, which take any id, still read the answer unchanged."""
    mac = hmac.new(codec.shared_secret(peer), ANSWER_CONTEXT + request_id, hashlib.sha256)
    return mac.digest()[:16]


# Answers after which a request is asked again (until its timeout) rather than given up.
ASK_AGAIN = (
    "not_ready",
    "no_handler",
    "rate_limited",
    "queue_full",
    "before_restart",
    "below_replay_floor",
    "in_progress",
    "too_many_uploads",
    "id_taken",  # (signed, or not: a fresh request each time anyway)
    # a copy was taken first (a relay that sent it twice kept the first answer):
    # asked again, a fresh request, as for `id_taken` (final review)
    "replayed",
)
# The peer restarted since this message's timestamp, or its replay cache's floor
# is above it: encode it again with a fresh timestamp, it was not taken.
SEND_AGAIN = frozenset({"before_restart", "below_replay_floor"})
# The peer holds another sender's frame under this push's id (a relay saw the
# id in the clear header and had it used first): the push was not taken under
# it, so it goes again under a fresh id (rv_net2 review).
ID_TAKEN = "id_taken"
SEND_AGAIN_PAUSE_S = 0.25
# A copy of this id is still arriving or being handled at the peer: not delivered
# (yet), send it again with backoff.
IN_PROGRESS = "in_progress"
# The peer's inbox for the kind, or this node's share of it, is full (503, after
# the client's own retries): not taken, send it again with backoff (same id).
QUEUE_FULL = "queue_full"


def ack_of(body: bytes) -> Any:
    """The `ack` signature of an acknowledgement's JSON body, or None. The body
    is whoever answered's (a relay, anyone on the path): b"[" * 60000, within
    ACK_LIMIT, raised RecursionError out of json.loads and failed the push."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):  # (UnicodeDecodeError is a ValueError)
        return None
    ack = obj.get("ack") if isinstance(obj, dict) else None
    return ack if isinstance(ack, str) else None


def acknowledged(
    codec: WireCodec,
    client: MessageClient,
    peer: str,
    message: OutgoingMessage,
    outcome: str,
    body: bytes,
) -> bool:
    """Whether `body` carries `peer`'s signed acknowledgement of `message` with
    `outcome`. If not, the answer is not the peer's word (a relay's, or anyone's
    on the path): the next attempt to `peer` goes through its next relay
    (`MessageClient.answer_refused`), so a relay forging or refusing answers
    cannot hold the link on itself (rv_net, rv_net2)."""
    if codec.verify_ack(peer, message.header.msg_id, outcome, ack_of(body)):
        return True
    client.answer_refused(peer, message)
    return False


@dataclass(kw_only=True, eq=False)
class Outbound:
    """Pushes (through the outbox) and requests, and the protocol traffic they make."""

    name: str
    cfg: SiteConfig
    codec: WireCodec
    client: MessageClient
    outbox: Outbox
    peers: PeerTable
    telemetry: Telemetry
    marks: ReplayMarks
    current_round: Callable[[], int]
    sent: TrafficCounter = field(default_factory=TrafficCounter)  # since start, no heartbeats
    # the answer ids (`answer_id`) of recent requests: one of them on another
    # request's answer is a withheld answer handed on, refused
    _asked: OrderedDict[bytes, None] = field(default_factory=OrderedDict, init=False)

    def count_sent(self, peer: str, kind: str, nbytes: int) -> None:
        """A protocol message (push, request or response) went out."""
        self.telemetry.record_sent(peer, kind, nbytes)
        self.sent.add(nbytes)

    # ------------------------------------------------------------------ pushes
    async def send_push(self, peer: str, kind: str, payload: Any, round_no: int) -> None:
        if peer not in self.client.links:
            raise PeerUnavailable(peer, "not in roster")
        entry = OutboxEntry(os.urandom(16), peer, kind, round_no, payload, time.time())
        await asyncio.to_thread(self.outbox.add, entry)
        try:
            await self._deliver(entry)
        finally:
            self.outbox.done(entry.file)

    async def _deliver(self, entry: OutboxEntry, *, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (timeout or self.cfg.transport.request_timeout_s)
        busy = 0  # answers `in_progress` or `queue_full` so far
        while True:
            # A fresh timestamp on every encoding, the same id: see the module docstring.
            message = self.codec.encode(
                entry.kind,
                entry.peer,
                entry.payload,
                round=entry.round,
                encrypt=self.cfg.wire.encryption,
                msg_id=entry.msg_id,
            )
            remaining = deadline - time.monotonic()
            try:
                status, body = await self.client.post(
                    entry.peer, message, timeout=max(0.05, remaining), answer_limit=ACK_LIMIT
                )
                reason = reason_of_response(status, body)
            except TransportError as exc:
                if exc.reason != QUEUE_FULL:
                    raise PeerUnavailable(entry.peer, exc.reason) from None
                status, body, reason = exc.status or 503, b"", exc.reason
            if status == 200 or (status == 409 and reason == "replayed"):
                outcome = "ok" if status == 200 else "replayed"
                if not acknowledged(self.codec, self.client, entry.peer, message, outcome, body):
                    # Not the receiver's signed word: whoever answered (a relay, or
                    # someone on the path) may have dropped the push. Not delivered.
                    log.warning(
                        "%s: %s %s to %s: an answer %d without %s's valid signed "
                        "acknowledgement; not counted as delivered",
                        self.name,
                        entry.kind,
                        entry.msg_id.hex(),
                        entry.peer,
                        status,
                        entry.peer,
                    )
                    self.telemetry.record_rejection("ack_unverified", entry.peer)
                    raise PeerUnavailable(entry.peer, "ack_unverified")
                self.count_sent(entry.peer, entry.kind, message.nbytes)
                log.info(
                    "%s: %s %s delivered to %s (round %d)",
                    self.name,
                    entry.kind,
                    entry.msg_id.hex(),
                    entry.peer,
                    entry.round,
                )
                return
            if reason in (IN_PROGRESS, QUEUE_FULL):
                busy += 1
                t = self.cfg.transport
                pause = SEND_AGAIN_PAUSE_S + random.uniform(
                    0, min(t.backoff_max_s, t.backoff_base_s * 2 ** (busy - 1))
                )
            elif reason in SEND_AGAIN:
                pause = SEND_AGAIN_PAUSE_S
            elif reason == ID_TAKEN:
                if not acknowledged(self.codec, self.client, entry.peer, message, reason, body):
                    # unsigned: maybe a relay's, which may have forwarded it
                    self.telemetry.record_rejection("ack_unverified", entry.peer)
                    raise PeerUnavailable(entry.peer, "ack_unverified")
                self.client.carrier_suspect(entry.peer, message)  # the relay saw the id
                pause = SEND_AGAIN_PAUSE_S
                await asyncio.to_thread(self.outbox.rekey, entry, os.urandom(16))
            else:
                raise PeerUnavailable(entry.peer, reason)
            if deadline - time.monotonic() <= pause:
                raise PeerUnavailable(entry.peer, reason)
            log.info(
                "%s: %s %s refused by %s %s; sending it again",
                self.name,
                entry.kind,
                entry.msg_id.hex(),
                entry.peer,
                "as a copy of it is in progress"
                if reason == IN_PROGRESS
                else "as its inbox (or this node's share of it) is full"
                if reason == QUEUE_FULL
                else "as another sender used its id first (a fresh id now)"
                if reason == ID_TAKEN
                else "as stamped before its restart"
                if reason == "before_restart"
                else "as stamped at or below its replay floor",
            )
            await asyncio.sleep(pause)

    async def resend_outbox(self) -> None:
        """Pushes interrupted by a crash go out again with their original id, once
        their peer is back, for up to transport.outbox_ttl_s after they were made."""
        for entry in self.outbox.pending():
            while True:
                if (
                    time.time() - entry.created > self.cfg.transport.outbox_ttl_s
                    or entry.peer not in self.client.links
                ):
                    log.warning(
                        "%s: dropping %s to %s from the outbox (peer gone or TTL passed)",
                        self.name,
                        entry.kind,
                        entry.peer,
                    )
                    break
                if any(p.name == entry.peer for p in self.peers.peers()):
                    try:
                        await self._deliver(entry)
                        log.info(
                            "%s: re-sent %s to %s after restart", self.name, entry.kind, entry.peer
                        )
                        break
                    except PeerUnavailable as exc:
                        log.info(
                            "%s: outbox %s to %s not delivered yet (%s)",
                            self.name,
                            entry.kind,
                            entry.peer,
                            exc.reason,
                        )
                await asyncio.sleep(self.cfg.transport.heartbeat_s)
            self.outbox.done(entry.file)

    # ------------------------------------------------------------------ requests
    async def request(self, peer: str, kind: str, query: dict[str, Any], timeout: float) -> Any:
        if peer not in self.client.links:
            raise PeerUnavailable(peer, "not in roster")
        deadline = time.monotonic() + timeout
        reason = "timeout"
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0.05:
                raise PeerUnavailable(peer, reason)
            if peer not in self.client.links:  # a roster reload removed it meanwhile
                raise PeerUnavailable(peer, "not in roster")  # (encode, answer_id: WireError)
            # A fresh message per attempt: a retried request must not look like a replay.
            message = self.codec.encode(
                REQUEST_PREFIX + kind,
                peer,
                {**query, "_wait_s": max(0.0, remaining * 0.8 - 0.2)},
                round=self.current_round(),
                encrypt=self.cfg.wire.encryption,
            )
            self._asked[answer_id(self.codec, peer, message.header.msg_id)] = None
            while len(self._asked) > ASKED_REMEMBERED:
                self._asked.popitem(last=False)
            try:
                status, body = await self.client.post(
                    peer, message, timeout=remaining, retries=0, held=True
                )
            except TransportError as exc:
                reason = exc.reason
                if exc.reason == "circuit_open":
                    raise PeerUnavailable(peer, reason) from None
                await asyncio.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
                continue
            self.count_sent(peer, REQUEST_PREFIX + kind, message.nbytes)
            if status == 200:
                try:
                    return await self._open_response(peer, kind, body, message)
                except WireError as exc:
                    if exc.reason not in SEND_AGAIN:
                        raise PeerUnavailable(peer, f"bad response: {exc.reason}") from None
                    reason = exc.reason  # our restart floor: ask again for a fresh answer
                    await asyncio.sleep(
                        min(SEND_AGAIN_PAUSE_S, max(0.0, deadline - time.monotonic()))
                    )
                    continue
            reason = reason_of_response(status, body)
            # a signed refusal that is not the peer's word sends the next attempt to its
            # next relay (`acknowledged`); the peer's id_taken says the relay saw the
            # id (`_deliver`), its replayed that the relay sent a copy first: never
            # this node, which sends a request once (retries=0)
            if (
                signed_refusal(status, body)
                and acknowledged(self.codec, self.client, peer, message, reason, body)
                and reason in (ID_TAKEN, "replayed")
            ):
                self.client.carrier_suspect(peer, message)
            if reason not in ASK_AGAIN:
                raise PeerUnavailable(peer, reason)
            if reason in SEND_AGAIN or reason == "replayed":  # at once: pause, not a busy loop
                await asyncio.sleep(min(SEND_AGAIN_PAUSE_S, max(0.0, deadline - time.monotonic())))

    async def _open_response(
        self, peer: str, kind: str, body: bytes, request: OutgoingMessage
    ) -> Any:
        """Verify and open the answer to our `request`; WireError (counted)
        if refused. An answer names its request's round (node/inbound.py echoes
        it) and, in its own id, its request (`answer_id`): an answer that
        carries the answer id of another of our requests is refused, so a relay
        that withheld an answer cannot hand it to a later request (rv_net
        review). An answer with any other id (an older node's) is taken.

        The header is verified on the loop (it reserves the id); a payload of
        OFF_LOOP_BYTES or more is opened in a worker thread, as inbound ones
        are: a 61 MiB answer decoded on the loop stalled it 4 s, a 244 MiB one
        past transport.dead_after_s (wire review, finding 4)."""
        asked = request.header
        try:
            header, payload = self.codec.verify_frame(bytearray(body))
            try:
                if len(payload) >= OFF_LOOP_BYTES:
                    obj = await asyncio.to_thread(
                        self.codec.open_payload, header, payload, require_finite=True
                    )
                else:
                    obj = self.codec.open_payload(header, payload, require_finite=True)
            except WireError as exc:
                if exc.reason == "digest_mismatch":  # as WireCodec.decode does
                    self.codec.release(header)
                raise
            delivered = Delivered(header, obj, len(body))
        except WireError as exc:
            self.telemetry.record_rejection(exc.reason, peer)
            if exc.reason not in SEND_AGAIN:
                # a relay's forgery, perhaps: its next relay next. Not for one
                # refused for this node's own replay state (its signature
                # verified first): asked again through the same relay, as before
                # a read-back review moved it, on restarts, to a stalling relay.
                self.client.answer_refused(peer, request)
            raise
        answers = obj.pop(ANSWERS, asked.id_hex) if isinstance(obj, dict) else asked.id_hex
        own = delivered.header.msg_id
        if (
            delivered.header.sender != peer
            or delivered.header.kind != RESPONSE_PREFIX + kind
            or delivered.header.round != asked.round
            or answers != asked.id_hex
            or (own in self._asked and own != answer_id(self.codec, peer, asked.msg_id))
        ):
            self.telemetry.record_rejection("payload_schema", peer)
            self.client.answer_refused(peer, request)
            raise PeerUnavailable(peer, "response does not match the request")
        try:
            await self.marks.cover(peer, delivered.header.timestamp_ms)
        except OSError as exc:
            log.error("%s: cannot write the replay marks: %s", self.name, exc)
            self.telemetry.record_rejection("storage_error", peer)
            raise PeerUnavailable(peer, "storage_error") from None
        self.telemetry.record_received(peer, delivered.header.kind, delivered.nbytes)
        return delivered.payload
