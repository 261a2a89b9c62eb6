"""A heartbeat broadcast to many outbound-only sites behind one relay (read-back
review). Each outbound-only peer has its own pool of connections to its relays
since the rv_net review (node/transport_client.py `_relayed`), so a node's
broadcast reaches the relay on as many connections at once as it has such
peers, where one shared pool let 8 through at a time. The relay holds 8 of a
sender's frames and queues 32 (node/relay_admission.py); one more is refused
`too_many_connections`. Real relay and client on 127.0.0.1, real signed,
encrypted frames (the helpers of tests/test_relay.py)."""

from __future__ import annotations

import asyncio
import dataclasses

from test_relay import FED, RelaySite, relay

from node.transport_client import MessageClient
from p2pfl.config import TransportSection
from p2pfl.secure.identity import LocalIdentity, Roster
from p2pfl.secure.wire import WireCodec

BEHIND = [f"c{i}" for i in range(100)]


def test_a_heartbeat_broadcast_to_100_sites_behind_one_relay_is_not_refused():
    ids = {n: LocalIdentity.generate(n) for n in ("a", *BEHIND)}
    behind = [dataclasses.replace(ids[n].card(), address=None, via=("r1",)) for n in BEHIND]
    roster = Roster([ids["a"].card("127.0.0.1:7001"), *behind], None, relays={"r1": "x:1"})
    a = WireCodec(ids["a"], roster, FED, require_encryption=True)

    async def scenario() -> list[object]:
        async with relay(roster) as (_server, url):
            sites = [RelaySite(ids[n], roster) for n in BEHIND]
            for site in sites:
                await site.connect(url)
            client = MessageClient(TransportSection(), None)
            for name in BEHIND:
                client.set_relayed_peer(name, [url.removeprefix("http://")])
            try:
                beats = [a.encode("heartbeat", n, {"round": 1}, encrypt=True) for n in BEHIND]
                return await asyncio.gather(
                    *(
                        client.post(n, b, timeout=10, retries=0, probe=True)
                        for n, b in zip(BEHIND, beats, strict=True)
                    ),
                    return_exceptions=True,
                )
            finally:
                await client.close()
                for site in sites:
                    await site.close()

    answers = asyncio.run(asyncio.wait_for(scenario(), 120))
    refused = [x if isinstance(x, BaseException) else x[1][:80] for x in answers]
    refused = [
        x
        for x, y in zip(refused, answers, strict=True)
        if not (isinstance(y, tuple) and y[0] == 200)
    ]
    assert not refused, refused
