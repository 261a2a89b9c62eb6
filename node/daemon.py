"""The node daemon: owns the event loop, transport, queues, peer table, state
directory, status endpoint and the protocol task. Everything a node owns hangs
off `Node` and is closed in `Node.stop()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from aiohttp.http_exceptions import HttpProcessingError

import protocols
from node.faults import WIRE_MODES, FaultPlan
from node.peers import PeerTable
from node.queues import Checkpoints, Inboxes, Journal, Outbox, OutboxEntry, Spool, unlink_all
from node.status import create_status_app, start_status_server
from node.telemetry import Telemetry
from node.transport import (
    PREFIX_LEN,
    SIG_LEN,
    IncomingFrame,
    MessageClient,
    MessageServer,
    Rejection,
    TransportError,
    client_ssl_context,
    reason_of_response,
    server_ssl_context,
)
from p2pfl.config import SiteConfig, parse_hostport
from p2pfl.errors import UserError
from p2pfl.secure import tensors
from p2pfl.secure.identity import LocalIdentity, Roster
from p2pfl.secure.wire import Header, WireCodec, WireError
from protocols.base import (
    Handler,
    NotReady,
    Offers,
    PeerInfo,
    PeerUnavailable,
    Received,
    RoundContext,
)

log = logging.getLogger(__name__)

HEARTBEAT = "heartbeat"
REQUEST_PREFIX = "req:"
RESPONSE_PREFIX = "resp:"


class NodeContext(RoundContext):
    """RoundContext over the real daemon."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.me = node.name
        self.config = node.cfg
        self._round = 0
        self.phase = "start"

    @property  # type: ignore[override]
    def round(self) -> int:
        return self._round

    @round.setter
    def round(self, value: int) -> None:
        self._round = value
        self.node.telemetry.set_round(value)
        self.node.on_progress()

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        self.node.telemetry.set_phase(phase)
        self.node.on_progress()

    def peers(self, alive_only: bool = True) -> list[PeerInfo]:
        return self.node.peers.peers(alive_only)

    def roster(self) -> list[str]:
        return self.node.roster.names()

    async def send(self, peer: str, kind: str, payload: Any, round: int | None = None) -> None:
        await self.node.send_push(peer, kind, payload, self._round if round is None else round)

    async def request(self, peer: str, kind: str, query: dict[str, Any], timeout: float) -> Any:
        return await self.node.request(peer, kind, query, timeout)

    def serve(self, kind: str, handler: Handler) -> None:
        self.node.handlers[kind] = handler
        self.node.offers.offered(kind)

    def offered(self, kind: str) -> None:
        self.node.offers.offered(kind)

    def inbox(self, kind: str) -> asyncio.Queue[Received]:
        return self.node.inboxes.get(kind)

    def publish(self, key: str, value: Any) -> None:
        tensors.encode(value)  # fail here, not in the heartbeat loop, if it cannot travel
        self.node.published[key] = value

    async def train(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.node.trainer, lambda: fn(*args, **kwargs))

    def checkpoint(self, state: dict[str, Any]) -> None:
        self.node.save_checkpoint(state)

    def restore(self) -> dict[str, Any] | None:
        return self.node.restored_state

    def log_metrics(self, round: int, **values: float) -> None:
        self.node.log_metrics(round, values)

    def record_choice(self, chosen: list[str]) -> None:
        self.node.telemetry.record_choice(self.me, list(chosen))

    def reject(self, peer: str, reason: str) -> None:
        self.node.on_reject(reason, peer)

    def set_community(self, community: dict[str, Any]) -> None:
        self.node.telemetry.set_community(community)

    def pair_secret(self, peer: str, context: bytes) -> bytes:
        from protocols.masking import pair_secret_from_shared

        if peer not in self.node.roster:
            raise PeerUnavailable(peer, "not in roster")
        return pair_secret_from_shared(self.node.codec.shared_secret(peer), self.me, peer, context)


class Node:
    def __init__(
        self,
        cfg: SiteConfig,
        roster: Roster,
        identity: LocalIdentity,
        *,
        config_path: Path | None = None,
    ) -> None:
        self.cfg = cfg
        self.name = cfg.node.name
        self.roster = roster
        self.identity = identity
        self.config_path = config_path
        state = Path(cfg.node.state_dir)
        state.mkdir(parents=True, exist_ok=True)
        self.state_dir = state
        self.faults = FaultPlan.from_env()
        self._first_reply: dict[str, list[bytes | memoryview]] = {}  # for the `replayed` drill
        self.codec = WireCodec(
            identity,
            roster,
            cfg.federation.id,
            max_message_bytes=cfg.wire.max_message_bytes,
            clock_skew_s=cfg.wire.clock_skew_s,
            replay_cache_size=cfg.wire.replay_cache_size,
        )
        self.telemetry = Telemetry(self.name)
        self.spool = Spool(state / "spool")
        self.journal = Journal(state / "journal.jsonl")
        self.outbox = Outbox(state / "outbox")
        self.checkpoints = Checkpoints(state / "checkpoints")
        self.inboxes = Inboxes(cfg.transport.inbox_size)
        self.peers = PeerTable(self.name, roster.names(), cfg.transport)
        tls = cfg.transport.tls
        self.server_ssl = (
            server_ssl_context(str(tls.cert), str(tls.key), str(tls.ca)) if tls else None
        )
        client_ssl = client_ssl_context(str(tls.cert), str(tls.key), str(tls.ca)) if tls else None
        self.server = MessageServer(self.codec, cfg.transport, self.on_frame, self.on_reject)
        self.client = MessageClient(cfg.transport, client_ssl)
        for site in roster.cards():
            if site.name != self.name:
                self.client.set_peer(site.name, site.address)
        self.handlers: dict[str, Handler] = {}
        self.offers = Offers()  # wakes requests held open on a kind
        self.published: dict[str, Any] = {}
        self.protocol = protocols.from_params(cfg.protocol)
        self.ctx = NodeContext(self)
        self.trainer = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.name}-train")
        self.restored_state: dict[str, Any] | None = None
        self._spool_ts: dict[str, int] = {}  # message id -> header timestamp, for the journal
        self.protocol_messages_sent = 0
        self.protocol_bytes_sent = 0
        self.protocol_done = False
        self.protocol_failed: str | None = None
        self.stopping = asyncio.Event()
        self._tasks: list[asyncio.Task[Any]] = []
        self._status_runner: Any = None
        self.status_port: int | None = None
        self.peer_port: int | None = None
        self._metrics_file = open(state / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115 - closed in stop()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        checkpoint = self.checkpoints.latest()
        self.restored_state = checkpoint.get("protocol") if checkpoint else None
        if checkpoint:
            self.ctx.round = int(checkpoint.get("round", 0))
            log.info("%s: resuming from checkpoint (round %d)", self.name, self.ctx.round)
        for msg_id, ts in self.journal.ids.items():
            self.codec.replay.add(bytes.fromhex(msg_id), ts)
        requeued = self._requeue_spool()
        host, port = parse_hostport(self.cfg.node.listen)
        try:
            self.peer_port = await self.server.start(host, port, self.server_ssl)
        except OSError as exc:
            raise UserError(
                f"node.listen {self.cfg.node.listen}: cannot bind ({exc.strerror}) — stop the process using that port or choose another one"
            ) from None
        scheme = "https" if self.server_ssl else "http"
        log.info(
            "%s: peer transport on %s://%s:%d (%d spooled messages re-queued)",
            self.name,
            scheme,
            host,
            self.peer_port,
            requeued,
        )
        if self.cfg.status.enabled:
            token = self.cfg.status.token
            if self.cfg.status.token_file:
                token = Path(self.cfg.status.token_file).read_text().strip()
            app = create_status_app(
                self.telemetry,
                node_name=self.name,
                protocol_name=self.cfg.protocol.name,
                token=token,
            )
            try:
                self._status_runner, self.status_port = await start_status_server(
                    app, self.cfg.status.host, self.cfg.status.port
                )
            except OSError as exc:
                await self.server.stop()
                raise UserError(
                    f"status.port {self.cfg.status.port}: cannot bind ({exc.strerror}) — choose another port or set status.enabled: false"
                ) from None
        self._spawn(self._heartbeat_loop(), "heartbeat")
        self._spawn(self._resend_outbox(), "outbox")
        self._spawn(self._run_protocol(), "protocol")

    def _spawn(self, coro: Any, name: str) -> None:
        self._tasks.append(asyncio.create_task(coro, name=f"{self.name}:{name}"))

    async def stop(self) -> None:
        """Graceful: stop the protocol (it resumes from its checkpoint), say goodbye, close."""
        self.stopping.set()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._broadcast_heartbeat(bye=True), timeout=2.0)
        await self.server.stop()
        if self._status_runner is not None:
            await self._status_runner.cleanup()
        await self.client.close()
        self.trainer.shutdown(wait=True, cancel_futures=True)
        self._metrics_file.close()
        log.info("%s: stopped", self.name)

    async def _wait_for_peers(self) -> None:
        """Give the federation a moment to come up, so round 1 is not run alone."""
        deadline = time.monotonic() + self.cfg.node.startup_wait_s
        while time.monotonic() < deadline:
            everyone = self.peers.peers(alive_only=False)
            if all(p.state == "alive" or p.phase == "done" for p in everyone):
                return
            await asyncio.sleep(0.2)
        alive = [p.name for p in self.peers.peers()]
        log.warning(
            "%s: starting with %d of %d peers alive after %.0f s: %s",
            self.name,
            len(alive),
            len(self.peers.records),
            self.cfg.node.startup_wait_s,
            ", ".join(alive) or "none",
        )

    async def _run_protocol(self) -> None:
        self.ctx.set_phase("waiting_for_peers")
        await self._wait_for_peers()
        self.ctx.set_phase("start")
        try:
            await self.protocol.run(self.ctx)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a failed protocol must not take the node (and its serving) down
            self.protocol_failed = f"{type(exc).__name__}: {exc}"
            log.exception("%s: protocol %s failed", self.name, self.cfg.protocol.name)
            self.ctx.set_phase("failed")
            return
        self.protocol_done = True
        self.ctx.set_phase("done")
        log.info(
            "%s: protocol %s finished at round %d",
            self.name,
            self.cfg.protocol.name,
            self.ctx.round,
        )

    async def wait_until_finished(self) -> None:
        """For exit_when_done: our protocol finished and every peer is done or gone."""
        while not self.stopping.is_set():
            if (self.protocol_done or self.protocol_failed) and self.peers.all_done_or_gone():
                return
            await asyncio.sleep(0.5)

    def on_progress(self) -> None:
        """Round or phase changed: let the fault plan (drills only) act."""
        if not self.faults.active:
            return
        self.faults.on_progress(self.ctx.round, self.ctx.phase)
        self.server.isolated = self.faults.isolated
        for link in self.client.links.values():
            link.blocked = self.faults.isolated

    # ------------------------------------------------------------------ state
    def save_checkpoint(self, state: dict[str, Any]) -> None:
        consumed = self.inboxes.take_consumed()
        self.checkpoints.save({"round": self.ctx.round, "protocol": state})
        self.journal.append(
            [
                {
                    "id": r.msg_id,
                    "kind": r.kind,
                    "from": r.sender,
                    "round": r.round,
                    "ts": self._spooled_ts(r),
                    "t": round(time.time(), 3),
                }
                for r in consumed
            ]
        )
        done = self.spool.forget([r.msg_id for r in consumed])
        if done:
            # Journaled first, so deleting later (off the loop) is crash-safe.
            try:
                asyncio.get_running_loop().run_in_executor(None, unlink_all, done)
            except RuntimeError:  # no loop (tools, tests): delete now
                unlink_all(done)

    def _spooled_ts(self, received: Received) -> int:
        return self._spool_ts.pop(received.msg_id, 0)

    def _requeue_spool(self) -> int:
        count = 0
        for path in self.spool.pending():
            msg_id = path.stem
            if msg_id in self.journal:
                path.unlink(missing_ok=True)
                continue
            try:
                frame = bytearray(path.read_bytes())
                n = self.codec.header_length(frame[:PREFIX_LEN])
                header = Header.unpack(frame[PREFIX_LEN : PREFIX_LEN + n])
                payload = self.codec.open_payload(
                    header, memoryview(frame)[PREFIX_LEN + n + SIG_LEN :], require_finite=True
                )
            except WireError as exc:
                log.warning(
                    "%s: spooled %s unreadable (%s); moved aside", self.name, path.name, exc.reason
                )
                path.rename(path.with_suffix(".corrupt"))
                continue
            self._spool_ts[msg_id] = header.timestamp_ms
            self.inboxes.get(header.kind).put_nowait(
                Received(header.sender, header.kind, header.round, payload, msg_id)
            )
            count += 1
        return count

    def log_metrics(self, round: int, values: dict[str, Any]) -> None:
        clean = {
            k: v
            for k, v in values.items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        }
        # Protocol traffic since start (heartbeats excluded), as the in-memory network reports it.
        clean.setdefault("messages_sent", self.protocol_messages_sent)
        clean.setdefault("bytes_sent", self.protocol_bytes_sent)
        self._metrics_file.write(
            json.dumps({"t": round_time(), "node": self.name, "round": round, **clean}) + "\n"
        )
        self._metrics_file.flush()
        self.telemetry.log_metrics(round, **clean)

    # ------------------------------------------------------------------ receiving
    def on_reject(self, reason: str, sender: str | None) -> None:
        self.telemetry.record_rejection(reason, sender)
        log.debug("%s: rejected a message from %s: %s", self.name, sender, reason)

    async def on_frame(self, incoming: IncomingFrame) -> tuple[int, Any]:
        header = incoming.header
        kind = header.kind
        if kind == HEARTBEAT:
            return await self._on_heartbeat(incoming)
        if self.faults.latency_s:
            await asyncio.sleep(self.faults.latency_s)  # drill: a slow peer
        if kind.startswith(REQUEST_PREFIX):
            return await self._on_request(incoming)
        return await self._on_push(incoming)

    def _open(self, incoming: IncomingFrame) -> Any:
        payload = self.codec.open_payload(
            incoming.header, incoming.payload, digest=incoming.digest, require_finite=True
        )
        self.telemetry.record_received(
            incoming.header.sender, incoming.header.kind, len(incoming.frame)
        )
        return payload

    async def _on_heartbeat(self, incoming: IncomingFrame) -> tuple[int, Any]:
        beat = self._open(incoming)
        if not isinstance(beat, dict):
            raise WireError("payload_schema", "heartbeat must be a map")
        sender = incoming.header.sender
        was = self.peers.records[sender].info.state if sender in self.peers.records else "unknown"
        self.peers.heard(sender, beat)
        if isinstance(beat.get("edges"), list):
            self.telemetry.merge_remote_edges(sender, beat["edges"])
        if isinstance(beat.get("choices"), list):
            self.telemetry.merge_remote_choices(sender, beat["choices"])
        info = self.peers.records[sender].info if sender in self.peers.records else None
        if info is not None:
            self.telemetry.set_peer(
                sender,
                self.peers.state_of(self.peers.records[sender], time.monotonic()),
                info.round,
                info.phase,
                info.last_seen,
            )
        if was in ("unknown", "dead") and not beat.get("bye"):
            # A peer (re)joined: answer at once so it learns our round without waiting.
            self._spawn(self._send_heartbeat(sender, self._heartbeat_payload()), f"hb-{sender}")
        return 200, None

    async def _on_request(self, incoming: IncomingFrame) -> tuple[int, Any]:
        header = incoming.header
        query = self._open(incoming)
        if not isinstance(query, dict):
            raise WireError("payload_schema", "request query must be a map")
        kind = header.kind[len(REQUEST_PREFIX) :]
        wait_s = query.pop("_wait_s", 0.0)
        wait_s = min(
            float(wait_s) if isinstance(wait_s, int | float) else 0.0,
            self.cfg.transport.request_timeout_s,
        )
        deadline = time.monotonic() + wait_s
        while True:
            changed = self.offers.watch(kind)
            handler = self.handlers.get(kind)
            if handler is not None:
                try:
                    payload = await handler(header.sender, query)
                    break
                except NotReady:
                    pass
                except Exception as exc:  # noqa: BLE001 - the protocol's handler failing is answered, not fatal
                    log.warning(
                        "%s: %s handler failed for %s: %r", self.name, kind, header.sender, exc
                    )
                    raise Rejection("handler_error", type(exc).__name__) from None
            if time.monotonic() >= deadline or self.stopping.is_set():
                raise Rejection("not_ready" if handler is not None else "no_handler", kind)
            # Re-ask when the protocol offers something new, at the latest in 0.1 s.
            await self.offers.wait(changed, min(0.1, max(0.0, deadline - time.monotonic())))
        attack = self.faults.poison_mode(kind, header.round) if self.faults.active else None
        if attack is not None:
            return self._poisoned_reply(incoming, kind, payload, attack)
        reply = self.codec.encode(
            RESPONSE_PREFIX + kind,
            header.sender,
            payload,
            round=header.round,
            encrypt=self.cfg.wire.encryption,
        )
        self._count_sent(header.sender, RESPONSE_PREFIX + kind, reply.nbytes)
        if self.faults.active and header.sender not in self._first_reply:
            self._first_reply[header.sender] = [bytes(c) for c in reply.chunks]
        return 200, reply.chunks

    def _poisoned_reply(
        self, incoming: IncomingFrame, kind: str, payload: Any, attack: str
    ) -> tuple[int, Any]:
        """Drill only (P2PFL_FAULTS): answer like a compromised peer would."""
        header = incoming.header
        self.faults.event("poison", mode=attack, to=header.sender, round=header.round)
        if attack == "replayed":
            if header.sender in self._first_reply:
                return 200, self._first_reply[header.sender]
            attack = "nan"  # nothing to replay yet
        codec = self.codec
        if attack == "forged":
            codec = WireCodec(
                LocalIdentity.generate(self.name), self.roster, self.cfg.federation.id
            )
        if attack not in WIRE_MODES:
            payload = self.faults.poison_payload(payload, attack)
        reply = codec.encode(
            RESPONSE_PREFIX + kind,
            header.sender,
            payload,
            round=header.round,
            encrypt=self.cfg.wire.encryption and attack != "forged",
        )
        self._first_reply.setdefault(header.sender, [bytes(c) for c in reply.chunks])
        return 200, reply.chunks

    async def _on_push(self, incoming: IncomingFrame) -> tuple[int, Any]:
        header = incoming.header
        msg_id = header.id_hex
        if self.spool.has(msg_id) or msg_id in self.journal:
            return 200, None  # a retry of something we already hold
        queue = self.inboxes.get(header.kind)
        if not queue.has_room():
            raise Rejection("queue_full", header.kind)
        queue.reserved += 1
        try:
            payload = self._open(incoming)
            await asyncio.to_thread(self.spool.persist, msg_id, incoming.frame)
        finally:
            queue.reserved -= 1
        self._spool_ts[msg_id] = header.timestamp_ms
        queue.put_nowait(Received(header.sender, header.kind, header.round, payload, msg_id))
        self.telemetry.set_queue_depth(header.kind, queue.qsize())
        log.debug(
            "%s: spooled and acknowledged %s %s from %s",
            self.name,
            header.kind,
            msg_id,
            header.sender,
        )
        if self.faults.active:
            self.faults.on_progress(header.round, "acked")  # drill: crash right after an ack
        return 200, None

    # ------------------------------------------------------------------ sending
    def _count_sent(self, peer: str, kind: str, nbytes: int) -> None:
        self.telemetry.record_sent(peer, kind, nbytes)
        self.protocol_messages_sent += 1
        self.protocol_bytes_sent += nbytes

    async def send_push(self, peer: str, kind: str, payload: Any, round: int) -> None:
        if peer not in self.client.links:
            raise PeerUnavailable(peer, "not in roster")
        entry = OutboxEntry(os.urandom(16), peer, kind, round, payload, time.time())
        await asyncio.to_thread(self.outbox.add, entry)
        try:
            await self._deliver(entry)
        finally:
            self.outbox.done(entry.msg_id)

    async def _deliver(self, entry: OutboxEntry, *, timeout: float | None = None) -> None:
        message = self.codec.encode(
            entry.kind,
            entry.peer,
            entry.payload,
            round=entry.round,
            encrypt=self.cfg.wire.encryption,
            msg_id=entry.msg_id,
        )
        try:
            status, body = await self.client.post(entry.peer, message, timeout=timeout)
        except TransportError as exc:
            raise PeerUnavailable(entry.peer, exc.reason) from None
        if status == 200 or (status == 409 and reason_of_response(status, body) == "replayed"):
            self._count_sent(entry.peer, entry.kind, message.nbytes)
            log.info(
                "%s: %s %s delivered to %s (round %d)",
                self.name,
                entry.kind,
                entry.msg_id.hex(),
                entry.peer,
                entry.round,
            )
            return
        raise PeerUnavailable(entry.peer, reason_of_response(status, body))

    async def _resend_outbox(self) -> None:
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
            self.outbox.done(entry.msg_id)

    async def request(self, peer: str, kind: str, query: dict[str, Any], timeout: float) -> Any:
        if peer not in self.client.links:
            raise PeerUnavailable(peer, "not in roster")
        deadline = time.monotonic() + timeout
        reason = "timeout"
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0.05:
                raise PeerUnavailable(peer, reason)
            # A fresh message per attempt: a retried request must not look like a replay.
            message = self.codec.encode(
                REQUEST_PREFIX + kind,
                peer,
                {**query, "_wait_s": max(0.0, remaining * 0.8 - 0.2)},
                round=self.ctx.round,
                encrypt=self.cfg.wire.encryption,
            )
            try:
                status, body = await self.client.post(peer, message, timeout=remaining, retries=0)
            except TransportError as exc:
                reason = exc.reason
                if exc.reason == "circuit_open":
                    raise PeerUnavailable(peer, reason) from None
                await asyncio.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
                continue
            self._count_sent(peer, REQUEST_PREFIX + kind, message.nbytes)
            if status == 200:
                return self._open_response(peer, kind, body)
            reason = reason_of_response(status, body)
            if reason not in ("not_ready", "no_handler", "rate_limited", "queue_full"):
                raise PeerUnavailable(peer, reason)

    def _open_response(self, peer: str, kind: str, body: bytes) -> Any:
        try:
            delivered = self.codec.decode(bytearray(body), require_finite=True)
        except WireError as exc:
            self.telemetry.record_rejection(exc.reason, peer)
            raise PeerUnavailable(peer, f"bad response: {exc.reason}") from None
        if delivered.header.sender != peer or delivered.header.kind != RESPONSE_PREFIX + kind:
            self.telemetry.record_rejection("payload_schema", peer)
            raise PeerUnavailable(peer, "response does not match the request")
        self.telemetry.record_received(peer, delivered.header.kind, delivered.nbytes)
        return delivered.payload

    # ------------------------------------------------------------------ membership
    def _heartbeat_payload(self, bye: bool = False) -> dict[str, Any]:
        return {
            "round": self.ctx.round,
            "phase": self.ctx.phase,
            "done": self.protocol_done,
            "bye": bye,
            "meta": self.published,
            "edges": self.telemetry.local_edges(),
            "choices": self.telemetry.local_choices(),
        }

    async def _send_heartbeat(self, peer: str, beat: dict[str, Any]) -> None:
        message = self.codec.encode(HEARTBEAT, peer, beat, round=self.ctx.round)
        try:
            status, _ = await self.client.post(
                peer,
                message,
                timeout=max(1.0, self.cfg.transport.heartbeat_s * 2),
                retries=0,
                probe=True,
            )
        except TransportError:
            return
        if status == 200:
            self.telemetry.record_sent(peer, HEARTBEAT, message.nbytes)

    async def _broadcast_heartbeat(self, bye: bool = False) -> None:
        beat = self._heartbeat_payload(bye)
        await asyncio.gather(
            *(self._send_heartbeat(p, beat) for p in list(self.client.links)),
            return_exceptions=True,
        )

    async def _heartbeat_loop(self) -> None:
        while True:
            await self._broadcast_heartbeat()
            self.peers.refresh()
            for record in self.peers.records.values():
                info = record.info
                self.telemetry.set_peer(
                    info.name, info.state, info.round, info.phase, info.last_seen
                )
            for kind, depth in self.inboxes.depths().items():
                self.telemetry.set_queue_depth(kind, depth)
            await asyncio.sleep(self.cfg.transport.heartbeat_s)

    def reload_roster(self) -> None:
        """SIGHUP: re-read the roster; removed sites are refused from now on."""
        try:
            roster = Roster.load(self.cfg.federation.roster)
        except Exception as exc:  # noqa: BLE001 - a bad roster file must not stop a running node
            log.error("%s: roster reload failed, keeping the old one: %s", self.name, exc)
            return
        if self.name not in roster:
            log.error("%s: reloaded roster does not list this site; keeping the old one", self.name)
            return
        self.roster = roster
        self.codec.roster = roster
        self.codec._shared.clear()
        for name in list(self.client.links):
            if name not in roster:
                self.client.remove_peer(name)
        for card in roster.cards():
            if card.name != self.name:
                self.client.set_peer(card.name, card.address)
        self.peers.set_roster(roster.names())
        log.info("%s: roster reloaded: %s", self.name, ", ".join(roster.names()))


def round_time() -> float:
    return round(time.time(), 3)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "t": round(record.created, 3),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(cfg: SiteConfig) -> None:
    fmt: logging.Formatter = (
        JsonFormatter()
        if cfg.logging.format == "json"
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.setLevel(cfg.logging.level)
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in (
        logging.StreamHandler(),
        logging.FileHandler(Path(cfg.node.state_dir) / "node.log", encoding="utf-8"),
    ):
        handler.setFormatter(fmt)
        root.addHandler(handler)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    logging.getLogger("aiohttp.server").addFilter(quiet_http_parser_refusals)


def quiet_http_parser_refusals(record: logging.LogRecord) -> bool:
    """aiohttp logs every request its HTTP parser refuses (already answered 400)
    at ERROR with a traceback: anyone who reaches the port could fill the log.
    Those become one DEBUG line; real handler errors keep their traceback."""
    exc = record.exc_info[1] if record.exc_info else None
    if not isinstance(exc, HttpProcessingError):
        return True
    if not logging.getLogger("aiohttp.server").isEnabledFor(logging.DEBUG):
        return False
    record.levelno, record.levelname = logging.DEBUG, "DEBUG"
    record.msg, record.args = "refused malformed HTTP request: %s", (exc,)
    record.exc_info = record.exc_text = None
    return True


async def serve(node: Node) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, node.reload_roster)
    try:
        await node.start()
    except UserError:
        await node.client.close()
        node.trainer.shutdown(wait=False)
        node._metrics_file.close()
        raise
    waiters = [asyncio.create_task(stop.wait())]
    if node.cfg.node.exit_when_done:
        waiters.append(asyncio.create_task(node.wait_until_finished()))
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for waiter in waiters:
        waiter.cancel()
    await node.stop()
    return 1 if node.protocol_failed else 0


def run_node(
    cfg: SiteConfig, roster: Roster, identity: LocalIdentity, *, config_path: Path | None = None
) -> int:
    Path(cfg.node.state_dir).mkdir(parents=True, exist_ok=True)
    configure_logging(cfg)
    if cfg.training.threads:
        import torch

        torch.set_num_threads(cfg.training.threads)
    node = Node(cfg, roster, identity, config_path=config_path)
    return asyncio.run(serve(node))
