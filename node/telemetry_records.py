"""The records `Telemetry` (node/telemetry.py) keeps, and the schema of what
peers gossip about the traffic graph: a peer's edges and neighbour choices are
untrusted input, validated here entry by entry and bounded in number.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

logger = logging.getLogger("node.telemetry")  # the name its messages had before the split

# Peer names and kinds on the wire are short; anything longer is not worth a label.
MAX_NAME_CHARS = 128
# Edges a single peer may report in one gossip (a federation is tens of sites).
MAX_REMOTE_EDGES_PER_PEER = 4096


@dataclass
class EdgeStats:
    """Traffic along one directed edge source -> target."""

    messages: int = 0
    bytes: int = 0
    last: float = 0.0


@dataclass
class PeerGauge:
    """A peer as last reported by the heartbeat layer."""

    state: str = "unknown"
    round: int = -1
    phase: str = ""
    last_seen: float = 0.0
    error: str = ""  # a failed peer's error kind


@dataclass
class TrafficCounter:
    messages: int = 0
    bytes: int = 0

    def add(self, nbytes: int) -> None:
        self.messages += 1
        self.bytes += nbytes


@dataclass
class MetricPoint:
    round: int
    time: float
    values: dict[str, float]


# Bounds of a gossiped count and time: no honest node sends more (2^53, exact
# in a float; a Unix time before the year 2286), and with "the larger count
# wins" a peer claiming 2^63 - 1 messages took over an edge (review 6).
MAX_GOSSIP_COUNT = 2**53
MAX_GOSSIP_TIME = 1e10


class RemoteEdge(BaseModel):
    """One edge as a peer gossips it (untrusted input, so validated)."""

    model_config = ConfigDict(extra="ignore")

    source: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    target: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    messages: int = Field(ge=0, le=MAX_GOSSIP_COUNT)
    bytes: int = Field(ge=0, le=MAX_GOSSIP_COUNT)
    last: float = Field(0.0, ge=0.0, le=MAX_GOSSIP_TIME, allow_inf_nan=False)


class RemoteChoice(BaseModel):
    """One who-chose-whom count as a peer gossips it."""

    model_config = ConfigDict(extra="ignore")

    chooser: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    chosen: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    count: int = Field(ge=0, le=MAX_GOSSIP_COUNT)


GossipEntry = TypeVar("GossipEntry", RemoteEdge, RemoteChoice)


def valid_entries(
    model: type[GossipEntry],
    entries: list[Any],
    peer_name: str,
    what: str,
    limit: int = MAX_REMOTE_EDGES_PER_PEER,
) -> tuple[list[GossipEntry], int]:
    """The entries of a peer's gossip that validate as `model` (at most the
    first `limit` entries, never more than MAX_REMOTE_EDGES_PER_PEER, are
    looked at), and how many were malformed (dropped; the caller counts them)."""
    valid: list[GossipEntry] = []
    dropped = 0
    for raw in entries[: min(limit, MAX_REMOTE_EDGES_PER_PEER)]:
        try:
            valid.append(model.model_validate(raw))
        except ValidationError as error:
            dropped += 1
            logger.debug("dropping malformed %s from %s: %s", what, peer_name, error)
    return valid, dropped


def edge_dict(key: tuple[str, str], stats: EdgeStats) -> dict[str, Any]:
    source, target = key
    return {
        "source": source,
        "target": target,
        "messages": stats.messages,
        "bytes": stats.bytes,
        "last": stats.last,
    }
