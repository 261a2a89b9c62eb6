"""What the in-memory network (network.py) keeps of each node: its faults,
handlers, inboxes, checkpoint, key pair and the traffic it sent, and the one
`PeerInfo` its peers see of it, updated in place.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from p2pfl.config import SiteConfig
from protocols.base import Handler, Kept, Offers, PeerInfo, Received


@dataclass
class KindTraffic:
    messages: int = 0
    bytes: int = 0


@dataclass
class Traffic:
    """What one node sent: requests, responses and pushes (heartbeat gossip is not counted)."""

    messages_sent: int = 0
    bytes_sent: int = 0
    by_kind: dict[str, KindTraffic] = field(default_factory=dict)

    def add(self, kind: str, nbytes: int) -> None:
        self.messages_sent += 1
        self.bytes_sent += nbytes
        entry = self.by_kind.setdefault(kind, KindTraffic())
        entry.messages += 1
        entry.bytes += nbytes

    def as_dict(self) -> dict[str, Any]:
        return {
            "messages_sent": self.messages_sent,
            "bytes_sent": self.bytes_sent,
            "by_kind": {
                k: {"messages": v.messages, "bytes": v.bytes}
                for k, v in sorted(self.by_kind.items())
            },
        }


@dataclass
class MemoryNode:
    name: str
    config: SiteConfig | None
    alive: bool = True
    partitioned: bool = False
    silent: bool = False
    latency_s: float = 0.0
    failed: str = ""  # the kind of error that stopped its protocol ("" while it runs)
    handlers: dict[str, Handler] = field(default_factory=dict)
    offers: Offers = field(default_factory=Offers)
    inboxes: dict[str, asyncio.Queue[Received]] = field(default_factory=dict)
    traffic: Traffic = field(default_factory=Traffic)
    checkpoint: bytes | None = None
    # the last Kept payload a handler returned and its encoded size
    kept_reply: tuple[Kept, int] | None = None
    task: asyncio.Task[None] | None = None
    round_events: dict[int, asyncio.Event] = field(default_factory=dict)
    agreement: X25519PrivateKey = field(default_factory=X25519PrivateKey.generate)
    # What peers() shows of it, and the one record of its round, phase, published
    # metadata and last-seen time (the properties below): updated in place.
    info: PeerInfo = field(init=False)

    def __post_init__(self) -> None:
        self.info = PeerInfo(name=self.name, state="alive", round=0)

    @property
    def round(self) -> int:
        return self.info.round

    @round.setter
    def round(self, value: int) -> None:
        self.info.round = value

    @property
    def phase(self) -> str:
        return self.info.phase

    @phase.setter
    def phase(self, value: str) -> None:
        self.info.phase = value

    @property
    def meta(self) -> dict[str, Any]:
        return self.info.meta

    @property
    def last_seen(self) -> float:
        return self.info.last_seen

    @last_seen.setter
    def last_seen(self, value: float) -> None:
        self.info.last_seen = value


def new_inbox(node: MemoryNode) -> asyncio.Queue[Received]:
    size = node.config.transport.inbox_size if node.config is not None else 0
    return asyncio.Queue(maxsize=size)
