"""A hostile review of the streamed relay (issue 31: the relay streams frames
down a site's WebSocket in pieces, the site's endpoint reads them in process).
One test per hole it found, each failing on the code it was found in:

1. every frame a site refused on its header while the relay still streamed it
   stayed in the tunnel's table of open frames for the connection's life (and
   the relay's /status counted the whole frame as sent);
2. a relay that reads no answers made the site write `queue_full` answers
   without end (its write buffer grew);
3. a sender's upload cut mid-frame sent the site no ABORT, so the site held
   the frame's id (`in_progress` to the honest retry), bytes and slot for its
   idle timeout;
4. one sender's dropped connection cancelled aiohttp's drain shared by every
   forward to that site, resetting another sender's connection unanswered;
5. a handler that failed sent no REPLY, so the sender waited forward_timeout_s.

A real RelayServer (served with handler_cancellation=True, as
`p2pfl-node relay` serves it) and a real site: MessageServer + RelayTunnel."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
import os
import socket
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
from aiohttp import web
from test_relay_attacks import FED, fake_relay, fast_transport, tunnel

from node.provision import free_ports
from node.relay import RelayServer
from node.relay_handshake import fetch_challenge, proof_headers
from node.relay_tunnel import FrameFeed
from node.relay_wire import DATA, RELAY_CONNECT_PATH, RELAY_MESSAGE_PATH, pack_forward
from node.transport import MessageServer
from p2pfl.config import RelaySettings
from p2pfl.secure.identity import LocalIdentity, Roster
from p2pfl.secure.wire import WireCodec

MAX = 8 << 20


def roster_for(ids: dict[str, LocalIdentity], port: int) -> Roster:
    """a and c reachable (never dialled here), b outbound-only via r1."""
    cards = [
        ids["a"].card("127.0.0.1:7001"),
        ids["c"].card("127.0.0.1:7003"),
        dataclasses.replace(ids["b"].card(), address=None, via=("r1",)),
    ]
    return Roster(cards, relays={"r1": f"127.0.0.1:{port}"})


async def until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def relay_and_site(**relay_settings: Any) -> AsyncIterator[dict[str, Any]]:
    ids = {n: LocalIdentity.generate(n) for n in ("a", "b", "c")}
    port = free_ports(1)[0]
    roster = roster_for(ids, port)
    relay = RelayServer(
        "r1", FED, roster, RelaySettings(**relay_settings), max_message_bytes=MAX, clock_skew_s=300
    )
    app = web.Application(client_max_size=MAX)
    relay.add_routes(app)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    codec = WireCodec(ids["b"], roster, FED, max_message_bytes=MAX, require_encryption=True)

    taken: list[bytes] = []

    async def on_frame(frame: Any) -> tuple[int, Any]:
        taken.append(frame.header.msg_id)
        return 200, None

    server = MessageServer(codec, fast_transport(), on_frame, lambda r, _p: None)
    site = tunnel(ids, port, server, MAX)
    site.start()
    codecs = {
        n: WireCodec(ids[n], roster, FED, max_message_bytes=MAX, require_encryption=True)
        for n in ("a", "c")
    }
    try:
        await until(lambda: site.connected)
        yield {
            "ids": ids,
            "roster": roster,
            "relay": relay,
            "port": port,
            "server": server,
            "tunnel": site,
            "codecs": codecs,
            "taken": taken,
        }
    finally:
        await site.stop()
        await relay.close()
        await runner.cleanup()


async def post(port: int, body: bytes) -> tuple[int, dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"http://127.0.0.1:{port}{RELAY_MESSAGE_PATH}", data=body) as resp,
    ):
        return resp.status, json.loads(await resp.read())


async def cut_upload(port: int, body: bytes, nbytes: int, pause: float = 0.3) -> None:
    """POST `body` (its whole Content-Length) but send only `nbytes`, then drop."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (
        f"POST {RELAY_MESSAGE_PATH} HTTP/1.1\r\nHost: x\r\n"
        f"Content-Type: application/octet-stream\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    writer.write(head.encode() + body[:nbytes])
    await writer.drain()
    await asyncio.sleep(pause)
    writer.transport.abort()


def frames_alive() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, FrameFeed))


def test_frames_a_site_refuses_on_their_header_leave_nothing_behind() -> None:
    async def scenario() -> None:
        async with relay_and_site() as e:
            frame = (
                e["codecs"]["a"]
                .encode("probe", "b", {"blob": os.urandom(4 << 20)}, round=1, encrypt=True)
                .to_bytes()
            )
            assert (await post(e["port"], frame))[0] == 200
            for _ in range(20):  # refused on the header while the relay still streams
                status, body = await post(e["port"], frame)
                assert (status, body["reason"]) == (409, "replayed")
            await until(lambda: not e["tunnel"]._forwards)
            assert frames_alive() <= 1  # the tunnel reader's last local, not a table entry
            assert e["tunnel"]._held == 0
            # the relay's /status counts the bytes that went down, not whole frames
            # it stopped sending when the site answered early
            sent = e["relay"].snapshot()["sites"]["b"]["bytes_out"]
            await until(lambda: e["tunnel"].bytes_in == sent, timeout=5)
            assert sent < 21 * len(frame)

    asyncio.run(scenario())


def test_a_relay_that_reads_no_answers_stalls_the_sites_reader_not_its_memory() -> None:
    """New frame ids past max_concurrent, as fast as a relay can send them, and
    never an answer read: the site answers queue_full from its reader, so its
    reader waits on its own drain; tasks and write buffer stay bounded."""
    ids = {n: LocalIdentity.generate(n) for n in ("a", "b")}
    stop = asyncio.Event()
    seen: dict[str, int] = {"tasks": 0, "buffer": 0}

    async def handler(ws: web.WebSocketResponse, n: int) -> None:
        # a small receive window: the site's answers back up within the test's seconds
        sock = ws._writer.transport.get_extra_info("socket")  # type: ignore[union-attr]
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        i = 0
        while not stop.is_set():
            i += 1
            await ws.send_bytes(pack_forward(i, DATA, b"J"))
            if i % 500 == 0:
                await asyncio.sleep(0)

    async def scenario() -> None:
        async with fake_relay(handler) as port:
            roster = Roster(
                [
                    ids["a"].card("127.0.0.1:7001"),
                    dataclasses.replace(ids["b"].card(), address=None, via=("r1",)),
                ],
                relays={"r1": f"127.0.0.1:{port}"},
            )
            codec = WireCodec(ids["b"], roster, FED, max_message_bytes=1 << 20)
            server = MessageServer(codec, fast_transport(), None, lambda r, _p: None)  # type: ignore[arg-type]
            t = tunnel(ids, port, server, 1 << 20, max_concurrent=4)
            t.start()
            await until(lambda: t.connected)
            assert t.ws is not None and t.ws._writer.transport is not None
            transport_ = t.ws._writer.transport  # and a small send buffer at the site
            transport_.get_extra_info("socket").setsockopt(
                socket.SOL_SOCKET, socket.SO_SNDBUF, 4096
            )
            try:
                deadline = time.monotonic() + 6.0
                while time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
                    seen["tasks"] = max(seen["tasks"], len(t._forwards))
                    seen["buffer"] = max(seen["buffer"], transport_.get_write_buffer_size())
            finally:
                stop.set()
                await t.stop()

    asyncio.run(scenario())
    assert seen["tasks"] <= 4 + 1, seen  # the frames' handlers, and one closing task
    assert seen["buffer"] <= 1 << 20, seen


def test_a_cut_upload_through_the_relay_frees_the_site_at_once() -> None:
    """The sender's connection drops mid-upload: the relay sends ABORT, so the
    site drops the frame at once and the honest retry of the same frame is
    taken, as after a direct POST cut the same way; 70 cut uploads in a row
    leave no slot held, and another sender's frame is taken."""

    async def scenario() -> None:
        async with relay_and_site() as e:
            a, c = e["codecs"]["a"], e["codecs"]["c"]
            frame = a.encode(
                "probe", "b", {"blob": os.urandom(4 << 20)}, round=1, encrypt=True
            ).to_bytes()
            await cut_upload(e["port"], frame, 1 << 20)
            await until(lambda: not e["server"]._in_flight, timeout=5)
            assert (await post(e["port"], frame))[0] == 200  # not 409 in_progress
            for _ in range(70):
                small = a.encode(
                    "probe", "b", {"blob": os.urandom(8 << 10)}, round=1, encrypt=True
                ).to_bytes()
                await cut_upload(e["port"], small, len(small) - 4096, pause=0.05)
            await until(lambda: not e["tunnel"]._forwards, timeout=5)
            honest = c.encode("probe", "b", {"x": 1}, round=1, encrypt=True).to_bytes()
            assert (await post(e["port"], honest))[0] == 200
            assert e["server"].reserved_bytes == 0

    asyncio.run(scenario())


def test_one_senders_dropped_connection_does_not_reset_anothers_forward() -> None:
    """Both forwards to a congested site wait in aiohttp's drain, one future
    for all; sender a's connection drops. Sender c still gets an answer (here
    relay_lost at forward_timeout_s, counted), not a reset connection."""

    async def scenario() -> None:
        async with relay_and_site(forward_timeout_s=3.0) as e:
            await e["tunnel"].stop()  # b's own tunnel goes; a stand-in that never reads
            url = f"http://127.0.0.1:{e['port']}"
            async with aiohttp.ClientSession() as session:
                challenge = await fetch_challenge(session, url, False)
                headers = proof_headers(e["ids"]["b"], FED, "r1", challenge["nonce"])
                ws = await session.ws_connect(url + RELAY_CONNECT_PATH, headers=headers)
                a, c = e["codecs"]["a"], e["codecs"]["c"]
                fa = a.encode(
                    "probe", "b", {"blob": os.urandom(6 << 20)}, round=1, encrypt=True
                ).to_bytes()
                fc = c.encode(
                    "probe", "b", {"blob": os.urandom(6 << 20)}, round=1, encrypt=True
                ).to_bytes()
                started = time.monotonic()
                sent_c = asyncio.create_task(post(e["port"], fc))
                await asyncio.sleep(1.0)  # c fills b's window: it waits in the drain
                await cut_upload(e["port"], fa, 300_000)  # a joins, then its connection drops
                status, body = await sent_c
                assert (status, body["reason"]) == (502, "relay_lost")
                assert time.monotonic() - started >= 2.5  # its own timeout, not a's drop
                assert e["relay"].refusals.get("relay_lost", 0) >= 1
                await ws.close()

    asyncio.run(scenario())


def test_a_handler_failure_is_answered_500_through_the_relay_at_once() -> None:
    async def scenario() -> None:
        async with relay_and_site(forward_timeout_s=20.0) as e:

            async def boom(frame: Any) -> tuple[int, Any]:
                raise RuntimeError("a handler bug")

            e["server"].on_frame = boom
            frame = e["codecs"]["a"].encode("probe", "b", {"x": 1}, round=1, encrypt=True)
            started = time.monotonic()
            status, body = await post(e["port"], frame.to_bytes())
            assert (status, body["reason"]) == (500, "handler_error")
            assert time.monotonic() - started < 10  # not forward_timeout_s

    asyncio.run(scenario())


def test_a_body_longer_than_its_header_or_the_same_frame_twice_at_once_is_refused() -> None:
    """A hostile sender through the relay: a chunked body with bytes past the
    payload its signed header announces is refused digest_mismatch and counted,
    and the site is told to drop what it had (ABORT: its endpoint never takes
    the frame); the same frame posted twice at once is taken once, the other
    copy refused (in_progress or replayed), and nothing stays held."""

    async def longer(data: bytes) -> AsyncIterator[bytes]:
        yield data
        yield b"\0" * 4096  # past the announced payload

    async def scenario() -> None:
        async with relay_and_site() as e:
            a = e["codecs"]["a"]
            frame = a.encode(
                "probe", "b", {"blob": os.urandom(1 << 20)}, round=1, encrypt=True
            ).to_bytes()
            async with (
                aiohttp.ClientSession() as session,
                session.post(
                    f"http://127.0.0.1:{e['port']}{RELAY_MESSAGE_PATH}", data=longer(frame)
                ) as resp,
            ):
                status, body = resp.status, json.loads(await resp.read())
            assert (status, body["reason"]) == (400, "digest_mismatch")
            assert e["relay"].refusals["digest_mismatch"] == 1
            assert e["taken"] == []
            twin = a.encode("probe", "b", {"x": 1}, round=1, encrypt=True).to_bytes()
            answers = await asyncio.gather(post(e["port"], twin), post(e["port"], twin))
            codes = sorted((s, b.get("reason")) for s, b in answers)
            assert codes[0] == (200, None)
            assert codes[1] in ((409, "in_progress"), (409, "replayed"))
            assert len(e["taken"]) == 1  # the twin, once
            await until(lambda: not e["tunnel"]._forwards)
            assert e["tunnel"]._held == 0 and e["server"].reserved_bytes == 0
            assert not e["server"]._in_flight

    asyncio.run(scenario())
