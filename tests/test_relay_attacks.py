"""Hostile review of the relay (issue 31): each test is an attack that worked on
the code before its fix, against real aiohttp servers on 127.0.0.1, real
Ed25519/X25519 identities and real frames from WireCodec.

- a client on no roster held a relay's handshake slot forever by sending pings
  (each ping restarted aiohttp's per-receive timeout): `max_handshakes` such
  connections kept every outbound-only site from connecting;
- a deeply nested JSON auth message raised RecursionError out of the relay's
  handshake (an unhandled exception, no refusal, nothing counted);
- a stranger awaiting authentication could make the relay buffer one WebSocket
  message of max_message_bytes (512 MiB by default): the relay accepted the
  WebSocket before the proof. The proof now rides on the upgrade request
  (node/relay_handshake.py), with nonces that are the relay process's own,
  expire and are used once;
- a relay that sent a challenge whose nonce the site cannot encode (a lone
  surrogate) or a deeply nested one killed the site's tunnel task for good: the
  site never dialled that relay again;
- a relay flooding a site with FORWARDs made the site hold 64 frames of up to
  max_message_bytes each in memory (65 x 512 MiB by default);
- one sender trickling two payloads held a recipient's whole byte budget at the
  relay, so every other sender got `queue_full`;
- the relay allocated (and zeroed) a frame's whole payload_len the moment its
  header was checked, before one payload byte arrived;
- a relay answered the sender of a push in the receiver's place: the
  acknowledgement was unsigned JSON, so a relay could drop a push and forge its
  ack (now signed by the receiver: node/transport.py, node/outbound.py).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import socket
import struct
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import test_relay
from aiohttp import web
from multidict import CIMultiDict
from test_relay import (
    FED,
    RelaySite,
    challenge_nonce,
    codec,
    frame,
    relay,
    until,
    upgrade,
)

from node.relay_handshake import open_relay_socket, proof_headers
from node.relay_tunnel import RelayTunnel
from node.relay_wire import (
    ABORT,
    DATA,
    END,
    NONCE_HEADER,
    RELAY_CHALLENGE_PATH,
    RELAY_CONNECT_PATH,
    RELAY_MESSAGE_PATH,
    RELAY_PROTOCOL,
    SIGNATURE_HEADER,
    SITE_HEADER,
    pack_forward,
    unpack_reply,
)
from node.transport_client import MessageClient, TransportError
from p2pfl.config import TransportSection
from p2pfl.secure.identity import LocalIdentity
from p2pfl.secure.wire import WireCodec

ids = test_relay.ids  # the relay tests' shared fixtures (module scope)
roster = test_relay.roster

WsHandler = Callable[[web.WebSocketResponse, int], Awaitable[None]]


def fast_transport() -> TransportSection:
    return TransportSection(
        request_timeout_s=5.0,
        connect_timeout_s=1.0,
        backoff_base_s=0.01,
        backoff_max_s=0.05,
        retries=0,
    )


@contextlib.asynccontextmanager
async def serve(app: web.Application) -> AsyncIterator[int]:
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield next(a[1] for a in runner.addresses if isinstance(a, tuple))
    finally:
        await runner.cleanup()


ChallengeHandler = Callable[[web.Request, int], Awaitable[web.StreamResponse]]


HONEST_CHALLENGE = {
    "type": "challenge",
    "relay": "r1",
    "federation": FED,
    "protocol": RELAY_PROTOCOL,
    "nonce": "ab" * 40,
}


async def honest_challenge(request: web.Request, n: int) -> web.StreamResponse:
    return web.json_response(HONEST_CHALLENGE)


@contextlib.asynccontextmanager
async def fake_relay(
    handler: WsHandler,
    challenge: ChallengeHandler = honest_challenge,
    max_msg_size: int = 64 << 20,
) -> AsyncIterator[int]:
    """A hostile relay: `challenge(request, n)` answers the n-th challenge
    request (from 1); `handler(ws, n)` plays the n-th upgraded connection,
    whatever its proof (we are the hostile side)."""
    counts = {"challenge": 0, "connect": 0}

    async def get_challenge(request: web.Request) -> web.StreamResponse:
        counts["challenge"] += 1
        return await challenge(request, counts["challenge"])

    async def connect(request: web.Request) -> web.WebSocketResponse:
        counts["connect"] += 1
        ws = web.WebSocketResponse(max_msg_size=max_msg_size)
        await ws.prepare(request)
        with contextlib.suppress(ConnectionError, aiohttp.ClientError, RuntimeError):
            await handler(ws, counts["connect"])
        return ws

    app = web.Application()
    app.router.add_get(RELAY_CHALLENGE_PATH, get_challenge)
    app.router.add_get(RELAY_CONNECT_PATH, connect)
    async with serve(app) as port:
        yield port


class Endpoint:
    """Stands in for the site's message endpoint (node/transport.py
    MessageServer.receive) where the test is about the tunnel's bounds: reads
    each frame whole once `release` is set (a real endpoint verifies as it
    reads; here the frames are not real), and answers 200."""

    isolated = False

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.release.set()
        self.frames: list[int] = []
        self.refused: list[str] = []

    async def receive(self, stream: Any, length: int | None) -> web.Response:
        await self.release.wait()
        size = 0
        try:
            while chunk := await asyncio.wait_for(stream.readany(), 5):
                size += len(chunk)
        except (ConnectionResetError, TimeoutError) as exc:
            self.refused.append(type(exc).__name__)
            return web.json_response({"reason": "truncated"}, status=400)
        self.frames.append(size)
        return web.json_response({"ok": True})


def tunnel(
    ids: dict[str, LocalIdentity], port: int, endpoint: Any, max_bytes: int, **options: Any
) -> RelayTunnel:
    return RelayTunnel(
        site="b",
        relay="r1",
        address=f"127.0.0.1:{port}",
        federation=FED,
        identity=ids["b"],
        endpoint=endpoint,
        cfg=fast_transport(),
        max_message_bytes=max_bytes,
        **options,
    )


# ----------------------------------------------------------------------------- relay: pre-auth


def test_a_busy_stranger_cannot_hold_a_handshake_slot_past_the_auth_timeout(ids, roster):
    """A stranger that fetched a challenge and keeps its connection busy
    (before: pinging the WebSocket restarted the timeout, and the slot was held
    for ever) holds the slot auth_timeout_s at most: the nonce expires."""

    async def scenario() -> None:
        async with (
            relay(roster, auth_timeout_s=1.5, max_handshakes_per_host=1) as (server, url),
            aiohttp.ClientSession() as s,
        ):
            nonce = await challenge_nonce(s, url)
            statuses = set()
            while server._handshakes:  # ask again and again on the same connection
                async with s.get(url + RELAY_CHALLENGE_PATH) as r:
                    statuses.add(r.status)
                await asyncio.sleep(0.05)
            # (a stall past the timeout between two requests may let one renew it)
            assert server.refusals.get("auth_timeout", 0) >= 1 and 429 in statuses
            late = proof_headers(ids["x"], FED, "r1", nonce)
            assert await upgrade(s, url, late) == (401, "nonce_expired")
            b = RelaySite(ids["b"], roster)  # the slot is free for a real site
            assert await b.connect(url) == {"type": "ok"}
            await b.close()

    asyncio.run(scenario())


def test_a_malformed_proof_is_refused_before_any_websocket_and_counted(ids, roster):
    """Proof headers missing, repeated, too long, not decodable, or of the wrong
    length: 400 auth_malformed, counted, no WebSocket, nothing parsed beyond the
    bounds (before: a deeply nested JSON offer raised RecursionError out of the
    handler, and any offer was read into a frame-sized buffer)."""

    async def scenario() -> None:
        async with relay(roster) as (server, url), aiohttp.ClientSession() as s:
            good = proof_headers(ids["b"], FED, "r1", await challenge_nonce(s, url))
            site, nonce, sig = SITE_HEADER, NONCE_HEADER, SIGNATURE_HEADER
            cases: list[Any] = [
                {k: v for k, v in good.items() if k != sig},  # no signature
                {**good, site: "b" * 4000},  # a long name
                {**good, nonce: "[" * 80},  # not hex
                {**good, nonce: good[nonce] + "00"},  # too long
                {**good, nonce: good[nonce].upper()},  # not the relay's spelling of it
                {**good, sig: "!" * 88},  # not base64
                {**good, sig: base64.b64encode(b"x" * 63).decode()},  # 63 bytes
                CIMultiDict([*good.items(), (site, "c")]),  # two names
            ]
            for headers in cases:
                assert await upgrade(s, url, headers) == (400, "auth_malformed"), headers
            # past aiohttp's own header bound: refused by its parser, before any handler
            assert (await upgrade(s, url, {**good, site: "b" * 20_000}))[0] == 400
            assert server.refusals == {"auth_malformed": len(cases)}
            assert not server.links
            assert await upgrade(s, url, good) == (101, None)  # its nonce was never used

    asyncio.run(scenario())


def test_nonces_of_another_relay_process_or_forged_or_altered_are_refused(ids, roster):
    """A nonce is the relay process's own: another r1's (say, before a restart),
    random bytes of the right length, or a real nonce with its issue time moved
    (to outlive auth_timeout_s) fail its HMAC: `bad_nonce`, counted."""

    async def scenario() -> None:
        async with (
            relay(roster) as (server, url),
            relay(roster) as (other, other_url),
            aiohttp.ClientSession() as s,
        ):
            foreign = await challenge_nonce(s, other_url)
            real = bytes.fromhex(await challenge_nonce(s, url))
            moved = (int.from_bytes(real[:8], "big") + 10**12).to_bytes(8, "big") + real[8:]
            for nonce_hex in (foreign, os.urandom(len(real)).hex(), moved.hex()):
                headers = proof_headers(ids["b"], FED, "r1", nonce_hex)  # b's real signature
                assert await upgrade(s, url, headers) == (401, "bad_nonce")
            assert server.refusals == {"bad_nonce": 3} and not server.links
            # a second connection of a site, with its own fresh proof, replaces the first
            first, second = RelaySite(ids["b"], roster), RelaySite(ids["b"], roster)
            assert await first.connect(url) == {"type": "ok"}
            link = server.links["b"]
            assert await second.connect(url) == {"type": "ok"}
            await until(lambda: link.closed and server.links["b"] is not link)
            await first.close()
            await second.close()

    asyncio.run(scenario())


# ----------------------------------------------------------------------------- site: hostile relay


def test_a_relay_sending_an_unusable_challenge_does_not_kill_the_sites_tunnel(ids):
    """A lone-surrogate nonce (UnicodeEncodeError when signed) and a deeply nested
    challenge (RecursionError) each ended the tunnel's task: the site never dialled
    that relay again. Now each, and a challenge too long to read or naming
    another relay, is one failed connection and the tunnel dials again."""
    honest = HONEST_CHALLENGE
    poison = [
        json.dumps({**honest, "protocol": RELAY_PROTOCOL - 1}),  # an older relay
        json.dumps({**honest, "nonce": "\ud800" * 20}),
        "[" * 200_000,
        json.dumps({**honest, "pad": "x" * (1 << 20)}),
        json.dumps({**honest, "relay": "r2"}),
    ]

    async def challenge(request: web.Request, n: int) -> web.StreamResponse:
        if n <= len(poison):
            return web.Response(text=poison[n - 1], content_type="application/json")
        return await honest_challenge(request, n)

    async def handler(ws: web.WebSocketResponse, n: int) -> None:
        await ws.receive(timeout=30)

    async def scenario() -> None:
        async with fake_relay(handler, challenge) as port:
            t = tunnel(ids, port, Endpoint(), 1 << 20)
            t.start()
            try:
                await until(lambda: t.connected, timeout=10)
            finally:
                await t.stop()
            assert t.connects == 1

    asyncio.run(scenario())


def test_a_forward_flood_from_a_relay_holds_bounded_bytes_at_the_site(ids):
    """A relay may stream pieces as fast as it likes; while the site's endpoint
    does not read, the site holds at most two max_message_bytes of them (as its
    transport reserves for uploads), not 12 frames of max_message_bytes each:
    past that it stops reading the connection. Then every frame is answered."""
    max_bytes = 1 << 20
    n_frames = 12
    piece = 64 << 10
    endpoint = Endpoint()
    replies: list[int] = []

    async def handler(ws: web.WebSocketResponse, n: int) -> None:
        async def answers() -> None:
            async for msg in ws:
                if msg.type == aiohttp.WSMsgType.BINARY:
                    replies.append(unpack_reply(msg.data)[1])

        reader = asyncio.create_task(answers())
        body = b"\0" * (max_bytes - 64)
        for stream_id in range(1, n_frames + 1):
            for start in range(0, len(body), piece):
                last = start + piece >= len(body)
                await ws.send_bytes(
                    pack_forward(stream_id, END if last else DATA, body[start : start + piece])
                )
        await reader

    async def scenario() -> None:
        endpoint.release.clear()  # the endpoint reads nothing yet
        async with fake_relay(handler) as port:
            t = tunnel(ids, port, endpoint, max_bytes)
            peak = 0
            t.start()
            try:
                await until(lambda: t._held >= max_bytes, timeout=10)
                for _ in range(20):  # time to take more, if it would
                    peak = max(peak, t._held)
                    await asyncio.sleep(0.05)
                assert peak <= 2 * max_bytes, f"{peak} bytes held"
                endpoint.release.set()
                await until(lambda: len(replies) == n_frames, timeout=20)
            finally:
                endpoint.release.set()
                await t.stop()
            assert replies == [200] * n_frames
            assert endpoint.frames == [max_bytes - 64] * n_frames
            assert t._held == 0

    asyncio.run(scenario())


def test_a_hostile_relays_pieces_cannot_confuse_or_stall_the_sites_frames(ids):
    """What a relay could do with the pieces of a stream (node/relay_wire.py):
    pieces of ids the site is done with, or that went lower, are dropped;
    ABORT mid-frame gives the endpoint a failed read, never a short frame; a
    frame past `max_concurrent` is answered queue_full at once (the reader never
    waits on a handler), and a frame whose pieces stop is the endpoint's idle
    timeout, not a hang. The honest frame between them arrives whole."""
    endpoint = Endpoint()
    replies: dict[int, int] = {}
    sent = asyncio.Event()

    async def handler(ws: web.WebSocketResponse, n: int) -> None:
        async def answers() -> None:
            async for msg in ws:
                if msg.type == aiohttp.WSMsgType.BINARY:
                    stream_id, status, _ = unpack_reply(msg.data)
                    replies[stream_id] = status

        reader = asyncio.create_task(answers())
        await ws.send_bytes(pack_forward(5, DATA, b"a" * 100))
        await ws.send_bytes(pack_forward(5, ABORT))  # the relay gives up on 5
        await until(lambda: 5 in replies, timeout=10)  # its handler is done
        await ws.send_bytes(pack_forward(5, END, b"b" * 100))  # 5 again: dropped
        await ws.send_bytes(pack_forward(3, END, b"c" * 100))  # lower than 5: dropped
        await ws.send_bytes(pack_forward(6, DATA, b"d" * 100))  # opens 6, left open
        await ws.send_bytes(pack_forward(7, DATA, b"e" * 100))  # opens 7
        await ws.send_bytes(pack_forward(8, DATA, b"f" * 10))  # past max_concurrent
        await ws.send_bytes(pack_forward(7, END, b"e" * 100))  # 7 completes
        sent.set()
        await reader

    async def scenario() -> None:
        async with fake_relay(handler) as port:
            t = tunnel(ids, port, endpoint, 1 << 20, max_concurrent=2)
            t.start()
            try:
                await until(lambda: sent.is_set() and {5, 7, 8} <= set(replies), timeout=10)
                assert replies[5] == 400 and replies[7] == 200
                assert replies[8] == 502  # queue_full from the tunnel itself
                await until(lambda: 6 in replies, timeout=10)  # the endpoint's read timed out
                assert replies[6] == 400
            finally:
                await t.stop()
            assert endpoint.frames == [200]  # only 7, whole
            assert sorted(endpoint.refused) == ["ConnectionResetError", "TimeoutError"]
            assert t.dropped == 2 and t._held == 0

    asyncio.run(scenario())


async def trickle(url: str, data: bytes, sent: int, stop: asyncio.Event) -> int:
    """POST `data` but send only its first `sent` bytes, then stall until `stop`."""

    async def body() -> AsyncIterator[bytes]:
        yield data[:sent]
        await stop.wait()

    with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
        async with aiohttp.ClientSession() as s, s.post(url + RELAY_MESSAGE_PATH, data=body()) as r:
            await r.read()
            return r.status
    return 0


def test_one_sender_trickling_payloads_cannot_take_a_recipients_whole_byte_budget(ids, roster):
    """Two frames of one sender, each stalled mid-payload, held all the bytes the
    relay keeps for b: every other sender's frame to b was `queue_full`. A sender
    now holds at most half of a recipient's bytes (beyond its first frame)."""
    a, f = codec(ids, roster, "a"), codec(ids, roster, "f")
    blob = 400_000

    async def scenario() -> None:
        async with relay(roster, max_pending_bytes_per_site=1 << 20) as (server, url):
            b = RelaySite(ids["b"], roster)
            await b.connect(url)
            stop = asyncio.Event()
            big = [frame(a, "b", {"blob": os.urandom(blob)}) for _ in range(2)]
            stalled = [asyncio.create_task(trickle(url, x, len(x) // 2, stop)) for x in big]
            try:
                await until(lambda: server.links["b"].pending_bytes >= len(big[0]), timeout=10)
                await asyncio.sleep(0.3)
                honest = frame(f, "b", {"blob": os.urandom(blob)})
                async with (
                    aiohttp.ClientSession() as s,
                    s.post(url + RELAY_MESSAGE_PATH, data=honest) as r,
                ):
                    status, body = r.status, await r.read()
                assert status == 200, body
            finally:
                stop.set()
                await asyncio.gather(*stalled, return_exceptions=True)
                await b.close()
            assert server.refusals.get("queue_full", 0) <= 1  # the trickler's second frame

    asyncio.run(scenario())


def test_the_relay_holds_payload_memory_as_bytes_arrive_not_from_the_header(ids, roster):
    """A signed header claiming 7 MiB made the relay allocate and zero 7 MiB at
    once: headers alone (a few hundred bytes each) bought max_pending_bytes_per_site
    per recipient. Now a frame's memory grows with the bytes actually received."""
    a = codec(ids, roster, "a")
    big = frame(a, "b", {"blob": os.urandom(7 << 20)})

    async def scenario() -> int:
        async with relay(roster) as (server, url):
            b = RelaySite(ids["b"], roster)
            await b.connect(url)
            stop = asyncio.Event()
            tracemalloc.start()
            try:
                before = tracemalloc.get_traced_memory()[0]
                task = asyncio.create_task(trickle(url, big, 4096, stop))
                await until(lambda: server.links["b"].pending == 1, timeout=10)
                await asyncio.sleep(0.3)
                grown = tracemalloc.get_traced_memory()[0] - before
            finally:
                tracemalloc.stop()
                stop.set()
                await asyncio.gather(task, return_exceptions=True)
                await b.close()
            return grown

    grown = asyncio.run(scenario())
    assert grown < 2 << 20, f"{grown} bytes held for 4 KiB received"


# ----------------------------------------------------------------------------- sender: forged ack


def test_a_relay_cannot_forge_the_final_receivers_acknowledgement(ids, roster, tmp_path):
    """A relay that drops a push and answers `{"ok": true}` itself (or a 409
    `replayed`) made the sender count it delivered: acknowledgements were
    unsigned JSON. Now the receiver signs its acknowledgement over the message
    id (p2pfl/secure/wire.py `sign_ack`) and Outbound counts a push delivered
    only if that signature verifies: a forged one is `ack_unverified`, counted."""
    from types import SimpleNamespace

    from node.outbound import Outbound
    from node.queues import Outbox
    from node.telemetry import Telemetry
    from protocols.base import PeerUnavailable

    a = codec(ids, roster, "a")
    b = codec(ids, roster, "b")
    swallowed: list[bytes] = []
    forged: list[dict[str, Any]] = []

    async def forge(request: web.Request) -> web.Response:
        swallowed.append(await request.read())  # dropped, never forwarded
        body, status = forged[len(swallowed) - 1]
        return web.json_response(body, status=status)

    async def scenario() -> list[str]:
        app = web.Application(client_max_size=8 << 20)
        app.router.add_post(RELAY_MESSAGE_PATH, forge)
        outcomes: list[str] = []
        async with serve(app) as port:
            tcfg = fast_transport()
            client = MessageClient(tcfg, None)
            client.set_relayed_peer("b", [f"127.0.0.1:{port}"])
            telemetry = Telemetry("a")
            out = Outbound(
                name="a",
                cfg=SimpleNamespace(transport=tcfg, wire=SimpleNamespace(encryption=True)),  # type: ignore[arg-type]
                codec=a,
                client=client,
                outbox=Outbox(tmp_path / "outbox"),
                peers=None,  # type: ignore[arg-type]
                telemetry=telemetry,
                marks=None,  # type: ignore[arg-type]
                current_round=lambda: 0,
            )
            try:
                for _ in forged:
                    try:
                        await out.send_push("b", "probe", {"round": 1}, 1)
                        outcomes.append("delivered")
                    except PeerUnavailable as exc:
                        outcomes.append(exc.reason)
            finally:
                await client.close()
            rejected = telemetry.status_json("a", "probe")["rejected"]
            outcomes.append(str(rejected.get("ack_unverified", 0)))
        return outcomes

    # b's real signature, but over another message (an ack the relay saw before)
    other = a.encode("probe", "b", {"round": 0}, encrypt=True).header
    replayed_sig = b.sign_ack(other, "ok")
    forged.extend(
        [
            ({"ok": True}, 200),  # the bare ack
            ({"ok": True, "ack": "x" * 88}, 200),  # junk signature
            ({"ok": True, "ack": replayed_sig}, 200),  # b's ack of another id
            ({"reason": "replayed", "ack": replayed_sig}, 409),  # "already had it"
        ]
    )
    outcomes = asyncio.run(scenario())
    assert len(swallowed) == 4, "every push went to the relay"
    assert outcomes[:4] == ["ack_unverified"] * 4, outcomes
    assert outcomes[4] == "4", outcomes  # each counted


# ----------------------------------------------------------------------------- relay: slow peers


def new_settings(**kw: Any) -> dict[str, Any]:
    """Settings this review added to RelaySettings, passed only where they exist
    (so each test fails on the code before its fix by its assertion, not a TypeError)."""
    from p2pfl.config import RelaySettings

    return {k: v for k, v in kw.items() if k in RelaySettings.model_fields}


def test_a_payload_trickled_below_the_minimum_rate_is_cut_off(ids, roster):
    """A byte now and then kept a relayed upload (its slot and bytes) alive for
    ever; now it must arrive within read_idle_timeout_s + its size at
    min_upload_bytes_per_s, as uploads to a site must (node/transport.py)."""
    a = codec(ids, roster, "a")
    data = frame(a, "b", {"blob": os.urandom(200_000)})

    async def scenario() -> None:
        settings = new_settings(min_upload_bytes_per_s=100_000.0)
        async with relay(roster, read_idle_timeout_s=1.0, **settings) as (server, url):
            b = RelaySite(ids["b"], roster)
            await b.connect(url)

            async def body() -> AsyncIterator[bytes]:
                yield data[:4096]
                for i in range(4096, len(data), 50):
                    await asyncio.sleep(0.2)  # 250 bytes/s: never idle, never done
                    yield data[i : i + 50]

            async with aiohttp.ClientSession() as s:
                post = s.post(url + RELAY_MESSAGE_PATH, data=body())
                r = await asyncio.wait_for(post, 30)
                status, answer = r.status, await r.read()
                r.release()
            assert (status, json.loads(answer)["reason"]) == (408, "upload_too_slow")
            assert server.links["b"].pending == 0 and server.links["b"].pending_bytes == 0
            await b.close()

    asyncio.run(scenario())


def test_an_answer_its_sender_does_not_read_is_not_held_for_ever(ids, roster):
    """A sender that never reads the answers to its requests pinned each answer
    (up to max_message_bytes) in the relay's memory for as long as it kept the
    connection open. Now an answer must be taken within read_idle_timeout_s + its
    size at min_upload_bytes_per_s, else the connection is aborted."""
    a = codec(ids, roster, "a")
    size = 7 << 20
    answered = asyncio.Event()

    async def big_answer(data: bytes) -> tuple[int, bytes]:
        answered.set()
        return 200, b"x" * size

    async def scenario() -> int:
        nonlocal answered
        answered = asyncio.Event()
        settings = new_settings(min_upload_bytes_per_s=float(4 << 20))
        async with relay(roster, read_idle_timeout_s=1.0, **settings) as (server, url):
            b = RelaySite(ids["b"], roster, big_answer)
            await b.connect(url)
            port = int(url.rsplit(":", 1)[1])
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # hold little ourselves
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
            reader, writer = await asyncio.open_connection(sock=sock)
            body = frame(a, "b")
            head = (
                f"POST {RELAY_MESSAGE_PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Content-Length: {len(body)}\r\nContent-Type: application/octet-stream\r\n\r\n"
            )
            writer.write(head.encode() + body)
            await writer.drain()
            await asyncio.wait_for(answered.wait(), 10)
            # not read: the relay gives up on it once past its deadline (about 3 s)
            await until(lambda: "answer_too_slow" in server.refusals, timeout=30)
            got = 0
            with contextlib.suppress(ConnectionError, asyncio.TimeoutError):
                while chunk := await asyncio.wait_for(reader.read(1 << 16), 5):
                    got += len(chunk)
            writer.close()
            await b.close()
            return got

    got = asyncio.run(scenario())
    assert got < size, f"the relay kept all {got} bytes of the unread answer"


def test_a_site_answering_with_an_informational_status_gets_its_sender_a_refusal(ids, roster):
    """A site's REPLY with status 1xx was written as the HTTP answer: the sender's
    client took it as an interim answer and hung until its own timeout."""
    a = codec(ids, roster, "a")

    async def interim(data: bytes) -> tuple[int, bytes]:
        return 100, b'{"ok": true}'

    async def scenario() -> tuple[int, bytes] | str:
        async with relay(roster) as (server, url):
            b = RelaySite(ids["b"], roster, interim)
            await b.connect(url)
            try:
                async with (
                    aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=8)) as s,
                    s.post(url + RELAY_MESSAGE_PATH, data=frame(a, "b")) as r,
                ):
                    return r.status, await r.read()
            except TimeoutError:
                return "timeout"
            finally:
                await b.close()

    outcome = asyncio.run(scenario())
    assert outcome != "timeout", "the sender hung on a 1xx answer"
    status, body = outcome
    assert (status, json.loads(body)["reason"]) == (502, "reply_malformed")


# ----------------------------------------------------------------------------- relay: handshake pool


def test_one_host_cannot_take_every_handshake_slot(ids, roster):
    """Without TLS anyone may ask for challenges: `max_handshakes` of them from
    one host (each renewed every auth_timeout_s) refused every site
    `too_many_handshakes`. A host now holds at most max_handshakes_per_host."""

    async def scenario() -> None:
        settings = new_settings(max_handshakes_per_host=2)
        async with (
            relay(roster, max_handshakes=4, **settings) as (server, url),
            aiohttp.ClientSession() as s,
        ):
            statuses = []
            for _ in range(4):
                async with s.get(url + RELAY_CHALLENGE_PATH) as r:
                    statuses.append(r.status)
            assert statuses == [200, 200, 429, 429]
            connector = aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))
            async with aiohttp.ClientSession(connector=connector) as other:
                ws = await open_relay_socket(  # b, from another address of this host
                    other, url, identity=ids["b"], relay="r1", federation=FED
                )
                assert "b" in server.links
                await ws.close()

    asyncio.run(scenario())


def test_a_relay_that_trickles_its_challenge_is_dialled_again(ids, monkeypatch):
    """A relay that never finishes its challenge (before: never sent it, but
    pinged the site, each ping restarting the receive timeout) kept the tunnel
    in its handshake for ever: the whole handshake has one deadline, then the
    tunnel dials again."""
    import node.relay_tunnel

    monkeypatch.setattr(node.relay_tunnel, "AUTH_TIMEOUT_S", 0.5)
    dials: list[int] = []

    async def challenge(request: web.Request, n: int) -> web.StreamResponse:
        dials.append(n)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        for _ in range(100):  # 10 s of one byte at a time, never a whole challenge
            await response.write(b" ")
            await asyncio.sleep(0.1)
        return response

    async def handler(ws: web.WebSocketResponse, n: int) -> None:
        raise AssertionError("no upgrade without a challenge")

    async def scenario() -> None:
        async with fake_relay(handler, challenge) as port:
            t = tunnel(ids, port, Endpoint(), 1 << 20)
            t.start()
            try:
                await until(lambda: len(dials) >= 2, timeout=8)
            finally:
                await t.stop()
            assert not t.connected and t.connects == 0

    asyncio.run(scenario())


def stranger_upgrade(port: int, proof: dict[str, str], tail: bytes) -> bytes:
    """A raw upgrade request with `proof`, then `tail` at once (a blocking
    socket in a thread: no buffer of ours in this process); the relay's answer."""
    lines = [
        f"GET {RELAY_CONNECT_PATH} HTTP/1.1",
        f"Host: 127.0.0.1:{port}",
        "Upgrade: websocket",
        "Connection: Upgrade",
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
        "Sec-WebSocket-Version: 13",
        *(f"{k}: {v}" for k, v in proof.items()),
    ]
    answer = b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        with contextlib.suppress(OSError):  # the relay closes on us: sent what it took
            sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
            sock.sendall(tail)  # no copy of it: only the relay's allocations count
        with contextlib.suppress(OSError):
            while chunk := sock.recv(65536):
                answer += chunk
    return answer


def test_a_stranger_cannot_make_the_relay_buffer_a_large_message_before_authenticating(ids, roster):
    """The relay accepted the WebSocket, then waited for the signed offer in a
    reader sized for frames: each stranger awaiting authentication could make
    it buffer a message of max_message_bytes (512 MiB by default; aiohttp fixes
    the size at prepare()). The proof now rides on the upgrade request: a
    WebSocket frame of 6 or 24 MiB sent right behind a refused one is never
    read as a message; what the relay holds meanwhile is its read buffers, the
    same for both sizes, a fraction of either."""

    def ws_frame(size: int) -> bytes:  # a masked text frame, as a client sends it
        return b"\x81\xff" + struct.pack(">Q", size) + b"\0\0\0\0" + b"x" * size

    tails = [ws_frame(6 << 20), ws_frame(24 << 20), ws_frame(6 << 20)]

    async def scenario() -> tuple[list[int], list[bytes], dict[str, int]]:
        async with relay(roster) as (server, url), aiohttp.ClientSession() as s:
            port = int(url.rsplit(":", 1)[1])
            proofs = [
                {},  # no proof at all
                proof_headers(ids["x"], FED, "r1", await challenge_nonce(s, url)),
                proof_headers(ids["x"], FED, "r1", await challenge_nonce(s, url), "b"),
            ]
            await asyncio.to_thread(lambda: None)  # the worker thread exists before we count
            grown, answers = [], []
            tracemalloc.start()
            try:
                for proof, tail in zip(proofs, tails, strict=True):
                    before = tracemalloc.get_traced_memory()[0]
                    tracemalloc.reset_peak()
                    answers.append(await asyncio.to_thread(stranger_upgrade, port, proof, tail))
                    grown.append(tracemalloc.get_traced_memory()[1] - before)
            finally:
                tracemalloc.stop()
            assert not server.links
            return grown, answers, dict(server.refusals)

    grown, answers, refusals = asyncio.run(scenario())
    assert refusals == {"auth_malformed": 1, "unknown_site": 1, "bad_signature": 1}
    for answer in answers:  # when the answer beat the relay's close (it may not: RST)
        assert not answer or answer.startswith(b"HTTP/1.1 4"), answer[:80]
    assert max(grown) < 2 << 20, f"the relay's peak grew {grown} bytes for refused upgrades"


def test_a_relay_answering_500_does_not_keep_senders_from_the_sites_other_relay(ids, roster):
    a = codec(ids, roster, "a")
    hits = {"broken": 0, "good": 0}

    def endpoint(name: str, status: int) -> web.Application:
        async def handle(request: web.Request) -> web.Response:
            await request.read()
            hits[name] += 1
            return web.json_response({"ok": True} if status == 200 else {}, status=status)

        app = web.Application(client_max_size=8 << 20)
        app.router.add_post(RELAY_MESSAGE_PATH, handle)
        return app

    async def scenario() -> tuple[int, bytes] | str:
        async with serve(endpoint("broken", 500)) as bad, serve(endpoint("good", 200)) as good:
            client = MessageClient(fast_transport(), None)
            client.set_relayed_peer("b", [f"127.0.0.1:{bad}", f"127.0.0.1:{good}"])
            message = a.encode("heartbeat", "b", {"round": 1}, encrypt=True)
            try:
                return await client.post("b", message, retries=3)
            except TransportError as exc:
                return exc.reason
            finally:
                await client.close()

    outcome = asyncio.run(scenario())
    assert outcome == (200, b'{"ok": true}'), (outcome, hits)


def test_a_client_vanishing_mid_handshake_is_counted_not_a_logged_traceback(ids, roster, caplog):
    """A client that sends the upgrade request and resets the connection made
    the relay's handler raise (writing to a closed transport): one ERROR
    traceback in the relay's log per connection, uncounted. Now a stranger's
    is refused on its headers, and a site's (a real proof) that vanishes
    mid-upgrade is `handshake_lost` or a connection opened and dropped."""

    async def scenario() -> dict[str, int]:
        async with relay(roster) as (server, url), aiohttp.ClientSession() as s:
            port = int(url.rsplit(":", 1)[1])
            for i in range(10):
                proof = {}
                if i % 2:
                    proof = proof_headers(ids["b"], FED, "r1", await challenge_nonce(s, url))
                lines = [
                    f"GET {RELAY_CONNECT_PATH} HTTP/1.1",
                    "Host: 127.0.0.1",
                    "Upgrade: websocket",
                    "Connection: Upgrade",
                    "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
                    "Sec-WebSocket-Version: 13",
                    *(f"{k}: {v}" for k, v in proof.items()),
                ]
                with socket.socket() as sock:
                    sock.connect(("127.0.0.1", port))
                    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                await asyncio.sleep(0.01 * (i % 3))
            await until(lambda: server._handshakes == 0 and not server.links)
            await asyncio.sleep(0.3)
            return dict(server.refusals)

    with caplog.at_level("WARNING"):
        refusals = asyncio.run(scenario())
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert not errors, errors[0].getMessage()
    assert set(refusals) <= {"auth_malformed", "handshake_lost"}, refusals
    assert refusals.get("auth_malformed", 0) <= 5


def test_a_stranger_cannot_learn_which_sites_are_connected(ids, roster):
    """`not_connected` was answered before the signature check: a frame signed
    by no roster key told a stranger whether a site was connected. Now a frame
    whose signature fails is `bad_signature` whether or not its recipient is
    connected, and only a roster member learns `not_connected`."""
    a = codec(ids, roster, "a")
    forger = LocalIdentity.generate("a")  # claims a's name, holds another key
    mallory = WireCodec(forger, roster, FED, max_message_bytes=8 << 20)

    async def scenario() -> dict[str, tuple[int, str]]:
        async with relay(roster) as (server, url):
            b = RelaySite(ids["b"], roster)
            await b.connect(url)
            out = {}
            async with aiohttp.ClientSession() as s:
                for label, sender, to in [
                    ("forged, connected", mallory, "b"),
                    ("forged, not connected", mallory, "c"),
                    ("signed, not connected", a, "c"),
                ]:
                    body = frame(sender, to, {"x": 1})
                    async with s.post(url + RELAY_MESSAGE_PATH, data=body) as r:
                        out[label] = (r.status, (await r.json())["reason"])
            await b.close()
            return out

    assert asyncio.run(scenario()) == {
        "forged, connected": (401, "bad_signature"),
        "forged, not connected": (401, "bad_signature"),
        "signed, not connected": (503, "not_connected"),
    }


def test_an_acknowledgement_signature_of_any_shape_but_the_receivers_is_refused(ids, roster):
    """What an answer's `ack` may hold: only b's signature over this id and this
    outcome verifies; huge, non-string, non-base64 values, the other outcome,
    another claimed signer or an unknown outcome are refused without decoding."""
    a, b = codec(ids, roster, "a"), codec(ids, roster, "b")
    header = a.encode("probe", "b", {"round": 1}, encrypt=True).header
    good = b.sign_ack(header, "ok")
    assert a.verify_ack("b", header.msg_id, "ok", good)
    for bad in (
        "A" * 1_000_000,
        12345,
        None,
        ["x"],
        {"ack": good},
        "!!not base64!!",
        "",
        good[:-4],
    ):
        assert not a.verify_ack("b", header.msg_id, "ok", bad), repr(bad)[:40]
    assert not a.verify_ack("b", header.msg_id, "replayed", good)  # another outcome
    assert not a.verify_ack("c", header.msg_id, "ok", good)  # another signer
    assert not a.verify_ack("zz", header.msg_id, "ok", good)  # not on the roster
    assert not a.verify_ack("b", header.msg_id, "delivered", good)  # no such outcome
    assert not a.verify_ack("b", bytes(16), "ok", good)  # another id
