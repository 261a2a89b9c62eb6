"""NodeContext: the RoundContext a protocol gets on a real node.

Every verb delegates to the part of the `Node` that does it (node/daemon.py
wires them): sends and requests to its Outbound, serving to its Inbound,
gossip to its Membership; round and phase changes reach the telemetry and the
fault plan. Artifacts live under `node.state_dir` (RoundContext.artifact).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from p2pfl.secure import tensors
from protocols.base import Handler, PeerInfo, PeerUnavailable, Received, RoundContext
from protocols.masking import pair_secret_from_shared

if TYPE_CHECKING:
    from node.daemon import Node


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
        return self.node.membership.roster.names()

    async def send(self, peer: str, kind: str, payload: Any, round: int | None = None) -> None:
        await self.node.outbound.send_push(
            peer, kind, payload, self._round if round is None else round
        )

    async def request(self, peer: str, kind: str, query: dict[str, Any], timeout: float) -> Any:
        return await self.node.outbound.request(peer, kind, query, timeout)

    def serve(self, kind: str, handler: Handler) -> None:
        self.node.inbound.serve(kind, handler)

    def offered(self, kind: str) -> None:
        self.node.inbound.offers.offered(kind)

    def inbox(self, kind: str) -> asyncio.Queue[Received]:
        return self.node.inboxes.get(kind)

    def publish(self, key: str, value: Any) -> None:
        tensors.encode(value)  # fail here, not in the heartbeat loop, if it cannot travel
        self.node.membership.published[key] = value

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
        self.node.inbound.on_reject(reason, peer)

    def sample_caps(self) -> dict[str, int]:
        return {
            card.name: card.max_samples
            for card in self.node.membership.roster.cards()
            if card.max_samples is not None
        }

    def set_community(self, community: dict[str, Any]) -> None:
        self.node.telemetry.set_community(community)

    def set_training(self, training: dict[str, Any]) -> None:
        self.node.telemetry.set_training(training)

    def set_privacy_gate(self, decision: dict[str, Any]) -> None:
        self.node.telemetry.set_privacy_gate(decision)

    def pair_secret(self, peer: str, context: bytes) -> bytes:
        if peer not in self.node.membership.roster:
            raise PeerUnavailable(peer, "not in roster")
        return pair_secret_from_shared(self.node.codec.shared_secret(peer), self.me, peer, context)
