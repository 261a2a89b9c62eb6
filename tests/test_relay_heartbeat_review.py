"""A heartbeat's answer through a relay is checked like a push's (rv_net2
review): the receiver signs its acknowledgement of a heartbeat too, but the
sender never verified it, so a relay that answered every heartbeat 200 (or
409 `replayed`) without forwarding it held the link on itself, and the peer
heard none of this node's heartbeats though its other relay was fine. Fake
relays and a real MessageServer on 127.0.0.1."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from relay_review_util import recording_server
from test_relay_failover_review import FAST, fake_relay
from test_upload_fairness import codec

from node.membership import Membership, Progress
from node.telemetry import Telemetry
from node.transport_client import MessageClient
from p2pfl.config import TransportSection


@pytest.mark.parametrize(
    ("status", "body"), [(200, {"ok": True, "ack": "A" * 88}), (409, {"reason": "replayed"})]
)
async def test_a_relay_answering_heartbeats_itself_does_not_hold_them(
    identities, roster, status, body
):
    alice = codec(identities, roster, "alice")
    bob = codec(identities, roster, "bob")
    heard: list[str] = []
    server, port = await recording_server(bob, heard, relay_route=True)
    forged: list[int] = []
    client = MessageClient(TransportSection(**FAST), None)
    tcfg = TransportSection(heartbeat_s=0.5)
    member = Membership(
        name="alice",
        cfg=SimpleNamespace(transport=tcfg, wire=SimpleNamespace(encryption=False)),  # type: ignore[arg-type]
        roster=alice.roster,
        codec=alice,
        client=client,
        peers=None,  # type: ignore[arg-type]
        telemetry=Telemetry("alice"),
        inboxes=None,  # type: ignore[arg-type]
        progress=lambda: Progress(0, "train", False),
        spawn=lambda coro, name: coro.close(),
    )
    try:
        async with fake_relay(status, body, forged) as r1:
            for peer in list(client.links):
                client.remove_peer(peer)
            client.set_relayed_peer("bob", [r1, f"127.0.0.1:{port}"])
            for _ in range(3):
                await member.broadcast()
                await asyncio.sleep(0.05)
    finally:
        await client.close()
        await server.stop()
    assert len(forged) == 1 and len(heard) == 2, (forged, heard)
