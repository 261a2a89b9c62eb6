"""A peer's circuit breaker: open after failures, and half-open as soon as a
verified heartbeat from the peer arrives (node/transport_client.py
`heard_from`, called by node/membership.py for every heartbeat but a goodbye):
a peer back from a restart is asked again at once, and one more failure opens
the breaker again."""

from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest

from node.transport_client import MessageClient, TransportError
from p2pfl.config import TransportSection

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
