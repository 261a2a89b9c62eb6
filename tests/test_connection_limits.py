"""Connections that hold a port's file descriptors without finishing a
request (node/listen.py). In the review, 150 connections per port that sent
half a request line and then nothing were kept for an hour (aiohttp's
keep-alive, 3630 s, and no deadline on headers): 300 descriptors, and at the
process's limit the node could not write its checkpoints nor answer /healthz,
while asyncio logged a traceback per failed accept (57,026 lines in 20 s).
Real servers on 127.0.0.1, in this process; each test well under 30 s."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time

import pytest

from node.listen import CONNECTION_LIMIT, HEADERS_TOO_SLOW
from node.logsetup import ACCEPT_FAILURES, quiet_network_noise
from node.status import (
    STATUS_HEADER_TIMEOUT_S,
    STATUS_MAX_CONNECTIONS,
    create_status_app,
    start_status_server,
)
from node.telemetry import Telemetry
from node.transport import MessageServer
from p2pfl.config import TransportSection

HALF_A_REQUEST = b"GET /status HTTP/1.1\r\nHost: loc"


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def half_open(port: int, n: int) -> list[socket.socket]:
    """n connections that each send half a request line, then nothing."""
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(HALF_A_REQUEST)
        s.setblocking(False)
        socks.append(s)
    return socks


def closed_by_server(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False  # open: nothing to read yet
    except ConnectionResetError:
        return True


async def wait_until(predicate, timeout: float, step: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(step)
    return predicate()


async def healthz(port: int) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
    answer = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return answer


async def test_half_open_requests_to_the_status_port_are_capped_and_cut_off() -> None:
    """The status server as the node runs it (its defaults): 100 connections
    that never finish a request line. Past STATUS_MAX_CONNECTIONS each new one
    takes the place of the oldest, so at most that many are held, and an
    honest request still gets in; the rest are closed once
    STATUS_HEADER_TIMEOUT_S is up. Every one counted; the descriptors come back."""
    telemetry = Telemetry("a")
    app = create_status_app(telemetry, node_name="a", protocol_name="probe", token="t" * 32)
    before = open_fds()
    runner, port = await start_status_server(app, "127.0.0.1", 0)
    socks = half_open(port, 100)
    extra = 100 - STATUS_MAX_CONNECTIONS
    try:
        assert await wait_until(lambda: sum(map(closed_by_server, socks)) >= extra, 3)
        rejected = telemetry.status_json("a", "probe")["rejected"]
        assert rejected == {CONNECTION_LIMIT: extra}
        held = [s for s in socks if not closed_by_server(s)]
        assert len(held) == STATUS_MAX_CONNECTIONS  # each new one pushed out an older one
        assert (await healthz(port)).startswith(b"HTTP/1.1 200")  # and so does an honest one
        held = [s for s in held if not closed_by_server(s)]
        assert len(held) == STATUS_MAX_CONNECTIONS - 1
        assert await wait_until(
            lambda: all(map(closed_by_server, held)), STATUS_HEADER_TIMEOUT_S + 3, step=0.25
        )
        rejected = telemetry.status_json("a", "probe")["rejected"]
        assert rejected == {CONNECTION_LIMIT: extra + 1, HEADERS_TOO_SLOW: len(held)}
        for s in socks:
            s.close()
        assert (await healthz(port)).startswith(b"HTTP/1.1 200")
        # the server's side of every connection is closed too
        assert await wait_until(lambda: open_fds() <= before + 4, 3), (before, open_fds())
    finally:
        for s in socks:
            s.close()
        await runner.cleanup()


async def test_headers_in_when_a_stalled_event_loop_wakes_are_not_cut_off() -> None:
    """The node's event loop blocked (a collection, a slow step) past a
    connection's header deadline while the headers arrived: on waking, the
    deadline and the bytes are due in the same round of the loop, and the
    request is answered, not cut off."""
    telemetry = Telemetry("a")
    app = create_status_app(telemetry, node_name="a", protocol_name="probe", token=None)
    runner, port = await start_status_server(app, "127.0.0.1", 0, header_timeout_s=0.2)
    try:
        s = socket.create_connection(("127.0.0.1", port))
        await asyncio.sleep(0.05)  # accepted: its deadline runs
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        time.sleep(0.4)  # the loop stalls past the deadline
        s.setblocking(False)
        answer = b""

        def answered() -> bool:
            nonlocal answer
            try:
                chunk = s.recv(65536)
            except (BlockingIOError, ConnectionResetError):
                return False
            answer += chunk
            return not chunk

        assert await wait_until(answered, 3)
        assert answer.startswith(b"HTTP/1.1 200"), answer
        assert HEADERS_TOO_SLOW not in telemetry.status_json("a", "probe")["rejected"]
        s.close()
    finally:
        await runner.cleanup()


async def test_an_idle_keep_alive_connection_to_the_status_port_is_closed() -> None:
    """After a whole request and its answer, a connection that says nothing
    more is closed after the keep-alive time (aiohttp's default: an hour)."""
    app = create_status_app(Telemetry("a"), node_name="a", protocol_name="probe", token=None)
    runner, port = await start_status_server(app, "127.0.0.1", 0, keepalive_s=1.0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")  # keep-alive
        assert (await reader.readuntil(b"ok")).startswith(b"HTTP/1.1 200")
        started = time.monotonic()
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the server
        assert time.monotonic() - started < 4  # (at once now: no keep-alive on this port)
        writer.close()
    finally:
        await runner.cleanup()


async def test_the_peer_port_caps_its_connections_and_cuts_off_slow_headers(codecs) -> None:
    """The peer port: transport.max_connections at once, and a request's
    headers within read_idle_timeout_s; refusals reach the node's counter.
    With every place held by a request in progress (its body stalled: the
    transport's own limits cut it off), one more connection is closed at once."""
    refused: list[tuple[str, str | None]] = []
    cfg = TransportSection(max_connections=16, read_idle_timeout_s=1.0)

    async def on_frame(incoming):  # pragma: no cover - no frame gets this far
        raise AssertionError("no request was finished")

    server = MessageServer(
        codecs["alice"], cfg, on_frame, lambda reason, who: refused.append((reason, who))
    )
    port = await server.start("127.0.0.1", 0, None)
    stalled = []
    for _ in range(16):  # whole headers, no body
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"POST /p2pfl/v1/message HTTP/1.1\r\nHost: a\r\nContent-Length: 100\r\n\r\n")
        s.setblocking(False)
        stalled.append(s)
    await asyncio.sleep(0.3)  # each is a request being read now
    socks = half_open(port, 8)
    try:
        assert await wait_until(lambda: all(map(closed_by_server, socks)), 0.8)
        assert refused == [(CONNECTION_LIMIT, None)] * 8
        assert await wait_until(lambda: len(refused) == 24, 4)
        assert refused[8:] == [("truncated", None)] * 16  # node/transport.py's own limit
        for s in stalled:
            s.close()  # (aiohttp lingers 10 s for the rest of an unread body)
        await asyncio.sleep(0.2)
        slow = half_open(port, 4)
        assert await wait_until(lambda: all(map(closed_by_server, slow)), 4)
        assert refused[24:] == [(HEADERS_TOO_SLOW, None)] * 4
        socks += slow
    finally:
        for s in socks + stalled:
            s.close()
        await server.stop()


async def test_an_idle_peer_connection_is_closed_after_the_keep_alive(codecs, monkeypatch) -> None:
    """A peer port's idle connection is closed (after SERVER_KEEPALIVE_S, more
    than the client's pool keeps one: shortened here), and one that starts a
    next request and stops is closed too."""
    import node.transport

    monkeypatch.setattr(node.transport, "SERVER_KEEPALIVE_S", 1.0)
    server = MessageServer(codecs["alice"], TransportSection(), None, lambda r, w: None)
    port = await server.start("127.0.0.1", 0, None)
    try:
        for then in (b"", b"POST /p2pfl/v1/message HTTP/1.1\r\nHost: a"):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /nothing HTTP/1.1\r\nHost: localhost\r\n\r\n" + then)
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 40")
            started = time.monotonic()
            while await asyncio.wait_for(reader.read(65536), 5):
                pass  # the 404's body, then the close
            assert time.monotonic() - started < 4, then
            writer.close()
    finally:
        await server.stop()


def test_a_flood_of_failed_accepts_is_one_line_of_log(caplog) -> None:
    """asyncio's "socket.accept() out of system resource", with its traceback,
    once per failed accept: the node's log keeps one line a minute, with how
    many it left out (ACCEPT_FAILURES.total counts them all)."""
    quiet_network_noise()
    ACCEPT_FAILURES.last = float("-inf")  # as in a fresh process
    total = ACCEPT_FAILURES.total
    loop = asyncio.new_event_loop()
    try:
        with socket.socket() as listening, caplog.at_level(logging.DEBUG, logger="asyncio"):
            for _ in range(5000):
                loop.call_exception_handler(
                    {
                        "message": "socket.accept() out of system resource",
                        "exception": OSError(24, "Too many open files"),
                        "socket": listening,
                    }
                )
    finally:
        loop.close()
    lines = [r for r in caplog.records if r.name == "asyncio"]
    assert len(lines) == 1, len(lines)
    assert lines[0].levelname == "WARNING" and lines[0].exc_info is None
    message = lines[0].getMessage()
    assert (
        message.startswith("cannot accept connections: Too many open files") and "\n" not in message
    )
    assert ACCEPT_FAILURES.total - total == 5000 and ACCEPT_FAILURES.left_out == 4999


@pytest.mark.parametrize("limit", [1 << 20])
def test_a_port_never_holds_more_than_half_the_descriptor_limit(limit: int) -> None:
    import resource

    from node.listen import ConnectionGate

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    gate = ConnectionGate(limit, 1.0, lambda reason: None)
    assert gate.limit == (limit if soft == resource.RLIM_INFINITY else min(limit, soft // 2))


async def test_with_tls_failed_and_stalled_handshakes_hold_no_place(codecs, tmp_path) -> None:
    """A handshake that fails tells the server's application nothing: counted
    from the accept, 20 strangers' failed handshakes would have held every
    place of a 4-connection port until their deadline. Counted from the
    handshake's end, they hold none: peers with certificates still get all 4.
    A handshake that never goes on is given up at the header deadline
    (asyncio's own default: 60 s)."""
    import ssl

    from test_tls import make_pki

    from node.tls import client_ssl_context, server_ssl_context

    make_pki(tmp_path, ["alice", "bob"])
    pki = {n: str(tmp_path / n) for n in ("alice.crt", "alice.key", "bob.crt", "bob.key", "ca.pem")}
    refused: list[str] = []
    cfg = TransportSection(max_connections=4, read_idle_timeout_s=1.0)
    server = MessageServer(codecs["alice"], cfg, None, lambda reason, who: refused.append(reason))
    ssl_context = server_ssl_context(pki["alice.crt"], pki["alice.key"], pki["ca.pem"])
    port = await server.start("127.0.0.1", 0, ssl_context)
    stranger = ssl.create_default_context(cafile=pki["ca.pem"])  # no certificate of its own
    peer = client_ssl_context(pki["bob.crt"], pki["bob.key"], pki["ca.pem"])
    writers = []
    try:
        for _ in range(20):
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=stranger)
                writer.write(HALF_A_REQUEST)
                await writer.drain()
                writers.append(writer)
            except (ssl.SSLError, ConnectionError):
                pass
        stalled = socket.create_connection(("127.0.0.1", port))  # TCP only: no ClientHello
        stalled.setblocking(False)
        for _ in range(4):
            _, writer = await asyncio.open_connection(
                "127.0.0.1", port, ssl=peer, server_hostname="localhost"
            )
            writer.write(HALF_A_REQUEST)
            writers.append(writer)
        await asyncio.sleep(0.3)
        assert CONNECTION_LIMIT not in refused, refused
        assert await wait_until(lambda: refused.count(HEADERS_TOO_SLOW) == 4, 4), refused
        assert await wait_until(lambda: closed_by_server(stalled), 4)
        stalled.close()
    finally:
        for writer in writers:
            writer.close()
        await server.stop()


async def test_a_relays_port_caps_its_connections_and_cuts_off_slow_headers(tmp_path) -> None:
    """relay.listen, where sites and their peers connect: the same gate,
    transport.max_connections and relay.read_idle_timeout_s, refusals counted
    with the relay's own."""
    from test_relay import make_roster, write_relay_yaml

    from node.provision import free_ports
    from node.relay_status import RelayProcess
    from p2pfl.config import load_relay_config
    from p2pfl.secure.identity import LocalIdentity, Roster

    ids = {n: LocalIdentity.generate(n) for n in ("a", "b", "c", "d", "f")}
    make_roster(ids).save(tmp_path / "roster.yaml")
    (port,) = free_ports(1)
    path = write_relay_yaml(
        tmp_path / "r1",
        {"name": "r1", "listen": f"127.0.0.1:{port}", "read_idle_timeout_s": 1.0},
        transport={"max_connections": 4},
        status={"enabled": False},
    )
    relay = RelayProcess(load_relay_config(path), Roster.load(tmp_path / "roster.yaml"), path)
    await relay.start()
    socks = half_open(port, 8)
    try:
        assert await wait_until(lambda: all(map(closed_by_server, socks)), 4)
        refusals = relay.server.snapshot()["refusals"]
        assert refusals == {CONNECTION_LIMIT: 4, HEADERS_TOO_SLOW: 4}, refusals
    finally:
        for s in socks:
            s.close()
        await relay.stop()


async def test_a_cheap_request_cannot_keep_a_place_of_the_status_port() -> None:
    """A second review held all 64 places of the status port, /healthz with
    them, by asking /healthz on each connection before its keep-alive ran out.
    Every answer of the status port now closes its connection."""
    app = create_status_app(Telemetry("a"), node_name="a", protocol_name="probe", token=None)
    runner, port = await start_status_server(app, "127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")  # asks keep-alive
        answer = await asyncio.wait_for(reader.read(), 5)  # read to EOF: the server closed
        assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"ok")
        writer.close()
    finally:
        await runner.cleanup()
