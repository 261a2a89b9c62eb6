"""A site connection the relay closes (replaced by the site's newer one, a
roster change, the relay's shutdown) is gone within a deadline even if the
site reads nothing (rv_net review). Real aiohttp servers on 127.0.0.1 and
real signed, encrypted frames (the helpers of tests/test_relay.py)."""

from __future__ import annotations

import asyncio
import os

import aiohttp
import test_relay
from test_relay import frame, post, relay, until

from node.relay_handshake import fetch_challenge, proof_headers
from node.relay_wire import RELAY_CONNECT_PATH

ids = test_relay.ids  # the relay tests' shared fixtures (module scope)
roster = test_relay.roster


async def dial(session: aiohttp.ClientSession, url: str, site) -> aiohttp.ClientWebSocketResponse:
    challenge = await fetch_challenge(session, url, True)
    headers = proof_headers(site, challenge["federation"], challenge["relay"], challenge["nonce"])
    return await session.ws_connect(url + RELAY_CONNECT_PATH, headers=headers)


def test_a_replaced_connection_whose_site_reads_nothing_is_closed_in_time(ids, roster):
    """Attack: b has the relay stream a 7 MiB frame down its connection (a frame
    of its own, to itself), reads none of it, and connects again. Before the
    fix the relay's close of the replaced connection waited for b to take the
    close frame, for good: the connection stayed open, its reader with it
    (up to a message of max_message_bytes each), as many as b made. Now it is
    aborted once the close's deadline (2 x min(10, auth_timeout_s)) passes."""
    b = test_relay.codec(ids, roster, "b")

    async def scenario() -> None:
        async with relay(roster, auth_timeout_s=1) as (server, url):
            sessions = [aiohttp.ClientSession() for _ in range(2)]
            sends = []
            try:
                first = await dial(sessions[0], url, ids["b"])
                await until(lambda: "b" in server.links)
                link = server.links["b"]
                big = frame(b, "b", {"x": os.urandom(7 << 20)})
                sends.append(asyncio.create_task(post(url, big)))
                await asyncio.sleep(1.0)  # its pieces fill what b does not read
                await dial(sessions[1], url, ids["b"])
                await until(lambda: server.links.get("b") not in (None, link))
                # the relay's end of the replaced connection (aiohttp's request transport)
                transport = link.ws._req.transport  # type: ignore[union-attr]
                await until(lambda: transport.is_closing() and not server._tasks, 8.0)
                await asyncio.sleep(0.2)
                assert transport.get_write_buffer_size() == 0  # aborted, not left to flush
                assert first is not None
            finally:
                for task in sends:
                    task.cancel()
                await asyncio.gather(*sends, return_exceptions=True)
                for s in sessions:
                    await s.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))
