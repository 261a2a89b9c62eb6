"""What arrives at a node's message endpoint, after the transport verified it.

- heartbeats go to the membership (node/membership.py);
- a request `req:<kind>` is held open (up to the wait the requester asked for,
  capped at transport.request_timeout_s) until the protocol's handler for
  `kind` has an answer, which goes back as `resp:<kind>`;
- a push is spooled to disk, then queued in its kind's inbox, and only then
  acknowledged. Each checkpoint carries the ids of the pushes the protocol
  consumed; then they are journaled and their spool files dropped; after a
  restart the spooled pushes neither checkpointed nor journaled are queued
  again if their signed header still passes against the roster of that start
  (see node/queues.py for the whole scheme); a roster reload drops the queued
  pushes of the sites it removed, and a push of such a site still arriving at
  the reload is refused `unknown_sender` once spooled, before it is queued or
  acknowledged.

Before any of that, the sender's replay mark is on disk at or above the
message's timestamp (node/queues.py `ReplayMarks`), so a message this node
acted on is refused if it comes again after a restart; a node that cannot
write the marks refuses the message (`storage_error`, retried by the sender)
rather than accept it unguarded.

Bounds against a hostile peer (issue 28):
- only the message kinds this node's protocol declares (`Protocol.message_kinds`,
  registered by the daemon at start with `accept_kinds`), the kinds it serves or
  reads, and heartbeats are accepted; any other kind is refused `unknown_kind`
  before it is spooled, queued or counted per kind;
- a push only of a kind the protocol reads from an inbox (`Protocol.pushed_kinds`,
  the `pushes` of `accept_kinds`, or an inbox it made); a push of a kind it only
  serves ("model" to FedAVGP2P) is refused `push_not_accepted` before it is
  opened or spooled: nothing would ever read, checkpoint or delete it. A restart
  deletes (and counts) spooled pushes of kinds no longer taken as pushes;
- one sender holds at most its share of a kind's inbox (`sender_share`),
  queued or being spooled; past it its pushes are refused `queue_full`;
- a restart queues at most `inbox_size` spooled pushes of a kind, and at most
  a sender's share of them, the newest; the older ones are deleted (logged,
  counted `queue_full`) rather than the node failing to start on a full queue;
- the numbers a request or heartbeat carries for the node itself (`_wait_s`,
  `round`) pass a pydantic schema with finite bounds, else `payload_schema`;
- a peer may have `transport.max_held_per_peer` requests held open at once;
  one more is refused `too_many_held` (the upload reservation is not held
  while they wait: node/transport.py);
- a heartbeat larger than an honest one can be (node/membership.py
  `heartbeat_limit`: 1 MiB + 1 KiB a roster site + 80 bytes a `selection.n`)
  is refused `heartbeat_oversize` from its signed header, before a byte of its
  payload is read (`check_header`, called by node/transport.py); before, only
  wire.max_message_bytes (512 MiB) bounded it;
- payloads of `OFF_LOOP_BYTES` (16 KiB, node/transport.py) or more are opened
  (decrypted, decoded, checked finite) in a worker thread, not on the event
  loop: heartbeats and requests too.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from node.control import HeartbeatControl, RequestControl, validated
from node.faults import FaultPlan
from node.membership import HEARTBEAT, Membership, heartbeat_limit
from node.outbound import REQUEST_PREFIX, RESPONSE_PREFIX, answer_id
from node.queues import Inboxes, Journal, ReplayMarks, Reservation, Spool, unlink_all
from node.telemetry import Telemetry
from node.transport import OFF_LOOP_BYTES, IncomingFrame, Rejection
from p2pfl.config import SiteConfig
from p2pfl.secure.wire import PREFIX_LEN, SIG_LEN, Header, WireCodec, WireError
from p2pfl.text import shown
from protocols.base import Handler, NotReady, Offers, Received

log = logging.getLogger(__name__)

SENDER_SHARE_MIN = 8  # pushes of one kind one sender may hold (half a smaller inbox)

BUILTIN_KINDS = frozenset({HEARTBEAT})


def _mtime(path: Path) -> float:
    """When a spool file was written (infinity if it cannot be read)."""
    try:
        return float(path.stat().st_mtime)
    except OSError:
        return float("inf")


@dataclass(kw_only=True, eq=False)
class Inbound:
    """Answers verified frames; owns the protocol's request handlers and the spool's bookkeeping."""

    name: str
    cfg: SiteConfig
    codec: WireCodec
    spool: Spool
    journal: Journal
    inboxes: Inboxes
    telemetry: Telemetry
    membership: Membership
    faults: FaultPlan
    marks: ReplayMarks
    count_sent: Callable[[str, str, int], None]
    stopping: asyncio.Event
    # set when this node's protocol failed: a request for what it has not made
    # is refused at once ("peer_failed") instead of held open until its timeout
    gone: asyncio.Event = field(default_factory=asyncio.Event)
    handlers: dict[str, Handler] = field(default_factory=dict)
    offers: Offers = field(default_factory=Offers)  # wakes requests held open on a kind
    # message id -> header timestamp, for the journal
    _spool_ts: dict[str, int] = field(default_factory=dict, init=False)
    _kinds: set[str] = field(default_factory=set, init=False)  # accept_kinds
    _pushes: set[str] = field(default_factory=set, init=False)  # accept_kinds(pushes=)
    _held: dict[str, int] = field(default_factory=dict, init=False)  # sender -> requests held
    _keeping: set[str] = field(default_factory=set, init=False)  # pushes being spooled

    def serve(self, kind: str, handler: Handler) -> None:
        self.handlers[kind] = handler
        self.offers.offered(kind)

    def accept_kinds(
        self, kinds: set[str] | frozenset[str], pushes: set[str] | frozenset[str] = frozenset()
    ) -> None:
        """Register the kinds the protocol pushes and serves (before any arrives),
        and among them `pushes`, those it reads from an inbox: only those are
        taken as pushes (the others are requested and served)."""
        self._kinds.update(kinds)
        self._kinds.update(pushes)
        self._pushes.update(pushes)

    def accepts_push(self, kind: str) -> bool:
        """A kind the protocol reads pushes of: registered as pushed, or an
        inbox the protocol made (ctx.inbox)."""
        return kind in self._pushes or kind in self.inboxes.queues

    def known_kind(self, kind: str) -> bool:
        """Heartbeats, registered kinds, kinds with a handler or an inbox the protocol made."""
        if kind in BUILTIN_KINDS:
            return True
        if kind.startswith(REQUEST_PREFIX):
            kind = kind[len(REQUEST_PREFIX) :]
            return kind in self._kinds or kind in self.handlers
        return kind in self._kinds or kind in self.inboxes.queues

    def heartbeat_limit(self) -> int:
        """The largest heartbeat payload taken (node/membership.py `heartbeat_limit`)."""
        return heartbeat_limit(len(self.codec.roster.names()), self.cfg.selection.n)

    def check_header(self, header: Header) -> None:
        """What a verified header alone refuses, before its payload is read
        (node/transport.py calls it, and `on_frame` again): a heartbeat larger
        than an honest one can be (`heartbeat_oversize`)."""
        if header.kind == HEARTBEAT and header.payload_len > (limit := self.heartbeat_limit()):
            raise Rejection(
                "heartbeat_oversize", f"{header.payload_len} bytes, at most {limit} taken"
            )

    def on_reject(self, reason: str, sender: str | None) -> None:
        self.telemetry.record_rejection(reason, sender)
        # `sender` is the name a refused header claims, unverified: shown()
        log.debug("%s: rejected a message from %s: %s", self.name, shown(sender), reason)

    async def on_frame(self, incoming: IncomingFrame) -> tuple[int, Any]:
        header = incoming.header
        kind = header.kind
        if not self.known_kind(kind):
            raise Rejection("unknown_kind", kind[:64])
        if (
            kind != HEARTBEAT
            and not kind.startswith(REQUEST_PREFIX)
            and not self.accepts_push(kind)
        ):
            raise Rejection("push_not_accepted", f"{kind[:64]} is requested, not pushed")
        self.check_header(header)
        try:
            await self.marks.cover(header.sender, header.timestamp_ms)
        except OSError as exc:
            log.error("%s: cannot write the replay marks: %s", self.name, exc)
            raise Rejection("storage_error", "replay marks not persisted") from None
        if kind == HEARTBEAT:
            beat = await self._open(incoming)
            if isinstance(beat, dict):
                validated(HeartbeatControl, beat)
            self.membership.heard(header.sender, beat)
            return 200, None
        if self.faults.latency_s:
            await asyncio.sleep(self.faults.latency_s)  # drill: a slow peer
        if kind.startswith(REQUEST_PREFIX):
            return await self._on_request(incoming)
        return await self._on_push(incoming)

    async def _open(self, incoming: IncomingFrame) -> Any:
        args = (incoming.header, incoming.payload)
        kw = {"digest": incoming.digest, "require_finite": True}
        if len(incoming.payload) >= OFF_LOOP_BYTES:
            payload = await asyncio.to_thread(self.codec.open_payload, *args, **kw)
        else:
            payload = self.codec.open_payload(*args, **kw)
        self.telemetry.record_received(
            incoming.header.sender, incoming.header.kind, len(incoming.frame)
        )
        return payload

    # ------------------------------------------------------------------ requests
    async def _on_request(self, incoming: IncomingFrame) -> tuple[int, Any]:
        header = incoming.header
        query = await self._open(incoming)
        if not isinstance(query, dict):
            raise WireError("payload_schema", "request query must be a map")
        control = validated(RequestControl, query)
        query.pop("_wait_s", None)
        kind = header.kind[len(REQUEST_PREFIX) :]
        if self.faults.active:
            # drill: crash on a request before answering it (e.g. "asked:secagg:mask")
            self.faults.on_progress(header.round, self._step("asked", kind, query), own=False)
        deadline = time.monotonic() + min(control.wait_s, self.cfg.transport.request_timeout_s)
        payload = await self._answer(header.sender, kind, query, deadline)
        encrypt = self.cfg.wire.encryption
        if self.faults.active:
            poisoned = self.faults.poisoned_reply(
                self.codec, header, kind, RESPONSE_PREFIX + kind, payload, encrypt=encrypt
            )
            if poisoned is not None:
                return 200, poisoned
        reply = self.codec.encode(
            RESPONSE_PREFIX + kind,
            header.sender,
            payload,
            round=header.round,
            encrypt=encrypt,
            msg_id=answer_id(self.codec, header.sender, header.msg_id),  # names the request
        )
        self.count_sent(header.sender, RESPONSE_PREFIX + kind, reply.nbytes)
        if self.faults.active:
            self.faults.remember_reply(header.sender, reply.chunks)
            # drill: crash right after answering (e.g. "answered:secagg:share")
            self.faults.on_progress(header.round, self._step("answered", kind, query), own=False)
        return 200, reply.chunks

    async def _answer(self, sender: str, kind: str, query: dict[str, Any], deadline: float) -> Any:
        """The handler's answer, asked again whenever the protocol offers something
        new (at the latest every 0.1 s) until `deadline`. While it waits the
        request counts against its sender's cap of held requests."""
        held = False
        try:
            while True:
                changed = self.offers.watch(kind)
                handler = self.handlers.get(kind)
                if handler is not None:
                    try:
                        return await handler(sender, query)
                    except NotReady:
                        pass
                    except Exception as exc:  # noqa: BLE001 - the protocol's handler failing is answered, not fatal
                        log.warning(
                            "%s: %s handler failed for %s: %r", self.name, kind, sender, exc
                        )
                        raise Rejection("handler_error", type(exc).__name__) from None
                if self.gone.is_set():
                    raise Rejection("peer_failed", kind)
                if time.monotonic() >= deadline or self.stopping.is_set():
                    raise Rejection("not_ready" if handler is not None else "no_handler", kind)
                if not held:
                    if self._held.get(sender, 0) >= self.cfg.transport.max_held_per_peer:
                        raise Rejection("too_many_held", f"{sender} has requests held already")
                    self._held[sender] = self._held.get(sender, 0) + 1
                    held = True
                await self.offers.wait(changed, min(0.1, deadline - time.monotonic()))
        finally:
            if held:
                left = self._held[sender] - 1
                if left:
                    self._held[sender] = left
                else:
                    del self._held[sender]

    @staticmethod
    def _step(event: str, kind: str, query: dict[str, Any]) -> str:
        """The fault plan's name for a request event: EVENT:KIND[:the query's phase]."""
        step = query.get("phase")
        return f"{event}:{kind}" + (f":{step}" if isinstance(step, str) else "")

    # ------------------------------------------------------------------ pushes
    def sender_share(self, *, at_most_half: bool = True) -> int:
        """How many pushes of one kind one sender may hold in its inbox (queued,
        or being spooled, even after their sender hung up): an equal share of
        `transport.inbox_size` among the other roster members, at least
        SENDER_SHARE_MIN and, for a live push, at most half the inbox; `recover` keeps at most as many of a sender's spooled
        pushes at a restart. Past it the push is refused `queue_full` (503,
        which the sender's outbox sends again with backoff until the push's
        deadline, node/outbound.py): one member that floods a kind the protocol
        reads slowly (FedER reads relays between trainings) no longer fills the
        inbox its honest peers need."""
        others = max(1, len(self.codec.roster.names()) - 1)
        size = self.inboxes.maxsize
        share = max(SENDER_SHARE_MIN, size // others)
        # live, never more than half the inbox, so no one sender fills a small
        # one; at a restart (`recover`) not: what is spooled was acknowledged
        return min(share, max(1, size // 2)) if at_most_half else share

    async def _on_push(self, incoming: IncomingFrame) -> tuple[int, Any]:
        header = incoming.header
        msg_id = header.id_hex
        if msg_id in self._keeping:
            raise Rejection("in_progress", "a copy of it is being spooled")
        if self.spool.has(msg_id) or msg_id in self.journal:
            # (the spool's sender too: once the replay cache dropped a spooled
            # id, another sender's push under it was answered 200 and counted
            # delivered unprocessed: final review)
            held_by = self.journal.sender(msg_id) or self.spool.sender(msg_id)
            if held_by not in ("", header.sender):
                raise Rejection("id_taken", "another sender's push had that id")
            return 200, None  # a retry of something we already hold (after a restart)
        queue = self.inboxes.get(header.kind)
        share = self.sender_share()
        if not queue.has_room(header.sender, share):
            detail = (
                f"{header.kind}: {header.sender[:64]!r} holds its share ({share})"
                if queue.has_room()
                else header.kind
            )
            raise Rejection("queue_full", detail)
        slot = queue.reserve(header.sender)
        keep: asyncio.Future[None] | None = None
        try:
            payload = await self._open(incoming)
            # Spooled and queued together, even if the sender hangs up meanwhile:
            # a push on disk but not in its queue would answer the retry 200 and
            # never reach the protocol (found by the second red-team pass).
            self._keeping.add(msg_id)
            keep = asyncio.ensure_future(self._keep(incoming, payload, queue, slot))
            keep.add_done_callback(lambda done: self._kept(msg_id, slot, done))
            await asyncio.shield(keep)
        finally:
            # Once _keep runs, the place is its to give back (when it queues the
            # push, or fails): a hang-up here cancels this handler only, and the
            # place given back now counted nowhere while the push was still being
            # written, so a sender that hung up on each push held more than its
            # share, and an honest push admitted meanwhile found the queue full
            # after it was spooled (review 4, R1).
            if keep is None:
                slot.release()
        log.debug(
            "%s: spooled and acknowledged %s %s from %s",
            self.name,
            header.kind,
            msg_id,
            header.sender,
        )
        if self.faults.active:
            self.faults.on_progress(header.round, "acked", own=False)  # drill: crash after an ack
        return 200, None

    async def _keep(
        self, incoming: IncomingFrame, payload: Any, queue: Any, slot: Reservation
    ) -> None:
        """Spool the push, then queue it in place of its reservation `slot`; a
        push that cannot be queued is removed from the spool and refused, never
        acknowledged nor left there to answer a resend 200."""
        header = incoming.header
        msg_id = header.id_hex
        try:
            await asyncio.to_thread(self.spool.persist, msg_id, incoming.frame)
            self.spool.sent_by(msg_id, header.sender)  # (in `_keeping` until then)
            # The transport checked the sender against the roster before the payload
            # streamed in; a reload (SIGHUP) since then may have removed it, and
            # drop_unlisted ran too early for this push. Checked again here, on the
            # event loop with no await before put_nowait, so no reload comes between.
            if header.sender not in self.codec.roster:
                self.spool.remove(msg_id)
                raise Rejection(
                    "unknown_sender",
                    f"{header.sender[:64]!r} left the roster while its push arrived",
                )
            # The reserved place becomes the queued one in this step (no await).
            slot.release()
            try:
                queue.put_nowait(
                    Received(header.sender, header.kind, header.round, payload, msg_id)
                )
            except asyncio.QueueFull:
                # Not expected while every push holds its place until here; if it
                # happens, the spooled copy must go: kept, it would answer the
                # sender's resend 200 and never reach the protocol in this run.
                log.warning(
                    "%s: %s %s from %r spooled but its inbox is full; removed, refused",
                    self.name,
                    header.kind[:64],
                    msg_id,
                    header.sender[:64],
                )
                self.spool.remove(msg_id)
                raise Rejection("queue_full", header.kind[:64]) from None
            self._spool_ts[msg_id] = header.timestamp_ms
            self.telemetry.set_queue_depth(header.kind, queue.qsize())
        finally:
            slot.release()  # its error paths (spool write, roster): given back once

    def _kept(self, msg_id: str, slot: Reservation, keep: asyncio.Future[None]) -> None:
        """A push's _keep ended: its id may arrive again, its place is given back
        (already, unless the task was cancelled before it ran), and an error is
        read here too, since a sender that hung up leaves no handler to read it."""
        self._keeping.discard(msg_id)
        slot.release()
        if not keep.cancelled() and (exc := keep.exception()) is not None:
            log.debug("%s: keeping %s failed: %r", self.name, msg_id, exc)

    def recover(self, checkpointed: list[dict[str, Any]]) -> int:
        """At start: the ids the latest checkpoint consumed (`checkpointed`) are
        journaled if a crash left them out; journaled ids count as seen (a resend
        is a replay, their spool files are dropped), and every other spooled push
        is queued again if it still passes `WireCodec.verify_origin` against the
        roster, federation and name of this start (a site removed from the
        roster, or a key rotated out, while it was spooled: deleted and counted
        under the check's reason); a card's previous key counts as valid if it
        was when the frame was signed (or spooled, if earlier). Returns how
        many were queued."""
        missing = [
            e
            for e in checkpointed
            if isinstance(e, dict) and isinstance(e.get("id"), str) and e["id"] not in self.journal
        ]
        if missing:
            log.info(
                "%s: journaling %d ids the last checkpoint consumed (crash before the journal)",
                self.name,
                len(missing),
            )
            self.journal.append(missing)
        for msg_id, ts in self.journal.ids.items():
            self.codec.replay.add(bytes.fromhex(msg_id), ts, self.journal.sender(msg_id))
        # Newest first, so that a kind with more spooled pushes than its inbox
        # holds keeps its newest (the inbox bounds pushes not yet consumed, the
        # spool those not yet checkpointed: FedER consumes and refuses old-round
        # relays at once, so more can be spooled than fit); queued oldest first.
        # And each sender keeps at most its share of a kind (`sender_share`, not
        # capped at half the inbox: these were acknowledged): else one sender's many spooled pushes, newer than an
        # honest one already acknowledged, took the whole inbox and the honest
        # push was deleted (review 4, R3).
        share = self.sender_share(at_most_half=False)
        kept: dict[str, list[Received]] = {}
        kept_by: dict[tuple[str, str], int] = {}
        dropped: dict[str, int] = {}
        for path in reversed(self.spool.pending()):
            msg_id = path.stem
            if msg_id in self.journal:
                path.unlink(missing_ok=True)
                continue
            try:
                frame = bytearray(path.read_bytes())
                n = self.codec.header_length(frame[:PREFIX_LEN])
                header = Header.unpack(frame[PREFIX_LEN : PREFIX_LEN + n])
            except WireError as exc:
                self._set_aside(path, exc.reason, None)  # its sender is unknown
                continue
            try:
                signature = frame[PREFIX_LEN + n : PREFIX_LEN + n + SIG_LEN]
                # A key is judged valid or not when the frame was signed (its
                # timestamp), or spooled if that was earlier (a sender whose clock
                # runs ahead): a previous key's grace period that ended while the
                # acknowledged push waited here must not delete it, its sender
                # will not send it again (second review, finding 3).
                signed = min(header.timestamp_ms / 1000, _mtime(path))
                self.codec.verify_origin(
                    header, frame[PREFIX_LEN : PREFIX_LEN + n], signature, now=signed
                )
            except WireError as exc:
                # Verified when it came, but no longer by this start's roster
                # (a revoked site), federation or name: never delivered.
                log.warning(
                    "%s: spooled %s from %r no longer passes the checks (%s); deleted",
                    self.name,
                    path.name,
                    header.sender[:64],
                    exc.reason,
                )
                self.telemetry.record_rejection(exc.reason, header.sender)
                self.spool.remove(msg_id)
                continue
            try:
                if self.accepts_push(header.kind) and (
                    len(kept.get(header.kind, ())) >= (self.inboxes.maxsize or sys.maxsize)
                    or kept_by.get((header.kind, header.sender), 0) >= share
                ):
                    payload = None  # not queued: not opened either
                else:
                    payload = self.codec.open_payload(
                        header, memoryview(frame)[PREFIX_LEN + n + SIG_LEN :], require_finite=True
                    )
            except WireError as exc:
                self._set_aside(path, exc.reason, header.sender)  # verified just above
                continue
            if not self.accepts_push(header.kind):
                # no protocol of this node reads that kind: it would stay spooled for good
                log.warning(
                    "%s: spooled %s is of kind %r, not taken as a push; deleted",
                    self.name,
                    path.name,
                    header.kind[:64],
                )
                reason = "push_not_accepted" if self.known_kind(header.kind) else "unknown_kind"
                self.telemetry.record_rejection(reason, header.sender)
                self.spool.remove(msg_id)
                continue
            # a resend is a replay (of this sender's: ids are the sender's, p2pfl/secure/wire.py)
            self.codec.replay.add(header.msg_id, header.timestamp_ms, header.sender)
            self.spool.sent_by(msg_id, header.sender)
            if payload is None:
                dropped[header.kind] = dropped.get(header.kind, 0) + 1
                self.telemetry.record_rejection("queue_full", header.sender)
                self.spool.remove(msg_id)
                continue
            self._spool_ts[msg_id] = header.timestamp_ms
            kept.setdefault(header.kind, []).append(
                Received(header.sender, header.kind, header.round, payload, msg_id)
            )
            kept_by[header.kind, header.sender] = kept_by.get((header.kind, header.sender), 0) + 1
        for kind, count in dropped.items():
            log.warning(
                "%s: %d older spooled pushes of kind %r did not fit its inbox (%d) or "
                "their sender's share of it (%d); deleted",
                self.name,
                count,
                kind[:64],
                self.inboxes.maxsize,
                share,
            )
        for kind, received in kept.items():
            queue = self.inboxes.get(kind)
            for item in reversed(received):
                queue.put_nowait(item)
        return sum(len(received) for received in kept.values())

    def _set_aside(self, path: Path, why: str, sender: str | None) -> None:
        """An acknowledged push that can no longer be read (a disk fault, a
        hostile copy): moved aside `.corrupt` for a person to look at, and
        counted `spool_unreadable` (under its sender when the header says who)
        on /status and /metrics, since it is never delivered."""
        log.warning("%s: spooled %s unreadable (%s); moved aside", self.name, path.name, why)
        self.telemetry.record_rejection("spool_unreadable", sender)
        self.spool.set_aside(path.stem)

    def drop_unlisted(self) -> int:
        """After a roster reload: the pushes queued from sites the roster no
        longer lists are taken out of their inboxes before the protocol sees
        them, their spool files deleted (a restart would not queue them either),
        each counted `unknown_sender`. Returns how many."""
        roster = self.codec.roster
        count = 0
        for kind, queue in self.inboxes.queues.items():
            for item in queue.discard(lambda r: r.sender not in roster):
                count += 1
                self._spool_ts.pop(item.msg_id, None)
                self.spool.remove(item.msg_id)
                self.telemetry.record_rejection("unknown_sender", item.sender)
                log.warning(
                    "%s: queued %s push %s from %r dropped: no longer in the roster",
                    self.name,
                    kind[:64],
                    item.msg_id,
                    item.sender[:64],
                )
            self.telemetry.set_queue_depth(kind, queue.qsize())
        return count

    def consumed_records(self, consumed: list[Received]) -> list[dict[str, Any]]:
        """What the checkpoint and then the journal keep of each consumed push."""
        return [
            {
                "id": r.msg_id,
                "kind": r.kind,
                "from": r.sender,
                "round": r.round,
                "ts": self._spool_ts.pop(r.msg_id, 0),
                "t": round(time.time(), 3),
            }
            for r in consumed
        ]

    def settle(self, consumed: list[dict[str, Any]]) -> None:
        """The checkpoint holding `consumed` (consumed_records) is written:
        journal them, then drop their spool files."""
        self.journal.append(consumed)
        done = self.spool.forget([r["id"] for r in consumed])
        if done:
            # Journaled first, so deleting later (off the loop) is crash-safe.
            try:
                asyncio.get_running_loop().run_in_executor(None, unlink_all, done)
            except RuntimeError:  # no loop (tools, tests): delete now
                unlink_all(done)
