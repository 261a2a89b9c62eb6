"""Set-up the relay and wire review tests share (tests/test_relay_*_review.py,
tests/test_wire_id*_review.py): a real MessageServer on 127.0.0.1 that records
what it processed."""

from __future__ import annotations

from aiohttp import web
from test_upload_fairness import recorder

from node.relay_wire import RELAY_MESSAGE_PATH
from node.transport import MessageServer
from p2pfl.config import TransportSection


async def recording_server(
    codec, processed: list[str], *, relay_route: bool = False
) -> tuple[MessageServer, int]:
    """`codec`'s MessageServer, started; the ids it processes go to
    `processed`. With `relay_route` it also takes frames on the relay's path,
    so that it stands in for an honest relay to itself."""
    server = MessageServer(codec, TransportSection(), recorder(codec, processed), lambda r, s: None)
    if relay_route:
        server.extra_routes.append(
            lambda app: app.router.add_post(RELAY_MESSAGE_PATH, server.handle)
        )
    return server, await server.start("127.0.0.1", 0, None)


async def serve_relay(handler) -> tuple[web.AppRunner, str]:
    """A fake relay on 127.0.0.1 whose relay path `handler` answers; its
    runner and address."""
    app = web.Application()
    app.router.add_post(RELAY_MESSAGE_PATH, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"127.0.0.1:{runner.addresses[0][1]}"
