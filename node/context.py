"""NodeContext: the RoundContext a protocol gets on a real node.

Every verb delegates to the part of the node that does it (node/daemon.py
wires them): sends and requests to its Outbound, serving to its Inbound,
gossip to its Membership; round and phase changes reach the telemetry and the
fault plan. Artifacts live under the node's state directory
(RoundContext.artifact).

It is handed those parts, and the few things the node itself keeps for its
protocol (checkpoints, the restored state, metrics, progress) as callables,
never the `Node`: so this module does not import node/daemon.py, which imports
it (issue 29).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from node.inbound import Inbound
from node.membership import Membership
from node.outbound import Outbound
from node.peers import PeerTable
from node.queues import Inboxes
from node.resources import freeze_startup_heap
from node.telemetry import Telemetry
from p2pfl.config import SiteConfig
from p2pfl.secure import tensors
from p2pfl.secure.wire import WireCodec
from protocols.base import Handler, PeerInfo, PeerUnavailable, Received, RoundContext
from protocols.masking import pair_secret_from_shared


@dataclass(frozen=True)
class NodeState:
    """What the node keeps for its protocol, beyond its parts: a round or phase
    changed (the fault plan acts), save a round's checkpoint with the pushes
    it consumed, the state a checkpoint restored, a round's metrics."""

    on_progress: Callable[[], None]
    save_checkpoint: Callable[[dict[str, Any]], None]
    restored_state: Callable[[], dict[str, Any] | None]
    log_metrics: Callable[[int, dict[str, Any]], None]


log = logging.getLogger(__name__)

# The first phase after a protocol's setup (and resume): its site is built.
FIRST_WORK_PHASES = frozenset({"train", "generator"})


class NodeContext(RoundContext):
    """RoundContext over the real daemon."""

    def __init__(
        self,
        *,
        name: str,
        cfg: SiteConfig,
        telemetry: Telemetry,
        peers: PeerTable,
        membership: Membership,
        outbound: Outbound,
        inbound: Inbound,
        inboxes: Inboxes,
        trainer: Executor,
        codec: WireCodec,
        state: NodeState,
    ) -> None:
        self.me = name
        self.config = cfg
        self._telemetry = telemetry
        self._peer_table = peers
        self._membership = membership
        self._outbound = outbound
        self._inbound = inbound
        self._inboxes = inboxes
        self._trainer = trainer
        self._codec = codec
        self._state = state
        self._round = 0
        self.phase = "start"
        self._heap_frozen = False

    @property  # type: ignore[override]
    def round(self) -> int:
        return self._round

    @round.setter
    def round(self, value: int) -> None:
        self._round = value
        self._telemetry.set_round(value)
        self._state.on_progress()

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        self._telemetry.set_phase(phase)
        self._state.on_progress()
        if not self._heap_frozen and phase in FIRST_WORK_PHASES:
            # the model, the data, the optimizer (and torch._dynamo, which the
            # first optimizer imports) exist only now: freeze them too (the
            # daemon froze what it had once it served)
            self._heap_frozen = True
            log.debug("heap frozen at the first %s phase: %d objects", phase, freeze_startup_heap())

    async def after_training(self, seconds: float) -> None:
        """A round's local training just ended, after `seconds` (the round
        skeleton calls it): the fault plan's slow_train drill waits here."""
        await self._inbound.faults.after_training(self._round, seconds)

    def peers(self, alive_only: bool = True) -> list[PeerInfo]:
        return self._peer_table.peers(alive_only)

    def roster(self) -> list[str]:
        return self._membership.roster.names()

    async def send(self, peer: str, kind: str, payload: Any, round_no: int | None = None) -> None:
        await self._outbound.send_push(
            peer, kind, payload, self._round if round_no is None else round_no
        )

    async def request(self, peer: str, kind: str, query: dict[str, Any], timeout: float) -> Any:
        return await self._outbound.request(peer, kind, query, timeout)

    def serve(self, kind: str, handler: Handler) -> None:
        self._inbound.serve(kind, handler)

    def offered(self, kind: str) -> None:
        self._inbound.offers.offered(kind)

    def inbox(self, kind: str) -> asyncio.Queue[Received]:
        return self._inboxes.get(kind)

    def publish(self, key: str, value: Any) -> None:
        tensors.encode(value)  # fail here, not in the heartbeat loop, if it cannot travel
        self._membership.published[key] = value

    async def run_blocking(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._trainer, lambda: fn(*args, **kwargs))

    def checkpoint(self, state: dict[str, Any]) -> None:
        self._state.save_checkpoint(state)

    def restore(self) -> dict[str, Any] | None:
        return self._state.restored_state()

    def log_metrics(self, round_no: int, **values: float) -> None:
        self._state.log_metrics(round_no, values)

    def record_choice(self, chosen: list[str]) -> None:
        self._telemetry.record_choice(self.me, list(chosen))

    def reject(self, peer: str, reason: str) -> None:
        self._inbound.on_reject(reason, peer)

    def sample_caps(self) -> dict[str, int]:
        return {
            card.name: card.max_samples
            for card in self._membership.roster.cards()
            if card.max_samples is not None
        }

    def set_community(self, community: dict[str, Any]) -> None:
        self._telemetry.set_community(community)

    def set_training(self, training: dict[str, Any]) -> None:
        self._telemetry.set_training(training)

    def set_privacy_gate(self, decision: dict[str, Any]) -> None:
        self._telemetry.set_privacy_gate(decision)

    def pair_secret(self, peer: str, context: bytes) -> bytes:
        if peer not in self._membership.roster:
            raise PeerUnavailable(peer, "not in roster")
        return pair_secret_from_shared(self._codec.shared_secret(peer), self.me, peer, context)
