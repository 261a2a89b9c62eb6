"""Heartbeats and the roster of a running node.

Every `transport.heartbeat_s` the node sends each roster peer a signed
heartbeat with its round, phase, whether its protocol is done, what the
protocol published and its traffic edges and choices (a node whose protocol
failed says so at once, with its error's kind); the heartbeats it
receives feed the peer table (node/peers.py) and the telemetry. With
`wire.encryption` each heartbeat is encrypted to its recipient, like every
other message: it carries the gossiped metadata (per-class F1 or model
statistics where the heuristic reads them, FedPerl's feature vectors;
docs/threat-model.md says what each reveals). A peer that
(re)joins is answered at once. On SIGHUP the roster file is read again: sites
no longer listed are refused from then on (and their queued pushes dropped:
node/inbound.py `drop_unlisted`), new ones are linked.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from node.outbound import ID_TAKEN, acknowledged
from node.peers import PeerTable
from node.queues import Inboxes
from node.telemetry import Telemetry
from node.transport_client import (
    ACK_LIMIT,
    MessageClient,
    TransportError,
    reason_of_response,
    signed_refusal,
)
from p2pfl.config import SiteConfig
from p2pfl.secure.identity import Roster
from p2pfl.secure.wire import WireCodec, WireError
from protocols.base import FAILED

log = logging.getLogger(__name__)

HEARTBEAT = "heartbeat"

# The largest heartbeat payload a node takes (node/inbound.py `check_header`),
# refused `heartbeat_oversize` before a byte of it is read. An honest one is:
# its fixed fields (phase at most 64 characters, error 80) and published
# metadata (per-class F1, model statistics, FedPerl's feature vector: 9 bytes
# a number; the registered models gossip at most 534 numbers a vector, 1,000
# classes 1,000 more), well inside HEARTBEAT_BASE_BYTES (about 110,000
# numbers); its edges (2 per other roster site) and choices (1), each under
# 200 bytes with names of at most 64 characters, inside HEARTBEAT_SITE_BYTES a
# roster site; and `recent`, at most `selection.n` names, HEARTBEAT_NAME_BYTES
# each. Before (a review, 2026-11-28) only wire.max_message_bytes (512 MiB)
# bounded it: decoded in a thread that holds the interpreter lock, then kept
# as the peer's metadata until its next heartbeat.
HEARTBEAT_BASE_BYTES = 1 << 20
HEARTBEAT_SITE_BYTES = 1 << 10
HEARTBEAT_NAME_BYTES = 80


def heartbeat_limit(roster_size: int, recent_n: int) -> int:
    """The most bytes an honest heartbeat's payload takes in a federation of
    `roster_size` sites whose `selection.n` is `recent_n` (see above)."""
    return (
        HEARTBEAT_BASE_BYTES
        + HEARTBEAT_SITE_BYTES * max(0, roster_size)
        + HEARTBEAT_NAME_BYTES * max(0, recent_n)
    )


class Progress(NamedTuple):
    """Where this node's protocol is, as its heartbeats tell it."""

    round: int
    phase: str
    done: bool
    error: str = ""  # a failed protocol's error kind (its class name, never its text)


@dataclass(kw_only=True, eq=False)
class Membership:
    """Sends and receives heartbeats; holds the roster and the published metadata."""

    name: str
    cfg: SiteConfig
    roster: Roster
    codec: WireCodec
    client: MessageClient
    peers: PeerTable
    telemetry: Telemetry
    inboxes: Inboxes
    progress: Callable[[], Progress]
    spawn: Callable[[Coroutine[Any, Any, None], str], None]  # a task the node cancels at stop
    published: dict[str, Any] = field(default_factory=dict)  # gossiped in heartbeats

    def __post_init__(self) -> None:
        self._link_roster()

    # ------------------------------------------------------------------ sending
    def _payload(self, bye: bool = False) -> dict[str, Any]:
        progress = self.progress()
        return {
            "round": progress.round,
            "phase": progress.phase,
            "done": progress.done,
            "error": progress.error,
            "bye": bye,
            "meta": self.published,
            "edges": self.telemetry.local_edges(),
            "choices": self.telemetry.local_choices(),
        }

    async def _send(self, peer: str, beat: dict[str, Any]) -> None:
        message = self.codec.encode(
            HEARTBEAT, peer, beat, round=self.progress().round, encrypt=self.cfg.wire.encryption
        )
        try:
            status, body = await self.client.post(
                peer,
                message,
                timeout=max(1.0, self.cfg.transport.heartbeat_s * 2),
                retries=0,
                probe=True,
                answer_limit=ACK_LIMIT,
            )
        except TransportError:
            return
        if status == 200 or signed_refusal(status, body):
            outcome = "ok" if status == 200 else reason_of_response(status, body)
            if not acknowledged(self.codec, self.client, peer, message, outcome, body):
                # not the peer's word (a relay's 200 or 409): its next relay, as
                # for a push; a relay forging the answers to heartbeats held
                # them on itself, and the peer heard none (rv_net2)
                return
            if outcome == ID_TAKEN:
                # the peer's word that someone used this heartbeat's id first: a
                # refusal of the relay that carried it, as for a push; else a relay
                # stealing every heartbeat's id held them on itself (final review)
                self.client.carrier_suspect(peer, message)
        if status == 200:
            self.telemetry.record_sent(peer, HEARTBEAT, message.nbytes)

    async def broadcast(self, bye: bool = False) -> None:
        """One heartbeat to every linked peer (a goodbye with `bye`)."""
        beat = self._payload(bye)
        await asyncio.gather(
            *(self._send(p, beat) for p in list(self.client.links)),
            return_exceptions=True,
        )

    async def run(self) -> None:
        """The heartbeat loop: beat, update peer states, refresh the gauges."""
        while True:
            await self.broadcast()
            self.peers.refresh()
            for record in self.peers.records.values():
                info = record.info
                self.telemetry.set_peer(
                    info.name, info.state, info.round, info.phase, info.last_seen, record.error
                )
            for kind, depth in self.inboxes.depths().items():
                self.telemetry.set_queue_depth(kind, depth)
            await asyncio.sleep(self.cfg.transport.heartbeat_s)

    # ------------------------------------------------------------------ receiving
    def heard(self, sender: str, beat: Any) -> None:
        """A verified heartbeat from `sender` (its payload already opened)."""
        if not isinstance(beat, dict):
            raise WireError("payload_schema", "heartbeat must be a map")
        before = self.peers.records.get(sender)
        was = before.info.state if before is not None else "unknown"
        was_phase = before.info.phase if before is not None else ""
        self.peers.heard(sender, beat)
        if not beat.get("bye"):
            self.client.heard_from(sender)  # up: requests to it may go through again
        if isinstance(beat.get("edges"), list):
            self.telemetry.merge_remote_edges(sender, beat["edges"])
        if isinstance(beat.get("choices"), list):
            self.telemetry.merge_remote_choices(sender, beat["choices"])
        record = self.peers.records.get(sender)
        if record is not None:
            info = record.info
            self.telemetry.set_peer(
                sender,
                self.peers.state_of(record, time.monotonic()),
                info.round,
                info.phase,
                info.last_seen,
                record.error,
            )
            if info.phase == FAILED and was_phase != FAILED:
                log.warning(
                    "%s: peer %s reports its protocol failed (%s): not chosen from now on",
                    self.name,
                    sender,
                    record.error or "no reason given",
                )
        if was in ("unknown", "dead") and not beat.get("bye"):
            # A peer (re)joined: answer at once so it learns our round without waiting.
            self.spawn(self._send(sender, self._payload()), f"hb-{sender}")

    # ------------------------------------------------------------------ roster
    def _link_roster(self) -> None:
        """Link every roster site but us; unlink sites the roster no longer lists.
        A site with no address is linked through the relays its card names.
        The telemetry learns the roster too: peers' gossiped edges and choices
        may name no other site."""
        self.telemetry.set_roster(self.roster.names())
        for name in list(self.client.links):
            if name not in self.roster:
                self.client.remove_peer(name)
        for card in self.roster.cards():
            if card.name == self.name:
                continue
            if card.address is None:  # outbound-only: through its relays (issue 31)
                relays = [self.roster.relays[r] for r in card.via]
                self.client.set_relayed_peer(card.name, relays)
            else:
                self.client.set_peer(card.name, card.address)

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
        self.codec.set_roster(roster)
        self._link_roster()
        self.peers.set_roster(roster.names())
        log.info("%s: roster reloaded: %s", self.name, ", ".join(roster.names()))
