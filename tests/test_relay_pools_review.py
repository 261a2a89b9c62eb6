"""A node's per-peer pools to relays (rv_net review) are closed when their
peer leaves (rv_net2 review): a roster reload that removed an outbound-only
peer, or gave it an address, left its pool open with its connections for
the node's lifetime, one more per peer ever removed. A fake relay on
127.0.0.1."""

from __future__ import annotations

import asyncio

from test_relay_failover_review import FAST, fake_relay
from test_upload_fairness import codec

from node.transport_client import MessageClient
from p2pfl.config import TransportSection


async def test_a_removed_or_readdressed_peers_relay_pool_is_closed(identities, roster):
    alice = codec(identities, roster, "alice")
    hits: list[int] = []
    async with fake_relay(200, {"ok": True}, hits) as r1:
        client = MessageClient(TransportSection(**FAST), None)
        try:
            pools = []
            for peer in ("bob", "carol"):
                client.set_relayed_peer(peer, [r1])
                assert (await client.post(peer, alice.encode("m", peer, {})))[0] == 200
                pools.append(client._relayed[peer])
            client.remove_peer("bob")  # a reload dropped bob
            client.set_peer("carol", "127.0.0.1:9")  # and gave carol an address
            await asyncio.sleep(0.1)
            assert all(p.closed for p in pools), [p.closed for p in pools]
            assert not client._relayed
        finally:
            await client.close()
    assert hits == [200, 200]
