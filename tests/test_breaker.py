"""A peer's circuit breaker: open after failures, and half-open as soon as a
verified heartbeat from the peer arrives (node/transport_client.py
`heard_from`, called by node/membership.py for every heartbeat but a goodbye):
a peer back from a restart is asked again at once, and one more failure opens
the breaker again."""

from __future__ import annotations

import math
import socket
from types import SimpleNamespace
from typing import Any

import pytest

from node.membership import Membership, Progress
from node.peers import PeerTable
from node.telemetry import Telemetry
from node.transport_client import MessageClient, TransportError
from p2pfl.config import TransportSection
from p2pfl.secure.wire import WireError

FRAME = SimpleNamespace(chunks=[b"x"])  # never read: nothing listens


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once closed


async def reason(client: MessageClient) -> str:
    with pytest.raises(TransportError) as err:
        await client.post("peer", FRAME, timeout=2.0, retries=0)  # type: ignore[arg-type]
    return err.value.reason


async def test_a_heartbeat_half_opens_the_breaker_and_one_failure_closes_it_again() -> None:
    cfg = TransportSection(retries=0, breaker_failures=2, breaker_reset_s=600.0)
    client = MessageClient(cfg, None)
    client.set_peer("peer", f"127.0.0.1:{closed_port()}")
    try:
        assert [await reason(client), await reason(client)] == ["unreachable"] * 2
        assert client.breaker_open("peer") and await reason(client) == "circuit_open"
        client.heard_from("peer")  # its heartbeat came in: up again
        assert not client.breaker_open("peer")
        assert await reason(client) == "unreachable"  # asked again at once
        assert client.breaker_open("peer")  # and one failure opened it again
        assert await reason(client) == "circuit_open"
        client.heard_from("stranger")  # not a peer: nothing to do
    finally:
        await client.close()


def membership(client: MessageClient) -> Any:
    """The heartbeat receiver, with what `Membership.heard` uses (its payload
    is already verified and opened; a peer's own answer is spawned)."""
    m = object.__new__(Membership)
    m.name, m.client = "me", client
    m.peers = PeerTable("me", ["peer"], TransportSection())
    m.telemetry = Telemetry("me")
    m.spawn = lambda coro, name: coro.close()
    m.progress, m.published = lambda: Progress(1, "train", False), {}
    return m


HOSTILE_FIELDS = [
    {"round": math.nan, "phase": "x" * 100_000, "meta": [1, 2], "error": 7},
    {"round": -(2**63), "done": math.inf, "edges": "not a list", "choices": {"a": 1}},
    {"round": 2**80, "edges": [None, {"x": math.nan}] * 1000, "choices": [[]] * 1000},
    {},
]


async def test_a_hostile_peers_heartbeats_are_refused_or_half_open_only_its_own_breaker() -> None:
    """What a roster member can put in its (signed) heartbeat: a payload that is
    not a map is refused `payload_schema` and leaves the breaker open; a goodbye
    (any truthy `bye`, NaN too) leaves it open; any other field NaN, infinite,
    negative, huge or of the wrong type half-opens only the sender's own
    breaker, and no crash. Ten thousand heartbeats in the name of a site this
    node has no link to make no link, no record and no breaker."""
    cfg = TransportSection(retries=0, breaker_failures=1, breaker_reset_s=600.0)
    client = MessageClient(cfg, None)
    client.set_peer("peer", f"127.0.0.1:{closed_port()}")
    m = membership(client)
    try:

        async def opened() -> None:
            await reason(client)
            assert client.breaker_open("peer")

        await opened()
        for beat in ([1, 2], None, "beat", 3.5):
            with pytest.raises(WireError) as refused:
                m.heard("peer", beat)
            assert refused.value.reason == "payload_schema"
            assert client.breaker_open("peer")
        for bye in (True, 1, "no", math.nan, [0]):
            m.heard("peer", {"bye": bye})
            assert client.breaker_open("peer"), bye
        for beat in HOSTILE_FIELDS:
            m.heard("peer", beat)
            assert not client.breaker_open("peer"), beat
            await opened()
        links, records = set(client.links), set(m.peers.records)
        for _ in range(10_000):
            m.heard("stranger", {"round": 1})
        assert set(client.links) == links and set(m.peers.records) == records
        assert client.breaker_open("peer")  # a stranger's beats are not the peer's
    finally:
        await client.close()


async def test_a_peers_phase_and_error_are_kept_as_short_printable_lines(caplog) -> None:
    """A roster member's heartbeat strings are stored, shown on /status and
    logged: an 8 MiB phase is kept as 64 characters (a 64 MiB one stalled
    /status for 1.5 s), and an error with newlines cannot write a line of the
    log of its own (the failed-peer warning names it)."""
    client = MessageClient(TransportSection(), None)
    client.set_peer("peer", f"127.0.0.1:{closed_port()}")
    m = membership(client)
    forged = "DataError\n2026-11-27 19:30:00,000 WARNING node.daemon: me: roster reloaded"
    try:
        m.heard("peer", {"round": 1, "phase": "x" * (8 << 20) + "\n", "error": forged})
        (shown,) = m.telemetry.status_json("me", "probe")["peers"]
        assert shown["phase"] == "x" * 64 and m.peers.records["peer"].info.phase == "x" * 64
        m.heard("peer", {"round": 2, "phase": "train\x1b[2J\u202e", "error": "E" * 500})
        assert m.peers.records["peer"].info.phase == "train?[2J?"
        assert m.peers.records["peer"].error == "E" * 80
        with caplog.at_level("WARNING", logger="node.membership"):
            m.heard("peer", {"round": 3, "phase": "failed", "error": forged})
        (warning,) = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
        assert "\n" not in warning and "DataError?2026-11-27" in warning, warning
    finally:
        await client.close()
