"""One source address cannot hold a port (node/listen.py's per-source cap).

Before the cap, a stranger who kept its connections alive (a cheap request
before each keep-alive ran out) or sent requests slowly could hold every place
of the peer port, up to `transport.max_connections`, from one address. Real
servers on 127.0.0.x in this process, with the loopback exemption turned off
so that 127.0.0.2 and 127.0.0.3 count as two sources (a local federation's
nodes all come from 127.0.0.1, which is why loopback is exempt by default)."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from aiohttp import web

from node.listen import (
    CONNECTION_LIMIT,
    SOURCE_CONNECTION_LIMIT,
    ConnectionGate,
    bound_port,
    serve_app,
    source_of,
)

KEEP_ALIVE_REQUEST = b"GET /x HTTP/1.1\r\nHost: localhost\r\n\r\n"
HALF_A_REQUEST = b"GET /x HTTP/1.1\r\nHost: loc"


def test_sources_are_addresses_ipv6_by_its_64_and_loopback_is_exempt() -> None:
    assert source_of(("10.1.2.3", 5000)) == "10.1.2.3"
    a = source_of(("2001:db8:1:2::7", 5000, 0, 0))
    assert a is not None and a == source_of(("2001:db8:1:2:ffff::9", 1, 0, 0))  # one /64
    assert a != source_of(("2001:db8:1:3::7", 1, 0, 0))
    assert source_of(("::ffff:10.1.2.3", 1, 0, 0)) == "10.1.2.3"  # IPv4-mapped
    assert source_of(("64:ff9b::a01:203", 1, 0, 0)) == "10.1.2.3"  # NAT64 (RFC 6052)
    assert source_of(("64:ff9b::a01:204", 1, 0, 0)) == "10.1.2.4"  # not one key for all
    # link-local: the same /64 on two interfaces is two sources
    assert source_of(("fe80::1%eth0", 1, 0, 2)) != source_of(("fe80::1%eth1", 1, 0, 3))
    assert source_of(("fe80::1%eth0", 1, 0, 2)) == source_of(("fe80::2%eth0", 1, 0, 2))
    assert source_of(("127.0.0.1", 1)) is None
    assert source_of(("::1", 1, 0, 0)) is None
    assert source_of(("::ffff:127.0.0.1", 1, 0, 0)) is None
    assert source_of(("64:ff9b::7f00:1", 1, 0, 0)) == "127.0.0.1"  # not loopback as received
    assert source_of(("127.0.0.2", 1), loopback_exempt=False) == "127.0.0.2"
    assert source_of("/run/sock") is None  # a Unix socket
    assert source_of(None) is None
    assert source_of(("not an address", 1)) is None


async def _serve(limit: int, per_source: int | None) -> tuple[web.AppRunner, int, Counter]:
    async def answer(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/x", answer)
    refused: Counter = Counter()
    gate = ConnectionGate(
        limit,
        30.0,
        lambda reason: refused.update([reason]),
        per_source=per_source,
        loopback_exempt=False,
    )
    runner = await serve_app(app, "127.0.0.1", 0, gate=gate, keepalive_s=30.0)
    return runner, bound_port(runner, 0), refused


async def _connect(source: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))


async def _kept_alive(source: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection that asks once and keeps its place (HTTP/1.1 keep-alive)."""
    reader, writer = await _connect(source, port)
    writer.write(KEEP_ALIVE_REQUEST)
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"ok"), 5)
    assert head.startswith(b"HTTP/1.1 200")
    return reader, writer


async def _answered(source: str, port: int) -> bool:
    """Does a request from `source` get its answer (not a closed connection)?"""
    try:
        reader, writer = await _connect(source, port)
        writer.write(b"GET /x HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        return answer.startswith(b"HTTP/1.1 200")
    except (ConnectionError, asyncio.IncompleteReadError):
        return False


async def _closed_by_server(reader: asyncio.StreamReader, timeout: float = 2.0) -> bool:
    """Did the server close this connection (within `timeout`)?"""
    try:
        return await asyncio.wait_for(reader.read(1), timeout) == b""
    except TimeoutError:
        return False  # still open: nothing to read
    except ConnectionError:
        return True


async def test_without_a_per_source_cap_one_address_holds_the_port() -> None:
    """The attack the cap is for: 8 kept-alive connections from 127.0.0.2 fill
    a port of 8 places, and 127.0.0.3's request is closed unanswered."""
    runner, port, refused = await _serve(limit=8, per_source=None)
    try:
        held = [await _kept_alive("127.0.0.2", port) for _ in range(8)]
        assert not await _answered("127.0.0.3", port)
        assert refused[CONNECTION_LIMIT] >= 1
        for _, w in held:
            w.close()
    finally:
        await runner.cleanup()


async def test_one_address_holds_at_most_its_share_and_others_still_get_in() -> None:
    runner, port, refused = await _serve(limit=8, per_source=3)
    try:
        held = [await _kept_alive("127.0.0.2", port) for _ in range(3)]
        # a fourth from the same address: its three places all hold a request
        # or a keep-alive connection, so it is closed at once, counted
        assert not await _answered("127.0.0.2", port)
        assert refused[SOURCE_CONNECTION_LIMIT] == 1
        assert not any([await _closed_by_server(r, 0.2) for r, _ in held])  # theirs kept
        # another address gets in, again and again
        for _ in range(5):
            assert await _answered("127.0.0.3", port)
        assert refused[CONNECTION_LIMIT] == 0
        for _, w in held:
            w.close()
    finally:
        await runner.cleanup()


async def test_a_source_at_its_cap_pushes_out_its_own_silent_connection_first() -> None:
    """Half-open connections (headers never finished) from one address: one
    more from it takes the place of its own oldest one, not anyone else's."""
    runner, port, refused = await _serve(limit=8, per_source=3)
    try:
        other_reader, other = await _kept_alive("127.0.0.3", port)
        silent = []
        for _ in range(3):
            r, w = await _connect("127.0.0.2", port)
            w.write(HALF_A_REQUEST)
            await w.drain()
            silent.append((r, w))
        await asyncio.sleep(0.1)
        newest_reader, newest = await _connect("127.0.0.2", port)
        newest.write(HALF_A_REQUEST)
        await newest.drain()
        assert await _closed_by_server(silent[0][0])  # its own oldest went
        assert refused[SOURCE_CONNECTION_LIMIT] == 1
        assert not await _closed_by_server(silent[1][0], 0.2)
        assert not await _closed_by_server(other_reader, 0.2)  # the other source's stays
        assert not await _closed_by_server(newest_reader, 0.2)
        for w in [other, newest, *(w for _, w in silent)]:
            w.close()
    finally:
        await runner.cleanup()


def test_the_cap_is_on_by_default_and_null_turns_it_off() -> None:
    """Behind a proxy or load balancer that hides the peers' addresses every
    peer comes from one source: such a site sets the cap to null."""
    from p2pfl.config import TransportSection
    from p2pfl.config.relay import RelayTransportSection

    assert TransportSection().max_connections_per_source == 256
    assert TransportSection(max_connections_per_source=None).max_connections_per_source is None
    assert RelayTransportSection(max_connections_per_source=None).max_connections_per_source is None
    with pytest.raises(ValueError):
        TransportSection(max_connections_per_source=0)
